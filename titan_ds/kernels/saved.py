"""Accounting of the activations autograd keeps for backward (the memory MLME is about), via saved_tensors_hooks.

``with SavedTensorMeter(exclude=model.parameters()) as meter: loss = model(x); loss.backward()`` sees every
tensor autograd saves inside the block, forward and backward alike (a block recomputed inside backward, as
``titan.mlme.recompute_blocks`` does, saves its internals again there). Two figures, both over distinct
storages (a view keeps its whole storage alive, so the storage is what counts), parameters and anything in
``exclude`` left out:

- ``peak``: the most bytes of saved storages alive at once during the block. A saved tensor is alive from its
  save until autograd frees it (after its node's backward, or with its graph); this is the activation memory
  of a training step, the recomputed internals included.
- ``bytes``: every storage saved during the block, counted once (what a forward keeps, when the block is only a
  forward whose graph is still alive; the figure before ``peak`` existed).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor

__all__ = ["SavedTensorMeter"]


class _Held:
    """A saved tensor as autograd keeps it while the meter packs: its release (autograd dropping the packed
    object) is the saved storage's end of life for the meter."""
    __slots__ = ("t", "meter", "ptr")

    def __init__(self, t: Tensor, meter: "SavedTensorMeter", ptr: int):
        self.t, self.meter, self.ptr = t, meter, ptr

    def __del__(self) -> None:
        self.meter._release(self.ptr)


def _unpack(x):
    return x.t if isinstance(x, _Held) else x


class SavedTensorMeter:
    """Context manager: distinct storages saved for backward inside the block; ``peak`` bytes alive at once and
    ``bytes`` of all of them (see the module docstring)."""

    def __init__(self, exclude: Iterable[Tensor] = ()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._storages: dict[int, int] = {}  # every storage saved: ptr -> bytes
        self._live: dict[int, list[int]] = {}  # alive now: ptr -> [saved tensors holding it, bytes]
        self._live_bytes = 0
        self.peak = 0
        self._ctx = None

    def _pack(self, t: Tensor):
        if not isinstance(t, Tensor) or t.layout != torch.strided:
            return t
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self._exclude or isinstance(t, torch.nn.Parameter):
            return t
        self._storages[ptr] = max(self._storages.get(ptr, 0), st.nbytes())
        held = self._live.get(ptr)
        if held is None:
            self._live[ptr] = [1, st.nbytes()]
            self._live_bytes += st.nbytes()
            self.peak = max(self.peak, self._live_bytes)
        else:
            held[0] += 1
        return _Held(t, self, ptr)

    def _release(self, ptr: int) -> None:
        held = self._live.get(ptr)
        if held is None:
            return
        held[0] -= 1
        if held[0] == 0:
            del self._live[ptr]
            self._live_bytes -= held[1]

    def __enter__(self) -> "SavedTensorMeter":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)

    @property
    def live(self) -> int:
        """Bytes of the saved storages alive now."""
        return self._live_bytes

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    @property
    def count(self) -> int:
        return len(self._storages)
