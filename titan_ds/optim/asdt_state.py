"""ASDT's optimizer state as checkpoints hold it, and its save and restore.

``self.state[t]`` holds ``step``, the buffers (``momentum`` of Growth units, stored in ``state_dtype`` or as
qstate's codes with ``<buffer>_absmax``; ``anchor`` of Elastic ones; ``second``: ``(v, t)`` of each Growth unit
with ``update="adaptive"``; ``variance``: each Growth element's own second moment with
``second_moment="coordinate"``) and ``units``, one :class:`~titan_ds.optim.layout.UnitState` record per active
unit saying where its slice of a buffer lies. A checkpoint holds the records as ``<buffer>_units`` (the units, in
buffer order) and ``<buffer>_lens`` (:func:`_to_saved`), the format every ASDT checkpoint has had: the chunked
strategies (core.py, sparse.py) read and write the same buffers, so checkpoints of the flat path load as they are
(``tests/optim/test_sparse.py::test_checkpoints_resume_across_paths``). :class:`CheckpointState` is the part of
:class:`~titan_ds.optim.asdt.ASDT` that saves and restores it, with what ASDT keeps besides (``["asdt"]``).
"""
from __future__ import annotations

from typing import Any

import torch

from .bsps import ELASTIC, GROWTH
from .layout import UnitState

__all__ = ["CheckpointState"]

_BUFFER = {GROWTH: "momentum", ELASTIC: "anchor"}
_SECOND = "second"  # update="adaptive": (v, t) of each Growth unit, fp32
_VARIANCE = "variance"  # second_moment="coordinate": each Growth element's own second moment
_SAVED = (*_BUFFER.values(), _SECOND, _VARIANCE)


def _to_saved(st: dict[str, Any]) -> dict[str, Any]:
    """A tensor's state as checkpoints hold it: the records as ``<buffer>_units`` (order) and ``_lens``."""
    if "units" not in st:  # already in this form (restored by HMS and not stepped since)
        return dict(st)
    out = {k: v for k, v in st.items() if k != "units"}
    for buffer in _SAVED:
        records = [r for r in st.get("units", []) if r.buffer == buffer]
        out[f"{buffer}_units"] = [r.unit for r in records]
        out[f"{buffer}_lens"] = {r.unit: r.length for r in records}
    return out


def _from_saved(st: dict[str, Any]) -> None:
    """Inverse of :func:`_to_saved`, in place (the units of a buffer lie in it end to end, in order)."""
    records = []
    for buffer in _SAVED:
        lens, cursor = st.pop(f"{buffer}_lens", {}), 0
        for u in st.pop(f"{buffer}_units", []):
            records.append(UnitState(int(u), buffer, cursor, int(lens[u])))
            cursor += int(lens[u])
    st["units"] = records


class CheckpointState:
    """:meth:`state_dict` and :meth:`load_state_dict` of :class:`~titan_ds.optim.asdt.ASDT` (a mixin of it)."""

    def state_dict(self) -> dict[str, Any]:
        """torch's format, each tensor's ``units`` records saved as plain lists (``_to_saved``), plus ``"asdt"``:
        the engine step, the TGSS table and the BSPS state."""
        sd = super().state_dict()
        sd["state"] = {k: _to_saved(st) for k, st in sd["state"].items()}
        sd["asdt"] = self._extra_state()
        return sd

    def _extra_state(self) -> dict[str, Any]:
        return {"engine_step": self._engine_step, "last_selected": self.last_selected,
                "clip_coef": float(self._clip_coef),
                "rounding_generators": {k: g.get_state() for k, g in self._generators.items()},
                "sketch": self.sketch.state_dict() if self.sketch is not None else None,
                "plasticity": self._plasticity_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        extra = state_dict.get("asdt")
        if extra is None:
            raise KeyError("not an ASDT optimizer state (no 'asdt' entry); resume with the optimizer it was saved with")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "asdt"})
        # torch casts every floating state tensor to its param's dtype: with bf16 params that rounds the fp32
        # block scales and second moments. Take those tensors again from the given state dict, as saved.
        saved = state_dict.get("state", {})
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for i, p in zip(ids, [p for g in self.param_groups for p in g["params"]]):
            st = self.state.get(p)
            for key, v in (saved.get(i) or {}).items():
                if st is not None and torch.is_tensor(v) and torch.is_tensor(st.get(key)) and st[key].dtype != v.dtype:
                    st[key] = v.detach().clone().to(st[key].device)
        for st in self.state.values():
            _from_saved(st)
            # a state saved under other settings: bring each buffer to this optimizer's dtype (quantized codes
            # to uint8, exactly: 0..255 survive fp32/bf16; their block absmax to fp32)
            dtypes = {"momentum": self.state_dtype, "anchor": self.anchor_dtype, _SECOND: torch.float32,
                      _VARIANCE: self.second_dtype}
            for key, dtype in dtypes.items():
                if f"{key}_absmax" in st:
                    st[key], st[f"{key}_absmax"] = st[key].to(torch.uint8), st[f"{key}_absmax"].float()
                elif key in st:
                    st[key] = st[key].to(dtype)
        self.load_extra_state(state_dict)

    def load_extra_state(self, state_dict: dict[str, Any]) -> None:
        """Restore, from a full :meth:`state_dict`, what ASDT keeps besides torch's per-tensor ``state`` and
        ``param_groups``: the engine step, the TGSS table and the BSPS state (saved once, in ``["asdt"]``).
        HMS calls it alone: under NVMe optimizer offload DeepSpeed saves the client optimizer's state dict in
        each rank's shard but never loads it, and HMS's snapshot restores the per-tensor state itself."""
        extra = state_dict.get("asdt")
        if extra is None:
            raise KeyError("not an ASDT optimizer state (no 'asdt' entry); resume with the optimizer it was saved with")
        self._engine_step = int(extra["engine_step"])
        self.last_selected = int(extra["last_selected"])
        self._clip_coef = float(extra.get("clip_coef", 1.0))  # step in backward's clipping of the next step
        for key, state in (extra.get("rounding_generators") or {}).items():  # the stochastic rounding's draws
            self._generators[key] = self._new_generator(key, 0)
            self._generators[key].set_state(state.cpu() if torch.is_tensor(state) else state)
        if self.sketch is not None:
            self.sketch.load_state_dict(extra["sketch"])
        if (extra.get("plasticity") is None) != (self.plasticity is None):
            raise ValueError("checkpoint and optimizer disagree on BSPS (titan.plasticity): resume with the same "
                             "titan section the checkpoint was saved with")
        if self.plasticity is not None:
            self._signal_sq = None  # the saved state holds the signals observed before it was saved
            self.plasticity.load_state_dict(extra["plasticity"])
            if not self._zero:
                self._restore_requires_grad()
