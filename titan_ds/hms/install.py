"""Wire HMS into ``deepspeed.initialize`` (the ``hms`` pillar of :mod:`titan_ds.engine`): :class:`HMSPillar`.

``validate`` (pure): ``titan.hms.nvme_path`` and every ``spill_tiers[i].path`` must be a folder that exists or
can be created in a writable parent (checked with ``stat``/``access``, nothing written); a model built under
plain ``deepspeed.zero.Init`` (DeepSpeed's swapper) is refused. Then the memory check (:mod:`titan_ds.hms.budget`):
the RAM this process may use against what ``initialize`` and a step will hold for this model; where the settings
as given do not fit, a smaller ``dram_cache_mb`` and/or ``gradient_buffer: "disk"`` where the user did not set them
(``apply`` uses them and logs why), else a refusal naming the bytes and the setting that would fit. The ds_config conflicts (another ZeRO stage,
another offload device, ``fast_init``) are cross-field rules: :func:`configure_ds_config`, run by
:mod:`titan_ds.rules` on a copy.

``apply``:

1. creates the folders (through the transaction: removed again if ``initialize`` fails) and probes them by
   writing a file;
2. makes the ds_config ZeRO-3 with parameters and optimizer state offloaded to ``nvme`` and bounds ZeRO-3's
   working buffers (``ZERO3_BOUNDS``) where the user left them unset or ``"auto"``; every value it sets is logged;
3. bounds glibc's retention of freed buffers (``mallopt``; put back to glibc's defaults on failure);
4. builds the store (``<nvme_path>/titan_hms/rank<r>``, spill tiers, DRAM cache; swap files of an earlier run are
   moved aside and deleted only once ``initialize`` succeeded), the predictor and the :class:`HMSParamSwapper`,
   and converts the user's ordinary model with ``deepspeed.zero.Init(module=model, config_dict_or_path=ds_config,
   param_swapper=swapper)`` (this consumes the model: see :mod:`titan_ds.transaction`);
5. for the duration of ``deepspeed.initialize``, points ZeRO-3's optimizer swapper classes at
   :class:`HMSOptimizerSwapper` and, with ``gradient_buffer: "disk"``, has ZeRO-3 allocate its gradient
   partitions in a file mapping (seams in :mod:`titan_ds.deepspeed_compat`).

``attach`` undoes those two patches, checks that DeepSpeed used them, and registers the lifecycle callbacks:
after each step that ends a gradient-accumulation boundary it tells the predictor where the step ended; on save
and load every rank writes/reads its HMS snapshot under ``<dir>/<tag>/hms/rank<r>`` (DeepSpeed writes
``client_state`` on DP rank 0 only, and its own NVMe resume skips the optimizer state: docs/deepspeed_seams.md);
the ``hms`` metrics (hit rate, bytes read/written, stall seconds, per step) and checkpoint state.
"""
from __future__ import annotations

import functools
import gc
import json
import logging
import os
import shutil
import uuid
import weakref
from typing import Any, Callable, Mapping, Optional

import torch

from .. import deepspeed_compat as dsc
from ..config import TitanConfigError, ds_precision
from ..pillar import Pillar, View
from ..utils import after_init_distributed
from . import budget
from .bounds import ZERO3_BOUNDS
from .gradnorm import ScratchNorm
from .io import AsyncIOHandle
from .prefetch import make_predictor
from .store import Tier, TensorStore
from .optimizer_swapper import HMSOptimizerSwapper
from .param_swapper import HMSParamSwapper

__all__ = ["HMSPillar", "PILLAR", "folder_problems", "configure_ds_config", "zero_init", "build_param_swapper",
           "ZERO3_BOUNDS"]

log = logging.getLogger("titan_ds.hms")
_MB = 1 << 20


def folder_problems(path: str, key: str) -> list[str]:
    """Whether ``path`` is (or can be created as) a writable folder, by ``stat``/``access`` only; errors name
    ``key``."""
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(full):
        if not os.path.isdir(full):
            return [f"{key}={path!r} exists but is not a folder; point it at a folder"]
        if not _writable(full):
            return [f"{key}={path!r} is not writable; fix its permissions or choose another folder"]
        return []
    parent = os.path.dirname(full)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return [f"{key}={path!r} cannot be created: {parent!r} is not a folder; point it at a writable folder"]
    if not _writable(parent):
        return [f"{key}={path!r} cannot be created: {parent!r} is not writable; point it at a writable folder"]
    return []


