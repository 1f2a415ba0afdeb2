"""Measure a folder's streaming speed the way HMS uses it (``titan-ds report`` shows the result).

:func:`measure_disk` writes and reads one ``mb``-MiB file through :class:`~titan_ds.hms.io.AsyncIOHandle`
(O_DIRECT where the filesystem allows, so the page cache does not flatter the read) and through the
:class:`~titan_ds.hms.store.TensorStore` (header, checksums, atomic rename). It removes what it wrote.
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch

from .io import AsyncIOHandle, aligned_empty, probe_direct_io
from .store import Tier, TensorStore

__all__ = ["measure_disk"]


def _drop_cache(path: str) -> None:
    """Ask the kernel to forget the file's cached pages (matters only for buffered I/O)."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure_disk(path: str, mb: int = 64, *, threads: int = 4, block_mb: int = 8, repeats: int = 2) -> dict[str, Any]:
    """Raw and store read/write GB/s for ``mb`` MiB under ``path`` (best of ``repeats``)."""
    if mb < 1:
        raise ValueError(f"mb must be >= 1, got {mb}")
    os.makedirs(path, exist_ok=True)
    direct = probe_direct_io(path)
    io = AsyncIOHandle(block_size=block_mb << 20, intra_op_parallelism=threads, direct="detect")
    nbytes = mb << 20
    buf = aligned_empty(nbytes, huge=True)  # as HMS's reused buffers: the disk's speed, not 4 KiB pages' pinning
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    raw = os.path.join(path, f".titan_diskprobe.{os.getpid()}")
    store_dir = os.path.join(path, f".titan_diskprobe_store.{os.getpid()}")
    store = TensorStore([Tier(store_dir)], io=io, durable=True)
    out: dict[str, Any] = {"direct_io": direct, "probe_MiB": mb, "io_threads": threads}
    best = {"raw_write_GBps": 0.0, "raw_read_GBps": 0.0, "store_write_GBps": 0.0, "store_read_GBps": 0.0}
    x = buf.view(torch.float32)
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            io.sync_pwrite(buf, raw, 0)
            fd = os.open(raw, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            best["raw_write_GBps"] = max(best["raw_write_GBps"], nbytes / (time.perf_counter() - t) / 1e9)
            _drop_cache(raw)
            t = time.perf_counter()
            io.sync_pread(buf, raw, 0)
            best["raw_read_GBps"] = max(best["raw_read_GBps"], nbytes / (time.perf_counter() - t) / 1e9)
            t = time.perf_counter()
            store.put("probe", x)
            best["store_write_GBps"] = max(best["store_write_GBps"], nbytes / (time.perf_counter() - t) / 1e9)
            _drop_cache(store.path("probe"))
            t = time.perf_counter()
            y = store.get("probe")
            best["store_read_GBps"] = max(best["store_read_GBps"], nbytes / (time.perf_counter() - t) / 1e9)
            if not torch.equal(y.view(torch.uint8), buf):  # compare bytes: random bits include NaNs
                raise RuntimeError(f"titan hms: disk probe under {path!r} read back different bytes")
    finally:
        if os.path.exists(raw):
            os.remove(raw)
        for name in os.listdir(store_dir):
            os.remove(os.path.join(store_dir, name))
        os.rmdir(store_dir)
        io.close()
    out.update({k: round(v, 3) for k, v in best.items()})
    return out
