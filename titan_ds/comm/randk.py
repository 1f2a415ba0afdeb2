"""``randk``: every rank sends the values of the **same** pseudo-random coordinates, summed by an all-reduce.

The index set is drawn from the call's seed (identical on all ranks: config seed, step, call order), so no index
crosses the wire and the payload is a fixed-length vector that a ring all-reduce sums in the network: each rank
receives ``2 (W-1)/W * 4k`` bytes whatever the number of ranks ``W``, where top-k's all-gather receives
``(W-1) * 8k``. The same bytes also carry twice top-k's coordinates (4 bytes per value, no index).

What it gives up is the choice: a coordinate waits for its turn in the residual instead of being sent when it
is large. With ``precondition: "rms"`` every coordinate's accumulated update is on one scale, which is where a
blind choice costs least (measured: docs/compress.md).

Selection: ``k = n / ratio`` coordinates as ``ceil(k / BLOCK)`` distinct blocks of ``BLOCK`` consecutive
coordinates, chosen by ``randperm`` of the blocks (``n / BLOCK`` int64, not ``n``), the last block clipped at
``n``. Every coordinate is equally likely to be chosen at every call. They are drawn on the host (a CPU generator:
the same set on every rank and every device) and copied to the device without waiting for it.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .base import Collective, Segment, nonfinite, to_device_async

__all__ = ["RandKCompressor", "randk_indices"]

BLOCK = 16


def randk_indices(n: int, ratio: float, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The sorted coordinates every rank sends at this call: ``~n / ratio`` of ``n``, in random blocks."""
    k = max(1, min(n, int(n / ratio)))
    blocks = math.ceil(n / BLOCK)
    take = min(blocks, math.ceil(k / BLOCK))
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(blocks, generator=gen)[:take].sort().values
    idx = (chosen[:, None] * BLOCK + torch.arange(BLOCK)[None, :]).reshape(-1)
    return to_device_async(idx[idx < n], torch.device(device))


class RandKCompressor:
    """``randk``: ``idx = randk_indices(n, ratio, seed)`` (the same on every rank); all-reduce ``acc[idx]`` plus
    a non-finite flag (fp32, ``4 (|idx| + 1)`` bytes, about ``4 n / ratio``); ``summed = scatter(idx, sum)``,
    ``sent = scatter(idx, acc[idx])`` (a NaN flag: ``summed`` all NaN, ``sent`` 0, without a host read)."""

    name = "randk"
    config_keys: tuple[str, ...] = ("ratio", "error_feedback", "seed", "ratio_warmup_steps", "ratio_warmup_start")

    def __init__(self, ratio: float, rows: int = 1):
        del rows  # CompressionConfig refuses sketch_rows for "randk" (not in config_keys)
        self.ratio = ratio

    def reduce(self, acc: torch.Tensor, comm: Collective, seed: int, *, layout: list[Segment],
               ratio: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
        del layout  # flat coordinates; residuals are the reducer's
        idx = randk_indices(acc.numel(), self.ratio if ratio is None else ratio, seed, acc.device)
        # one more fp32: NaN when this rank's acc holds NaN/Inf anywhere (most of it is not sent), so every
        # rank sees a non-finite sum and skips the step (and rolls its residuals back); decided on the device
        flag = torch.zeros(1, dtype=acc.dtype, device=acc.device).masked_fill_(nonfinite(acc), float("nan"))
        payload = torch.cat([acc[idx], flag])
        sent = torch.zeros_like(acc)
        sent[idx] = payload[:-1]
        comm.all_reduce_sum(payload)
        bad = ~torch.isfinite(payload[-1])
        summed = torch.zeros_like(acc)
        summed[idx] = payload[:-1]
        return summed.masked_fill_(bad, float("nan")), sent.masked_fill_(bad, 0.0)
