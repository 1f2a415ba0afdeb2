"""Writes in flight, per sub-group: both HMS swappers hand a sub-group's tensors to the store's writer thread and
keep its futures (a list per sub-group, oldest first); these wait for them and raise the first failure."""
from __future__ import annotations

import time
from collections import deque

from .timeline import current as _timeline

__all__ = ["wait_all", "drain"]


def wait_all(futs: list) -> None:
    """Wait for every write in ``futs`` (one sub-group's), then raise the first failure."""
    first = None
    for f in futs:
        try:
            f.result()
        except Exception as e:  # noqa: BLE001 - every write of the sub-group is waited for first
            first = first or e
    if first is not None:
        raise first


def drain(writing: deque, phase: str, then=None) -> None:
    """Wait for every sub-group's writes in ``writing`` (oldest first), then call ``then``; the wait is a timeline
    span of ``phase``. The first failure is raised after all (``writing`` is empty either way)."""
    t0 = time.perf_counter()
    try:
        while writing:
            wait_all(writing.popleft())
    finally:
        writing.clear()
        if then is not None:
            then()
        if (tl := _timeline()) is not None:
            tl.add(phase, t0, time.perf_counter())
