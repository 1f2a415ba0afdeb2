"""ASDT's ``importance="sketch"``: the TGSS Count-Min estimate of each element's EMA of ``|g|`` as its score.

Per stepped tensor and mode (:meth:`SketchScores.add`): the elements' ``(1 - beta2) * |g|`` are added to a fresh
table at their global indices (``Unit.global_offset`` + the offset in the unit), chunk by chunk of
:mod:`~titan_ds.optim.core`'s slices, in element order (so each counter receives its additions in the order one
call over the whole tensor makes them); the table is all-reduced when the tensor is a ZeRO partition of a
group, then merged into the optimizer's sketch, which ASDT decays by ``beta2`` once per engine step. The scores
of a slice are queried when the sparse step needs them (:meth:`SketchScores.__call__`), so no index or score
buffer of the whole tensor is held.
"""
from __future__ import annotations

from typing import Any

import torch

from ..comm.tgss import CountMinSketch
from .core import Slice
from .layout import Piece, Unit

__all__ = ["SketchScores"]


class SketchScores:
    """The scores of ``importance="sketch"`` over the slices of ``pieces`` (one tensor, one mode)."""

    def __init__(self, sketch: CountMinSketch, units: list[Unit], pieces: list[Piece], device: torch.device):
        if sketch.table.device != device:  # made with the optimizer, before the model reached its device
            sketch.table = sketch.table.to(device)
        self.sketch, self.units, self.pieces, self.device = sketch, units, pieces, device

    def indices(self, s: Slice) -> torch.Tensor:
        """The global indices of the elements of slice ``s`` (int64)."""
        parts = []
        for pc in self.pieces[s.lo:s.hi]:
            start = self.units[pc.unit].global_offset + pc.unit_offset + s.offset
            parts.append(torch.arange(start, start + (s.n if s.hi - s.lo == 1 else pc.length), device=self.device))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def add(self, slices: list[Slice], g_flat: torch.Tensor, beta2: float, group: Any = None) -> None:
        """This step's ``(1 - beta2) * |g|`` of every slice into the sketch (all-reduced over ``group``)."""
        delta = CountMinSketch(self.sketch.width, self.sketch.depth, self.sketch.seed, device=self.device)
        for s in slices:
            delta.update_at(self.indices(s), g_flat[s.flat:s.flat + s.n].float().abs() * (1 - beta2))
        if group is not None:
            import deepspeed.comm as dist
            dist.all_reduce(delta.table, group=group)
        self.sketch.merge_(delta)

    def __call__(self, s: Slice) -> torch.Tensor:
        return self.sketch.query(self.indices(s))
