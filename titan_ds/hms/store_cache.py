"""The HMS store's DRAM cache: least recently used tensors up to a byte budget (see :mod:`titan_ds.hms.store`).

It holds copies the store made (the caller owns what it put or got) and is not thread-safe by itself: the store
calls it under its lock, and decides what a current value is (a background read of a replaced file is not
cached).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Optional

import torch

__all__ = ["DramCache", "CACHE_ITEM_FRACTION"]

# the DRAM cache admits a tensor of at most 1/CACHE_ITEM_FRACTION of its budget: every admission is a copy (the
# caller owns the tensor it put or got), and an LRU cache that admits tensors near its size holds one or two of
# them, each evicted before its next use (measured: a 12x768 HMS step under a 64 MiB cache cloned every 40 MB
# optimizer-state tensor and 9 MB partition it read or wrote, ~3 s of CPU a step, for no hits)
CACHE_ITEM_FRACTION = 8


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class DramCache:
    """Key -> tensor, least recently used first, within ``budget`` bytes; admits tensors up to ``item_max``."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self.item_max = self.budget // CACHE_ITEM_FRACTION  # largest tensor the cache admits
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.nbytes = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def items(self):
        return self._entries.items()

    def admits(self, nbytes: int) -> bool:
        return nbytes <= self.item_max

    def get(self, key: str) -> Optional[torch.Tensor]:
        """The cached tensor (now the most recently used), or None."""
        t = self._entries.get(key)
        if t is not None:
            self._entries.move_to_end(key)
        return t

    def insert(self, key: str, t: torch.Tensor) -> None:
        """Hold ``t`` (the cache's own copy) under ``key``, evicting the least recently used to make room; a
        tensor over ``item_max`` is not admitted."""
        nbytes = _nbytes(t)
        if nbytes > self.item_max:
            return
        while self.nbytes + nbytes > self.budget and self._entries:
            self.drop(next(iter(self._entries)))
        self._entries[key] = t
        self.nbytes += nbytes

    def drop(self, key: str) -> None:
        t = self._entries.pop(key)
        self.nbytes -= _nbytes(t)