def _folders_problems(hms: Any) -> list[str]:
    """:func:`folder_problems` of ``nvme_path`` and of every spill tier's path."""
    out = folder_problems(hms.nvme_path, "titan.hms.nvme_path")
    for i, t in enumerate(hms.spill_tiers):
        out += folder_problems(t.path, f"titan.hms.spill_tiers[{i}].path")
    return out


def _writable(folder: str) -> bool:
    """Permissions and a read-only mount (root passes every permission check but not that one)."""
    return os.access(folder, os.W_OK | os.X_OK) and not os.statvfs(folder).f_flag & os.ST_RDONLY


def _make_folder(path: str, key: str, txn: Any = None) -> str:
    """Create ``path`` (through ``txn`` when given: removed again on rollback) and probe it with a write."""
    try:
        full = txn.make_dirs(path) if txn is not None else os.path.abspath(os.path.expanduser(path))
        if txn is None:
            os.makedirs(full, exist_ok=True)
    except OSError as e:
        raise TitanConfigError([f"{key}={path!r} cannot be created ({e.strerror}); point it at a writable folder"]) \
            from None
    probe = os.path.join(full, f".titan_write_probe.{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
        os.remove(probe)
    except OSError as e:
        raise TitanConfigError([f"{key}={path!r} is not writable ({e.strerror}); fix its permissions or choose "
                                f"another folder"]) from None
    return full




def configure_ds_config(ds: dict[str, Any], nvme_path: str, param_tier: str = "nvme") -> list[str]:
    """Make ``ds`` ZeRO-3 with nvme offload of the optimizer and of the parameters (``param_tier`` "nvme") or
    parameters in CPU memory (``param_tier`` "dram"); returns what was set. Raises on conflicts
    (:mod:`titan_ds.rules` runs it on a copy during validation, so ``initialize`` never gets that far)."""
    errors, changed = [], []
    want = {"offload_param": "nvme" if param_tier == "nvme" else "cpu", "offload_optimizer": "nvme"}
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
            off = zero[sec] = ({"device": "cpu", "pin_memory": True} if want[sec] == "cpu"
                               else {"device": "nvme", "nvme_path": nvme_path})
            changed.append(f"zero_optimization.{sec}.device={want[sec]}")
        if off.get("device", "none") != want[sec]:
            if sec == "offload_param" and param_tier == "nvme" and off.get("device") == "cpu":
                errors.append("zero_optimization.offload_param.device is \"cpu\" but titan.hms.param_tier is "
                              "\"nvme\" (HMS streams the parameters from disk): set titan.hms.param_tier to "
                              "\"dram\" to keep them in CPU memory, or offload_param.device to \"nvme\"")
            elif sec == "offload_param" and param_tier == "dram":
                errors.append(f"titan.hms.param_tier \"dram\" keeps the parameters in CPU memory, so "
                              f"zero_optimization.offload_param.device must be \"cpu\", got {off.get('device')!r}: "
                              f"set it to \"cpu\" (or remove offload_param), or set titan.hms.param_tier to \"nvme\"")
            else:
                errors.append(f"titan.hms replaces DeepSpeed's NVMe swap, so zero_optimization.{sec}.device must "
                              f"be \"nvme\", got {off.get('device')!r}: set it to \"nvme\" or remove {sec}")
            continue
        if want[sec] == "cpu":
            continue
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
    for key, value in ZERO3_BOUNDS.items():
        if zero.get(key, "auto") == "auto":  # HF's "auto" would be filled from the hidden size, unbounded
            zero[key] = value
            changed.append(f"zero_optimization.{key}={value:.0e}")
    return changed


_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8
_GLIBC_DEFAULTS = {_M_MMAP_THRESHOLD: 128 * 1024, _M_ARENA_MAX: 0}  # glibc's documented defaults (0: 8 x cores)


def _mallopt() -> Any:
    import ctypes
    import ctypes.util
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return None


def _bound_allocator_retention(txn: Any = None) -> bool:
    """Make glibc return freed large blocks to the OS (HMS allocates a fresh tensor per read on its I/O threads).

    By default glibc raises its mmap threshold after frees (up to 32 MiB) and keeps one arena per thread, so
    freed read buffers stay in the process: measured +1.2 GiB peak RSS on the 85M-parameter GPT (4.98 vs
    3.75 GiB with ``MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_ARENA_MAX=2``). Same settings, via ``mallopt``.
    If ``initialize`` then fails, ``txn`` puts glibc's documented defaults back (128 KiB, arenas by core count;
    glibc has no way to read the old values or to turn its dynamic threshold back on, so a value the process had
    set before is not restored). Returns False where the C library is not glibc (nothing changed).
    """
    mallopt = _mallopt()
    if mallopt is None:
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, 1 << 20)) and bool(mallopt(_M_ARENA_MAX, 2))
    if ok:
        log.info("titan hms: glibc mmap threshold 1 MiB, 2 malloc arenas (freed I/O buffers go back to the OS)")
        if txn is not None:
            txn.on_undo("glibc mallopt back to its defaults",
                        lambda: [mallopt(k, v) for k, v in _GLIBC_DEFAULTS.items()] and None)
    return ok


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _prepare(hms, ds_config: dict[str, Any], txn: Any = None) -> str:
    """Create and probe the folders, make ``ds_config`` ZeRO-3 + NVMe with bounded buffers, set up the process."""
    import deepspeed
    root = _make_folder(hms.nvme_path, "titan.hms.nvme_path", txn)
    for i, t in enumerate(hms.spill_tiers):
        _make_folder(t.path, f"titan.hms.spill_tiers[{i}].path", txn)
    for c in configure_ds_config(ds_config, root, hms.param_tier):
        log.info("titan hms: set %s", c)
    _bound_allocator_retention(txn)
    deepspeed.init_distributed()
    after_init_distributed()
    return root


