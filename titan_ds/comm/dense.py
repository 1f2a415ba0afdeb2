"""``none``: the uncompressed all-reduce, through the same code and byte accounting as the lossy methods."""
from __future__ import annotations

import torch

from .base import Collective

__all__ = ["DenseCompressor"]


class DenseCompressor:
    """``none``: the dense all-reduce (ratio 1); ``sent`` is all of ``acc``, so the residual stays zero."""

    name = "none"
    unused_keys = ("ratio", "error_feedback", "sketch_rows", "seed")

    def __init__(self, ratio: float = 1.0, rows: int = 1):
        del ratio, rows  # CompressionConfig refuses both for "none" (unused_keys)

    def reduce(self, acc: torch.Tensor, comm: Collective, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        summed = acc.clone()
        comm.all_reduce_sum(summed)
        return summed, acc
