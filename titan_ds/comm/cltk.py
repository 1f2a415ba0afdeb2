"""``cltk``: cyclic local top-k (ScaleCom, Chen et al. 2020): one **leader** rank per call picks the top-k
coordinates of its own accumulator, every rank sends its values at those coordinates, and an all-reduce sums them.

Why: ``topk``'s index sets differ between ranks, so they are all-gathered and each rank *receives* about ``W``
times what it sent. Here the index set is the same on every rank, so both rounds are all-reduces of ``k``
entries, and what a rank receives does not grow with ``W`` (a ring all-reduce: ``2 (W-1)/W`` of the payload):

1. ``leader = seed % W`` (``seed`` is the same on every rank for the same call, and changes every step, so the
   leadership cycles over the ranks).
2. The leader writes ``idx = topk(|acc|, k)`` (int32, ``k = n / (2 ratio)``) into a buffer the other ranks leave
   at zero; ``all_reduce_sum`` of it hands every rank the leader's indices (``4k`` bytes; a broadcast would be
   cheaper, the protocol has two collectives and the counts stay honest).
3. Every rank all-reduces ``acc[idx]`` plus a non-finite flag (``4 (k + 1)`` bytes). ``summed = scatter(idx,
   sum)``; ``sent = acc[idx]`` at ``idx`` (a :class:`~titan_ds.comm.base.SparseSent`); the rest stays in the
   residual (error feedback is the reducer's).

The leader's choice is a guess for the others: the ranks' accumulators are correlated (the same model, i.i.d.
data), and with ``precondition: "rms"`` every coordinate is on one scale. A non-finite ``acc`` on any rank makes
the sum all NaN (every rank then skips the step) without a host read.
"""
from __future__ import annotations

from typing import Optional

import torch

from .base import Collective, Segment, SparseSent, nonfinite, topk_budget
from .topk import topk_indices

__all__ = ["CLTKCompressor", "collective_rank"]


def collective_rank(comm: Collective) -> int:
    """This rank's index in ``comm``'s group (0 for a one-rank collective); wrappers forward ``inner``."""
    while not hasattr(comm, "rank") and hasattr(comm, "inner"):
        comm = comm.inner  # type: ignore[attr-defined]
    rank = getattr(comm, "rank", None)
    if rank is None:
        if comm.world_size == 1:
            return 0
        raise TypeError(f"{type(comm).__name__} does not say which rank this is; 'cltk' needs it (give it .rank)")
    return int(rank)


class CLTKCompressor:
    """``cltk``: the leader's top-k coordinates, every rank's values there, two all-reduces of ``k`` entries."""

    name = "cltk"
    config_keys: tuple[str, ...] = ("ratio", "error_feedback", "ratio_warmup_steps", "ratio_warmup_start")

    def __init__(self, ratio: float, rows: int = 1):
        del rows  # CompressionConfig refuses sketch_rows for "cltk" (not in config_keys)
        self.ratio = ratio

    def reduce(self, acc: torch.Tensor, comm: Collective, seed: int, *, layout: list[Segment],
               ratio: Optional[float] = None) -> tuple[torch.Tensor, SparseSent]:
        del layout  # flat coordinates; residuals are the reducer's
        n = acc.numel()
        k = topk_budget(n, self.ratio if ratio is None else ratio)
        leader = seed % comm.world_size
        idx = torch.zeros(k, dtype=torch.int32, device=acc.device)
        if collective_rank(comm) == leader:
            idx.copy_(topk_indices(acc.abs(), k))
        comm.all_reduce_sum(idx)
        idx = idx.long()
        flag = torch.zeros(1, dtype=acc.dtype, device=acc.device).masked_fill_(nonfinite(acc), float("nan"))
        val = acc[idx]
        payload = torch.cat([val, flag])
        comm.all_reduce_sum(payload)
        bad = ~torch.isfinite(payload[-1])
        summed = torch.zeros_like(acc)
        summed[idx] = payload[:-1]
        return summed.masked_fill_(bad, float("nan")), SparseSent(idx, val.masked_fill_(bad, 0.0), n)