def _fresh_folder(folder: str, txn: Any) -> None:
    """Swap files of an earlier run in ``folder`` are stale (checkpoints live elsewhere): moved aside and deleted
    once ``initialize`` succeeded (``txn``), or deleted now (``titan_ds.zero_init``, no transaction)."""
    if txn is not None:
        txn.move_aside(folder)
    else:
        shutil.rmtree(folder, ignore_errors=True)


def build_store(hms, root: str, txn: Any = None) -> TensorStore:
    """This rank's store (``<nvme_path>/titan_hms/rank<r>``, spill tiers, DRAM cache), in folders emptied of an
    earlier run's swap files (:func:`_fresh_folder`)."""
    rank = _rank()
    folder = os.path.join(root, "titan_hms", f"rank{rank}")
    _fresh_folder(folder, txn)
    tiers = [Tier(folder, None if hms.nvme_capacity_mb is None else hms.nvme_capacity_mb * _MB)]
    for t in hms.spill_tiers:
        sub = os.path.join(os.path.abspath(os.path.expanduser(t.path)), "titan_hms", f"rank{rank}")
        _fresh_folder(sub, txn)
        tiers.append(Tier(sub, None if t.capacity_mb is None else t.capacity_mb * _MB))
    io = AsyncIOHandle(threads=hms.io_threads, direct=hms.direct_io)
    # a predictor names prefetch_depth keys ahead after each access; twice that many unread guesses means
    # the trace went wrong (e.g. step 2 replays DeepSpeed's differently ordered first step): drop the oldest
    # swap files (a new run empties the folder): rewritten in place, not replaced (2.4x the write speed here)
    # swap files are discarded by the next run: written unchecked unless swap_checksums (snapshots stay checked)
    store = TensorStore(tiers, dram_cache_bytes=hms.dram_cache_mb * _MB, io=io, durable=False,
                        prefetch_workers=hms.prefetch_workers, max_speculative=max(2, 2 * hms.prefetch_depth),
                        overwrite_in_place=True, checksum=hms.swap_checksums)
    if txn is not None:
        txn.on_undo("close the HMS store (its I/O threads)", store.close)
    return store


def build_param_swapper(hms, ds_config: dict[str, Any], root: str, txn: Any = None) -> HMSParamSwapper:
    """:func:`build_store` and the parameter swapper that streams the partitions through it."""
    store = build_store(hms, root, txn)
    buffer_count = int(ds_config["zero_optimization"]["offload_param"].get("buffer_count", 5))
    # ZeRO-3's read-ahead window in bytes (its default bucket 5e7 elements; 4 bytes an element at most here)
    bucket = ds_config["zero_optimization"].get("stage3_prefetch_bucket_size", 5e7)
    window = int(bucket) * 4 if isinstance(bucket, (int, float)) else 0  # "auto" (HF) not filled in yet: none
    return HMSParamSwapper(store, buffer_count=buffer_count, predictor=make_predictor(hms.prefetch),
                           device_budget_bytes=None if hms.device_budget_mb is None else hms.device_budget_mb * _MB,
                           prefetch_depth=hms.prefetch_depth,
                           write_behind_depth=hms.pipeline_depth if hms.param_write_behind else 0,
                           # TITAN_HMS_PARAM_POOL=0: the parameter side alone off, for an A/B (launch/bench/hms_scale.py)
                           pooled_reads=hms.pooled_reads and os.environ.get("TITAN_HMS_PARAM_POOL", "1") != "0",
                           pool_bytes=window)


