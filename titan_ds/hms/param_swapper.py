"""ZeRO-3's parameter swapper over the HMS store (``param.nvme_swapper``): :class:`HMSParamSwapper`.


:class:`HMSParamSwapper` implements the interface ZeRO-3 calls on DeepSpeed's
``AsyncPartitionedParameterSwapper`` (deepspeed_seams.md 2.3): ``swappable_tensor``, ``get_buffer``,
``swap_in``, ``synchronize_reads``, ``swap_out_and_release``, ``remove_partition_and_release_buffers``,
``available_swap_in_buffers``, ``swap_into_buffer``, ``reserve_partitioned_swap_space``,
``swap_out_partitioned_params``. Partitions live in the store under ``param/<ds_id>``. Buffers are allocated
in the **parameter's own dtype** (DeepSpeed's swapper allocates them in the dtype ``zero.Init`` computed,
which is bf16 on a CPU for an fp32 model: seams 0.5). The device budget bounds the bytes of partitions held
in memory at once; ``available_swap_in_buffers`` reports how many more the budget admits. A predictor
(:mod:`titan_ds.hms.prefetch`) sees every swap-in and names the partitions to read ahead into DRAM.

With :func:`titan_ds.hms.timeline.enable` it records its waits and writes as timeline spans. The optimizer-state
swapper is :mod:`titan_ds.hms.optimizer_swapper`.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import wait as futures_wait
from typing import Any, Optional

import torch

from .io import BufferPool, io_empty
from .prefetch import Predictor
from .store import TensorStore
from .timeline import current as _timeline
from .writes import drain, wait_all

__all__ = ["HMSParamSwapper", "PartitionedParamStatus"]

try:  # the enum ZeRO-3 compares against; importing it builds no op
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
except ImportError:  # pragma: no cover - deepspeed is a hard dependency of titan_ds
    raise


def _pkey(param) -> str:
    return f"param/{param.ds_id}"


def _note_view(store: TensorStore, key: str, src: torch.Tensor) -> None:
    """Record that ``key`` was just put from ``src``, a view of another tensor's storage (an fp32 master's slice
    written as a partition of the same dtype): :meth:`HMSOptimizerSwapper._stored_as_partitions` reads it."""
    esize = src.element_size()
    store.written_views.setdefault(src.untyped_storage().data_ptr(), []).append(
        (key, src.storage_offset() * esize, src.numel() * esize))


class HMSParamSwapper:
    """ZeRO-3 parameter-partition swapper over a :class:`TensorStore` (see module docstring)."""

    def __init__(self, store: TensorStore, *, buffer_count: int = 5, device_budget_bytes: Optional[int] = None,
                 predictor: Optional[Predictor] = None, prefetch_depth: int = 2, write_behind_depth: int = 0,
                 pooled_reads: bool = True, pool_bytes: int = 0):
        self.store = store
        # titan.hms.pooled_reads: partitions are read into reused (huge-page, already faulted-in) buffers that come
        # back at release, not into fresh memory the kernel zeroes page by page on every read; the free ones kept
        # are bounded by pool_bytes (ZeRO-3's prefetch window: the partitions it reads ahead, whose buffers the
        # releases behind it hand on) or twice the largest partition, the larger (_track_largest)
        self.pool_bytes = int(pool_bytes)
        self.read_pool: Optional[BufferPool] = BufferPool(max_free_bytes=self.pool_bytes) if pooled_reads else None
        if self.read_pool is not None:
            store.pool_reads("param/", self.read_pool)
        self._values: dict[Any, torch.Tensor] = {}  # ds_id -> the value read for it (handed back at release)
        self.recycled = 0  # read buffers given back to read_pool
        if write_behind_depth < 0:
            raise ValueError(f"write_behind_depth must be >= 0 (0: synchronous writes), got {write_behind_depth}")
        # titan.hms.param_write_behind: the partitions the optimizer step updates are written on the store's
        # "param" writer lane; at most this many swap_out_partitioned_params calls (sub-groups) in flight
        self.write_behind_depth = int(write_behind_depth)
        self._writing: deque[list] = deque()  # per sub-group handed to the writer: its writes' futures
        # storage address -> the writes in flight whose bytes are a view of that storage (an fp32 master's slice
        # handed over as is): wait_for_storage, before the optimizer swapper reuses a master buffer
        self._reads_from: dict[int, list] = {}
        self.buffer_count = int(buffer_count)
        self.device_budget_bytes = device_budget_bytes
        self.predictor = predictor
        self.prefetch_depth = int(prefetch_depth)
        self._numel: dict[Any, int] = {}
        self._held: dict[Any, int] = {}  # ds_id -> bytes held in memory
        self._inflight: list = []
        self._largest = 1
        self.swap_in_count = 0
        self.stall_s = 0.0
        self.access_log: Optional[list[list[str]]] = None  # set to [[]] to record the access trace, per step

    # ------------------------------------------------------------------ budget
    @property
    def held_bytes(self) -> int:
        return sum(self._held.values())

    def available_swap_in_buffers(self) -> int:
        if self.device_budget_bytes is None:
            return max(0, self.buffer_count - len(self._held))
        return max(0, (self.device_budget_bytes - self.held_bytes) // self._largest)

    def _track_largest(self, nbytes: int) -> None:
        self._largest = max(self._largest, nbytes)
        if self.read_pool is not None:
            self.read_pool.max_free_bytes = max(self.pool_bytes, 2 * self._largest)

    def _release(self, param) -> None:
        self._held.pop(param.ds_id, None)
        value = self._values.pop(param.ds_id, None)
        param.ds_tensor.data = torch.empty(0, dtype=param.ds_tensor.dtype)
        param.ds_tensor.status = PartitionedParamStatus.NOT_AVAILABLE
        if value is not None and self.store.recycle(value):  # back to the pool unless something else holds it
            self.recycled += 1

    # ------------------------------------------------------------------ ZeRO-3 interface
    def swappable_tensor(self, param=None, numel=None) -> bool:
        if (param is None) == (numel is None):
            raise ValueError("swappable_tensor takes exactly one of param= or numel=")
        n = param.ds_tensor.ds_numel if param is not None else numel
        return n > 0  # every partition streams; small ones stay hot in the DRAM cache

    def get_buffer(self, param, numel: int) -> torch.Tensor:
        self._numel[param.ds_id] = int(numel)
        self._held[param.ds_id] = int(numel) * torch.empty(0, dtype=param.dtype).element_size()
        self._track_largest(self._held[param.ds_id])
        return io_empty(numel, param.dtype)  # read into directly (aligned), see titan_ds/hms/io.py

    def swap_out_and_release(self, params, async_op: bool = False, force_buffer_release: bool = False) -> None:
        t0 = time.perf_counter()
        for p in params:
            n = p.ds_tensor.ds_numel
            self._numel[p.ds_id] = n
            self.store.put(_pkey(p), p.ds_tensor.data.narrow(0, 0, n), durable=False)
            self._release(p)
        if (tl := _timeline()) is not None:
            tl.add("param write", t0, time.perf_counter())

    def swap_in(self, params, async_op: bool = True, swap_in_buffers=None) -> None:
        bad = [p.ds_id for p in params if p.ds_tensor.status != PartitionedParamStatus.NOT_AVAILABLE]
        if bad:
            raise RuntimeError(f"titan hms: swap_in of partitions {bad} that are already available or in flight")
        t0 = time.perf_counter()
        for i, p in enumerate(params):
            key = _pkey(p)
            self._observe(key)
            if swap_in_buffers is not None:
                self.store.get(key, out=swap_in_buffers[i].narrow(0, 0, p.ds_tensor.ds_numel))
                self._held[p.ds_id] = swap_in_buffers[i].numel() * swap_in_buffers[i].element_size()
                p.ds_tensor.data = swap_in_buffers[i].narrow(0, 0, p.ds_tensor.ds_numel).data
                p.ds_tensor.status = PartitionedParamStatus.AVAILABLE
                continue
            self.store.prefetch(key)
            self._held[p.ds_id] = p.ds_tensor.ds_numel * p.ds_tensor.element_size()
            self._track_largest(self._held[p.ds_id])
            p.ds_tensor.status = PartitionedParamStatus.INFLIGHT
            self._inflight.append(p)
        if swap_in_buffers is not None and (tl := _timeline()) is not None:
            tl.add("param fetch", t0, time.perf_counter())
        if not async_op:
            self.synchronize_reads()

    def synchronize_reads(self) -> None:
        t0 = time.perf_counter()
        inflight, self._inflight = self._inflight, []
        for p in inflight:
            t = self.store.get(_pkey(p))
            self._values[p.ds_id] = t
            p.ds_tensor.data = t.reshape(-1).data
            p.ds_tensor.status = PartitionedParamStatus.AVAILABLE
        self.stall_s += time.perf_counter() - t0
        if inflight and (tl := _timeline()) is not None:
            tl.add("param fetch", t0, time.perf_counter())

    def remove_partition_and_release_buffers(self, params) -> None:
        for p in params:
            self._release(p)

    def swap_into_buffer(self, param, dest_buffer: torch.Tensor) -> None:
        if param.ds_tensor.status != PartitionedParamStatus.NOT_AVAILABLE:
            raise RuntimeError(f"titan hms: param {param.ds_id} is already available or in flight")
        t0 = time.perf_counter()
        self.store.get(_pkey(param), out=dest_buffer.narrow(0, 0, param.ds_tensor.ds_numel))
        if (tl := _timeline()) is not None:
            tl.add("param fetch", t0, time.perf_counter())

    def reserve_partitioned_swap_space(self, partition_num_elems) -> None:
        """Nothing to reserve: ``swap_out_partitioned_params`` writes from the caller's tensors."""

    def swap_out_partitioned_params(self, dst_fp16_params, src_fp32_params) -> None:
        if len(dst_fp16_params) != len(src_fp32_params):
            raise ValueError(f"{len(dst_fp16_params)} params but {len(src_fp32_params)} fp32 sources")
        # the partitions the predictor expects next (the first ones of the next forward) keep their new value in
        # DRAM as a finished prefetch instead of being read back from the file just written
        soon = set(self.predictor.predict(self.prefetch_depth)) if self.predictor is not None else set()
        t0 = time.perf_counter()
        if self.write_behind_depth:
            self._swap_out_behind(dst_fp16_params, src_fp32_params, soon)
            if (tl := _timeline()) is not None:
                tl.add("param write", t0, time.perf_counter())
            return
        for p, src in zip(dst_fp16_params, src_fp32_params):
            key, value = _pkey(p), src.to(p.ds_tensor.dtype)
            self.store.put(key, value, durable=False)
            if value is src:
                _note_view(self.store, key, src)
            if key in soon:
                self.store.stage(key, value.clone() if value is src else value)
            p.ds_tensor.status = PartitionedParamStatus.NOT_AVAILABLE
        if (tl := _timeline()) is not None:
            tl.add("param write", t0, time.perf_counter())

    def _swap_out_behind(self, dst_fp16_params, src_fp32_params, soon: set) -> None:
        """The partitions' writes on the store's ``"param"`` lane, after waiting until fewer than
        ``write_behind_depth`` earlier calls' writes are in flight. A value in the master's dtype is a view of
        ZeRO-3's fp32 master, handed over as is: the optimizer swapper reads a later sub-group's master into that
        buffer only after :meth:`wait_for_storage` (``HMSOptimizerSwapper._master_buffer``), so nothing changes it
        while it is written; one
        the next forward reads first (``soon``) is copied, since that copy becomes the partition ZeRO-3 gets."""
        while len(self._writing) >= self.write_behind_depth:
            self._wait_oldest()
        for ptr in [k for k, fs in self._reads_from.items() if all(f.done() for f in fs)]:
            del self._reads_from[ptr]
        tl = _timeline()
        done = None if tl is None else (lambda a, b: tl.add("param write (bg)", a, b, lane="param writer"))
        futs = []
        for p, src in zip(dst_fp16_params, src_fp32_params):
            key, value = _pkey(p), src.to(p.ds_tensor.dtype)
            keep = key in soon
            if value is src:  # the file gets the master's bytes (a copy of them if staged, the same bytes)
                _note_view(self.store, key, src)
            view = value is src and not keep
            if keep and value is src:
                value = value.clone()
            futs.append(self.store.put_behind(key, value.detach(), durable=False, on_done=done, lane="param",
                                              stage=keep))
            if view:
                self._reads_from.setdefault(src.untyped_storage().data_ptr(), []).append(futs[-1])
            p.ds_tensor.status = PartitionedParamStatus.NOT_AVAILABLE
        self._writing.append(futs)

    def wait_for_storage(self, ptr: int) -> None:
        """Wait until no parameter write in flight reads from the storage at address ``ptr`` (a master buffer the
        optimizer swapper is about to read the next sub-group into). A failed write is raised by :meth:`flush` or
        :meth:`check`, as before."""
        futures_wait(self._reads_from.pop(ptr, []))

    def _wait_oldest(self) -> None:
        wait_all(self._writing.popleft())

    def flush(self) -> None:
        """Wait for every parameter write in flight; raise the first failure (naming its key)."""
        self._reads_from.clear()  # every write is waited for below
        if self._writing:
            drain(self._writing, "param write")

    def check(self) -> None:
        """Raise the failure of a parameter write that has finished (waits for nothing)."""
        for futs in self._writing:
            for f in futs:
                if f.done() and f.exception() is not None:
                    self._writing.remove(futs)
                    raise f.exception()

    def get_path(self, param, must_exist: bool = False) -> str:
        raise NotImplementedError("titan hms stores headed, checksummed files that DeepSpeed's fast_init cannot "
                                  "read raw; set zero_optimization.offload_optimizer.fast_init to false")

    def reserve_available_buffers(self):
        return self.get_path(None)

    def release_reserved_buffers(self) -> None:
        self.get_path(None)

    # ------------------------------------------------------------------ prediction
    def _observe(self, key: str) -> None:
        self.swap_in_count += 1
        if self.access_log is not None:
            self.access_log[-1].append(key)
        if self.predictor is None:
            return
        self.predictor.observe(key)
        self._prefetch_predicted()

    def _prefetch_predicted(self) -> None:
        for nxt in self.predictor.predict(self.prefetch_depth):
            if nxt in self.store:
                self.store.prefetch(nxt, speculative=True)

    def end_step(self) -> None:
        """A training step ended: the predictor learns the boundary and the next step's first keys are read."""
        if self.access_log is not None:
            self.access_log.append([])
        if self.predictor is not None:
            self.predictor.end_step()
            self._prefetch_predicted()
