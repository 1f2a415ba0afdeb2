"""Accounting of the activations autograd keeps for backward (the memory MLME is about), via saved_tensors_hooks.

``with SavedTensorMeter(exclude=model.parameters()) as meter: loss = model(x)`` records every tensor autograd
saves during the block; ``meter.bytes`` is the size of the distinct storages they live in (a view keeps its
whole storage alive, so the storage is what counts), parameters and anything in ``exclude`` left out.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor

__all__ = ["SavedTensorMeter"]


class SavedTensorMeter:
    """Context manager: distinct storages saved for backward inside the block, and their bytes."""

    def __init__(self, exclude: Iterable[Tensor] = ()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._storages: dict[int, int] = {}
        self._ctx = None

    def _pack(self, t: Tensor) -> Tensor:
        if not isinstance(t, Tensor) or t.layout != torch.strided:
            return t
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self._exclude and not isinstance(t, torch.nn.Parameter):
            self._storages[ptr] = max(self._storages.get(ptr, 0), st.nbytes())
        return t

    def __enter__(self) -> "SavedTensorMeter":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    @property
    def count(self) -> int:
        return len(self._storages)