def zero_init(ds_config: Any, **init_kwargs: Any):
    """``deepspeed.zero.Init`` for a model too large to exist whole in RAM: use it as the context in which the
    model is built, then pass the same ds_config to :func:`titan_ds.initialize`::

        with titan_ds.zero_init(ds_config):
            model = build_model()            # each module is partitioned (and, with titan.hms, streamed to
        engine, *_ = titan_ds.initialize(    # disk) as soon as it is constructed
            model=model, config=ds_config)

    With a ``titan.hms`` section the parameters go straight to HMS's store, which ``initialize`` then adopts;
    without one this is ``deepspeed.zero.Init(config_dict_or_path=ds_config)``. ``ds_config`` is completed in
    place (ZeRO-3 + NVMe offload and HMS's buffer bounds), as ``initialize`` would, when it is a dict.
    """
    from ..config import TitanConfig, load_ds_config
    init = dsc.zero_init_class()  # DeepSpeed's own, also while titan_ds.install() routes deepspeed.zero.Init here
    ds = ds_config if isinstance(ds_config, dict) else load_ds_config(ds_config)
    titan = TitanConfig.from_ds_config(ds) if "titan" in ds else None
    plain = {k: v for k, v in ds.items() if k != "titan"}
    if titan is None or titan.hms is None:
        return init(config_dict_or_path=plain, **init_kwargs)
    problems = _folders_problems(titan.hms)
    try:
        configure_ds_config(json.loads(json.dumps(plain)), titan.hms.nvme_path, titan.hms.param_tier)
    except TitanConfigError as e:
        problems += e.errors
    if problems:
        raise TitanConfigError(problems)
    root = _prepare(titan.hms, plain)
    for k, v in plain.items():
        ds[k] = v
    if titan.hms.param_tier == "dram":  # parameters in CPU memory: DeepSpeed's own Init (offload_param cpu)
        return init(config_dict_or_path=plain, **init_kwargs)
    _refuse_live_store(root)
    pswap = build_param_swapper(titan.hms, plain, root)
    _LIVE[root] = pswap
    return init(config_dict_or_path=plain, param_swapper=pswap, **init_kwargs)


# nvme_path -> the swapper of the last model built there by zero_init (the model's parameters hold it)
_LIVE: "weakref.WeakValueDictionary[str, HMSParamSwapper]" = weakref.WeakValueDictionary()


def _refuse_live_store(root: str) -> None:
    """A model built under :func:`zero_init` lives in ``<root>/titan_hms``; a second build there would empty that
    folder under the first model (e.g. ``from_pretrained`` twice under the Trainer's ZeRO-3 with titan.hms)."""
    if root in _LIVE:
        gc.collect()  # a model dropped by the caller but still in a reference cycle
    if root in _LIVE:
        raise TitanConfigError([f"titan.hms: a model built under titan_ds.zero_init still keeps its parameters in "
                                f"{root!r}; building another there would delete them. Delete the first model, or "
                                f"give the second one another titan.hms.nvme_path"])


class _DiskGradientBuffer:
    """``titan.hms.gradient_buffer: "disk"``: ZeRO-3's fp32 gradient partitions of this rank
    (``grad_partitions_flat_buffer``, 4 bytes/param) in a shared mapping of a sparse file instead of anonymous
    memory (:func:`titan_ds.deepspeed_compat.z3_gradient_partitions_allocator` has ZeRO-3 call :meth:`alloc`).
    Its pages are page cache: the kernel writes them back and reclaims them under memory pressure (a cgroup cap
    included), where anonymous memory could only be swapped or OOM-killed. The file is unlinked once mapped (the
    space is freed with the mapping). :class:`HMSOptimizerSwapper` reads the gradient pieces of each sub-group
    from this mapping (ZeRO-3 hands it views of it) instead of writing them to the store again."""

    def __init__(self, folder: str):
        self._folder = folder
        self.bytes = 0
        self.mapped = None  # the mapped buffer, once DeepSpeed allocated it

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        os.makedirs(self._folder, exist_ok=True)
        path = os.path.join(self._folder, f"grad_buffer.{os.getpid()}.bin")
        itemsize = torch.empty((), dtype=dtype).element_size()
        with open(path, "wb") as f:
            f.truncate(numel * itemsize)  # sparse: reads as zeros, takes disk only as pages are written back
        t = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        os.unlink(path)
        self.bytes, self.mapped = numel * itemsize, t
        log.info("titan hms: ZeRO-3 gradient partitions (%.1f MiB) in a file mapping under %s", self.bytes / _MB,
                 self._folder)
        return t


