"""Tiered tensor store: a bounded DRAM cache over one or more disk tiers, with checked, atomic files.

Tiers, fastest first: the DRAM cache (LRU, ``dram_cache_bytes``), then disk tiers (``Tier(path,
capacity_bytes)``; e.g. an NVMe folder with a capacity, then a larger SSD folder). A tensor is placed in the
first disk tier with room; :meth:`TensorStore.rebalance` moves files so that the most frequently read keys sit
in the fastest tiers (placement by measured access counts). The compute-device budget is enforced by the
users of the store (the ZeRO-3 parameter swapper counts the bytes it has handed out).

One file per key, checked (a checksum per 4 MiB of payload and one of the header): the format is
:mod:`titan_ds.hms.store_format`. The DRAM cache is a :class:`~titan_ds.hms.store_cache.DramCache`, the writer
threads :class:`~titan_ds.hms.store_writer.WriteLanes`; this class places files in tiers, keeps the index, and
coordinates the cache, the prefetches and the writes in flight.

Writes are atomic: the file is written to ``<name>.tmp.<pid>.<n>``, optionally fsync'ed (``durable``), then
renamed over the old file, so a reader sees the old version or the new one, never a torn mix; a crash leaves
at most a stray ``.tmp`` file, which :meth:`TensorStore.scan` removes. A full disk raises
:class:`StoreFullError` naming the file, the bytes needed and the bytes free, and the previous version stays
readable. A payload or header that does not match its checksum raises
:class:`~titan_ds.hms.store_format.ChecksumError` naming the file.

Write-behind: :meth:`TensorStore.put_behind` queues a ``put`` on one of the store's writer threads (lane
``"opt"``: optimizer state; lane ``"param"``: parameter partitions) and returns its ``Future``. Until that write is done, a ``get``, ``prefetch``, ``put`` or ``delete`` of the key waits for it
(so it sees the new value, never the file or cached copy it replaces); :meth:`TensorStore.flush` waits for
every queued write and raises the first failure (a :class:`StoreFullError` or other ``OSError`` of the same
type, its message naming the key). ``close`` flushes.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import store_format as fmt
from .io import ALIGN, AsyncIOHandle, BufferPool, started_pool, storage_refs, tensor_bytes
from .store_cache import CACHE_ITEM_FRACTION, DramCache
from .store_format import FORMAT_VERSION, ChecksumError
from .store_writer import WriteLanes

__all__ = ["Tier", "TensorStore", "ChecksumError", "StoreFullError", "StoreStats", "FORMAT_VERSION",
           "CACHE_ITEM_FRACTION"]

log = logging.getLogger("titan_ds.hms")


class StoreFullError(OSError):
    """A disk tier ran out of space (or out of its configured capacity); the previous version is intact."""


@dataclass
class Tier:
    path: str
    capacity_bytes: Optional[int] = None
    used_bytes: int = 0


@dataclass
class _Entry:
    tier: int
    nbytes: int  # bytes on disk (header + padded payload)
    gen: int


@dataclass
class StoreStats:
    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    cache_hits: int = 0
    prefetch_hits: int = 0
    misses: int = 0
    stall_s: float = 0.0
    bytes_prefetched: int = 0
    staged_writes: int = 0  # values kept from a put for an expected read (see TensorStore.stage)
    prefetch_dropped: int = 0  # speculative prefetches dropped unread to stay within max_speculative
    moves: int = 0
    # key prefix ("param", "opt") -> [hits, misses, stall_s, misses whose prefetch was still in flight]
    by_kind: dict = field(default_factory=dict)

    def count(self, key: str, hit: bool, stall: float, inflight: bool = False) -> None:
        c = self.by_kind.setdefault(key.split("/", 1)[0], [0, 0, 0.0, 0])
        c[0 if hit else 1] += 1
        c[2] += stall
        c[3] += int(inflight)

    def as_dict(self) -> dict:
        hits = self.cache_hits + self.prefetch_hits
        total = hits + self.misses
        out = {"hit_rate": hits / total if total else 0.0, "bytes_read": self.bytes_read,
               "bytes_written": self.bytes_written, "stall_s": self.stall_s,
               "bytes_prefetched": self.bytes_prefetched, "reads": self.reads, "writes": self.writes,
               "staged_writes": self.staged_writes, "prefetch_dropped": self.prefetch_dropped}
        for kind, (h, m, st, late) in self.by_kind.items():
            out[f"{kind}_hit_rate"] = h / (h + m) if h + m else 0.0
            out[f"{kind}_hits"], out[f"{kind}_misses"], out[f"{kind}_stall_s"] = h, m, st
            out[f"{kind}_misses_inflight"] = late  # prefetched too late; the other misses were never prefetched
        return out


class TensorStore:
    """Key -> tensor store over ``tiers`` with a DRAM LRU cache of ``dram_cache_bytes``.

    ``put`` writes through (the file is always current); ``get`` returns a tensor the caller owns;
    ``prefetch`` starts a background read so that a later ``get`` does not wait.

    A *speculative* prefetch (a predictor's guess, not a read the caller is about to wait for) holds its tensor
    until a ``get`` takes it. A wrong guess is taken late or never: unbounded, such reads pile up (measured: a
    170M-parameter HMS run held ~370 MB of them in its second step's forward, when the trace of DeepSpeed's
    first, differently ordered step is replayed). ``max_speculative`` bounds them: beyond it the oldest unread
    one is dropped (``stats.prefetch_dropped``); a later ``get`` of it reads the file.
    """

    def __init__(self, tiers: list[Tier], *, dram_cache_bytes: int = 0, io: Optional[AsyncIOHandle] = None,
                 durable: bool = True, verify: bool = True, prefetch_workers: int = 2,
                 max_speculative: Optional[int] = None, overwrite_in_place: bool = False, checksum: bool = True):
        if not tiers:
            raise ValueError("TensorStore needs at least one disk tier")
        self.tiers = tiers
        for t in tiers:
            os.makedirs(t.path, exist_ok=True)
        self.io = io or AsyncIOHandle()
        self.durable, self.verify = durable, verify
        # False: swap files, written with no payload checksums (store_format: a restarted run discards them)
        self.checksum = bool(checksum)
        self._cache = DramCache(dram_cache_bytes)
        self._index: dict[str, _Entry] = {}
        self._freq: dict[str, int] = {}
        self._staged: dict[str, object] = {}
        self._read_pools: dict[str, BufferPool] = {}  # key prefix -> pool its reads go into (pool_reads)
        self._speculative: OrderedDict[str, None] = OrderedDict()  # staged by a guess, oldest first
        if max_speculative is not None and max_speculative < 1:
            raise ValueError(f"max_speculative must be >= 1 or None, got {max_speculative}")
        self.max_speculative = max_speculative
        # whole-file prefetch tasks run here, never on the I/O pool they wait on (nesting would deadlock)
        self._prefetch_pool = started_pool(int(prefetch_workers), "titan-hms-prefetch")
        self._lock = threading.RLock()
        # put_behind runs on these (lane "opt", the default, and lane "param"); the same dicts as the writer's
        self._write_lanes = WriteLanes(self._lock)
        self._lanes, self._writes = self._write_lanes.lanes, self._write_lanes.writes
        self._writer = self._lanes["opt"]
        # key -> set when its in-place overwrite (see _put) is done; no read of the key runs meanwhile
        self._overwriting: dict[str, threading.Event] = {}
        # True: a put that is not durable rewrites a same-sized file where it is (see _put): for swap files,
        # which a restarted run discards; a crash then leaves that file torn. False: every put writes a new file
        # and renames it over the old one (a crash leaves the previous version whole)
        self.overwrite_in_place = bool(overwrite_in_place)
        self._tmp = itertools.count()
        self.stats = StoreStats()
        # storage data_ptr -> [(key, byte offset in that storage, nbytes)]: values put by HMS's parameter swapper
        # that were views of another tensor's storage (the partitions ZeRO-3 writes from an fp32 master), so that
        # the optimizer swapper can keep that master as those files instead of writing its bytes a second time
        self.written_views: dict[int, list[tuple[str, int, int]]] = {}

    # ------------------------------------------------------------------ paths and index
    @property
    def cache_budget(self) -> int:
        return self._cache.budget

    @property
    def cache_item_max(self) -> int:
        """The largest tensor the DRAM cache admits."""
        return self._cache.item_max

    def path(self, key: str, tier: Optional[int] = None) -> str:
        t = self._index[key].tier if tier is None else tier
        return os.path.join(self.tiers[t].path, fmt.file_name(key))

    def __contains__(self, key: str) -> bool:
        return key in self._index or key in self._writes

    def keys(self) -> list[str]:
        return list(self._index)

    def tier_of(self, key: str) -> int:
        return self._index[key].tier

    def scan(self) -> int:
        """Rebuild the index from the files in every tier (a fresh process over an existing store).

        Removes stray ``.tmp`` files left by a crash. Returns the number of keys found.
        """
        self._index.clear()
        for ti, tier in enumerate(self.tiers):
            tier.used_bytes = 0
            for name in sorted(os.listdir(tier.path)):
                full = os.path.join(tier.path, name)
                if ".tmp." in name:
                    os.remove(full)
                    continue
                if not name.endswith(fmt.SUFFIX):
                    continue
                meta, _ = self._read_header(full)
                key = fmt.key_of(name)
                size = os.path.getsize(full)
                self._index[key] = _Entry(ti, size, meta["gen"])
                tier.used_bytes += size
        return len(self._index)

    # ------------------------------------------------------------------ write
    def _place(self, key: str, size: int) -> int:
        old = self._index.get(key)
        for ti, tier in enumerate(self.tiers):
            room = None if tier.capacity_bytes is None else tier.capacity_bytes - tier.used_bytes
            if old is not None and old.tier == ti and room is not None:
                room += old.nbytes
            if room is None or size <= room:
                return ti
        raise StoreFullError(errno.ENOSPC, f"titan hms: every disk tier is at its capacity; {key!r} needs {size} "
                                           f"bytes; raise titan.hms.nvme_capacity_mb or add a spill_tiers entry")

    def put(self, key: str, tensor: torch.Tensor, *, durable: Optional[bool] = None) -> int:
        """Write ``tensor`` under ``key`` atomically; returns the new generation. Updates a cached copy."""
        self._wait_write(key)  # a queued write of the key lands first: the last put wins
        return self._put(key, tensor, durable=durable)

    def _put(self, key: str, tensor: torch.Tensor, *, durable: Optional[bool] = None, unstage: bool = True) -> int:
        src = tensor.detach()
        if src.device.type != "cpu":
            src = src.cpu()
        src = src.contiguous()
        view = tensor_bytes(src)
        nbytes = view.numel()
        with self._lock:
            old = self._index.get(key)
            gen = (old.gen + 1) if old else 1
        meta, hlen = fmt.new_header(key, src, nbytes, gen, checksum=self.checksum)
        padded = -(-nbytes // ALIGN) * ALIGN
        size = hlen + padded
        durable = self.durable if durable is None else durable
        with self._lock:
            ti = self._place(key, size)
            # a swap file (not durable) of the same size in the same tier is overwritten where it is: writing a
            # new file and renaming it over the old one allocates its extents and frees the old ones every time
            # (measured on this disk: 0.8 GB/s against 1.9 GB/s overwriting, O_DIRECT, 40 MiB files). Its old
            # value is not needed once a new one is being written; a read of it must not overlap the write
            in_place = (not durable and self.overwrite_in_place and old is not None and old.tier == ti
                        and old.nbytes == size and key not in self._overwriting)
            pending = None
            if in_place:
                if unstage:  # put: a prefetch of the old value (put_behind dropped it when it was queued, and its
                    # staged entry may now be the new value, stage=True)
                    pending = self._staged.pop(key, None)
                    self._speculative.pop(key, None)
                self._overwriting[key] = threading.Event()
        final = self.path(key, ti)
        if pending is not None:
            try:
                pending.result()  # a prefetch of the old value still reading the file
            except Exception:  # noqa: BLE001 - its value is dropped either way
                pass
        tmp = final if in_place else f"{final}.tmp.{os.getpid()}.{next(self._tmp)}"
        try:
            try:
                self._write_file(tmp, meta, hlen, view, durable=durable)
            finally:
                if in_place:
                    with self._lock:
                        self._overwriting.pop(key).set()
            if not in_place:
                os.replace(tmp, final)
        except BaseException as e:
            if in_place:  # the file holds neither value now: forget the key rather than read it back torn
                with self._lock:
                    self._index.pop(key, None)
                    self.tiers[ti].used_bytes -= old.nbytes
                    self._unstage(key)
                    if key in self._cache:
                        self._cache_drop(key)
                if os.path.exists(final):
                    os.remove(final)
                if isinstance(e, OSError):
                    raise OSError(e.errno, f"titan hms: overwriting {final!r} failed ({e.strerror or e}); the value "
                                           f"of {key!r} is lost") from e
                raise
            if os.path.exists(tmp):
                os.remove(tmp)
            if not isinstance(e, OSError):
                raise
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                st = os.statvfs(self.tiers[ti].path)
                raise StoreFullError(e.errno, f"titan hms: disk full writing {final!r}: needed {size} bytes, "
                                              f"{st.f_bavail * st.f_frsize} free; the previous version of {key!r} "
                                              f"is intact. Free space or point titan.hms.nvme_path elsewhere") from None
            raise
        with self._lock:
            if old is not None:
                self.tiers[old.tier].used_bytes -= old.nbytes
                if old.tier != ti:
                    os.remove(self.path(key, old.tier))
            self._index[key] = _Entry(ti, size, gen)
            self.tiers[ti].used_bytes += size
            self.stats.writes += 1
            self.stats.bytes_written += nbytes
            if unstage:  # a write-behind dropped the stale staged copy when it was queued (put_behind)
                self._unstage(key)
            if key in self._cache:
                self._cache_drop(key)
            if nbytes <= self.cache_item_max:  # write-allocate: the next read of a fresh value hits DRAM
                self._cache_insert(key, src.clone())
        return gen

    def put_behind(self, key: str, tensor: torch.Tensor, *, durable: Optional[bool] = None,
                   on_done=None, lane: str = "opt", stage: bool = False, on_written=None) -> Future:
        """:meth:`put` on the writer thread of ``lane`` (writes of one lane land in the order queued); returns its
        ``Future`` at once (see the module docstring). The caller hands ``tensor`` over: it must not change it
        until the future is done. ``on_done(start, end)`` is called on the writer thread with the write's
        ``time.perf_counter`` span (the timeline's in-flight bars). ``stage``: the next ``get`` of ``key`` takes
        ``tensor`` itself (as :meth:`stage`, once the write landed) instead of reading the file back.
        ``on_written()``: called on the writer thread once the write landed, only if it did, before the future is
        done (so a ``get`` that waited for the write sees what it did).

        A prefetch or staged copy of ``key`` from before this call is dropped here (it holds the old value); a
        prefetch issued while the write is in flight reads the new file once it landed and is kept."""
        if lane not in self._lanes:
            raise ValueError(f"put_behind lane must be one of {sorted(self._lanes)}, got {lane!r}")
        src = tensor.detach()
        done: Optional[Future] = None

        def write() -> int:
            t0 = time.perf_counter()
            try:
                gen = self._put(key, src, durable=durable, unstage=False)
                if on_written is not None:
                    on_written()
                return gen
            except BaseException:
                with self._lock:  # the file keeps the old value: so must the next read
                    if done is not None and self._staged.get(key) is done:
                        self._unstage(key)
                raise
            finally:
                if on_done is not None:
                    on_done(t0, time.perf_counter())

        def named() -> int:
            try:
                return write()
            except OSError as e:
                if key in str(e):
                    raise
                raise type(e)(e.errno, f"titan hms: background write of {key!r} failed: {e.strerror or e}") from e
            except Exception as e:
                raise RuntimeError(f"titan hms: background write of {key!r} failed: {type(e).__name__}: {e}") from e

        self._wait_write(key)  # two queued writes of one key: in order
        with self._lock:
            pool = self._lanes[lane]
            self._unstage(key)  # the old value's prefetch or staged copy
            # held as a finished prefetch (a get still waits for the write, and raises its failure), unless the
            # write puts it in the DRAM cache anyway (write-allocate), as stage() decides
            if stage and src.numel() * src.element_size() > self.cache_item_max:
                done = Future()
                done.set_result(src)
            f = pool.submit(named)
            self._writes[key] = f
            if done is not None:
                self._staged[key] = done
                self.stats.staged_writes += 1
        return f

    def _wait_write(self, key: str) -> None:
        """Wait for the queued write of ``key``, if any; raise its failure (once)."""
        self._write_lanes.wait(key)

    def pending_writes(self) -> list[str]:
        """Keys whose queued write is not done yet."""
        return self._write_lanes.pending()

    def flush(self, prefix: str = "") -> None:
        """Wait for every queued write (of the keys that start with ``prefix``); raise the first failure (its
        message names the key), after all are done."""
        self._write_lanes.flush(prefix)

    def _write_file(self, path: str, meta: dict, hlen: int, view: torch.Tensor, *, durable: bool) -> None:
        fmt.write_file(self.io, path, meta, hlen, view, durable=durable)

    # ------------------------------------------------------------------ read
    def _read_header(self, path: str) -> tuple[dict, int]:
        return fmt.read_header(self.io, path)

    def pool_reads(self, prefix: str, pool: BufferPool) -> None:
        """Read the keys starting with ``prefix`` (when no ``out`` is given) into buffers taken from ``pool``
        instead of fresh ones: the caller hands a value back with :meth:`recycle` once nothing uses it."""
        self._read_pools[prefix] = pool

    def _read_file(self, key: str, path: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Read and verify ``key``'s file; into ``out`` directly when it is a contiguous CPU tensor of the
        stored size (:func:`titan_ds.hms.store_format.read_file`), else into a buffer of the key's read pool
        (:meth:`pool_reads`) or a fresh one."""
        pool = next((p for pre, p in self._read_pools.items() if key.startswith(pre)), None) if out is None else None
        taken: list[torch.Tensor] = []

        def alloc(n: int) -> torch.Tensor:
            taken.append(pool.take(n))
            return taken[-1]

        t, nbytes = fmt.read_file(self.io, key, path, out, verify=self.verify, alloc=None if pool is None else alloc)
        if taken and t.numel() and t.data_ptr() == taken[0].data_ptr():
            # the value shares the pool buffer: recycle() gives it back when this and the value are its only users
            t._titan_pool = (pool, taken[0], storage_refs(t))
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes_read += nbytes
        return t

    def get(self, key: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The tensor stored under ``key`` (caller-owned); copied into ``out`` when given."""
        self._wait_write(key)
        with self._lock:
            ev = self._overwriting.get(key)
        if ev is not None:  # a put on another thread rewriting the file where it is
            ev.wait()
        with self._lock:
            if key not in self._index:
                raise KeyError(f"titan hms: no tensor stored under {key!r}")
            self._freq[key] = self._freq.get(key, 0) + 1
            cached = self._cache.get(key)
            if cached is not None:
                self.stats.cache_hits += 1
                self.stats.count(key, True, 0.0)
            # a finished prefetch also cached its value (_maybe_cache): a cache hit must drop the staged copy too,
            # or it is held until the key is next written (a full copy of every prefetched partition through
            # forward and backward: ~4 bytes/param more at HMS's peak)
            staged = self._unstage(key)
            reading = None
            if cached is not None:
                staged, reading = None, staged
        if cached is not None:
            if reading is not None and not reading.done():
                # a prefetch still reading (the write it waited for cached the value as it landed): it may be
                # reading into the caller's buffer (prefetch(out=...)), which the caller reuses once this returns;
                # let it finish first, or its bytes land in whatever the buffer holds next
                try:
                    reading.result()
                except Exception:  # noqa: BLE001 - its value is not used; the cached copy is
                    pass
            t = cached.clone() if out is None else out.copy_(cached)
            return t
        t0 = time.perf_counter()
        if staged is not None:
            was_done = staged.done()
            t = staged.result()
            with self._lock:
                stall = 0.0 if was_done else time.perf_counter() - t0
                if was_done:
                    self.stats.prefetch_hits += 1
                else:
                    self.stats.misses += 1
                    self.stats.stall_s += stall
                self.stats.count(key, was_done, stall, inflight=not was_done)
        else:
            t = self._read_file(key, self.path(key), out)
            with self._lock:
                stall = time.perf_counter() - t0
                self.stats.misses += 1
                self.stats.stall_s += stall
                self.stats.count(key, False, stall)
            self._maybe_cache(key, t)
        if out is not None and t is not out:
            return out.copy_(t.reshape(out.shape) if t.numel() == out.numel() else t)
        return t

    @staticmethod
    def recycle(t: torch.Tensor) -> bool:
        """Give the buffer of ``t``, a value read into a pool (:meth:`pool_reads`), back to its pool, if no other
        tensor shares its storage (else it is left to be freed as usual). The caller must not use ``t`` after a
        True. False for a value not read into a pool (a cached or staged copy, a read into ``out``)."""
        held = getattr(t, "_titan_pool", None)
        if held is None:
            return False
        pool, buf, refs = held
        del t._titan_pool
        if refs < 0 or storage_refs(buf) != refs:
            return False
        pool.give(buf)
        return True

    def _unstage(self, key: str):
        self._speculative.pop(key, None)
        return self._staged.pop(key, None)

    def prefetch(self, key: str, speculative: bool = False, out: Optional[torch.Tensor] = None) -> None:
        """Start reading ``key`` in the background (no-op if cached, already staged, or unknown).
        ``speculative``: a guess, bounded by ``max_speculative`` (see the class docstring); a plain prefetch of
        a key staged by a guess makes it a plain one. ``out``: read into this tensor (a buffer the caller reuses,
        of the stored dtype and size: no fresh allocation, and ``get(key, out=out)`` then returns it without a
        copy); the caller must not touch it until that ``get`` returned. Not with ``speculative`` (a dropped
        guess would still be reading into it)."""
        if out is not None and speculative:
            raise ValueError("prefetch: a speculative read cannot target the caller's buffer (out)")
        with self._lock:
            if key in self._staged and not speculative:
                self._speculative.pop(key, None)
            write = self._writes.get(key)
            if write is not None and write.done() and write.exception() is None:
                write = None  # landed: the index and cache are current
            # a queued write makes the index and any cached copy stale: read after it lands
            if write is None and (key not in self._index or key in self._cache) or key in self._staged:
                return
            if key in self._overwriting:  # a put rewriting the file where it is: the get reads it after
                return
            path, gen = (self.path(key), self._index[key].gen) if write is None else (None, None)

            def load() -> torch.Tensor:
                nonlocal path, gen
                if write is not None:
                    write.result()  # a failure is raised by the get that takes this read
                    with self._lock:
                        path, gen = self.path(key), self._index[key].gen
                t = self._read_file(key, path, out)
                with self._lock:
                    self.stats.bytes_prefetched += t.numel() * t.element_size()
                self._maybe_cache(key, t, gen)
                return t

            self._staged[key] = self._prefetch_pool.submit(load)
            if speculative:
                self._speculative[key] = None
                while self.max_speculative is not None and len(self._speculative) > self.max_speculative:
                    oldest, _ = self._speculative.popitem(last=False)
                    self._staged.pop(oldest, None)  # an in-flight read finishes on its own and is let go
                    self.stats.prefetch_dropped += 1

    def stage(self, key: str, tensor: torch.Tensor) -> None:
        """Hold ``tensor``, the value just ``put`` under ``key``, as a finished prefetch: the next ``get`` of
        ``key`` takes it instead of reading the file back. For a value that is about to be read again (the
        optimizer step writes the partitions that the next forward reads first): without it the read starts
        only when the write is done and is still in flight when ZeRO-3 asks. The caller hands ``tensor`` over
        (it must not change it); it is dropped when ``key`` is written again or :meth:`drop_staged` runs."""
        with self._lock:
            if key not in self._index or key in self._cache or key in self._staged:
                return
            f: Future = Future()
            f.set_result(tensor)
            self._staged[key] = f
            self.stats.staged_writes += 1

    def unstage(self, key: str) -> None:
        """Forget ``key``'s prefetched-but-unused read (after it finished): the next ``get`` reads the file (or the
        cache). For a read into the caller's buffer (``prefetch(out=...)``) that the caller will not take."""
        with self._lock:
            f = self._unstage(key)
        if f is not None:
            try:
                f.result()
            except Exception:  # noqa: BLE001 - a failed read is not used; the next get raises its own
                pass

    def drop_staged(self) -> None:
        """Forget prefetched-but-unused reads (after waiting for them)."""
        with self._lock:
            staged, self._staged = self._staged, {}
            self._speculative.clear()
        for f in staged.values():
            f.result()

    # ------------------------------------------------------------------ cache
    def _maybe_cache(self, key: str, t: torch.Tensor, gen: Optional[int] = None) -> None:
        nbytes = t.numel() * t.element_size()
        if nbytes > self.cache_item_max:
            return
        with self._lock:
            entry = self._index.get(key)
            if gen is not None and (entry is None or entry.gen != gen):
                return  # a put replaced the file while this background read ran: its bytes are stale
            if key not in self._cache:
                self._cache_insert(key, t.clone())

    def _cache_insert(self, key: str, t: torch.Tensor) -> None:
        self._cache.insert(key, t)

    def _cache_drop(self, key: str) -> None:
        self._cache.drop(key)

    @property
    def cache_bytes(self) -> int:
        return self._cache.nbytes

    # ------------------------------------------------------------------ placement, deletion
    def rebalance(self) -> int:
        """Move files so the most-read keys sit in the fastest tiers that have room. Returns files moved."""
        with self._lock:
            order = sorted(self._index, key=lambda k: -self._freq.get(k, 0))
            free = [t.capacity_bytes for t in self.tiers]
            want: dict[str, int] = {}
            for k in order:
                size = self._index[k].nbytes
                for ti in range(len(self.tiers)):
                    if free[ti] is None or size <= free[ti]:
                        if free[ti] is not None:
                            free[ti] -= size
                        want[k] = ti
                        break
                else:
                    want[k] = self._index[k].tier
            moves = [(k, ti) for k, ti in want.items() if ti != self._index[k].tier]
            # demotions first, so promotions find their room
            moves.sort(key=lambda m: -m[1])
            for k, ti in moves:
                e = self._index[k]
                src, dst = self.path(k), self.path(k, ti)
                tmp = f"{dst}.tmp.{os.getpid()}.{next(self._tmp)}"
                with open(src, "rb") as fi, open(tmp, "wb") as fo:
                    while chunk := fi.read(8 << 20):
                        fo.write(chunk)
                os.replace(tmp, dst)
                os.remove(src)
                self.tiers[e.tier].used_bytes -= e.nbytes
                self.tiers[ti].used_bytes += e.nbytes
                e.tier = ti
                self.stats.moves += 1
            return len(moves)

    def delete(self, key: str) -> None:
        self._wait_write(key)
        with self._lock:
            e = self._index.pop(key)
            self.tiers[e.tier].used_bytes -= e.nbytes
            if key in self._cache:
                self._cache_drop(key)
            self._unstage(key)
        os.remove(self.path_for(key, e.tier))

    def path_for(self, key: str, tier: int) -> str:
        return os.path.join(self.tiers[tier].path, fmt.file_name(key))

    def close(self, *, io: bool = True) -> None:
        """Flush the queued writes (raising the first failure, after the pools are shut down), then stop the
        threads; ``io=False`` leaves the I/O handle open (a store that shares another store's handle)."""
        try:
            self.flush()
        finally:
            self.drop_staged()
            self._write_lanes.shutdown()
            self._prefetch_pool.shutdown(wait=True)
            if io:
                self.io.close()
