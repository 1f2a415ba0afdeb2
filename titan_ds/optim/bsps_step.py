"""BSPS on the step side: which units of a stepped tensor are in which mode, the state buffers that follow the
modes, and the gradient signals BSPS decides its transitions on (:mod:`~titan_ds.optim.bsps` is the schedule
itself: the modes and their transitions, on the host).

:class:`PlasticitySteps` is the part of :class:`~titan_ds.optim.asdt.ASDT` that does it (a mixin of it): each
stepped tensor's pieces by mode (Growth and Elastic hold state; Frozen and Sleeping units are skipped), the
placement of the buffers over the active units (:meth:`_place`: new Growth units start at 0, Elastic ones at their
weights; units that left free their slices), each block's sum of squared gradients summed on the gradients'
device and read once per engine step, and at stage 0 ``requires_grad`` for the next step.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .asdt_state import _SECOND, _VARIANCE
from .bsps import ELASTIC, GROWTH
from .layout import Layout, Piece, place_units, views

__all__ = ["PlasticitySteps"]


class PlasticitySteps:
    """BSPS's step-side bookkeeping of :class:`~titan_ds.optim.asdt.ASDT` (see the module docstring)."""

    def _stage0_plasticity(self) -> None:
        """Stage 0: free the state of blocks that left Growth/Elastic now, and set ``requires_grad`` for the
        next step (Frozen/Sleeping blocks compute no gradient, except at probe steps). Under ZeRO
        ``requires_grad`` is fixed at engine init, so this runs only when the optimizer holds the parameters."""
        for _, p in self._params():
            st = self.state.get(p)
            if st:
                self._unpack(st)
                self._place(p, st, self._layouts.of(p))
                self._pack(st)
        self._restore_requires_grad(drop_grads=True)

    def _restore_requires_grad(self, drop_grads: bool = False) -> None:
        """Stage 0: ``requires_grad`` of each parameter for the next step, from its blocks' BSPS modes."""
        nxt = self._engine_step + 1
        for name, p in self._params():
            need = any(self.plasticity.needs_grad(self._block_of_unit[u.index], nxt)
                       for u in self.units_by_param[name])
            p.requires_grad_(need)
            if drop_grads and not need:
                p.grad = None  # a frozen/sleeping block holds no gradient

    def _pieces_by_mode(self, layout: Layout) -> dict[int, list[Piece]]:
        if self.plasticity is None:  # every unit is in Growth, always
            return {GROWTH: layout.pieces, ELASTIC: []}
        out: dict[int, list[Piece]] = {GROWTH: [], ELASTIC: []}
        for pc in layout.pieces:
            mode = self.unit_mode(pc.unit)
            if mode in out:
                out[mode].append(pc)
        return out

    def _place(self, t: torch.Tensor, st: dict[str, Any], layout: Layout) -> dict[int, list[Piece]]:
        """Make the state buffers cover the active units (new Growth units start at 0, Elastic ones at w)."""
        w_flat, dtype, dev = t.data.view(-1), self.state_dtype, t.device
        by_mode = self._pieces_by_mode(layout)
        place_units(st, "momentum", by_mode[GROWTH], lambda pc: torch.zeros(pc.length, dtype=dtype, device=dev),
                    torch.zeros(0, dtype=dtype, device=dev))
        place_units(st, "anchor", by_mode[ELASTIC], lambda pc: views(w_flat, [pc])[0].to(self.anchor_dtype),
                    torch.zeros(0, dtype=self.anchor_dtype, device=dev))
        if self.update == "adaptive":
            place_units(st, _SECOND, by_mode[GROWTH], lambda pc: torch.zeros(2, device=dev),
                        torch.zeros(0, device=dev), per_unit=2)
        if self.second_moment == "coordinate":
            vd = self.second_dtype
            place_units(st, _VARIANCE, by_mode[GROWTH], lambda pc: torch.zeros(pc.length, dtype=vd, device=dev),
                        torch.zeros(0, dtype=vd, device=dev))
        return by_mode

    def _placed(self, st: dict[str, Any], by_mode: dict[int, list[Piece]]) -> bool:
        """Whether every state buffer holds exactly the units of its mode (what :meth:`_place` makes)."""
        need = {"momentum": by_mode[GROWTH], "anchor": by_mode[ELASTIC]}
        if self.update == "adaptive":
            need[_SECOND] = by_mode[GROWTH]
        if self.second_moment == "coordinate":
            need[_VARIANCE] = by_mode[GROWTH]
        return all(key in st and [r.unit for r in st["units"] if r.buffer == key] == [pc.unit for pc in pieces]
                   for key, pieces in need.items())

    def _observe(self, layout: Layout, g_flat: torch.Tensor) -> None:
        """BSPS's signal: each block's sum of squared gradients, summed on the gradients' device (fp64, in the
        order of the pieces); :meth:`_hand_signals` gives it to the Plasticity when the engine step ends."""
        p = self.plasticity
        if p is None:
            return
        probe = p.is_probe(self._engine_step if self._zero else self._engine_step + 1)
        if self._signal_sq is None:
            self._signal_sq = torch.zeros(len(p.blocks), dtype=torch.float64, device=g_flat.device)
        acc = self._signal_sq
        for pc in layout.pieces:
            if probe or self.unit_mode(pc.unit) in (GROWTH, ELASTIC):
                g = g_flat[pc.start:pc.start + pc.length]
                b = self._block_of_unit[pc.unit]
                acc[b:b + 1] += g.float().pow(2).sum().double()

    def _sum_signals(self, group: Any) -> None:
        """ZeRO: sum this step's signals over the ranks (blocks split across ranks), on the tensors' device (NCCL
        takes no CPU tensor). Signals the Plasticity holds already (restored from a checkpoint, or saved into one
        before this step ended) join them; there are none in a plain step, so nothing is copied to the device."""
        import deepspeed.comm as dist
        dev = self._layouts.device()
        acc = self._signal_sq
        if acc is None:
            acc = torch.zeros(len(self.plasticity.blocks), dtype=torch.float64, device=dev)
        held = self.plasticity.take_signals()
        if held is not None:
            acc = held.to(acc.device) + acc  # (nothing is observed after a checkpoint before the step ends: exact)
        dist.all_reduce(acc, group=group)
        self._signal_sq = acc

    def _hand_signals(self) -> None:
        """The signals observed so far to the Plasticity: one read to the host, at the end of an engine step (once
        every update of it has been queued: BSPS decides its transitions on the host) or for a checkpoint."""
        acc, self._signal_sq = self._signal_sq, None
        if acc is not None:
            self.plasticity.add_signals(acc)

    def _plasticity_state(self) -> Optional[dict[str, Any]]:
        """BSPS's state, with the signals observed since its last ``end_step`` (under ZeRO a step's signals are
        folded in when the next step begins, so a checkpoint between steps holds them)."""
        if self.plasticity is None:
            return None
        self._hand_signals()
        return self.plasticity.state_dict()