def _adopted_swapper(model: torch.nn.Module, param_tier: str = "nvme") -> HMSParamSwapper | None:
    """The HMS swapper of a model built under :func:`zero_init`; None for an ordinary model. Raises for a model
    built under plain ``deepspeed.zero.Init`` (its parameters use DeepSpeed's swapper) or a mix. With
    ``param_tier`` "dram" a model built under ``zero.Init`` whose parameters stream from no swapper is adopted as it is."""
    converted = [p for p in model.parameters() if dsc.is_zero_param(p)]
    if not converted:
        return None
    if param_tier == "dram":
        if any(dsc.param_swapper_of(p) is not None for p in converted):
            raise TitanConfigError(["titan.hms.param_tier is \"dram\" but the model's parameters stream from a "
                                    "disk swapper (built under titan_ds.zero_init with param_tier \"nvme\", or "
                                    "DeepSpeed's NVMe offload): build it with the same ds_config you train with"])
        return None
    swappers = {id(dsc.param_swapper_of(p)): dsc.param_swapper_of(p) for p in converted}
    only = next(iter(swappers.values()))
    if len(swappers) == 1 and isinstance(only, HMSParamSwapper) and len(converted) == len(list(model.parameters())):
        return only
    raise TitanConfigError(["titan.hms: the model was built under deepspeed.zero.Init, so its parameters use "
                            "DeepSpeed's own swapper; build it under titan_ds.zero_init(ds_config) instead (same "
                            "arguments), or build it normally and titan converts it"])


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _convert_model(model: torch.nn.Module, ds_config: dict, pswap: HMSParamSwapper) -> None:
    # ``zero.Init(module=...)`` partitions the parameters in the dtype they have, and DeepSpeed's engine casts the
    # module to bf16/fp16 only when it converts it itself: converted here first, a bf16 run would otherwise
    # train fp32 partitions (measured: the gathered parameters stayed fp32). Cast as the engine would.
    dtype = _DTYPES.get(ds_precision(ds_config))
    if dtype is not None:
        model.to(dtype)
    # dtype=None: Init then takes the dtype from the config; passing one hits the CPU dtype bug (seams 0.5)
    dsc.zero_init_class()(module=model, config_dict_or_path=ds_config, param_swapper=pswap)


