"""ASDT's flat path: :func:`~titan_ds.optim.asdt_math.asdt_update` on a whole tensor's fp32 state.

Every unit of a tensor with units split across ZeRO ranks steps here: a split unit's threshold is a collective
(:func:`~titan_ds.optim.layout.kth_largest`, a bisection over the bit patterns summed across ranks) and so is its
per-unit second moment (:func:`~titan_ds.optim.layout.unit_sums`), which every rank must join in the same order.
The quantized buffers are decoded whole for the step (:meth:`ASDT._unpack`) and stored again after it. Every
other tensor steps on the chunked strategies (core.py at density 1, sparse.py otherwise), which the tests hold
bit for bit to this path (``tests/optim/test_sparse.py`` routes ASDT here as the oracle).

:class:`FlatPath` is the part of :class:`~titan_ds.optim.asdt.ASDT` that runs it (a mixin of it).
"""
from __future__ import annotations

from typing import Any

import torch

from ..comm.tgss import CountMinSketch
from .asdt_math import _chunk_plans, asdt_update
from .asdt_state import _BUFFER, _SECOND, _VARIANCE
from .bsps import ELASTIC, GROWTH
from .layout import Layout, Piece, kth_largest, unit_sums, views

__all__ = ["FlatPath"]


class FlatPath:
    """The flat path of :class:`~titan_ds.optim.asdt.ASDT` (see the module docstring)."""

    def _flat_update(self, t: torch.Tensor, st: dict[str, Any], layout: Layout, group: dict[str, Any]) -> None:
        """``t``'s step on the flat path (:func:`asdt_update` on the whole tensor's fp32 state): units split across
        ranks, whose thresholds and per-unit sums are collectives; the oracle of :meth:`_sparse_update`."""
        self._observe(layout, t.grad.view(-1))
        self._unpack(st)
        by_mode = self._place(t, st, layout)
        for mode, pieces in by_mode.items():
            if pieces or layout.split_units:  # split units: every rank joins the collective top-k
                self._apply(t, st, layout, pieces, mode, group)
        self._pack(st)

    def _apply(self, t: torch.Tensor, st: dict[str, Any], layout: Layout, pieces: list[Piece], mode: int,
               group: dict[str, Any]) -> None:
        """Bookkeeping around :func:`asdt_update` for the units of one mode held in ``t``."""
        # split units in this mode: BSPS modes are the same on every rank, so every rank gets the same list
        split = Layout(layout.pieces, [u for u in layout.split_units if self.unit_mode(u) == mode], layout.group)
        if self.update == "adaptive" and mode == GROWTH and self.sketch is None:
            self._apply_adaptive(t, st, pieces, split, group)
            return
        buffer = _BUFFER[mode]
        records = [r for r in st["units"] if r.buffer == buffer]  # in the order of ``pieces`` (place_units)
        bufs = views(st[buffer], records)
        gs = [g.float() for g in views(t.grad.view(-1), pieces)]
        b2 = group["betas"][1]
        scores = self._sketch_scores(pieces, gs, layout, b2, t.device) if self.sketch is not None else None
        adaptive = self.update == "adaptive" and mode == GROWTH
        variances = None
        if adaptive and self.second_moment == "coordinate":
            variances = views(st[_VARIANCE], [r for r in st["units"] if r.buffer == _VARIANCE])
        self._selected_acc += asdt_update(
            views(t.data.view(-1), pieces), gs, lr=group["lr"], betas=group["betas"], density=group["density"],
            weight_decay=group["weight_decay"], unit_numels=[self.units[pc.unit].numel for pc in pieces],
            importance=self.importance, momenta=bufs if mode == GROWTH else None,
            anchors=bufs if mode == ELASTIC else None, lr_scales=[self.unit_lr_scale(pc.unit) for pc in pieces],
            elastic_pull=self.plasticity.elastic_pull if self.plasticity is not None else 0.0, scores=scores,
            kth_largest=lambda s, ks: kth_largest(s, ks, pieces, split, t.device),
            seconds=st[_SECOND].view(-1, 2) if adaptive else None, eps=self.eps,
            unit_sums=lambda x: unit_sums(x, pieces, split), update_clip=self.update_clip if adaptive else None,
            variances=variances, generator=self._generator(t))

    def _apply_adaptive(self, t: torch.Tensor, st: dict[str, Any], pieces: list[Piece], split: Layout,
                        group: dict[str, Any]) -> None:
        """``update="adaptive"`` on the Growth units of ``t``: the same :func:`asdt_update`, handed runs of
        consecutive units as single slices (a whole parameter at stage 0) so that nothing loops over units."""
        key = (id(t), tuple(pc.unit for pc in pieces[:1]), len(pieces))
        plans = self._runs.get(key) if self.plasticity is None else None
        if plans is None:
            plans = _chunk_plans(pieces, [self.units[pc.unit].numel for pc in pieces])
            if self.plasticity is None:
                self._runs[key] = plans
        w_flat, g_flat = t.data.view(-1), t.grad.view(-1)
        scales = None if self.plasticity is None else [self.unit_lr_scale(pc.unit) for pc in pieces]
        seconds = st[_SECOND].view(-1, 2)
        coordinate = self.second_moment == "coordinate"
        for lo, hi, off, runs, lengths, numels in plans:
            part = pieces[lo:hi]
            variances = [st[_VARIANCE][off:off + sum(lengths)]] if coordinate else None
            self._selected_acc += asdt_update(
                [w_flat[a:b] for a, b in runs], [g_flat[a:b] for a, b in runs], lr=group["lr"],
                betas=group["betas"], density=group["density"], weight_decay=group["weight_decay"],
                unit_numels=numels, importance=self.importance, lengths=lengths,
                momenta=[st["momentum"][off:off + sum(lengths)]], lr_scales=None if scales is None else scales[lo:hi],
                kth_largest=lambda s, ks, part=part: kth_largest(s, ks, part, split, t.device),
                seconds=seconds[lo:hi],
                eps=self.eps, unit_sums=lambda x, part=part: unit_sums(x, part, split), update_clip=self.update_clip,
                variances=variances, generator=self._generator(t))

    def _sketch_scores(self, pieces: list[Piece], gs: list[torch.Tensor], layout: Layout, b2: float,
                       dev: torch.device) -> list[torch.Tensor]:
        """Add this call's ``(1 - beta2) * |g|`` to the TGSS sketch (all-reduced when split), then query it; on the
        device ``dev`` of the tensor stepped on."""
        if self.sketch.table.device != dev:  # made with the optimizer, before the model reached its device
            self.sketch.table = self.sketch.table.to(dev)
        delta = CountMinSketch(self.sketch.width, self.sketch.depth, self.sketch.seed, device=dev)
        idx = [self.units[pc.unit].global_offset + pc.unit_offset + torch.arange(pc.length, device=dev)
               for pc in pieces]
        for i, g in zip(idx, gs):
            delta.update_at(i, g.abs() * (1 - b2))
        if layout.group is not None:
            import deepspeed.comm as dist
            dist.all_reduce(delta.table, group=layout.group)
        self.sketch.merge_(delta)
        return [self.sketch.query(i) for i in idx]
