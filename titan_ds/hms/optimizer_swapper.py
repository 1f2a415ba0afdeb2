"""ZeRO-3's optimizer-state swapper over the HMS store: :class:`HMSOptimizerSwapper`.

:class:`HMSOptimizerSwapper` implements the ZeRO-3 optimizer-swapper interface (seams 2.4). Every fp32
sub-group is swappable, whatever its size (DeepSpeed keeps sub-groups under 1 MiB in RAM, and its resume never
restores them: appendix A). Per sub-group the store holds ``opt/<id>/fp32``, one file per element-wise state
tensor and every state tensor of at least ``SWAP_MIN_NUMEL`` elements (``opt/<id>/state/<name>``, any name, any
dtype) and the gradient pieces ``opt/<id>/grad/<offset>``. Other state values (scalars such as ``step``, small
tensors) stay in ``optimizer.state``. :meth:`HMSOptimizerSwapper.snapshot`
and :meth:`HMSOptimizerSwapper.restore` write and read a self-contained per-rank checkpoint of all of it,
with the client optimizer's hyper-parameters, which DeepSpeed's NVMe resume skips (engine.py:4456).

Pipelined optimizer step (``titan.hms.pipeline_optimizer``, ``pipeline_depth`` > 0): ZeRO-3 steps the sub-groups
one after another, and while sub-group ``i`` steps the state of ``i+1`` is being read (the prefetch of
``swap_in_optimizer_state``'s ``async_parameter``) and that of ``i-1`` written: ``swap_out_optimizer_state``
hands the tensors to the store's writer thread (:meth:`TensorStore.put_behind`) and returns. Before handing over
a sub-group it waits until fewer than ``pipeline_depth`` sub-groups' writes are in flight, so DRAM holds at most
that many more sub-groups' state. :meth:`HMSOptimizerSwapper.flush` waits for all of them and raises a failed
write (naming its key); it runs at the end of every optimizer step (ZeRO-3 calls ``log_timers`` there), before a
snapshot, a restore or a synchronous write, and the store flushes on close. Reads of a key with a write in flight
wait for it (the store's rule), so the values are the unpipelined step's bit for bit.

With :func:`titan_ds.hms.timeline.enable` it records its waits and writes as timeline spans. The parameter swapper
is :mod:`titan_ds.hms.param_swapper`.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Optional

import torch

from .io import BufferPool, io_empty
from .store import TensorStore, Tier
from .timeline import current as _timeline
from .writes import drain, wait_all

if TYPE_CHECKING:
    from .param_swapper import HMSParamSwapper

__all__ = ["HMSOptimizerSwapper", "SWAP_MIN_NUMEL"]

SWAP_MIN_NUMEL = 4096  # a non-element-wise optimizer state tensor this large goes to the store too


def _libc_madvise():
    """libc's ``madvise(addr, length, advice)`` (0 on success), or None where there is none (not Linux/glibc)."""
    if not hasattr(mmap, "MADV_WILLNEED"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _libc_madvise()

log = logging.getLogger("titan_ds.hms")


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same bytes (NaNs and signed zeros included), compared as integers in place."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():  # one tensor's bytes (the aliased master)
        return True
    as_int = _INT_OF_SIZE.get(a.element_size())
    if as_int is None or not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(a.reshape(-1).view(as_int), b.reshape(-1).view(as_int))


class HMSOptimizerSwapper:
    """ZeRO-3 optimizer-state swapper over a :class:`TensorStore` (see module docstring).

    Constructed by ZeRO-3 as ``cls(swap_config, aio_config, base_folder, optimizer, largest_numel, device,
    dtype, timers)``; :func:`titan_ds.hms.install.before_initialize` binds ``store`` with a partial.
    """

    def __init__(self, swap_config, aio_config, base_folder, optimizer, largest_numel, device, dtype, timers,
                 *, store: TensorStore, rank: int = 0, grad_file: Any = None, pipeline_depth: int = 0,
                 master_from_partitions: bool = True, resident_bytes: int = 0, pooled_reads: bool = True,
                 gradient_store: bool = False):
        self.store = store
        # titan.hms.optimizer_dram_mb: sub-groups whose state (and master, unless the partitions in RAM hold it)
        # stays in DRAM between steps, admitted at their first swap-out while it fits: pid -> {name: tensor}
        if resident_bytes < 0:
            raise ValueError(f"resident_bytes must be >= 0, got {resident_bytes}")
        self.resident_budget = int(resident_bytes)
        self.resident_bytes = 0
        self._resident: dict[str, dict[str, torch.Tensor]] = {}
        # titan.hms.master_from_partitions: a sub-group whose parameter partitions were all written from its fp32
        # master in the master's dtype keeps the master as those files: pid -> [(key, element offset, numel)]
        self.master_from_partitions = bool(master_from_partitions)
        self._master_parts: dict[str, list[tuple[str, int, int]]] = {}
        # param_tier "dram": the sub-groups' flat parameter partitions in CPU memory in the master's dtype
        # (use_partition_masters), and the sub-groups whose master is, since their last write, those bytes
        self._partition_flats: dict[str, torch.Tensor] = {}
        self._master_in_partitions: set[str] = set()
        if pipeline_depth < 0:
            raise ValueError(f"pipeline_depth must be >= 0 (0: synchronous writes), got {pipeline_depth}")
        self.pipeline_depth = int(pipeline_depth)
        self._writing: deque[list] = deque()  # per sub-group handed to the writer: its writes' futures
        # titan.hms.gradient_buffer "disk": DeepSpeed's fp32 gradient partitions already live in a file mapping
        # (install._DiskGradientBuffer). The pieces ZeRO-3 hands to swap_out_gradients are views of it when
        # their dtype is the master's, so they are kept as views instead of being written to the store a second
        # time (4 bytes/param of disk and of write traffic per step).
        self.grad_file = grad_file
        # titan.hms.gradient_store (with gradient_buffer "disk"): each piece ZeRO-3 hands over from the mapping is
        # written to the store behind (O_DIRECT, on the "opt" writer, while backward goes on and its pages are
        # still in memory) and, once on disk, its whole pages are punched out of the mapping (MADV_REMOVE): the
        # kernel then neither writes them back nor reads them in again when the next backward overwrites them (a
        # hole faults in as a zero page). The step reads the pieces from the store, prefetched with the state
        # straight into one of two gradient buffers it takes in turn (_grad_buffer): no fault per 4 KiB page and
        # no second copy
        self.gradient_store = bool(gradient_store) and grad_file is not None
        self._grad_bufs: list[Optional[torch.Tensor]] = [None, None]
        self._grad_turn = 0
        self._grad_pending: dict[str, torch.Tensor] = {}  # pid -> the buffer its pieces are being read into
        self.grads_stored = 0  # gradient pieces written to the store from the mapping
        self.grad_bytes_punched = 0  # bytes of the mapping punched once their piece was on disk
        self._punch_ok = _MADVISE is not None and hasattr(mmap, "MADV_REMOVE")
        # gradient_buffer "dram": the same for DeepSpeed's own gradient partition buffer in CPU memory
        # (grad_partitions_flat_buffer: with offload_optimizer ZeRO-3 allocates it on the CPU, pinned on a GPU
        # machine, and keeps it from backward to the optimizer step). Set by install._HMSRuntime.attach; before
        # that (None) every piece is written to the store
        self.grad_buffer: Optional[torch.Tensor] = None
        self._grad_views: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self.optimizer = optimizer
        self.dtype = dtype
        self.device = device
        # DeepSpeed's checkpointing copies this folder into <tag>/offloaded_tensors; it stays empty here because
        # the state lives in the store and is checkpointed by snapshot()/restore().
        self.swap_folder = os.path.join(base_folder, "optimizer", f"rank{rank}")
        os.makedirs(self.swap_folder, exist_ok=True)
        self._numel: dict[str, int] = {}
        self._state_names: dict[str, list[str]] = {}
        self._grads: dict[str, list[tuple[int, int]]] = {}
        # the sub-group's fp32 gradient during its step, one buffer for every sub-group of a step (grown to the
        # largest), dropped at the step's end (flush): _gradient_into
        self._grad_scratch: Optional[torch.Tensor] = None
        self.grads_in_place = 0  # sub-group steps whose gradient was ZeRO-3's buffer itself (_gradient_in_place)
        self.grads_advised = 0  # sub-groups whose gradient pages in the file mapping were asked for ahead
        # the sub-groups' fp32 masters read from their partitions, alternately into two buffers kept for the step
        # (_master_buffer), once reuse_master_buffers was called
        self._masters: list[Optional[torch.Tensor]] = [None, None]
        self._master_turn = 0
        self._master_reuse = False
        # a sub-group's master prefetched straight into its master buffer (_prefetch_master): pid -> (buffer,
        # [(key, element offset, numel, the exact view the read targets)]), taken by its swap-in
        self._master_pending: dict[str, tuple[torch.Tensor, list[tuple[str, int, int, torch.Tensor]]]] = {}
        self.param_swapper: Optional[HMSParamSwapper] = None
        self.stall_s = 0.0
        # the swapped state is read into reused buffers (_state_buffer), not fresh tensors: pid -> {name: (shape,
        # dtype)} as last written (a prefetch knows the size it reads), and the buffers handed out, pid -> {name:
        # (the pool's uint8 buffer, the typed view the state holds)}, back to the pool once written
        self._pool = BufferPool()
        self.pooled_reads = bool(pooled_reads)  # titan.hms.pooled_reads
        self._state_meta: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] = {}
        self._lent: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._returning: list[tuple[list[torch.Tensor], list]] = []  # (buffers, the writes reading them)

    # ------------------------------------------------------------------ interface used by stage3.py
    def is_swappable_tensor(self, tensor=None, numel=None) -> bool:
        if tensor is None and numel is None:
            raise ValueError("is_swappable_tensor needs tensor= or numel=")
        return True  # every sub-group, small ones included (their resume is what DeepSpeed loses)

    def initialize_parameters(self, parameters, src_tensors) -> None:
        for p, src in zip(parameters, src_tensors):
            self._numel[p.ds_id] = src.numel()
            self._master_in_partitions.discard(p.ds_id)
            self.store.put(f"opt/{p.ds_id}/fp32", src.reshape(-1).to(self.dtype), durable=False)
            self._state_names.setdefault(p.ds_id, [])

    def initialize_from_swapped_fp16_params(self, *args, **kwargs) -> None:
        raise NotImplementedError("titan hms does not support offload_optimizer.fast_init; set it to false")

    def init_timers(self) -> None:
        """Timers are kept as stall seconds in the store statistics."""

    def log_timers(self) -> None:
        """ZeRO-3 calls this at the end of every optimizer step (``_post_step``, and on an overflow's early
        return): the step's background writes are flushed here."""
        self.flush()

    def flush(self) -> None:
        """Wait for every background write of optimizer state; raise the first failure (naming its key). Called
        at the end of every step: the gradient scratch and the master buffers are not held through forward and
        backward (a write still reading a master keeps its buffer alive until it lands)."""
        self._grad_scratch = None
        self._masters = [None, None]
        self._drop_master_pending()
        self._drop_grad_pending()
        try:
            if not self._writing and not any(k.startswith("opt/") for k in self.store.pending_writes()):
                self.store.flush("opt/")  # a failure already done but not yet raised
                return
            # then the optimizer state's writes only: parameter writes go on into the forward
            drain(self._writing, "opt write", lambda: self.store.flush("opt/"))
        finally:
            self._returning = []  # the state's read buffers, like the masters, are not held through forward
            self._pool.clear()

    def _wait_oldest(self) -> None:
        wait_all(self._writing.popleft())

    def pre_backward(self) -> None:
        """Nothing to prepare: gradient pieces are written when ZeRO-3 hands them over."""

    def post_backward(self) -> None:
        """Backward is done and the optimizer step follows: tell the read pool which state sizes the step will take
        (so it keeps no buffer that no later read can reuse) and start reading the first sub-group's state."""
        if self.pooled_reads:
            self._pool.expect(shape.numel() * dtype.itemsize for pid in self._numel if pid not in self._resident
                              for shape, dtype in self._state_meta.get(pid, {}).values())
        if self._numel:
            self._prefetch_subgroup(next(iter(self._numel)))

    def _master_keys(self, pid) -> list[str]:
        if pid in self._master_in_partitions:
            return []
        parts = self._master_parts.get(pid)
        return [f"opt/{pid}/fp32"] if parts is None else [k for k, _, _ in parts]

    def _read_master(self, pid, reuse: bool = False) -> torch.Tensor:
        """Sub-group ``pid``'s fp32 master: its file, or the parameter partitions it was stored as (``reuse``: read
        into one of the step's two master buffers, :meth:`_master_buffer`, else a fresh tensor)."""
        kept = self._resident.get(pid)
        if kept is not None and "fp32" in kept:  # optimizer_dram_mb: the master stays in memory
            if reuse and self.param_swapper is not None:  # partition writes behind may still read it (as below)
                self.param_swapper.wait_for_storage(kept["fp32"].untyped_storage().data_ptr())
            return kept["fp32"]
        parts = self._master_parts.get(pid)
        in_ram = pid in self._master_in_partitions
        pending = self._master_pending.pop(pid, None)
        if pending is not None and reuse and not in_ram:
            buf, reads = pending
            if [(k, o, n) for k, o, n, _ in reads] == self._master_layout(pid):  # what was prefetched is current
                for key, _, _, view in reads:
                    self.store.get(key, out=view)  # the read that went into this very view: no copy
                return buf
            self._unstage(reads)
        elif pending is not None:
            self._unstage(pending[1])
        if parts is None and not in_ram:
            return self.store.get(f"opt/{pid}/fp32")
        if in_ram:  # param_tier "dram": the partitions ZeRO-3 keeps in CPU memory hold the master's bits. The
            # master is that flat itself: the optimizer steps it in place, ZeRO-3's copy of the master into its
            # partitions is then a copy onto itself (torch returns at once) and the write's bit comparison is one
            # pointer check. Nothing reads the partitions during the step (the next forward gathers them)
            return self._partition_flats[pid]
        master = self._master_buffer(self._numel[pid]) if reuse else io_empty(self._numel[pid], self.dtype)
        for key, off, n in parts:
            self.store.get(key, out=master.narrow(0, off, n))
        return master

    def _read_state(self, pid, name: str) -> torch.Tensor:
        """Sub-group ``pid``'s swapped state tensor ``name``: kept in memory (``optimizer_dram_mb``) or its file
        (read into the buffer its prefetch used, else a pooled one: :meth:`_state_buffer`)."""
        kept = self._resident.get(pid)
        if kept is not None:
            return kept[name]
        return self.store.get(f"opt/{pid}/state/{name}", out=self._state_buffer(pid, name))

    def _state_buffer(self, pid, name: str) -> Optional[torch.Tensor]:
        """The reused buffer that state ``name`` of ``pid`` is read into (the one handed out for it already, else
        one from the pool), or None where its size is not known (before its first write here, after a restore)."""
        lent = self._lent.get(pid, {}).get(name)
        if lent is not None:
            return lent[1]
        meta = self._state_meta.get(pid, {}).get(name)
        if meta is None or not self.pooled_reads:
            return None
        shape, dtype = meta
        self._reclaim()
        raw = self._pool.take(shape.numel() * dtype.itemsize)
        self._reclaim()  # that take may have been the last one a held buffer waited for
        typed = raw.view(dtype).view(shape)
        self._lent.setdefault(pid, {})[name] = (raw, typed)
        return typed

    def _give_back(self, pid, written: list, futures: list) -> None:
        """Return ``pid``'s lent state buffers to the pool once ``futures`` (the writes of ``written``) are done;
        only those that were written (a buffer the optimizer let go of may still be referenced elsewhere). Checked
        on this thread at the next take (:meth:`_reclaim`), never from a writer thread: the step's flush then drops
        every buffer, none comes back after it."""
        lent = self._lent.pop(pid, None)
        if not lent:
            return
        ptrs = {v.untyped_storage().data_ptr() for v in written if torch.is_tensor(v)}
        queued: dict[int, int] = {}
        for held, _ in self._returning:
            for b in held:
                queued[b.numel()] = queued.get(b.numel(), 0) + 1
        bufs = []
        for raw, _ in lent.values():
            n = raw.numel()
            # only a buffer a read still to come can reuse is held for its write to land; the others are let go
            # here, freed by their write as a fresh tensor would be
            if raw.untyped_storage().data_ptr() in ptrs and self._pool.wanted(n) > queued.get(n, 0):
                queued[n] = queued.get(n, 0) + 1
                bufs.append(raw)
        if bufs:
            self._returning.append((bufs, futures))
            self._reclaim()

    def _reclaim(self) -> None:
        """Buffers whose writes have landed go back to the pool; one still being written that no read to come can
        reuse any more is let go (its write holds it until it lands, as it would a fresh tensor)."""
        keep, queued = [], {}
        for bufs, futures in self._returning:
            if all(f.done() for f in futures):
                for b in bufs:
                    self._pool.give(b)
                continue
            held = []
            for b in bufs:
                if self._pool.wanted(b.numel()) > queued.get(b.numel(), 0):
                    queued[b.numel()] = queued.get(b.numel(), 0) + 1
                    held.append(b)
            if held:
                keep.append((held, futures))
        self._returning = keep
    def _stored_as_partitions(self, parameter) -> Optional[list[tuple[str, int, int]]]:
        """The partitions written from ``parameter``'s master since it was read (its whole range, in the master's
        dtype, as :func:`_note_view` recorded them), or None when they do not cover it exactly once."""
        master = parameter.data
        views = self.store.written_views.pop(master.untyped_storage().data_ptr(), None)
        if not self.master_from_partitions or not views or master.dtype != self.dtype:
            return None
        esize, base, n = master.element_size(), master.storage_offset() * master.element_size(), master.numel()
        parts, pos = [], 0
        for key, boff, nbytes in sorted(views, key=lambda v: v[1]):
            if boff != base + pos * esize or nbytes % esize:
                return None
            parts.append((key, pos, nbytes // esize))
            pos += nbytes // esize
        return parts if pos == n else None

    def _master_layout(self, pid) -> list[tuple[str, int, int]]:
        """Where sub-group ``pid``'s master is read from: its partitions' keys with their element ranges, or its
        own file (the whole range)."""
        parts = self._master_parts.get(pid)
        return list(parts) if parts is not None else [(f"opt/{pid}/fp32", 0, self._numel[pid])]

    def _prefetch_master(self, pid) -> bool:
        """Once the step's master buffers are in use (:meth:`reuse_master_buffers`), read sub-group ``pid``'s
        master from the store straight into the master buffer its swap-in will use (its turn of the two is
        taken now, and the partition writes still reading that buffer are waited for, as there): no fresh tensor
        per read and no second copy at the swap-in. False where it does not apply (the master kept in memory, or in
        the partitions in RAM, or before attach); the caller then prefetches the keys as before."""
        if not self._master_reuse or pid in self._master_in_partitions or pid in self._master_pending:
            return pid in self._master_pending
        kept = self._resident.get(pid)
        if kept is not None and "fp32" in kept:
            return False
        layout = self._master_layout(pid)
        if layout[0][0] not in self.store:
            return False
        buf = self._master_buffer(self._numel[pid])
        reads = [(key, off, n, buf.narrow(0, off, n)) for key, off, n in layout]
        for key, _, _, view in reads:
            self.store.prefetch(key, out=view)
        self._master_pending[pid] = (buf, reads)
        return True

    def _unstage(self, reads) -> None:
        """Forget the prefetches into a master buffer that no swap-in took (their reads waited for): a later
        ``get`` of those keys (a parameter fetch in the next forward) must read its own copy, not this buffer."""
        for key, _, _, _ in reads:
            self.store.unstage(key)

    def _drop_master_pending(self) -> None:
        pending, self._master_pending = self._master_pending, {}
        for _, reads in pending.values():
            self._unstage(reads)

    def _prefetch_subgroup(self, pid) -> None:
        kept = self._resident.get(pid)
        direct = self._prefetch_master(pid)
        grads_direct = self._prefetch_gradient(pid)
        keys = [*([] if direct or kept is not None and "fp32" in kept else self._master_keys(pid)),
                *([] if kept is not None else (f"opt/{pid}/state/{n}" for n in self._state_names.get(pid, []))),
                *([] if grads_direct else (f"opt/{pid}/grad/{off}" for off, _ in self._grads.get(pid, [])))]
        for key in keys:
            name = key.rsplit("/", 1)[1] if key.startswith(f"opt/{pid}/state/") else None
            self.store.prefetch(key, out=None if name is None else self._state_buffer(pid, name))
        self._advise_gradient(pid)

    @staticmethod
    def _tiles(spans, numel: int) -> bool:
        """``spans`` ((offset, numel) pieces) cover ``[0, numel)`` back to back."""
        spans = sorted(spans)
        return bool(spans) and spans[0][0] == 0 and spans[-1][0] + spans[-1][1] == numel and \
            all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:]))

    def _grad_buffer(self, numel: int) -> torch.Tensor:
        """``gradient_store``: a buffer for the next sub-group's gradient, the step's two taken in turn (as
        :meth:`_master_buffer`): sub-group i+1's pieces are read into one while sub-group i steps on the other."""
        i, self._grad_turn = self._grad_turn, self._grad_turn ^ 1
        return self._sized(self._grad_bufs, i, numel)[0]

    def _sized(self, bufs: list, i: int, numel: int) -> tuple[torch.Tensor, bool]:
        """``bufs[i]`` (one of a step's two reused buffers) as ``numel`` elements, and whether it is new: grown
        when smaller (the old one goes before the larger one comes)."""
        buf = bufs[i]
        if buf is not None and buf.numel() >= numel:
            return buf[:numel], False
        bufs[i] = None
        bufs[i] = io_empty(numel, self.dtype)
        return bufs[i][:numel], True

    def _prefetch_gradient(self, pid) -> bool:
        """``gradient_store``: read sub-group ``pid``'s gradient pieces from the store straight into the gradient
        buffer its swap-in will use, where they tile the sub-group. False where that does not apply (the caller
        prefetches the pieces as before)."""
        if pid in self._grad_pending:
            return True
        pieces = self._grads.get(pid)
        if not self.gradient_store or not pieces or self._grad_views.get(pid) or \
                not self._tiles(pieces, self._numel[pid]):
            return False
        buf = self._grad_buffer(self._numel[pid])
        for off, n in pieces:
            self.store.prefetch(f"opt/{pid}/grad/{off}", out=buf.narrow(0, off, n))
        self._grad_pending[pid] = buf
        return True

    def _drop_grad_pending(self) -> None:
        """Forget the gradient buffers and the prefetches into them that no swap-in took (their reads waited for)."""
        pending, self._grad_pending = self._grad_pending, {}
        for pid in pending:
            for off, _ in self._grads.get(pid, []):
                self.store.unstage(f"opt/{pid}/grad/{off}")
        self._grad_bufs = [None, None]

    def _punch(self, view: torch.Tensor) -> None:
        """``gradient_store``: free the whole pages of ``view`` (a piece of the gradient mapping, now on disk) from
        the mapping's file (MADV_REMOVE): not written back, and zero pages at the next touch. Called on the writer
        thread once the piece's write landed. Where the kernel refuses (a file system without hole punching),
        warns once and stops punching: the pages are then written back as without the store, same values."""
        if not self._punch_ok:
            return
        page = mmap.PAGESIZE
        start = view.data_ptr()
        lo, hi = -(-start // page) * page, (start + view.numel() * view.element_size()) // page * page
        if hi <= lo:
            return
        if _MADVISE(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_REMOVE) != 0:
            self._punch_ok = False
            log.warning("titan hms: gradient_store could not punch the gradient mapping (madvise MADV_REMOVE: %s); "
                        "its pages are written back by the kernel instead", os.strerror(ctypes.get_errno()))
            return
        self.grad_bytes_punched += hi - lo

    def _advise_gradient(self, pid) -> None:
        """``gradient_buffer: "disk"``: ask the kernel to read the next sub-group's gradient pages back into the page
        cache now (``madvise(MADV_WILLNEED)`` on their range of the file mapping: asynchronous readahead), while
        this sub-group steps. Under a cap the pages written in backward have mostly been written back and dropped by
        the step, and without this the first touch of each (ZeRO-3's in-place unscale) faulted them back 4 KiB at a
        time on the main thread. Advice only: the values are the file's either way."""
        views = self._grad_views.get(pid)
        mapped = getattr(self.grad_file, "mapped", None)
        if not views or mapped is None or _MADVISE is None:
            return
        base = mapped.untyped_storage().data_ptr()
        if any(v.untyped_storage().data_ptr() != base for _, v in views):
            return
        start = min(v.data_ptr() for _, v in views)
        end = max(v.data_ptr() + v.numel() * v.element_size() for _, v in views)
        page = mmap.PAGESIZE
        lo = start // page * page
        if _MADVISE(ctypes.c_void_p(lo), ctypes.c_size_t(end - lo), mmap.MADV_WILLNEED) == 0:
            self.grads_advised += 1

    def flush_gradients(self) -> None:
        """Gradient writes are synchronous: nothing to flush."""

    def _swapped(self, p, name: str, value: Any) -> bool:
        """The state tensors that live in the store between steps: the element-wise ones (Adam's moments) and
        every other of at least ``SWAP_MIN_NUMEL`` elements, whatever its shape and dtype (ASDT's momentum over
        the active BSPS units only, its 8-/4-bit codes). Smaller ones (block scales, per-unit counters) and
        non-tensors stay in ``optimizer.state``."""
        if not torch.is_tensor(value) or value.numel() <= 1:
            return False
        return value.numel() == self._numel.get(p.ds_id, -1) or value.numel() >= SWAP_MIN_NUMEL

    def swap_in_optimizer_state(self, parameter, async_parameter=None) -> None:
        pid = parameter.ds_id
        if pid not in self._numel:
            return
        t0 = time.perf_counter()
        parameter.data = self._read_master(pid, reuse=self._master_reuse)
        # a record left at this address by a freed tensor is not about this master
        self.store.written_views.pop(parameter.data.untyped_storage().data_ptr(), None)
        state = self.optimizer.state[parameter]
        for name in self._state_names.get(pid, []):
            t = self._read_state(pid, name)
            if torch.is_tensor(state.get(name)):
                state[name].data = t
            else:
                state[name] = t
        pieces, views = self._grads.get(pid), self._grad_views.get(pid)
        self._prefetch_gradient(pid)  # gradient_store, not prefetched yet (after a restore): read it the same way
        buf = self._grad_pending.pop(pid, None)
        if buf is not None:  # gradient_store: the pieces were read into this buffer
            for off, n in pieces:
                self.store.get(f"opt/{pid}/grad/{off}", out=buf.narrow(0, off, n))
            parameter.grad = buf
        elif pieces or views:
            spans = [*(pieces or ()), *((off, v.numel()) for off, v in views or ())]
            whole = self._tiles(spans, self._numel[pid])
            g = self._gradient_in_place(pid, views) if whole and not pieces else None
            if g is None:
                g = self._gradient_into(self._numel[pid], whole)
                for off, n in pieces or ():
                    self.store.get(f"opt/{pid}/grad/{off}", out=g.narrow(0, off, n))
                for off, v in views or ():
                    g.narrow(0, off, v.numel()).copy_(v.reshape(-1))
            parameter.grad = g
        self.stall_s += time.perf_counter() - t0
        if (tl := _timeline()) is not None:
            tl.add("opt read", t0, time.perf_counter())
        if async_parameter is not None and async_parameter.ds_id in self._numel:
            self._prefetch_subgroup(async_parameter.ds_id)

    def reuse_master_buffers(self, param_swapper: Optional[HMSParamSwapper]) -> None:
        """From now on (install's attach, after DeepSpeed's initialize) read each sub-group's master into the
        step's two buffers; ``param_swapper``: the one whose write-behind may read from them (None: the partitions
        live in RAM, ``param_tier: "dram"``, and DeepSpeed copies into them)."""
        self.param_swapper, self._master_reuse = param_swapper, True

    def use_partition_masters(self, pairs) -> int:
        """``param_tier: "dram"`` with ``master_from_partitions``: ``pairs`` are ZeRO-3's (flat fp32 master, flat
        parameter partitions) per sub-group (``deepspeed_compat.z3_partition_flats``). After each sub-group's step
        ZeRO-3 copies the master into its partitions, which stay in CPU memory; where they are in the master's
        dtype they then hold the master's bits, so the master is not written to disk (and not read back): at the
        write it is compared bit for bit with them (a sub-group that differs, e.g. after a restore or an
        overflow, writes its master as before) and read from them at the next swap-in. Returns how many
        sub-groups qualify (every one for an fp32 model, none for bf16/fp16 parameters)."""
        if not self.master_from_partitions:
            return 0
        for master, flat in pairs:
            pid = getattr(master, "ds_id", None)
            if pid in self._numel and flat is not None and flat.dtype == self.dtype and \
                    flat.device.type == "cpu" and flat.is_contiguous() and flat.numel() == self._numel[pid]:
                self._partition_flats[pid] = flat
        return len(self._partition_flats)

    def _master_buffer(self, numel: int) -> torch.Tensor:
        """A buffer for the next sub-group's master, the two of the step taken in turn (as :meth:`_gradient_into`:
        a fresh 40 MB tensor is fresh pages under HMS's 1 MiB mmap threshold). The buffer the sub-group before last
        used may still be read by that sub-group's partition writes (handed to the writer as views of the master,
        ``HMSParamSwapper._swap_out_behind``): those are waited for first, which two buffers make rare. A master
        written behind whole (``_write_state``) leaves its buffer to that write."""
        i, self._master_turn = self._master_turn, self._master_turn ^ 1
        buf, new = self._sized(self._masters, i, numel)
        if not new and self.param_swapper is not None:
            self.param_swapper.wait_for_storage(buf.untyped_storage().data_ptr())
        return buf

    def _gradient_in_place(self, pid, views) -> Optional[torch.Tensor]:
        """The sub-group's gradient as one view of ZeRO-3's gradient buffer (the file mapping of
        ``gradient_buffer: "disk"`` or its CPU buffer with ``"dram"``) when its pieces lie there back to back in
        the sub-group's order, as ZeRO-3 lays them out (``grad_partitions_flat_buffer`` follows the sub-groups'
        parameters in order): no copy into the scratch. None otherwise (the caller copies). The step may change
        it in place (ZeRO-3 scales it by the clip coefficient): the values are dead after the step, and the next
        backward overwrites them (its first micro-step copies, it does not add)."""
        first = min(views, key=lambda ov: ov[0])[1]  # offset 0: the pieces tile the sub-group
        storage, base, esize = first.untyped_storage(), first.data_ptr(), first.element_size()
        if any(v.untyped_storage().data_ptr() != storage.data_ptr() or v.data_ptr() != base + off * esize
               for off, v in views):
            return None
        self.grads_in_place += 1
        return first.detach().as_strided((self._numel[pid],), (1,))  # from first's offset, over the pieces after it

    def _gradient_into(self, numel: int, whole: bool) -> torch.Tensor:
        """A sub-group's fp32 gradient buffer: a view of one scratch tensor that every sub-group of the step reuses
        (ZeRO-3 steps them one at a time, and ``_release`` drops ``parameter.grad`` before the next swap-in). A
        fresh tensor per sub-group was fresh pages every time: with HMS's glibc mmap threshold (1 MiB) each
        40 MB gradient was mapped, faulted in 4 KiB at a time, zeroed by the kernel and unmapped again. Zero-filled
        unless the pieces tile the sub-group (``whole``: they overwrite every element)."""
        if self._grad_scratch is None or self._grad_scratch.numel() < numel:
            self._grad_scratch = None  # the old one goes before the larger one comes
            self._grad_scratch = io_empty(numel, self.dtype)
        g = self._grad_scratch[:numel]
        return g if whole else g.zero_()

    def _write_state(self, parameter, behind: bool = False) -> list:
        """Write the sub-group's master and swapped state; ``behind``: on the writer thread (returns the futures;
        the tensors are detached here, so ``_release`` emptying ``parameter.data`` and the state tensors' ``.data``
        leaves the bytes being written alone)."""
        pid = parameter.ds_id
        flat = self._partition_flats.get(pid)
        in_ram = flat is not None and _same_bits(parameter.data, flat)
        parts = None if in_ram else self._stored_as_partitions(parameter)
        if in_ram:  # param_tier "dram": ZeRO-3 copied the master into the partitions it keeps in CPU memory
            items = []
            self._master_in_partitions.add(pid)
            self._master_parts.pop(pid, None)
            if f"opt/{pid}/fp32" in self.store:
                self.store.delete(f"opt/{pid}/fp32")
        elif parts is None:
            self._master_in_partitions.discard(pid)
            items = [(f"opt/{pid}/fp32", parameter.data)]
            self._master_parts.pop(pid, None)
            if behind:  # the writer holds the master until its write lands: its buffer is not reused
                ptr = parameter.data.untyped_storage().data_ptr()
                self._masters = [b if b is None or b.untyped_storage().data_ptr() != ptr else None
                                 for b in self._masters]
        else:  # the master's bytes are on disk already, as its partitions: its own file is stale from now on
            items = []
            self._master_in_partitions.discard(pid)
            self._master_parts[pid] = parts
            if f"opt/{pid}/fp32" in self.store:
                self.store.delete(f"opt/{pid}/fp32")
        names = []
        for name, value in self.optimizer.state.get(parameter, {}).items():
            if self._swapped(parameter, name, value):
                items.append((f"opt/{pid}/state/{name}", value))
                names.append(name)
        self._state_names[pid] = names
        self._state_meta[pid] = {n: (self.optimizer.state[parameter][n].shape, self.optimizer.state[parameter][n].dtype)
                                 for n in names}
        written = [value for _, value in items]
        if not behind:
            for key, value in items:
                self.store.put(key, value, durable=False)
            self._give_back(pid, written, [])
            return []
        tl = _timeline()
        done = None if tl is None else (lambda a, b: tl.add("opt write (bg)", a, b, lane="writer"))
        futures = [self.store.put_behind(key, value.detach(), durable=False, on_done=done) for key, value in items]
        self._give_back(pid, written, futures)
        return futures

    def _release(self, parameter) -> None:
        parameter.data = torch.empty(0, dtype=self.dtype)
        for name in self._state_names.get(parameter.ds_id, []):
            v = self.optimizer.state[parameter].get(name)
            if torch.is_tensor(v):
                v.data = torch.empty(0, dtype=v.dtype)
        parameter.grad = None

    def swap_out_optimizer_state(self, parameter, async_swap: bool = False) -> None:
        if parameter.ds_id not in self._numel:
            return
        t0 = time.perf_counter()
        if self._keep_resident(parameter):
            pass
        elif self.pipeline_depth:
            while len(self._writing) >= self.pipeline_depth:  # bounded: at most pipeline_depth sub-groups in flight
                self._wait_oldest()
            self._writing.append(self._write_state(parameter, behind=True))
        else:
            self._write_state(parameter)
        if (tl := _timeline()) is not None:
            tl.add("opt write", t0, time.perf_counter())
        self._release(parameter)
        self._forget_grads(parameter.ds_id)

    def _keep_resident(self, parameter) -> bool:
        """``titan.hms.optimizer_dram_mb``: keep the sub-group's master (unless the partitions in RAM hold its
        bits) and swapped state in DRAM instead of writing them, if it is resident already or its bytes still fit
        the budget (admitted at its first swap-out, in the order ZeRO-3 steps them; never evicted, since the
        sub-groups are visited in the same cycle every step, where evicting one for another saves no I/O)."""
        pid = parameter.ds_id
        if not self.resident_budget:
            return False
        state = self.optimizer.state.get(parameter, {})
        names = [n for n, v in state.items() if self._swapped(parameter, n, v)]
        flat = self._partition_flats.get(pid)
        in_ram = flat is not None and _same_bits(parameter.data, flat)
        if pid not in self._resident:
            need = sum(state[n].numel() * state[n].element_size() for n in names) + \
                (0 if in_ram else parameter.data.numel() * parameter.data.element_size())
            if self.resident_bytes + need > self.resident_budget:
                return False
            self.resident_bytes += need
        kept = {n: state[n].data for n in names}
        if in_ram:
            self._master_in_partitions.add(pid)
        else:
            self._master_in_partitions.discard(pid)
            master = parameter.data
            if any(b is not None and b.untyped_storage().data_ptr() == master.untyped_storage().data_ptr()
                   for b in self._masters):  # one of the step's reused master buffers: the next sub-group's
                master = master.clone()
            kept["fp32"] = master
        self._resident[pid] = kept
        self._state_names[pid] = names
        self._lent.pop(pid, None)  # its read buffers stay with the resident state
        self._master_parts.pop(pid, None)
        for key in [f"opt/{pid}/fp32", *(f"opt/{pid}/state/{n}" for n in names)]:  # stale from now on
            if key in self.store:
                self.store.delete(key)
        return True

    def _drop_resident(self, keep_masters: bool = False) -> None:
        """Forget the resident state (a restore puts every value in the store; admitted again after);
        ``keep_masters``: write the resident masters to the store first (a purge forgets the state only)."""
        for pid, kept in self._resident.items():
            if keep_masters and "fp32" in kept:
                self.store.put(f"opt/{pid}/fp32", kept["fp32"], durable=False)
        self._resident.clear()
        self.resident_bytes = 0

    def _forget_grads(self, pid) -> None:
        self._grads[pid] = []  # their store entries stay until overwritten (a mapped view replaces them)
        self._grad_views[pid] = []

    def _is_mapped(self, t: torch.Tensor) -> bool:
        """``t`` is a view, in the master's dtype, of a gradient buffer that lives until the step reads it: the
        file mapping (gradient_buffer "disk") or DeepSpeed's CPU gradient partitions (gradient_buffer "dram")."""
        if t.dtype != self.dtype or not t.is_contiguous() or t.device.type != "cpu":
            return False
        ptr = t.untyped_storage().data_ptr()
        return any(m is not None and ptr == m.untyped_storage().data_ptr()
                   for m in (getattr(self.grad_file, "mapped", None), self.grad_buffer))

    def _in_file_mapping(self, t: torch.Tensor) -> bool:
        """``t`` is a contiguous view, in the master's dtype, of the gradient file mapping (gradient_buffer "disk")."""
        mapped = getattr(self.grad_file, "mapped", None)
        return mapped is not None and t.dtype == self.dtype and t.is_contiguous() and t.device.type == "cpu" and \
            t.untyped_storage().data_ptr() == mapped.untyped_storage().data_ptr()

    def swap_out_gradients(self, parameter, gradient_offsets, gradient_tensors) -> None:
        pid = parameter.ds_id
        if pid not in self._numel:
            return
        t0 = time.perf_counter()
        pieces = self._grads.setdefault(pid, [])
        views = self._grad_views.setdefault(pid, [])
        tl = _timeline()
        done = None if tl is None else (lambda a, b: tl.add("grad write (bg)", a, b, lane="writer"))
        for off, t in zip(gradient_offsets, gradient_tensors):
            off = int(off)
            pieces[:] = [pc for pc in pieces if pc[0] != off]
            views[:] = [pc for pc in views if pc[0] != off]
            if self.gradient_store and self._in_file_mapping(t):
                piece = t.detach().reshape(-1)
                self.store.put_behind(f"opt/{pid}/grad/{off}", piece, durable=False, on_done=done,
                                      on_written=functools.partial(self._punch, piece))
                pieces.append((off, t.numel()))
                self.grads_stored += 1
            elif self._is_mapped(t):
                if f"opt/{pid}/grad/{off}" in self.store:
                    self.store.delete(f"opt/{pid}/grad/{off}")
                views.append((off, t))
            else:
                self.store.put(f"opt/{pid}/grad/{off}", t.reshape(-1).to(self.dtype), durable=False)
                pieces.append((off, t.numel()))
        if (tl := _timeline()) is not None:
            tl.add("grad write", t0, time.perf_counter())

    def release_swap_buffers(self, parameter) -> None:
        if parameter.ds_id in self._numel:
            self._release(parameter)

    def writeback_optimizer_state_and_gradients(self, parameter, write_opt_state: bool, write_gradients: bool) -> None:
        pid = parameter.ds_id
        if pid not in self._numel:
            return
        self.flush()
        if write_opt_state and not self._keep_resident(parameter):
            self._write_state(parameter)
        if write_gradients and parameter.grad is not None:
            for off, n in self._grads.get(pid, []):
                self.store.put(f"opt/{pid}/grad/{off}", parameter.grad.narrow(0, off, n), durable=False)
            for off, v in self._grad_views.get(pid, []):
                v.reshape(-1).copy_(parameter.grad.narrow(0, off, v.numel()))
        self._release(parameter)

    def purge_state(self) -> None:
        """Forget swapped optimizer state (ZeRO-3 calls this before loading a non-NVMe checkpoint)."""
        self.flush()
        self._drop_resident(keep_masters=True)
        for pid, names in self._state_names.items():
            for name in names:
                if f"opt/{pid}/state/{name}" in self.store:  # a resident sub-group's state had no file
                    self.store.delete(f"opt/{pid}/state/{name}")
            names.clear()
        self._state_meta.clear()
        self._lent.clear()

    # ------------------------------------------------------------------ checkpoint
    def snapshot(self, folder: str, fp32_params: list) -> dict:
        """Write every sub-group's fp32 master, element-wise state and other state to ``folder`` (durable).

        Returns the small metadata (also saved as ``folder/meta.pt``).
        """
        self.flush()
        snap = TensorStore([Tier(folder)], io=self.store.io, durable=True, prefetch_workers=1)
        try:
            return self._snapshot(snap, folder, fp32_params)
        finally:
            snap.close(io=False)  # its threads; the I/O handle is the live store's

    def _snapshot(self, snap: TensorStore, folder: str, fp32_params: list) -> dict:
        meta: dict[str, Any] = {"subgroups": {}, "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]}
        for p in fp32_params:
            pid = p.ds_id
            if pid not in self._numel:
                raise RuntimeError(f"titan hms: sub-group {pid} is not managed by the HMS optimizer swapper")
            snap.put(f"opt/{pid}/fp32", self._read_master(pid))
            for name in self._state_names.get(pid, []):
                snap.put(f"opt/{pid}/state/{name}", self._read_state(pid, name))
            other = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.optimizer.state.get(p, {}).items()
                     if k not in self._state_names.get(pid, [])}
            meta["subgroups"][pid] = {"numel": self._numel[pid], "state_names": list(self._state_names.get(pid, [])),
                                      "other": other}
        torch.save(meta, os.path.join(folder, "meta.pt"))
        return meta

    def restore(self, folder: str, fp32_params: list, *, load_optimizer_states: bool = True) -> None:
        """Inverse of :meth:`snapshot`: put the saved tensors back in the live store and state.

        With ``load_optimizer_states=False`` only the fp32 masters come back (DeepSpeed's flag of that name).
        """
        self.flush()
        meta = torch.load(os.path.join(folder, "meta.pt"), weights_only=False)
        snap = TensorStore([Tier(folder)], io=self.store.io, prefetch_workers=1)
        try:
            self._restore(snap, meta, folder, fp32_params, load_optimizer_states)
        finally:
            snap.close(io=False)

    def _restore(self, snap: TensorStore, meta: dict, folder: str, fp32_params: list,
                 load_optimizer_states: bool) -> None:
        snap.scan()
        self._drop_resident()
        if len(meta["param_groups"]) != len(self.optimizer.param_groups):
            raise RuntimeError(f"titan hms: checkpoint {folder!r} has {len(meta['param_groups'])} optimizer param "
                               f"groups, this optimizer has {len(self.optimizer.param_groups)}")
        if load_optimizer_states:
            for g, saved in zip(self.optimizer.param_groups, meta["param_groups"]):
                g.update(saved)
        for p in fp32_params:
            pid = p.ds_id
            sg = meta["subgroups"].get(pid)
            if sg is None or sg["numel"] != self._numel.get(pid):
                raise RuntimeError(f"titan hms: checkpoint {folder!r} has no sub-group {pid} of the same size; "
                                   f"resume with the same model, world size and sub_group_size")
            self.store.put(f"opt/{pid}/fp32", snap.get(f"opt/{pid}/fp32"), durable=False)
            self._state_meta.pop(pid, None)  # read by size again once written (the files are the snapshot's)
            self._lent.pop(pid, None)
            self._master_parts.pop(pid, None)  # the restored master is its file until its partitions are written
            self._master_in_partitions.discard(pid)
            if not load_optimizer_states:
                continue
            for name in sg["state_names"]:
                self.store.put(f"opt/{pid}/state/{name}", snap.get(f"opt/{pid}/state/{name}"), durable=False)
            self._state_names[pid] = list(sg["state_names"])
            state = self.optimizer.state[p]
            state.clear()
            state.update(sg["other"])
            for name in sg["state_names"]:
                state[name] = torch.empty(0, dtype=self.dtype)
            self._forget_grads(pid)