class HMSPillar(Pillar):
    """``titan.hms``: see the module docstring."""

    key = "hms"

    decision: Optional[budget.Decision] = None  # the memory check's (validate); apply acts on it

    def validate(self, view: View) -> list[str]:
        out = _folders_problems(self.cfg)
        asked = self.cfg.gradient_store and "gradient_store" in self.cfg.model_fields_set
        if asked and self.cfg.gradient_buffer == "dram" and "gradient_buffer" in self.cfg.model_fields_set:
            out.append('titan.hms.gradient_store writes the gradient mapping of gradient_buffer "disk" to the store; '
                       'with gradient_buffer "dram" there is none: set gradient_buffer to "disk" or remove '
                       'gradient_store')
        if asked and ds_precision(view.ds_config) == "fp16":
            out.append("titan.hms.gradient_store does not run with fp16: ZeRO-3's overflow check reads the whole "
                       "gradient buffer at the step, after its pages went to the store; use bf16, or remove "
                       "gradient_store")
        try:
            _adopted_swapper(view.model, self.cfg.param_tier)
        except TitanConfigError as e:
            out += e.errors
        if not out:
            self.decision = _memory_decision(self.cfg, view)
            if self.decision is not None and not self.decision.fits:
                out.append(self.decision.message)
        return out

    def apply(self, ctx: Any) -> None:
        if self.decision is not None and self.decision.changes:  # only keys the user left unset (budget.decide)
            log.warning("%s", self.decision.message)  # a warning: seen without a logging setup, as it changes the run
            self.cfg = self.cfg.model_copy(update=self.decision.changes)
        elif self.decision is not None:
            log.info("%s", self.decision.message)
        hms, txn = self.cfg, ctx.txn
        root = _prepare(hms, ctx.ds_config, txn)
        if hms.param_tier == "dram":  # the parameters stay in CPU memory: only the optimizer state goes to the store
            pswap, store = None, build_store(hms, root, txn)
            if not any(map(dsc.is_zero_param, ctx.model.parameters())):  # validate() refused a disk-swapped model
                _convert_model(ctx.model, ctx.ds_config, None)
        else:
            pswap = _adopted_swapper(ctx.model)  # built under titan_ds.zero_init: its parameters already live in HMS
            if pswap is None:
                pswap = build_param_swapper(hms, ctx.ds_config, root, txn)
                _convert_model(ctx.model, ctx.ds_config, pswap)
            # parameters later pillars create (TRD cores) stream via HMS
            ctx.zero_init_kwargs["param_swapper"] = pswap
            store = pswap.store
        rank = _rank()
        grad_file = _DiskGradientBuffer(store.tiers[0].path) if hms.gradient_buffer == "disk" else None
        factory = functools.partial(HMSOptimizerSwapper, store=store, rank=rank, grad_file=grad_file,
                                    pipeline_depth=hms.pipeline_depth if hms.pipeline_optimizer else 0,
                                    master_from_partitions=hms.master_from_partitions,
                                    resident_bytes=hms.optimizer_dram_mb * _MB, pooled_reads=hms.pooled_reads,
                                    # off with fp16 (validate refused it where it was asked for)
                                    gradient_store=hms.gradient_store and ds_precision(ctx.ds_config) != "fp16")
        # only for the duration of deepspeed.initialize: attach undoes them
        self.patches = [ctx.patch(p) for p in dsc.route_optimizer_swapper(factory)]
        if grad_file is not None:
            self.patches.append(ctx.patch(dsc.z3_gradient_partitions_allocator(grad_file.alloc)))
        self.runtime = _HMSRuntime(store=store, param_swapper=pswap, rank=rank, grad_file=grad_file)

    def attach(self, ctx: Any) -> None:
        for p in reversed(self.patches):
            p.undo()
        runtime = self.runtime
        runtime.attach(ctx.engine)
        if ctx.titan.compression is None:  # (compression overrides the same seam, and has its own one-rank case)
            ctx.patch(dsc.z3_one_rank_scatter(ctx.engine.optimizer))
        runtime.unscale = ctx.patch(dsc.z3_unscale_and_clip(
            ctx.engine.optimizer, lambda original: fold_unscale(ctx.engine.optimizer, original))).value
        runtime.grad_norm = ctx.patch(dsc.z3_grad_norm(
            ctx.engine.optimizer, lambda original: ScratchNorm(original, dsc.z3_norm_dtype()))).value
        ctx.on_before_step(runtime.before_step)
        ctx.on_after_step(runtime.after_step)
        ctx.on_save(runtime.save)
        ctx.on_load(runtime.load)
        ctx.add_metrics(runtime.metrics)
        ctx.add_state("hms", runtime.state, runtime.load_state)
        ctx.reports["hms"] = runtime


PILLAR = HMSPillar


def _local_ranks(world_size: int) -> int:
    """Processes of this run sharing this machine's memory (the launchers' LOCAL_WORLD_SIZE / LOCAL_SIZE)."""
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(var, "").isdigit():
            return max(1, int(os.environ[var]))
    return max(1, world_size)


def _memory_decision(hms: Any, view: View) -> Optional[budget.Decision]:
    """:func:`budget.decide` for this model and config; None (logged) where it cannot be judged here."""
    if view.titan.trd is not None:  # the estimate would count the dense layers TRD replaces after this check
        log.info("titan hms: memory check skipped: titan.trd changes the parameter count after it")
        return None
    have = budget.read_memory()
    if have is None:
        log.info("titan hms: memory check skipped: neither a cgroup limit nor /proc/meminfo could be read")
        return None
    sizes = [int(p.ds_numel) if dsc.is_zero_param(p) else p.numel() for p in view.model.parameters()]
    from deepspeed.accelerator import get_accelerator
    from ..plan import HEADROOM
    ranks = _local_ranks(view.world_size)
    kw = dict(params=sum(sizes), largest=max(sizes, default=0), titan=view.titan, zero=view.zero(),
              ranks=max(1, view.world_size), half=view.precision() in ("bf16", "fp16"), gpu=get_accelerator().device_name() != "cpu")
    fixed = {k: f"you set titan.hms.{k}; HMS does not override a value you set" for k in budget.KNOBS
             if k in hms.model_fields_set}
    if any(map(dsc.is_zero_param, view.model.parameters())) and hms.param_tier == "nvme":
        fixed["dram_cache_mb"] = ("titan.hms.dram_cache_mb sized the store when titan_ds.zero_init built the model: "
                                  "set it in the ds_config you build the model with")
    return budget.decide(lambda s: budget.estimate(settings=s, **kw) * ranks, budget.settings_of(hms), fixed, have,
                         HEADROOM)


