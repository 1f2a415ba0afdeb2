"""Asynchronous file I/O for HMS, with the handle interface DeepSpeed's swappers use.

:class:`AsyncIOHandle` provides ``async_pread``, ``async_pwrite``, ``wait``, ``new_cpu_locked_tensor``,
``free_cpu_locked_tensor`` and ``is_pinned`` (plus the synchronous ``sync_pread``/``sync_pwrite`` and the
``get_*`` accessors of DeepSpeed's ``aio_handle``). It is built on a thread pool: every request is split into
``block_size`` chunks that the pool's threads run with ``os.preadv``/``os.pwritev`` (which release the GIL),
so several chunks are in flight at once, like libaio's queue.

Direct I/O: with ``direct="detect"`` a folder is probed once (an aligned ``O_DIRECT`` write and read of one
block); where the filesystem refuses (tmpfs, some overlay filesystems) the handle falls back to buffered I/O
and logs that once per folder. ``direct="on"`` raises instead of falling back; ``"off"`` never tries. A
request uses ``O_DIRECT`` only when its file offset and length are multiples of :data:`ALIGN`; buffers from
:meth:`new_cpu_locked_tensor` are aligned, so whole-buffer requests qualify. A request whose buffer address is
not aligned (a slice of a larger tensor: ZeRO-3's parameter partitions are views of their sub-group's fp32 master)
goes through a per-thread aligned bounce buffer of one block (``bounce=True``, the default; measured: buffered
writes of such slices ran at ~100 MB/s beside the optimizer's direct writes, the page cache's dirty throttling
under a memory cap), one copy per chunk either way.

"Locked" buffers: on CUDA machines they are page-locked (``pin_memory``) for fast host-device copies; on the
CPU they are ordinary memory aligned to :data:`ALIGN`. ``is_pinned`` is true for any view into a buffer
returned by ``new_cpu_locked_tensor`` (DeepSpeed's swappers check views, not only whole buffers).

The reference path is :func:`reference_pread`/:func:`reference_pwrite` (plain ``open``/``read``/``write``),
used as the oracle in tests. DeepSpeed's libaio op is never built here: :func:`deepspeed_aio_available` only
reports whether an already-built op could be loaded.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal, Optional

import torch

__all__ = ["ALIGN", "AsyncIOHandle", "BufferPool", "HUGE_PAGES", "aligned_empty", "io_empty", "probe_direct_io", "storage_refs", "tensor_bytes",
           "reference_pread", "reference_pwrite", "TitanAIOBuilder", "deepspeed_aio_available"]

log = logging.getLogger("titan_ds.hms")

# O_DIRECT needs buffer address, offset and length aligned to the logical block size; 4096 covers every
# common device (512e and 4Kn disks, NVMe namespaces with 4 KiB LBAs).
ALIGN = 4096
_DIRECT_CACHE: dict[str, bool] = {}
_LOGGED: set[str] = set()
_LOCK = threading.Lock()


HUGE_PAGE = 2 << 20


def _huge_pages_available() -> bool:
    """Transparent huge pages on request (``madvise`` or ``always``) and not turned off by ``TITAN_HMS_HUGE_PAGES=0``."""
    if os.environ.get("TITAN_HMS_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


HUGE_PAGES = _huge_pages_available()


def _huge_empty(padded: int) -> torch.Tensor:
    """``padded`` bytes of anonymous memory starting on a 2 MiB boundary, advised ``MADV_HUGEPAGE``. Direct reads
    into it ran at 1.7-2.0x the speed into 4 KiB pages on this VM (the kernel pins a 2 MiB page per 512 small
    ones; results/hms_streaming.md, results/hms_read_probe.md). The mapping lives as long as the tensor (and its views) do."""
    size = -(-padded // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start on a huge-page boundary
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    off = (-raw.data_ptr()) % HUGE_PAGE
    # only the whole huge pages: a tail past the last one stays on small pages (a 2.1 MiB buffer must not hold 4)
    mm.madvise(mmap.MADV_HUGEPAGE, off, padded // HUGE_PAGE * HUGE_PAGE)
    return raw[off:off + padded]


def io_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised ``numel``-element tensor that HMS reads into or writes from again and again (the swappers'
    reused buffers): aligned (``O_DIRECT`` straight into it, no bounce copy) and on huge pages from 2 MiB up."""
    nbytes = int(numel) * dtype.itemsize
    return aligned_empty(nbytes, huge=True)[:nbytes].view(dtype)


