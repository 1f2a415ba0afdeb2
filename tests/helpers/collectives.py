"""Collectives for tests: ``world_size`` ranks simulated by threads in one process (no process group)."""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

from titan_ds.comm.base import check_splits

__all__ = ["ThreadCollective", "run_ranks"]


class ThreadCollective:
    """``world_size`` ranks simulated by threads in one process: call ``rank(r)`` for rank r's view."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size)
        self._slots: list[Optional[torch.Tensor]] = [None] * world_size

    def rank(self, r: int) -> "_ThreadRank":
        return _ThreadRank(self, r)


class _ThreadRank:
    def __init__(self, group: ThreadCollective, r: int):
        self.group, self.r, self.world_size = group, r, group.world_size
        self.rank = r

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        g = self.group
        g._slots[self.r] = t.clone()
        g._barrier.wait()
        out = [s.clone() for s in g._slots]  # type: ignore[union-attr]
        g._barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        parts = self._exchange(t)
        total = parts[0]
        for p in parts[1:]:
            total = total + p  # same order on every rank: bit-identical sums
        t.copy_(total)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self._exchange(t)

    def all_to_all(self, t: torch.Tensor, send: Optional[list[int]] = None,
                   recv: Optional[list[int]] = None) -> torch.Tensor:
        check_splits(t, self.world_size, send, recv)
        if send is None:
            parts = self._exchange(t)
            return torch.cat([p.view(self.world_size, -1)[self.r] for p in parts])
        parts = [list(torch.split(p, s)) for p, s in self._exchange_v(t, list(send))]
        out = [parts[i][self.r] for i in range(self.world_size)]
        assert [o.numel() for o in out] == list(recv), f"rank {self.r} expected {recv}, got {[o.numel() for o in out]}"
        return torch.cat(out)

    def _exchange_v(self, t: torch.Tensor, send: list[int]) -> list[tuple[torch.Tensor, list[int]]]:
        g = self.group
        g._slots[self.r] = (t.clone(), send)  # type: ignore[assignment]
        g._barrier.wait()
        out = [(s[0].clone(), s[1]) for s in g._slots]  # type: ignore[index]
        g._barrier.wait()
        return out


def run_ranks(world: int, fn: Callable[[int, Any], Any]) -> list:
    """Run fn(rank, comm) in ``world`` threads sharing a ThreadCollective; return the results by rank."""
    group = ThreadCollective(world)
    out: list = [None] * world
    errs: list = []

    def target(r):
        try:
            out[r] = fn(r, group.rank(r))
        except BaseException as e:  # surfaced below
            errs.append(e)
            group._barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errs:
        raise errs[0]
    return out