class _HMSRuntime:
    """What HMS keeps after initialize: the store, the swappers, metrics and lifecycle callbacks."""

    def __init__(self, *, store: TensorStore, param_swapper: Optional[HMSParamSwapper], rank: int,
                 grad_file: "_DiskGradientBuffer | None" = None):
        self.store, self.param_swapper, self.rank = store, param_swapper, rank
        self.grad_file = grad_file
        self.grad_norm: Optional[ScratchNorm] = None  # ZeRO-3's gradient norms into one buffer (attach)
        self.unscale: Optional[Callable[..., Any]] = None  # ZeRO-3's unscale, skipped or folded (fold_unscale)
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
        rates = {k: v for k, v in now.items() if k.endswith(("_hit_rate", "_hits", "_misses", "_misses_inflight"))}
        return {"hms": {"hit_rate": now["hit_rate"], **rates, **step,
                        "hits": st.cache_hits + st.prefetch_hits, "misses": st.misses,
                        "staged_writes": st.staged_writes, "prefetch_dropped": st.prefetch_dropped, "reads": st.reads,
                        "disk_bytes": sum(t.used_bytes for t in self.store.tiers) +
                        (self.grad_file.bytes if self.grad_file else 0),
                        "dram_cache_bytes": self.store.cache_bytes,
                        "optimizer_dram_bytes": getattr(getattr(self, "opt_swapper", None), "resident_bytes", 0),
                        # sub-group steps since the start whose unscale pass was skipped (factor 1), folded into
                        # the optimizer's read, or run by ZeRO-3 (fold_unscale)
                        **{f"unscale_{k}": getattr(self.unscale, k, 0) for k in ("skipped", "folded", "called")}}}

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
        if self.grad_file is not None and not self.grad_file.bytes:
            raise RuntimeError("titan hms: gradient_buffer \"disk\" did not find DeepSpeed's gradient buffer "
                               "allocation (stage3._setup_for_real_optimizer); this DeepSpeed version differs from "
                               "0.19.8: set titan.hms.gradient_buffer to \"dram\"")
        self.engine = engine
        self.opt_swapper = dsc.z3_optimizer_swapper(engine.optimizer)
        if not isinstance(self.opt_swapper, HMSOptimizerSwapper):
            raise RuntimeError("titan hms: DeepSpeed did not build the HMS optimizer swapper; is "
                               "zero_optimization.offload_optimizer.device \"nvme\"?")
        # from here on the masters are read into reused buffers; the partitions' writes may read from them
        self.opt_swapper.reuse_master_buffers(self.param_swapper)
        if self.param_swapper is None:  # param_tier "dram": a master whose bits sit in the partitions is not written
            self.opt_swapper.use_partition_masters(dsc.z3_partition_flats(engine.optimizer))
        if self.grad_file is None:  # gradient_buffer "dram": the step reads ZeRO-3's CPU gradient partitions
            buf = dsc.z3_gradient_partitions(engine.optimizer)
            if torch.is_tensor(buf) and buf.device.type == "cpu":
                self.opt_swapper.grad_buffer = buf

    def before_step(self) -> None:
        self._boundary = self.engine.is_gradient_accumulation_boundary()  # before step() advances micro_steps
        if self.grad_norm is not None:
            self.grad_norm.release()  # backward's norms are taken: its buffer is not held through the step

    def after_step(self) -> None:
        self.opt_swapper.flush()  # ZeRO-3's step already flushed (log_timers); a no-op then, raises a failure
        if self.param_swapper is None:  # param_tier "dram"
            return
        self.param_swapper.check()  # a parameter write that failed already (the rest go on into the forward)
        if self._boundary:
            self.param_swapper.end_step()

    def save(self, save_dir: str, tag: str) -> None:
        """After DeepSpeed wrote ``tag``: this rank's optimizer-state snapshot (the engine synchronises after)."""
        self.snapshot_id, self._pending = self._pending or uuid.uuid4().hex[:12], None
        folder = os.path.join(save_dir, tag, "hms", f"rank{self.rank}")
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        if self.param_swapper is not None:  # every updated parameter partition on disk before the checkpoint is complete
            self.param_swapper.flush()
        self.opt_swapper.snapshot(folder, dsc.z3_fp32_masters(self.engine.optimizer))
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
        if self.param_swapper is not None:  # no write of the old values lands after the restored ones
            self.param_swapper.flush()
        self.opt_swapper.restore(folder, dsc.z3_fp32_masters(self.engine.optimizer),
                                 load_optimizer_states=options.get("load_optimizer_states", True))
        dsc.z3_reset_swap_buffers(self.engine.optimizer)  # every parameter partition from its restored fp32 master
        if options.get("load_optimizer_states", True):
            self._restore_optimizer_extra(load_dir, tag)
        with open(os.path.join(folder, "SNAPSHOT_ID")) as f:
            self.snapshot_id = f.read().strip()
        _barrier()


    def _client_optimizer(self) -> Any:
        """The optimizer the user (or titan.optimizer) gave DeepSpeed, inside its ZeRO-3 optimizer."""
        return dsc.zero_client_optimizer(self.engine.optimizer)

    def _restore_optimizer_extra(self, load_dir: str, tag: str) -> None:
        """Under NVMe optimizer offload DeepSpeed writes the client optimizer's ``state_dict()`` into each rank's
        optimizer shard but never loads it back (seams appendix A); the snapshot restored the per-tensor state,
        and this hands the shard's copy to the optimizer's ``load_extra_state`` (ASDT: engine step, TGSS table,
        BSPS state), so that state is saved once, in DeepSpeed's own file."""
        load = getattr(self._client_optimizer(), "load_extra_state", None)
        if load is None:
            return
        path = dsc.zero_checkpoint_file(self.engine, load_dir, tag)
        shard = torch.load(path, map_location="cpu", weights_only=False, mmap=True)  # mmap: only what is read
        load(shard["optimizer_state_dict"]["optimizer_state_dict"])


