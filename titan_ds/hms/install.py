"""Wire HMS into ``deepspeed.initialize`` (the ``hms`` pillar of :mod:`titan_ds.engine`).

``before_initialize(ctx)``:

1. checks ``titan.hms.nvme_path`` (and every ``spill_tiers[i].path``): it must exist or be creatable, and be
   writable; otherwise a :class:`TitanConfigError` names the key;
2. makes the ds_config ZeRO-3 with parameters and optimizer state offloaded to ``nvme`` (sets what is missing,
   raises naming the key for what contradicts it: another stage, another offload device, ``fast_init``);
   with a client optimizer it sets ``zero_force_ds_cpu_optimizer: false`` and
   ``zero_allow_untested_optimizer: true`` (seams 1.2);
3. builds the store (``<nvme_path>/titan_hms/rank<r>``, spill tiers, DRAM cache), the predictor and the
   :class:`HMSParamSwapper`, and converts the user's ordinary model with
   ``deepspeed.zero.Init(module=model, config_dict_or_path=ds_config, param_swapper=swapper)``: the dtype then
   comes from the config, not from the CPU dtype bug (seams 0.5), and ZeRO's own conversion inside
   ``deepspeed.initialize`` finds the parameters already converted;
4. points ``stage3.PartitionedOptimizerSwapper`` / ``PipelinedOptimizerSwapper`` at :class:`HMSOptimizerSwapper`
   for the duration of ``deepspeed.initialize`` (restored in ``after_initialize``, and by ``ctx.on_abort`` if
   initialization fails anywhere later);
5. registers the ``hms`` metrics (hit rate, bytes read/written, stall seconds, per step) and the ``hms``
   checkpoint state.

``after_initialize(ctx)`` restores the stage3 globals and registers lifecycle callbacks: after each step that
ends a gradient-accumulation boundary it tells the predictor where the step ended; on save and load every rank
writes/reads its HMS snapshot under ``<dir>/<tag>/hms/rank<r>`` (DeepSpeed writes ``client_state`` on DP rank 0
only, and its own NVMe resume skips the optimizer state: seams appendix A).
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import uuid
from typing import Any, Mapping

import torch

from ..config import TitanConfigError
from ..utils import after_init_distributed
from .io import AsyncIOHandle
from .prefetch import make_predictor
from .store import Tier, TensorStore
from .swapper import HMSOptimizerSwapper, HMSParamSwapper

__all__ = ["before_initialize", "after_initialize", "validate_folder", "configure_ds_config"]

log = logging.getLogger("titan_ds.hms")
_MB = 1 << 20


def validate_folder(path: str, key: str) -> str:
    """Create ``path`` if needed and check that it is writable; errors name ``key``."""
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(full) and not os.path.isdir(full):
        raise TitanConfigError([f"{key}={path!r} exists but is not a folder; point it at a folder"])
    try:
        os.makedirs(full, exist_ok=True)
    except OSError as e:
        raise TitanConfigError([f"{key}={path!r} cannot be created ({e.strerror}); point it at a writable folder"])
    probe = os.path.join(full, f".titan_write_probe.{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
        os.remove(probe)
    except OSError as e:
        raise TitanConfigError([f"{key}={path!r} is not writable ({e.strerror}); fix its permissions or choose "
                                f"another folder"])
    return full


def configure_ds_config(ds: dict[str, Any], nvme_path: str, *, client_optimizer: bool) -> list[str]:
    """Make ``ds`` ZeRO-3 with nvme offload of params and optimizer; returns what was set. Raises on conflicts."""
    errors, changed = [], []
    zero = ds.setdefault("zero_optimization", {})
    stage = zero.get("stage")
    if stage is None:
        zero["stage"] = 3
        changed.append("zero_optimization.stage=3")
    elif int(stage) != 3:
        errors.append(f"titan.hms needs ZeRO stage 3 (it swaps ZeRO-3 partitions); zero_optimization.stage is "
                      f"{stage}: set it to 3 or remove titan.hms")
    for sec in ("offload_param", "offload_optimizer"):
        off = zero.get(sec)
        if off is None:
            off = zero[sec] = {"device": "nvme", "nvme_path": nvme_path}
            changed.append(f"zero_optimization.{sec}.device=nvme")
        if off.get("device", "none") != "nvme":
            errors.append(f"titan.hms replaces DeepSpeed's NVMe swap, so zero_optimization.{sec}.device must be "
                          f"\"nvme\", got {off.get('device')!r}: set it to \"nvme\" or remove {sec}")
        off.setdefault("nvme_path", nvme_path)
        if sec == "offload_param" and "max_in_cpu" not in off:
            # DeepSpeed otherwise moves up to 1e9 "nvme" parameter elements into a CPU buffer for good; HMS's
            # DRAM tier is titan.hms.dram_cache_mb instead
            off["max_in_cpu"] = 0
            changed.append("zero_optimization.offload_param.max_in_cpu=0")
        if sec == "offload_optimizer" and off.get("fast_init"):
            errors.append("zero_optimization.offload_optimizer.fast_init reads DeepSpeed's raw swap files, which "
                          "titan.hms replaces; set it to false")
    if errors:
        raise TitanConfigError(errors)
    if client_optimizer:
        for key, value in (("zero_force_ds_cpu_optimizer", False), ("zero_allow_untested_optimizer", True)):
            if ds.get(key, value) != value:
                raise TitanConfigError([f"{key}={ds[key]!r} conflicts with titan.hms with a client optimizer "
                                        f"(offloaded state on the CPU), which needs {value!r}; set it"])
            if key not in ds:
                ds[key] = value
                changed.append(f"{key}={value}")
    return changed


def _bound_allocator_retention() -> bool:
    """Make glibc return freed large blocks to the OS (HMS allocates a fresh tensor per read on its I/O threads).

    By default glibc raises its mmap threshold after frees (up to 32 MiB) and keeps one arena per thread, so
    freed read buffers stay in the process: measured +1.2 GiB peak RSS on the 85M-parameter GPT (4.98 vs
    3.75 GiB with ``MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_ARENA_MAX=2``). Same settings, via ``mallopt``.
    Returns False where the C library is not glibc (nothing changed).
    """
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold, m_arena_max = -3, -8
    ok = bool(mallopt(m_mmap_threshold, 1 << 20)) and bool(mallopt(m_arena_max, 2))
    if ok:
        log.info("titan hms: glibc mmap threshold 1 MiB, 2 malloc arenas (freed I/O buffers go back to the OS)")
    return ok


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def before_initialize(ctx) -> None:
    import deepspeed
    from deepspeed.runtime.zero import stage3

    hms = ctx.titan.hms
    root = validate_folder(hms.nvme_path, "titan.hms.nvme_path")
    spill = [validate_folder(t.path, f"titan.hms.spill_tiers[{i}].path") for i, t in enumerate(hms.spill_tiers)]
    changed = configure_ds_config(ctx.ds_config, root, client_optimizer=ctx.optimizer is not None
                                  or ctx.titan.optimizer is not None)
    for c in changed:
        log.info("titan hms: set %s", c)
    _bound_allocator_retention()
    deepspeed.init_distributed()
    after_init_distributed()
    rank = _rank()
    folder = os.path.join(root, "titan_hms", f"rank{rank}")
    shutil.rmtree(folder, ignore_errors=True)  # swap files of an earlier run are stale; checkpoints live elsewhere
    tiers = [Tier(folder, None if hms.nvme_capacity_mb is None else hms.nvme_capacity_mb * _MB)]
    for path, t in zip(spill, hms.spill_tiers):
        sub = os.path.join(path, "titan_hms", f"rank{rank}")
        shutil.rmtree(sub, ignore_errors=True)
        tiers.append(Tier(sub, None if t.capacity_mb is None else t.capacity_mb * _MB))
    io = AsyncIOHandle(threads=hms.io_threads, direct=hms.direct_io)
    store = TensorStore(tiers, dram_cache_bytes=hms.dram_cache_mb * _MB, io=io, durable=False)
    buffer_count = int(ctx.ds_config["zero_optimization"]["offload_param"].get("buffer_count", 5))
    pswap = HMSParamSwapper(store, buffer_count=buffer_count, predictor=make_predictor(hms.prefetch),
                            device_budget_bytes=None if hms.device_budget_mb is None else hms.device_budget_mb * _MB,
                            prefetch_depth=hms.prefetch_depth)
    _convert_model(ctx.model, ctx.ds_config, pswap)
    ctx.zero_init_kwargs["param_swapper"] = pswap  # parameters later pillars create (TRD cores) stream via HMS
    saved = (stage3.PartitionedOptimizerSwapper, stage3.PipelinedOptimizerSwapper)
    ctx.on_abort(functools.partial(_restore_swapper_classes, saved))
    factory = functools.partial(HMSOptimizerSwapper, store=store, rank=rank)
    stage3.PartitionedOptimizerSwapper = stage3.PipelinedOptimizerSwapper = factory
    runtime = _HMSRuntime(store=store, param_swapper=pswap, rank=rank, saved_globals=saved)
    ctx.reports["hms"] = runtime
    ctx.add_metrics(runtime.metrics)
    ctx.add_state("hms", runtime.state, runtime.load_state)


def _restore_swapper_classes(saved: tuple[Any, Any]) -> None:
    from deepspeed.runtime.zero import stage3
    stage3.PartitionedOptimizerSwapper, stage3.PipelinedOptimizerSwapper = saved


def _convert_model(model: torch.nn.Module, ds_config: dict, pswap: HMSParamSwapper) -> None:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import is_zero_param
    params = list(model.parameters())
    converted = [p for p in params if is_zero_param(p)]
    if converted:
        if all(isinstance(getattr(p, "nvme_swapper", None), HMSParamSwapper) for p in converted):
            return
        raise TitanConfigError(["titan.hms converts the model itself: build it normally, not under "
                                "deepspeed.zero.Init (its parameters would use DeepSpeed's own swapper)"])
    # dtype=None: Init then takes the dtype from the config; passing one hits the CPU dtype bug (seams 0.5)
    deepspeed.zero.Init(module=model, config_dict_or_path=ds_config, param_swapper=pswap)


class _HMSRuntime:
    """What HMS keeps after initialize: the store, the swappers, metrics and lifecycle callbacks."""

    def __init__(self, *, store: TensorStore, param_swapper: HMSParamSwapper, rank: int, saved_globals):
        self.store, self.param_swapper, self.rank = store, param_swapper, rank
        self.saved_globals = saved_globals
        self.engine = None
        self.opt_swapper = None
        self.snapshot_id = None
        self._pending = None
        self._boundary = False
        self._last = store.stats.as_dict()

    def __repr__(self) -> str:
        tiers = ", ".join(f"{t.path} ({t.used_bytes / _MB:.1f} MiB)" for t in self.store.tiers)
        return f"HMS(rank {self.rank}; tiers: {tiers}; DRAM cache {self.store.cache_budget / _MB:.0f} MiB)"

    def metrics(self) -> dict[str, Any]:
        """Per step: bytes read/written/prefetched and stall seconds; cumulative: hit rates (all reads, and
        parameter partitions ``param_hit_rate`` / optimizer state ``opt_hit_rate`` separately)."""
        now = self.store.stats.as_dict()
        st = self.store.stats
        step = {k: now[k] - self._last[k] for k in ("bytes_read", "bytes_written", "stall_s", "bytes_prefetched")}
        self._last = now
        rates = {k: v for k, v in now.items() if k.endswith(("_hit_rate", "_hits", "_misses"))}
        return {"hms": {"hit_rate": now["hit_rate"], **rates, **step,
                        "hits": st.cache_hits + st.prefetch_hits, "misses": st.misses,
                        "disk_bytes": sum(t.used_bytes for t in self.store.tiers),
                        "dram_cache_bytes": self.store.cache_bytes}}

    def state(self) -> dict[str, Any]:
        # called by titan_ds.engine just before engine.save_checkpoint: name the snapshot about to be written
        self._pending = uuid.uuid4().hex[:12]
        return {"format": 1, "snapshot_id": self._pending}

    def load_state(self, state: dict[str, Any]) -> None:
        if state.get("snapshot_id") != self.snapshot_id:
            raise RuntimeError(f"titan hms: the checkpoint's HMS snapshot {state.get('snapshot_id')!r} is not the "
                               f"one restored ({self.snapshot_id!r}); the checkpoint folder is inconsistent")

    # ------------------------------------------------------------------ lifecycle callbacks
    def attach(self, engine) -> None:
        _restore_swapper_classes(self.saved_globals)
        self.engine = engine
        self.opt_swapper = getattr(engine.optimizer, "optimizer_swapper", None)
        if not isinstance(self.opt_swapper, HMSOptimizerSwapper):
            raise RuntimeError("titan hms: DeepSpeed did not build the HMS optimizer swapper; is "
                               "zero_optimization.offload_optimizer.device \"nvme\"?")

    def before_step(self) -> None:
        self._boundary = self.engine.is_gradient_accumulation_boundary()  # before step() advances micro_steps

    def after_step(self) -> None:
        if self._boundary:
            self.param_swapper.end_step()

    def save(self, save_dir: str, tag: str) -> None:
        """After DeepSpeed wrote ``tag``: this rank's optimizer-state snapshot (the engine synchronises after)."""
        self.snapshot_id, self._pending = self._pending or uuid.uuid4().hex[:12], None
        folder = os.path.join(save_dir, tag, "hms", f"rank{self.rank}")
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        self.opt_swapper.snapshot(folder, self.engine.optimizer.fp32_partitioned_groups_flat)
        with open(os.path.join(folder, "SNAPSHOT_ID"), "w") as f:
            f.write(self.snapshot_id)

    def load(self, load_dir: str, tag: str, options: Mapping[str, Any]) -> None:
        """After DeepSpeed read ``tag``: restore this rank's snapshot (before the titan state checks its id)."""
        folder = os.path.join(load_dir, tag, "hms", f"rank{self.rank}")
        if not os.path.isdir(folder):
            raise RuntimeError(f"titan hms: checkpoint {os.path.join(load_dir, tag)!r} has no HMS snapshot "
                               f"for rank {self.rank} ({folder!r}); it was not saved with titan.hms")
        if options.get("load_module_only"):
            raise RuntimeError("titan hms: load_module_only is not supported with HMS (parameters live in the "
                               "optimizer's fp32 masters); load the full checkpoint")
        self.opt_swapper.restore(folder, self.engine.optimizer.fp32_partitioned_groups_flat,
                                 load_optimizer_states=options.get("load_optimizer_states", True))
        self.engine.optimizer.reset_swap_buffers()  # rewrite every parameter partition from its restored fp32 master
        if options.get("load_optimizer_states", True):
            self._restore_optimizer_extra(load_dir, tag)
        with open(os.path.join(folder, "SNAPSHOT_ID")) as f:
            self.snapshot_id = f.read().strip()
        _barrier()


    def _client_optimizer(self) -> Any:
        """The optimizer the user (or titan.optimizer) gave DeepSpeed, inside its ZeRO-3 optimizer."""
        return getattr(self.engine.optimizer, "optimizer", None)

    def _restore_optimizer_extra(self, load_dir: str, tag: str) -> None:
        """Under NVMe optimizer offload DeepSpeed writes the client optimizer's ``state_dict()`` into each rank's
        optimizer shard but never loads it back (seams appendix A); the snapshot restored the per-tensor state,
        and this hands the shard's copy to the optimizer's ``load_extra_state`` (ASDT: engine step, TGSS table,
        BSPS state), so that state is saved once, in DeepSpeed's own file."""
        load = getattr(self._client_optimizer(), "load_extra_state", None)
        if load is None:
            return
        path = self.engine._get_zero_ckpt_name(load_dir, tag)
        shard = torch.load(path, map_location="cpu", weights_only=False, mmap=True)  # mmap: only what is read
        load(shard["optimizer_state_dict"]["optimizer_state_dict"])


def _barrier() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def after_initialize(ctx) -> None:
    runtime = ctx.reports["hms"]
    runtime.attach(ctx.engine)
    ctx.on_before_step(runtime.before_step)
    ctx.on_after_step(runtime.after_step)
    ctx.on_save(runtime.save)
    ctx.on_load(runtime.load)
