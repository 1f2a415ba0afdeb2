"""Bytes as the network sees them: sent **and received** per worker, for every collective of a run.

One table of per-worker costs (:func:`ring_bytes`), used by both places that move data:

* the real path: :func:`count_collectives` wraps the collectives for the duration of a ``with`` block, at
  ``torch.distributed``, at ``distributed_c10d`` and where DeepSpeed's backend bound them at start-up, so
  DeepSpeed's own traffic (ZeRO's parameter all-gathers and gradient reduce-scatters, the initial broadcast),
  titan's, and ``all_gather_object``'s tensors all pass through it, and adds each call to a :class:`WireCount`;
* the simulator (:class:`SimCollective`, ``W`` virtual workers in one process): the same :class:`WireCount`.

Costs are those of ring algorithms (bandwidth term only, latency ignored): all-reduce ``2 (W-1)/W * n`` sent and
received per worker (reduce-scatter then all-gather; Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009;
NCCL's bus-bandwidth factor in nccl-tests ``doc/PERFORMANCE.md``), all-gather of ``n`` bytes per worker
``(W-1) n``, reduce-scatter of an ``n``-byte input ``(W-1)/W * n``, broadcast (pipelined chain) ``n`` received by
every worker but the root and ``n`` sent by every worker but the last.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from .base import check_splits

__all__ = ["DistCollective", "ring_allreduce_bytes", "ring_allgather_bytes", "ring_bytes", "ring_rounds", "WireCount",
           "count_collectives", "SimCollective", "split_bytes"]


def ring_allreduce_bytes(nbytes: int, world: int) -> float:
    """Bytes each worker sends (and, the same, receives) in a ring all-reduce of an ``nbytes`` buffer."""
    return 2.0 * (world - 1) / world * nbytes if world > 1 else 0.0


def ring_allgather_bytes(nbytes: int, world: int) -> float:
    """Bytes each worker sends (and receives) in a ring all-gather where every worker contributes ``nbytes``."""
    return float((world - 1) * nbytes)


def ring_bytes(op: str, nbytes: int, world: int, *, is_root: bool = False, is_last: bool = False) -> tuple[float, float]:
    """``(sent, received)`` by one worker for collective ``op`` with an ``nbytes`` send buffer."""
    if world <= 1:
        return 0.0, 0.0
    if op in ("all_reduce", "all_reduce_sum"):
        b = ring_allreduce_bytes(nbytes, world)
        return b, b
    if op in ("all_gather", "all_gather_into_tensor"):
        b = ring_allgather_bytes(nbytes, world)
        return b, b
    if op in ("reduce_scatter_tensor", "all_to_all_single"):
        b = (world - 1) / world * nbytes
        return b, b
    if op == "broadcast":
        return (0.0 if is_last else float(nbytes)), (0.0 if is_root else float(nbytes))
    raise ValueError(f"unknown collective {op!r}; choose one of all_reduce, all_gather, all_gather_into_tensor, "
                     f"reduce_scatter_tensor, all_to_all_single, broadcast")


def ring_rounds(op: str, world: int) -> int:
    """Message rounds one worker waits through in ``op`` (the latency term of an alpha-beta model, each round one
    link latency): a ring all-reduce ``2 (W - 1)`` (reduce-scatter, then all-gather), a ring all-gather,
    reduce-scatter or pairwise all-to-all ``W - 1``, a tree broadcast ``ceil(log2 W)``."""
    if world <= 1:
        return 0
    if op in ("all_reduce", "all_reduce_sum"):
        return 2 * (world - 1)
    if op in ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        return world - 1
    if op == "broadcast":
        return (world - 1).bit_length()
    raise ValueError(f"unknown collective {op!r}; choose one of all_reduce, all_gather, all_gather_into_tensor, "
                     f"reduce_scatter_tensor, all_to_all_single, broadcast")


@dataclass
class WireCount:
    """Bytes one worker sent and received, collective calls by op, and message rounds (:func:`ring_rounds`)."""

    sent: float = 0.0
    received: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)
    rounds: int = 0

    def add(self, op: str, nbytes: int, world: int, **kw: Any) -> None:
        s, r = ring_bytes(op, nbytes, world, **kw)
        self.add_exact(op, s, r, rounds=ring_rounds(op, world))

    def add_exact(self, op: str, sent: float, received: float, rounds: int = 0) -> None:
        """A call whose bytes are known piece by piece (an all-to-all with unequal splits)."""
        self.sent += sent
        self.received += received
        self.rounds += rounds
        self.calls[op] = self.calls.get(op, 0) + 1


def split_bytes(send: list[int], recv: list[int], rank: int, element_size: int) -> tuple[float, float]:
    """``(sent, received)`` by ``rank`` in an all-to-all with splits (elements): every piece but its own crosses
    the wire once, from its sender straight to its receiver."""
    return (float((sum(send) - send[rank]) * element_size), float((sum(recv) - recv[rank]) * element_size))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_COUNTING = threading.local()  # depth of counted calls on this thread: only the outermost call counts


@contextlib.contextmanager
def count_collectives(count: WireCount) -> Iterator[WireCount]:
    """Count every collective this process calls inside the block into ``count``: DeepSpeed's, titan's and
    ``all_gather_object``'s.

    Three places are wrapped, so no path goes around the counter: the names on ``torch.distributed``, the same
    names in ``torch.distributed.distributed_c10d`` (which torch's own helpers such as ``all_gather_object`` and
    the coalescing paths call through), and the functions DeepSpeed's backend bound when it started
    (``TorchBackend.all_gather_function`` / ``reduce_scatter_function``: bound once, so a patch of
    ``torch.distributed`` made after ``deepspeed.init_distributed`` never saw ZeRO's parameter all-gathers and
    gradient reduce-scatters; :func:`titan_ds.deepspeed_compat.backend_bound_collectives`). A call that goes
    through another counted name (``all_gather_into_tensor`` calls ``all_gather_single``) counts once: only the
    outermost counted call on a thread is added. Entered before ``deepspeed.initialize``, it also counts the
    engine's initial parameter broadcast. A backend started inside the block keeps the wrappers it bound; after the
    block they pass calls through uncounted."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from .. import deepspeed_compat as dsc

    active = True

    def world(group: Any) -> int:
        return dist.get_world_size(group=group)

    def wrap(name: str, original: Callable[..., Any], size: Callable[..., tuple[int, dict[str, Any]]]
             ) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(_COUNTING, "depth", 0)
            if active and depth == 0:
                nbytes, extra = size(*args, **kwargs)
                if "exact" in extra:
                    count.add_exact(name, *extra["exact"], rounds=ring_rounds(name, world(kwargs.get("group"))))
                else:
                    count.add(name, nbytes, world(kwargs.get("group")), **extra)
            _COUNTING.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                _COUNTING.depth = depth

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        counted._titan_counted = True  # type: ignore[attr-defined]
        return counted

    def first(*args: Any, **kwargs: Any) -> tuple[int, dict[str, Any]]:
        return _nbytes(kwargs["tensor"] if "tensor" in kwargs else args[0]), {}

    def gather(*args: Any, **kwargs: Any) -> tuple[int, dict[str, Any]]:
        return _nbytes(kwargs["tensor"] if "tensor" in kwargs else args[1]), {}

    def into(*args: Any, **kwargs: Any) -> tuple[int, dict[str, Any]]:
        for key in ("input_tensor", "input"):
            if key in kwargs:
                return _nbytes(kwargs[key]), {}
        return _nbytes(args[1]), {}

    def a2a(*args: Any, **kwargs: Any) -> tuple[int, dict[str, Any]]:  # all_to_all_single(output, input, ...)
        t = kwargs["input"] if "input" in kwargs else args[1]
        send = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
        recv = kwargs.get("output_split_sizes", args[2] if len(args) > 2 else None)
        if send is None and recv is None:
            return _nbytes(t), {}
        w, rank = world(kwargs.get("group")), dist.get_rank(group=kwargs.get("group"))
        send = list(send) if send is not None else [t.shape[0] // w] * w
        recv = list(recv) if recv is not None else [t.shape[0] // w] * w
        row = t.numel() // max(1, t.shape[0]) * t.element_size() if t.dim() > 1 else t.element_size()  # dim-0 rows
        return _nbytes(t), {"exact": split_bytes(send, recv, rank, row)}

    def bcast(*args: Any, **kwargs: Any) -> tuple[int, dict[str, Any]]:
        src = kwargs["src"] if "src" in kwargs else args[1]
        group = kwargs.get("group")
        rank, w = dist.get_rank(), world(group)
        return first(*args, **kwargs)[0], {"is_root": rank == src, "is_last": rank == (src - 1) % w}

    table = {"all_reduce": first, "all_gather": gather, "all_gather_into_tensor": into,
             "all_gather_single": into, "reduce_scatter_tensor": into, "reduce_scatter_single": into,
             "all_to_all_single": a2a, "broadcast": bcast}
    # the op each is counted as (ring_bytes' names): the newer "_single" spellings are the same collectives
    op_of = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}
    wrappers: dict[Any, Callable[..., Any]] = {}  # original function -> its counted wrapper
    patches = []
    for module in (dist, c10d):
        for name, size in table.items():
            original = getattr(module, name, None)
            if original is None or getattr(original, "_titan_counted", False):
                continue
            if original not in wrappers:
                wrappers[original] = wrap(op_of.get(name, name), original, size)
            patches.append(dsc.Patch(f"torch.distributed.{name} (counted)", module, name, wrappers[original]))
    def counted_of(fn: Any) -> Optional[Callable[..., Any]]:
        if getattr(fn, "_titan_counted", False):  # bound inside an earlier count: the function it wraps
            fn = fn.__wrapped__
        return wrappers.get(fn)

    patches += dsc.backend_bound_collectives(counted_of)
    try:
        with dsc.applied(patches):
            yield count
    finally:
        active = False


class DistCollective:
    """``deepspeed.comm`` collectives over one process group."""

    def __init__(self, group: Any):
        from deepspeed import comm as dist
        self.dist, self.group = dist, group
        self.world_size = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        self.dist.all_reduce(t, group=self.group)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self.dist.all_gather(out, t, group=self.group)
        return out

    def all_to_all(self, t: torch.Tensor, send: Optional[list[int]] = None,
                   recv: Optional[list[int]] = None) -> torch.Tensor:
        check_splits(t, self.world_size, send, recv)
        if send is None:
            out = torch.empty_like(t)
            self.dist.all_to_all_single(out, t, group=self.group)
            return out
        out = t.new_empty(sum(recv))  # type: ignore[arg-type]
        self.dist.all_to_all_single(out, t, output_split_sizes=list(recv), input_split_sizes=list(send),  # type: ignore[arg-type]
                                    group=self.group)
        return out


class _Abort(RuntimeError):
    pass


class SimCollective:
    """``world_size`` virtual workers that run **one at a time**, in rank order, with the collectives computed on
    the list of all workers' payloads (the simulator of ``launch/bench/compress_scale.py`` and
    ``bench_diloco.py``).

    The compressors call their collectives inline (``reduce`` encodes, all-reduces, decodes, all-reduces
    again), so each worker runs in its own thread only to keep its stack between rounds: a turn token lets
    exactly one worker compute at a time. Worker ``w`` runs until its next collective, deposits its payload
    and hands the turn to ``w + 1``; the last worker computes the collective once (the sum in rank order, or
    the list), and the turn goes back to worker 0, which reads the result and runs on. Every worker gets the
    same tensor, so sums are identical on all workers by construction.

    Bytes: ``wire[w]`` is worker ``w``'s :class:`WireCount` (the same costs as :func:`count_collectives`);
    ``sent``/``received`` list them; ``calls`` counts collectives. Time: ``cpu_seconds[w]`` is the CPU time worker
    ``w``'s thread spent in ``fn`` (:meth:`run`) less the collectives' own arithmetic (the sums a network would do),
    i.e. its encode/decode work: measured with ``time.thread_time`` so turn waits are not in it (exact with
    ``OMP_NUM_THREADS=1``, where torch computes on the calling thread).
    """

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.wire = [WireCount() for _ in range(world_size)]
        self.calls = 0
        self.cpu_seconds = [0.0] * world_size
        self._cond = threading.Condition()
        self._turn = 0
        self._slots: list[Optional[tuple[str, torch.Tensor]]] = [None] * world_size
        self._result: Any = None
        self._failed = False

    @property
    def sent(self) -> list[float]:
        return [c.sent for c in self.wire]

    @property
    def received(self) -> list[float]:
        return [c.received for c in self.wire]

    def worker(self, w: int) -> "_SimWorker":
        return _SimWorker(self, w)

    def _wait_turn(self, w: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._failed or self._turn == w)
            if self._failed:
                raise _Abort("another virtual worker failed")

    def _pass_turn(self, w: int) -> None:
        with self._cond:
            self._turn = (w + 1) % self.world_size
            self._cond.notify_all()

    def _collective(self, w: int, op: str, t: torch.Tensor, splits: Optional[tuple[list[int], list[int]]] = None) -> Any:
        self._slots[w] = (op, t.detach().clone(), splits)
        if w == self.world_size - 1:
            t0 = time.thread_time()
            self._result = self._compute()
            self.cpu_seconds[w] -= time.thread_time() - t0  # the network's work, not the worker's
        self._pass_turn(w)
        self._wait_turn(w)
        return self._result

    def _compute(self) -> Any:
        if any(s is None for s in self._slots):
            raise RuntimeError("virtual workers disagree on the collective: a worker did not call it")
        if self._slots[0][0] == "all_to_all_v":  # type: ignore[index]
            return self._compute_v()
        ops = {(s[0], tuple(s[1].shape), s[1].dtype) for s in self._slots if s is not None}
        if len(ops) != 1:
            raise RuntimeError(f"virtual workers disagree on the collective: {sorted(map(str, ops))}")
        op = self._slots[0][0]  # type: ignore[index]
        parts = [s[1] for s in self._slots]  # type: ignore[index]
        for c in self.wire:
            c.add("all_to_all_single" if op == "all_to_all" else op, _nbytes(parts[0]), self.world_size)
        self.calls += 1
        self._slots = [None] * self.world_size
        if op == "all_gather":
            return parts
        if op == "all_to_all":  # worker w receives piece w of every worker's buffer, in rank order
            return [torch.cat([p.view(self.world_size, -1)[w] for p in parts]) for w in range(self.world_size)]
        total = parts[0].clone()
        for p in parts[1:]:
            total += p  # rank order, once: every worker reads this same tensor
        return total

    def _compute_v(self) -> list[torch.Tensor]:
        """An all-to-all with splits: worker ``w`` receives, in rank order, the piece each worker sent it."""
        slots = self._slots
        W = self.world_size
        if any(s[0] != "all_to_all_v" for s in slots) or len({s[1].dtype for s in slots}) != 1:  # type: ignore[index]
            raise RuntimeError("virtual workers disagree on the collective: not all called all_to_all with splits")
        for w in range(W):
            for i in range(W):
                if slots[w][2][1][i] != slots[i][2][0][w]:  # type: ignore[index]
                    raise RuntimeError(f"all_to_all splits disagree: worker {w} expects {slots[w][2][1][i]} "
                                       f"elements from worker {i}, which sends it {slots[i][2][0][w]}")
        pieces = [list(torch.split(s[1], s[2][0])) for s in slots]  # type: ignore[index]
        for w, c in enumerate(self.wire):
            c.add_exact("all_to_all_single", *split_bytes(slots[w][2][0], slots[w][2][1], w,  # type: ignore[index]
                                                           slots[w][1].element_size()),  # type: ignore[index]
                        rounds=ring_rounds("all_to_all_single", W))
        self.calls += 1
        self._slots = [None] * W
        return [torch.cat([pieces[i][w] for i in range(W)]) for w in range(W)]

    def run(self, fn: Callable[[int, Any], Any]) -> list:
        """``fn(w, worker_view)`` for every worker (turn by turn); the results in worker order."""
        out: list = [None] * self.world_size
        errors: list[BaseException] = []

        def target(w: int) -> None:
            try:
                self._wait_turn(w)
                t0 = time.thread_time()
                out[w] = fn(w, self.worker(w))
                self.cpu_seconds[w] += time.thread_time() - t0  # its own thread: turn waits cost no CPU
                self._pass_turn(w)
            except _Abort:
                pass
            except BaseException as e:  # surfaced below, after every thread stopped
                errors.append(e)
                with self._cond:
                    self._failed = True
                    self._cond.notify_all()

        with self._cond:
            self._turn, self._failed = 0, False
        threads = [threading.Thread(target=target, args=(w,), daemon=True) for w in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


class _SimWorker:
    """Worker ``w``'s view of a :class:`SimCollective`: the ``Collective`` protocol of ``titan_ds.comm.base``."""

    def __init__(self, group: SimCollective, w: int):
        self.group, self.w, self.world_size = group, w, group.world_size
        self.rank = w

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        t.copy_(self.group._collective(self.w, "all_reduce_sum", t))

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [p.clone() for p in self.group._collective(self.w, "all_gather", t)]

    def all_to_all(self, t: torch.Tensor, send: Optional[list[int]] = None,
                   recv: Optional[list[int]] = None) -> torch.Tensor:
        check_splits(t, self.world_size, send, recv)
        if send is None:
            return self.group._collective(self.w, "all_to_all", t)[self.w].clone()
        return self.group._collective(self.w, "all_to_all_v", t.reshape(-1),
                                      (list(send), list(recv)))[self.w].clone()  # type: ignore[arg-type]
