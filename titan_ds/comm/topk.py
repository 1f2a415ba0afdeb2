"""``topk``: each rank sends its own largest-magnitude entries as (index, value) pairs through an all-gather.

With ``momentum`` (and ``momentum_masking``, ``local_clip``, ``ratio_warmup_*``) set in ``titan.compression``,
the same selection is Deep Gradient Compression (Lin et al. 2018): the reducer accumulates velocity instead of
the raw gradient (``titan_ds/comm/dgc.py``); this class only selects and exchanges.
"""
from __future__ import annotations

from typing import Optional

import torch

from .base import Collective, Segment, SparseSent, topk_budget

__all__ = ["TopKCompressor", "topk_indices"]


_CHUNK = 1 << 20  # elements per torch.topk call in topk_indices


def topk_indices(mag: torch.Tensor, k: int, chunk: int = _CHUNK) -> torch.Tensor:
    """Indices of the ``k`` largest entries of the flat ``mag`` (NaN counts as largest, as in ``torch.topk``).

    ATen's CPU ``topk`` copies its whole input into (value, int64 index) pairs, 12 bytes an element (59 MB for
    the seed GPT's 4.9M gradients in one bucket). Here it runs on chunks of ``chunk`` elements, keeping each
    chunk's ``k`` largest, then once more on those candidates: the global top ``k`` of a set is among the top
    ``k`` of each of its parts, so the selection is the same set (up to which of equal values at the threshold
    are taken)."""
    n = mag.numel()
    if n <= chunk:
        return torch.topk(mag, k, sorted=False).indices
    cand = torch.cat([torch.topk(mag[lo:lo + chunk], min(k, min(chunk, n - lo)), sorted=False).indices.add_(lo)
                      for lo in range(0, n, chunk)])
    return cand[torch.topk(mag[cand], k, sorted=False).indices]


class TopKCompressor:
    """``topk``: each rank sends its own k largest-magnitude entries as (index, value) pairs via all-gather.

    1. ``k = n / (2 * ratio)``; ``idx = topk(|acc|, k)`` on this rank (index sets differ between ranks).
    2. all-gather ``idx`` (int32) and ``acc[idx]`` (fp32): 8k bytes handed over per rank.
    3. ``summed = sum_r scatter(idx_r, val_r)``; ``sent = scatter(idx, acc[idx])``, returned as a
       :class:`~titan_ds.comm.base.SparseSent` (no full-size tensor).
    Note the gather's *received* bytes grow with the number of ranks; ratios here are per-rank send bytes.
    """

    name = "topk"
    config_keys: tuple[str, ...] = ("ratio", "error_feedback", "momentum", "momentum_masking", "local_clip",
                                    "ratio_warmup_steps", "ratio_warmup_start")

    def __init__(self, ratio: float, rows: int = 1):
        del rows  # CompressionConfig refuses sketch_rows for "topk" (not in config_keys)
        self.ratio = ratio

    def reduce(self, acc: torch.Tensor, comm: Collective, seed: int, *, layout: list[Segment],
               ratio: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
        del seed, layout  # the selection is this rank's own; residuals and momentum are the reducer's
        n = acc.numel()
        k = topk_budget(n, self.ratio if ratio is None else ratio)
        summed = torch.empty_like(acc)  # first |acc| (no temporary of its own), then the sum
        idx = topk_indices(torch.abs(acc, out=summed), k)
        val = acc[idx]
        idx_all = comm.all_gather(idx.to(torch.int32))
        val_all = comm.all_gather(val.contiguous())
        summed.zero_()
        for i, v in zip(idx_all, val_all):
            summed.index_add_(0, i.long(), v)
        return summed, SparseSent(idx, val, n)