def fold_unscale(opt: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """ZeRO-3's ``unscale_and_clip_grads`` without its pass over the gradient where it can go. Under HMS that pass
    is the first touch of every gradient page (with ``gradient_buffer: "disk"``, each read back from the file and
    then dirtied; 15 s a step at 5.04B by profile).

    - The factor is exactly 1 (fp32 or bf16 training, no clipping or a norm under the threshold): ``g * (1 / 1.0)``
      is ``g`` bit for bit; nothing runs (``skipped``).
    - Any other factor (an active clip, a loss scale), when the client optimizer takes one (``fold_grad_scale``:
      titan's ASDT) and the factor is on the host: ``1 / combined_scale``, computed as DeepSpeed computes it, is
      handed to the optimizer, which reads the sub-group's gradient times it, bit for bit the step after the pass
      (``folded``; tests/hms/test_gradnorm.py).
    - Otherwise (torch AdamW, DeepSpeedCPUAdam: they read ``p.grad`` as it is) DeepSpeed's own pass (``called``).

    The factor is read on the host only where it is a host float or a CPU tensor (HMS's offloaded fp32
    partitions); a device tensor goes to DeepSpeed's path unread (no sync)."""
    client = dsc.zero_client_optimizer(opt)
    fold = getattr(client, "fold_grad_scale", None)

    def unscale_and_clip_grads(sub_group_id: int, total_norm: Any) -> Any:
        combined = dsc.z3_combined_scale(opt, total_norm)
        on_host = not torch.is_tensor(combined) or (combined.device.type == "cpu" and combined.numel() == 1)
        if on_host and float(combined) == 1.0:
            unscale_and_clip_grads.skipped += 1
            return None
        flat = dsc.z3_fp32_masters(opt)[sub_group_id]
        if fold is not None and on_host and flat.device.type == "cpu" and flat.grad is not None \
                and flat.grad.dtype == torch.float32 and os.environ.get("TITAN_HMS_FOLD_UNSCALE", "1") != "0":
            fold(flat, 1. / combined)  # (DeepSpeed's expression: grad.mul_(1. / combined_scale))
            unscale_and_clip_grads.folded += 1
            return None
        unscale_and_clip_grads.called += 1
        return original(sub_group_id, total_norm)
    unscale_and_clip_grads.skipped = unscale_and_clip_grads.called = 0  # type: ignore[attr-defined]
    unscale_and_clip_grads.folded = 0  # type: ignore[attr-defined]
    return unscale_and_clip_grads


def _barrier() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