class BufferPool:
    """Reused read buffers (:func:`io_empty`: aligned, on huge pages from 2 MiB up) by size. ``take`` hands out a
    free one of that many bytes (or a new one), ``give`` returns it once nothing reads or writes it any more, ``clear``
    lets the free ones go. A read into a fresh tensor faults every 4 KiB page in and has the kernel zero it: on this VM
    40 MB store reads ran at 1.07 GB/s into fresh tensors against 2.13 into reused buffers, and the optimizer
    swapper's state reads moved to the pool took the like-for-like step from 1.606 to 1.382 s
    (results/hms_ab_pool.md).

    ``expect`` bounds what the pool keeps: given the sizes still to be taken (a count per size), a buffer given back
    is kept only while fewer of its size are free than takes of it remain, else it is let go at once. Without that a
    pool whose sizes never repeat held every buffer it made until ``clear``: plan's 8x768 config under 1.5 GiB (4
    sub-groups of two sizes, 8 buffers made, none reused) peaked 1.413 GiB against 1.276 with fresh tensors."""

    def __init__(self, max_free_bytes: Optional[int] = None):
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        # bytes of free buffers kept at most (None: no bound); a buffer given back beyond it is let go at once
        self.max_free_bytes = max_free_bytes
        self._demand: Optional[dict[int, int]] = None  # takes still to come per size (None: keep everything)
        self.allocated = 0  # buffers made (not taken from the free list): the faults paid
        self.dropped = 0  # buffers given back and let go at once (no take of their size remained)

    def expect(self, sizes) -> None:
        """The takes to come, as byte sizes (repeated per take); replaces the previous expectation and lets go of
        free buffers beyond it."""
        demand: dict[int, int] = {}
        for n in sizes:
            demand[int(n)] = demand.get(int(n), 0) + 1
        with self._lock:
            self._demand = demand
            for n in list(self._free):
                del self._free[n][demand.get(n, 0):]
                if not self._free[n]:
                    del self._free[n]

    def wanted(self, nbytes: int) -> int:
        """How many more buffers of ``nbytes`` the expected takes could use beyond the free ones (unbounded without
        ``expect``)."""
        n = int(nbytes)
        with self._lock:
            if self._demand is None:
                return 1 << 62
            return max(0, self._demand.get(n, 0) - len(self._free.get(n, ())))

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of exactly ``nbytes`` (its storage ALIGN-aligned)."""
        n = int(nbytes)
        with self._lock:
            if self._demand is not None and self._demand.get(n, 0) > 0:
                self._demand[n] -= 1
            free = self._free.get(n)
            if free:
                return free.pop()
            self.allocated += 1
        return io_empty(n, torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        n = buf.numel() * buf.element_size()
        with self._lock:
            free = self._free.setdefault(n, [])
            over = (self.max_free_bytes is not None
                    and sum(k * len(v) for k, v in self._free.items()) + n > self.max_free_bytes)
            if over or self._demand is not None and len(free) >= self._demand.get(n, 0):
                self.dropped += 1
                if not free:
                    del self._free[n]
                return
            free.append(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._demand = None

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(n * len(v) for n, v in self._free.items())


def storage_refs(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (strong references to it, ``t`` included); -1 where this torch build
    does not say (then a caller must treat the storage as shared)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return -1
    return int(count(t.untyped_storage()._cdata)) - 1  # less the temporary reference untyped_storage() holds


def aligned_empty(nbytes: int, *, pin: bool = False, huge: bool = False) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` (rounded up to ALIGN) whose data pointer is ALIGN-aligned. ``huge``: from 2 MiB
    up, on transparent huge pages where the kernel offers them (:data:`HUGE_PAGES`), for buffers that are read
    into again and again (a fresh tensor's first touch was no faster on huge pages: docs/hms.md, "Reads")."""
    padded = -(-max(nbytes, 1) // ALIGN) * ALIGN
    if huge and HUGE_PAGES and not pin and padded >= HUGE_PAGE:
        return _huge_empty(padded)
    raw = torch.empty(padded + ALIGN, dtype=torch.uint8)
    if pin:
        raw = raw.pin_memory()
    off = (-raw.data_ptr()) % ALIGN
    return raw[off:off + padded]


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor's bytes (any dtype, any shape, 0-dim included)."""
    if not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor; call .contiguous() first")
    flat = t.reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return flat.view(torch.uint8)


def _mv(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def probe_direct_io(folder: str) -> bool:
    """Whether ``folder``'s filesystem accepts an aligned O_DIRECT write and read (cached per folder)."""
    folder = os.path.abspath(folder)
    with _LOCK:
        if folder in _DIRECT_CACHE:
            return _DIRECT_CACHE[folder]
    ok = False
    if hasattr(os, "O_DIRECT"):
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".titan_direct_probe.{os.getpid()}.{threading.get_ident()}")
        buf = aligned_empty(ALIGN)
        buf.fill_(7)
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            try:
                ok = os.pwritev(fd, [_mv(buf)], 0) == ALIGN and os.preadv(fd, [_mv(buf)], 0) == ALIGN
            finally:
                os.close(fd)
        except OSError:
            ok = False
        finally:
            if os.path.exists(probe):
                os.remove(probe)
    with _LOCK:
        _DIRECT_CACHE[folder] = ok
    return ok


def _log_once(key: str, msg: str, *args) -> None:
    with _LOCK:
        if key in _LOGGED:
            return
        _LOGGED.add(key)
    log.warning(msg, *args)


def reference_pread(buffer: torch.Tensor, path: str, offset: int = 0) -> int:
    """Plain buffered read of ``buffer.nbytes`` bytes at ``offset`` (the test oracle)."""
    view = tensor_bytes(buffer)
    with open(path, "rb") as f:
        f.seek(offset)
        return f.readinto(_mv(view))


def reference_pwrite(buffer: torch.Tensor, path: str, offset: int = 0) -> int:
    """Plain buffered write of ``buffer``'s bytes at ``offset``, creating the file (the test oracle)."""
    view = tensor_bytes(buffer.contiguous())
    mode = "r+b" if os.path.exists(path) else "wb"
    with open(path, mode) as f:
        f.seek(offset)
        return f.write(_mv(view))


def started_pool(workers: int, prefix: str) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` whose ``workers`` threads all exist on return. The executor starts threads
    lazily, when a task finds none idle, so a process's thread count would grow mid-run whenever two reads first
    overlap (a long-run leak check saw 9 -> 10 threads); started up front, it is constant."""
    pool = ThreadPoolExecutor(max_workers=int(workers), thread_name_prefix=prefix)
    gate = threading.Barrier(int(workers) + 1)
    for _ in range(int(workers)):
        pool.submit(gate.wait)  # each waits at the gate, so the next submit finds no idle thread: a new one
    gate.wait()
    return pool


class AsyncIOHandle:
    """Thread-pool file I/O with DeepSpeed's ``aio_handle`` interface (see module docstring).

    ``async_pread(buffer, path, offset)`` / ``async_pwrite(...)`` return 0 at once and queue the request;
    ``wait()`` blocks until every queued request is done and returns how many completed since the last
    ``wait``; the first I/O error is re-raised there, naming the file.
    """

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 8, single_submit: bool = False,
                 overlap_events: bool = True, intra_op_parallelism: int = 4, *,
                 direct: Literal["detect", "on", "off"] = "detect", threads: Optional[int] = None):
        if direct not in ("detect", "on", "off"):
            raise ValueError(f"direct must be 'detect', 'on' or 'off', got {direct!r}")
        if block_size < ALIGN or block_size % ALIGN:
            raise ValueError(f"block_size must be a positive multiple of {ALIGN}, got {block_size}")
        self.block_size, self.queue_depth = int(block_size), int(queue_depth)
        self.single_submit, self.overlap_events = bool(single_submit), bool(overlap_events)
        self.intra_op_parallelism = int(threads or intra_op_parallelism)
        self.direct = direct
        self.bounce = True  # unaligned buffers: O_DIRECT through a per-thread aligned block (see module docstring)
        self._bounce = threading.local()
        self._pool = started_pool(self.intra_op_parallelism, "titan-hms-io")
        self._pending: list[tuple[int, list[Future]]] = []
        self._locked: dict[int, tuple[int, int]] = {}  # storage data_ptr -> (start, end)
        self.bytes_read = 0
        self.bytes_written = 0

    # ------------------------------------------------------------------ DeepSpeed aio_handle accessors
    def get_block_size(self) -> int:
        return self.block_size

    def get_queue_depth(self) -> int:
        return self.queue_depth

    def get_single_submit(self) -> bool:
        return self.single_submit

    def get_overlap_events(self) -> bool:
        return self.overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self.intra_op_parallelism

    def get_alignment(self) -> int:
        return ALIGN

    # ------------------------------------------------------------------ locked buffers
    def new_cpu_locked_tensor(self, numel: int, example: torch.Tensor) -> torch.Tensor:
        """An ALIGN-aligned CPU tensor of ``numel`` elements of ``example.dtype`` (page-locked under CUDA)."""
        esize = torch.empty(0, dtype=example.dtype).element_size()
        raw = aligned_empty(int(numel) * esize, pin=torch.cuda.is_available(), huge=True)
        t = raw[:int(numel) * esize].view(example.dtype)
        start = t.data_ptr()
        self._locked[start] = (start, start + raw.numel())
        return t

    def free_cpu_locked_tensor(self, t: torch.Tensor) -> None:
        if self._locked.pop(t.data_ptr(), None) is None:
            raise ValueError("free_cpu_locked_tensor: tensor was not returned by new_cpu_locked_tensor")

    def is_pinned(self, t: torch.Tensor) -> bool:
        """True for a locked buffer or any view inside one."""
        p = t.data_ptr()
        end = p + t.numel() * t.element_size()
        return any(s <= p and end <= e for s, e in self._locked.values())

    # ------------------------------------------------------------------ I/O
    def _use_direct(self, path: str, addr: int, offset: int, nbytes: int) -> bool:
        if self.direct == "off" or not hasattr(os, "O_DIRECT"):
            return False
        folder = os.path.dirname(os.path.abspath(path))
        if not probe_direct_io(folder):
            if self.direct == "on":
                raise OSError(errno.EINVAL, f"titan.hms.direct_io is 'on' but the filesystem of {folder!r} refuses "
                                            f"O_DIRECT; set direct_io to 'detect' or 'off', or use another folder")
            _log_once(folder, "titan hms: O_DIRECT not supported under %s; using buffered I/O there", folder)
            return False
        return addr % ALIGN == 0 and offset % ALIGN == 0 and nbytes % ALIGN == 0

    def _run(self, write: bool, view: torch.Tensor, path: str, offset: int, block: Optional[int] = None,
             post=None) -> list[Future]:
        """Queue ``view``'s transfer as ``block``-sized chunk tasks; with ``post``, each task also returns
        ``post(lo, hi)`` computed on its chunk (after reading it, or before writing it)."""
        nbytes = view.numel()
        block = block or self.block_size
        direct = self._use_direct(path, view.data_ptr(), offset, nbytes)
        # an unaligned buffer with an aligned offset and length: O_DIRECT through each thread's bounce block
        bounce = not direct and self.bounce and nbytes > 0 and self._use_direct(path, 0, offset, nbytes)
        direct = direct or bounce
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        if direct:
            flags |= os.O_DIRECT
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            raise OSError(e.errno, f"titan hms: cannot open {path!r} for {'writing' if write else 'reading'}: "
                                   f"{e.strerror}") from None
        remaining = [max(1, -(-nbytes // block))]
        lock = threading.Lock()

        def chunk(lo: int, hi: int):
            try:
                extra = post(lo, hi) if (post is not None and write) else None
                if bounce:
                    buf = self._bounce_block(hi - lo)
                    if write:
                        buf.copy_(view[lo:hi])
                    mv = _mv(buf)
                else:
                    mv = _mv(view[lo:hi])
                done = 0
                while done < hi - lo:
                    sub = mv[done:]
                    n = os.pwritev(fd, [sub], offset + lo + done) if write else os.preadv(fd, [sub], offset + lo + done)
                    if n <= 0:
                        raise OSError(errno.EIO, f"short {'write' if write else 'read'} at byte {offset + lo + done}")
                    done += n
                if bounce and not write:
                    view[lo:hi].copy_(buf)
                if post is None:
                    return done
                return done, (post(lo, hi) if not write else extra)
            except OSError as e:
                raise OSError(e.errno, f"titan hms: {'write to' if write else 'read from'} {path!r} failed: "
                                       f"{e.strerror or e}") from None
            finally:
                with lock:
                    remaining[0] -= 1
                    last = remaining[0] == 0
                if last:
                    os.close(fd)

        if nbytes == 0:
            os.close(fd)
            f: Future = Future()
            f.set_result(0)
            return [f]
        return [self._pool.submit(chunk, lo, min(lo + block, nbytes)) for lo in range(0, nbytes, block)]

    def _bounce_block(self, nbytes: int) -> torch.Tensor:
        """This thread's aligned bounce buffer, ``nbytes`` long (kept and reused: one block per I/O thread)."""
        buf = getattr(self._bounce, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._bounce.buf = aligned_empty(max(nbytes, self.block_size), huge=True)
        return buf[:nbytes]

    def transfer_with(self, write: bool, buffer: torch.Tensor, filename: str, file_offset: int, block: int,
                      post) -> list:
        """Synchronous transfer in ``block`` chunks, each running ``post(lo, hi)`` on its own thread (used to
        checksum while reading or writing); returns the ``post`` results in chunk order."""
        view = tensor_bytes(buffer)
        futs = self._run(write, view, str(filename), int(file_offset), block=block, post=post)
        out, n, first = [], 0, None
        for f in futs:
            try:
                done, value = f.result()
            except OSError as e:
                first = first or e
                continue
            n += done
            out.append(value)
        if first is not None:
            raise first
        if write:
            self.bytes_written += n
        else:
            self.bytes_read += n
        return out

    def _submit(self, write: bool, buffer: torch.Tensor, filename: str, file_offset: int) -> int:
        view = tensor_bytes(buffer)
        futs = self._run(write, view, str(filename), int(file_offset))
        self._pending.append((int(write), futs))
        return 0

    def async_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self._submit(False, buffer, filename, file_offset)

    def async_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self._submit(True, buffer, filename, file_offset)

    def _drain(self, pending: list[tuple[bool, list[Future]]]) -> int:
        """Wait for every future of ``(write, futures)``, count the bytes moved, re-raise the first I/O error
        once all of them are done (a buffer is never handed back while a thread still fills it)."""
        moved = 0
        first: Optional[BaseException] = None
        for write, futs in pending:
            for f in futs:
                try:
                    n = f.result()
                except OSError as e:
                    first = first or e
                    continue
                moved += n
                if write:
                    self.bytes_written += n
                else:
                    self.bytes_read += n
        if first is not None:
            raise first
        return moved

    def wait(self) -> int:
        """Block until all queued requests finish; return their count; re-raise the first error."""
        pending, self._pending = self._pending, []
        self._drain(pending)
        return len(pending)

    def sync_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self.run_all([(False, buffer, filename, file_offset)])

    def sync_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        return self.run_all([(True, buffer.contiguous(), filename, file_offset)])

    def run_all(self, ops: list[tuple[bool, torch.Tensor, str, int]]) -> int:
        """Run ``(write, buffer, path, offset)`` requests concurrently and wait for them (bytes moved).

        Independent of the ``async_*``/``wait`` queue, so it is safe from any thread.
        """
        return self._drain([(w, self._run(w, tensor_bytes(b), str(p), int(o))) for w, b, p, o in ops])

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on the I/O pool. ``fn`` must not wait on other pool work (no nesting)."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _Op:
    aio_handle = AsyncIOHandle


class TitanAIOBuilder:
    """Drop-in for DeepSpeed's ``AsyncIOBuilder``: ``TitanAIOBuilder().load().aio_handle(...)`` builds nothing."""

    def load(self, verbose: bool = True):
        return _Op

    def is_compatible(self, verbose: bool = False) -> bool:
        return True


def deepspeed_aio_available() -> bool:
    """Whether DeepSpeed's libaio op is already built and loadable (never triggers a build)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        b = AsyncIOBuilder()
        import importlib
        importlib.import_module(b.absolute_name())
        return True
    except Exception:  # noqa: BLE001 - any failure means "not prebuilt"; we never JIT-build it
        return False

