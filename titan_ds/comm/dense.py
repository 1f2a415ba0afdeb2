"""``none``: the uncompressed all-reduce, through the same code and byte accounting as the lossy methods."""
from __future__ import annotations

from typing import Optional

import torch

from .base import Collective, Segment

__all__ = ["DenseCompressor"]


class DenseCompressor:
    """``none``: the dense all-reduce (ratio 1); ``sent`` is all of ``acc``, so the residual stays zero."""

    name = "none"
    config_keys: tuple[str, ...] = ()

    def __init__(self, ratio: float = 1.0, rows: int = 1):
        del ratio, rows  # CompressionConfig refuses both for "none" (not in config_keys)

    def reduce(self, acc: torch.Tensor, comm: Collective, seed: int, *, layout: list[Segment],
               ratio: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
        del seed, layout, ratio  # dense: nothing to hash, select or ramp
        summed = acc.clone()
        comm.all_reduce_sum(summed)
        return summed, acc
