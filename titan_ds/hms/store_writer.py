"""The HMS store's writer threads: the write-behind lanes and the writes in flight (see :mod:`titan_ds.hms.store`).

One thread per lane (``"opt"``: optimizer state; ``"param"``: parameter partitions), so that a parameter write does
not queue behind the optimizer state's end-of-step flush nor the other way round; each thread's writes are split
over the store's I/O pool (they release the GIL). ``writes`` maps a key to its last queued write until someone
waits for it; the store queues them (:meth:`titan_ds.hms.store.TensorStore.put_behind`) under ``lock``, the lock
it shares with this.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future

from .io import started_pool

__all__ = ["WriteLanes"]


class WriteLanes:
    """The writer threads of one store and its writes in flight, key -> ``Future``."""

    def __init__(self, lock: threading.RLock):
        self.lock = lock
        self.lanes = {"opt": started_pool(1, "titan-hms-writer"), "param": started_pool(1, "titan-hms-writer-param")}
        self.writes: dict[str, Future] = {}  # key -> its last queued write, until waited for

    def wait(self, key: str) -> None:
        """Wait for the queued write of ``key``, if any; raise its failure (once)."""
        with self.lock:
            f = self.writes.get(key)
        if f is None:
            return
        try:
            f.result()
        finally:
            with self.lock:
                if self.writes.get(key) is f:
                    del self.writes[key]

    def pending(self) -> list[str]:
        """Keys whose queued write is not done yet."""
        with self.lock:
            return [k for k, f in self.writes.items() if not f.done()]

    def flush(self, prefix: str = "") -> None:
        """Wait for every queued write (of the keys that start with ``prefix``); raise the first failure (its
        message names the key), after all are done."""
        with self.lock:
            writes = {k: f for k, f in self.writes.items() if k.startswith(prefix)}
            for k in writes:
                del self.writes[k]
        first = None
        for f in writes.values():
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - re-raised below, after every write is done
                first = first or e
        if first is not None:
            raise first

    def shutdown(self) -> None:
        for pool in self.lanes.values():
            pool.shutdown(wait=True)
