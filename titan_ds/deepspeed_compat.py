"""Every place titan touches DeepSpeed's internals: one module, versioned, each change undoable.

titan plugs into DeepSpeed 0.19.x at seams that are not public API (module globals, instance methods, private
attributes; docs/deepspeed_seams.md says what each does and why, with DeepSpeed's file and line). They all live
here, and nowhere else in the package (``tests/test_deepspeed_compat.py`` greps for the private names):

* **Version.** :func:`check_version` runs when ``titan_ds`` is imported: a DeepSpeed outside
  :data:`SUPPORTED` raises :class:`UnsupportedDeepSpeed` naming the installed version and the range.
* **Changes** are :class:`Patch` objects: named, applied once, undone once (``undo()`` restores exactly what
  was there, checked with ``is``; an attribute that was not on the instance is deleted again). The pillars hand
  them to the transaction of ``titan_ds.initialize`` (:mod:`titan_ds.transaction`), which undoes them if
  initialization fails.
* **Reads** of private state are small functions named after what they return.
* **Canaries.** :data:`SYMBOLS` lists every DeepSpeed symbol titan relies on, with the parameters it expects;
  :data:`INSTANCE_ATTRIBUTES` the private attributes it reads per optimizer class. The canary tests check both
  against the installed DeepSpeed, so an upgrade fails in CI, not in a user's run.

DeepSpeed is imported lazily (``import titan_ds`` stays light); the version check reads the installed
distribution's metadata.
"""
from __future__ import annotations

import contextlib
import importlib
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

__all__ = ["SUPPORTED", "UnsupportedDeepSpeed", "check_version", "Patch", "Symbol", "SYMBOLS", "INSTANCE_ATTRIBUTES",
           "PRIVATE_NAMES", "resolve"]

log = logging.getLogger("titan_ds")

# pyproject.toml pins deepspeed==0.19.8; every seam below was read and measured on it
SUPPORTED = (">=0.19.0", "<0.20.0")


class UnsupportedDeepSpeed(ImportError):
    """The installed DeepSpeed is outside the range titan's seams were written for."""


def _installed_version() -> str:
    from importlib import metadata
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        raise UnsupportedDeepSpeed("titan_ds needs DeepSpeed (supported: deepspeed" + ",".join(SUPPORTED) +
                                   "), and it is not installed: pip install deepspeed==0.19.8") from None


def check_version(installed: Optional[str] = None) -> str:
    """Raise :class:`UnsupportedDeepSpeed` unless ``installed`` (default: the installed DeepSpeed) is in
    :data:`SUPPORTED`; returns the version."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version
    version = installed if installed is not None else _installed_version()
    spec = SpecifierSet(",".join(SUPPORTED))
    try:
        ok = Version(version) in spec
    except InvalidVersion:
        ok = False
    if not ok:
        raise UnsupportedDeepSpeed(
            f"titan_ds supports DeepSpeed {spec} (its seams into ZeRO's internals were written for 0.19.8), but "
            f"DeepSpeed {version} is installed: pip install deepspeed==0.19.8, or a titan_ds release made for "
            f"DeepSpeed {version}")
    return version


# ============================================================================================ patches
_MISSING = object()


class Patch:
    """One named, undoable change: ``owner.attr = value``.

    ``apply()`` remembers what was there (the owner's own attribute, or none: then ``undo()`` deletes the
    attribute so the class's applies again) and ``undo()`` puts it back. ``undo()`` refuses when something else
    replaced ``value`` since (it would throw that change away) and is a no-op when already undone. A patch is
    also a context manager (applied inside the ``with``)."""

    def __init__(self, name: str, owner: Any, attr: str, value: Any):
        self.name, self.owner, self.attr, self.value = name, owner, attr, value
        self.original: Any = _MISSING
        self.active = False

    def __repr__(self) -> str:
        return f"Patch({self.name}, {'applied' if self.active else 'not applied'})"

    def apply(self) -> "Patch":
        if self.active:
            raise RuntimeError(f"titan: {self.name} is already applied")
        own = getattr(self.owner, "__dict__", None)
        if own is None:  # no instance dict (slots): put back what was read
            self.original = getattr(self.owner, self.attr)
        else:  # the owner's own attribute, or none (inherited or absent: undo deletes it again)
            self.original = own.get(self.attr, _MISSING)
        setattr(self.owner, self.attr, self.value)
        self.active = True
        return self

    def undo(self) -> None:
        if not self.active:
            return
        current = getattr(self.owner, self.attr, _MISSING)
        if current is not self.value:
            raise RuntimeError(f"titan: cannot undo {self.name}: {self.attr} was replaced again since (by "
                               f"{getattr(current, '__qualname__', type(current).__name__)}); undo that first")
        if self.original is _MISSING:
            delattr(self.owner, self.attr)
        else:
            setattr(self.owner, self.attr, self.original)
        self.active = False

    def __enter__(self) -> "Patch":
        return self.apply()

    def __exit__(self, *exc: Any) -> None:
        self.undo()


def _module(path: str) -> Any:
    return importlib.import_module(path)


def _stage3() -> Any:
    return _module("deepspeed.runtime.zero.stage3")


# ============================================================================================ canaries
@dataclass(frozen=True)
class Symbol:
    """A DeepSpeed symbol titan relies on: ``module``'s attribute ``path`` (dots for nested), and the parameter
    names it must take (``None``: not a function, only its existence is checked)."""

    what: str
    module: str
    path: str
    params: Optional[tuple[str, ...]] = None


_Z3 = "deepspeed.runtime.zero.stage3"
_Z12 = "deepspeed.runtime.zero.stage_1_and_2"
_ENGINE = "deepspeed.runtime.engine"
_Z3_AVG_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"  # name-mangled private method
_Z3_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"

SYMBOLS: tuple[Symbol, ...] = (
    Symbol("deepspeed.initialize (titan_ds.install routes it)", "deepspeed", "initialize",
           ("args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler", "config")),
    Symbol("ZeRO-3's optimizer swapper class, looked up as a module global", _Z3, "PartitionedOptimizerSwapper"),
    Symbol("ZeRO-3's pipelined optimizer swapper class, a module global", _Z3, "PipelinedOptimizerSwapper"),
    Symbol("ZeRO-3's reduce-scatter of gradients, a module global", _Z3, "reduce_scatter_coalesced",
           ("tensors", "group")),
    Symbol("ZeRO-3 optimizer setup that allocates the gradient partitions", _Z3,
           "DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer", ("self",)),
    Symbol("ZeRO-3 optimizer-state initialization (runs before the gradient partitions are allocated)", _Z3,
           "DeepSpeedZeroOptimizer_Stage3.initialize_optimizer_states", ("self",)),
    Symbol("ZeRO-3's per-bucket gradient average (name-mangled)", _Z3,
           f"DeepSpeedZeroOptimizer_Stage3.{_Z3_AVG_SCATTER}", ("self", "params_to_reduce", "communication_data_type")),
    Symbol("ZeRO-3: the process group a parameter's gradient is partitioned over", _Z3,
           "DeepSpeedZeroOptimizer_Stage3._get_param_partition_group", ("self", "param")),
    Symbol("ZeRO-3: one gradient partition's norm (fp64)", _Z3,
           "DeepSpeedZeroOptimizer_Stage3._constant_buffered_norm2", ("self", "input", "buffer_size")),
    Symbol("ZeRO-3: the dtype gradients are converted to for their norms, a module global", _Z3, "get_norm_dtype",
           ()),
    Symbol("ZeRO-3: unscale and clip one sub-group's fp32 gradient partition in place", _Z3,
           "DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads", ("self", "sub_group_id", "total_norm")),
    Symbol("ZeRO-3: rewrite parameter partitions from the fp32 masters", _Z3,
           "DeepSpeedZeroOptimizer_Stage3.reset_swap_buffers", ("self",)),
    Symbol("ZeRO-0 gradient all-reduce of one bucket", _ENGINE, "DeepSpeedEngine.allreduce_bucket",
           ("self", "bucket", "dp_group", "dp_world_size")),
    Symbol("ZeRO-0 fp32 gradient clipping (clip_grad_norm_ over the module's parameters)", _ENGINE,
           "DeepSpeedEngine.clip_fp32_gradients", ("self",)),
    Symbol("the engine's ZeRO checkpoint file name", _ENGINE, "DeepSpeedEngine._get_zero_ckpt_name",
           ("self", "checkpoints_path", "tag")),
    Symbol("ZeRO-1/2 IPG-buffer average", _Z12, "DeepSpeedZeroOptimizer.average_tensor",
           ("self", "tensor", "communication_data_type")),
    Symbol("ZeRO-1/2 bucket all-reduce", _Z12, "DeepSpeedZeroOptimizer.allreduce_bucket",
           ("self", "bucket", "communication_data_type", "rank", "log", "divide", "process_group")),
    Symbol("ZeRO-1/2 whole-buffer reduction with pre-division", _Z12,
           "DeepSpeedZeroOptimizer.gradient_reduction_w_predivide", ("self", "tensor", "communication_data_type")),
    Symbol("ZeRO-3 parameter check", "deepspeed.runtime.zero.partition_parameters", "is_zero_param", ("parameter",)),
    Symbol("ZeRO-3 parameter used outside its module", "deepspeed.runtime.zero.partition_parameters",
           "register_external_parameter", ("module", "parameter")),
    Symbol("DeepSpeed's zero.Init class (titan_ds.install routes deepspeed.zero.Init; titan_ds.zero_init calls this "
           "one)", "deepspeed.runtime.zero.partition_parameters", "Init",
           ("module", "config_dict_or_path", "config", "enabled", "param_swapper")),
    Symbol("ZeRO-3 parameter status enum (HMS's parameter swapper sets it)",
           "deepspeed.runtime.swap_tensor.partitioned_param_swapper", "PartitionedParamStatus"),
)

# private attributes read from DeepSpeed's optimizer wrappers (checked on a live instance by the canary tests)
INSTANCE_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "DeepSpeedEngine": ("_config", "enable_backward_allreduce", "gradient_average", "basic_optimizer",
                        "data_parallel_group", "seq_data_parallel_group", "dp_world_size"),
    "DeepSpeedZeroOptimizer": ("ipg_buckets", "bit16_groups", "single_partition_of_fp32_groups", "averaged_gradients",
                               "real_dp_process_group", "partition_size", "round_robin_bit16_groups",
                               "round_robin_bit16_offsets", "dp_process_group", "gradient_average"),
    # the collectives the backend binds once, in its constructor (deepspeed/comm/torch.py: TorchBackend.__init__)
    "TorchBackend": ("all_gather_function", "reduce_scatter_function"),
    "DeepSpeedZeroOptimizer_Stage3": ("fp32_partitioned_groups_flat", "fp16_groups",
                                      "fp16_partitioned_groups_flat_numel", "fp16_partitioned_groups_flat",
                                      "sub_group_process_groups",
                                      "dp_process_group", "optimizer_swapper", "grad_partitions_flat_buffer",
                                      "loss_scale", "clip_grad", _Z3_GRAD_PARTITIONS),
}


# every private DeepSpeed name titan touches: outside this module no code names them (the grep test scans the package's
# identifiers after a ".", and string literals; ZeRO-3's parameter attributes ``ds_id``/``ds_numel``/``ds_shape``/
# ``ds_tensor``, which HMS's swappers implement as DeepSpeed's swapper protocol, are that protocol, not listed)
PRIVATE_NAMES: frozenset[str] = frozenset(
    {s.path.rsplit(".", 1)[-1] for s in SYMBOLS if s.module != "deepspeed"} - {"is_zero_param",
                                                                             "register_external_parameter",
                                                                             "PartitionedParamStatus", "Init"}
    | {a for attrs in INSTANCE_ATTRIBUTES.values() for a in attrs} | {"nvme_swapper", "sequence_parallel_size"})


def resolve(symbol: Symbol) -> Any:
    """The live object a :class:`Symbol` names (raises AttributeError/ImportError when it is gone)."""
    obj = _module(symbol.module)
    for part in symbol.path.split("."):
        obj = getattr(obj, part)
    return obj


# ============================================================================================ ZeRO-3 globals
def route_optimizer_swapper(factory: Callable[..., Any]) -> list[Patch]:
    """ZeRO-3 builds its optimizer swapper from the module globals ``PartitionedOptimizerSwapper`` /
    ``PipelinedOptimizerSwapper`` (stage3.py:845): both become ``factory`` (HMS's). Not applied."""
    s3 = _stage3()
    return [Patch("stage3.PartitionedOptimizerSwapper", s3, "PartitionedOptimizerSwapper", factory),
            Patch("stage3.PipelinedOptimizerSwapper", s3, "PipelinedOptimizerSwapper", factory)]


def z3_reduce_scatter(fn: Callable[..., Any]) -> Patch:
    """ZeRO-3 reduces gradients with the module global ``reduce_scatter_coalesced`` (stage3.py:1931). Not
    applied."""
    return Patch("stage3.reduce_scatter_coalesced", _stage3(), "reduce_scatter_coalesced", fn)


def z3_reduce_scatter_original() -> Callable[..., Any]:
    return _stage3().reduce_scatter_coalesced


class _ZerosOnce(torch.overrides.TorchFunctionMode):
    """Once armed, the first ``torch.zeros`` of exactly ``numel`` elements of ``dtype`` on the CPU is answered by
    ``alloc(numel, dtype)``; every other call runs as usual."""

    def __init__(self, numel: int, dtype: torch.dtype, alloc: Callable[[int, torch.dtype], torch.Tensor]):
        super().__init__()
        self.numel, self.dtype, self.alloc = numel, dtype, alloc
        self.armed, self.result = False, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.armed and func is torch.zeros and self.result is None:
            size = args[0] if len(args) == 1 else args
            n = int(size) if isinstance(size, int) else int(torch.Size(size).numel()) if size else 0
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            device = torch.device(kwargs.get("device") or "cpu")
            if n == self.numel and dtype == self.dtype and device.type == "cpu":
                self.result = self.alloc(n, dtype)
                self.armed = False
                return self.result
        return func(*args, **kwargs)


def z3_gradient_partitions_allocator(alloc: Callable[[int, torch.dtype], torch.Tensor]) -> Patch:
    """ZeRO-3 allocates every gradient partition of the rank as one ``torch.zeros`` buffer
    (``grad_partitions_flat_buffer``, stage3.py:791) at the end of ``_setup_for_real_optimizer``, right after
    ``initialize_optimizer_states()``. This patch of ``_setup_for_real_optimizer`` (on the class, not applied)
    has ``alloc(numel, dtype)`` allocate it instead: after ``initialize_optimizer_states`` returns, the first
    ``torch.zeros`` of exactly that many elements of the accumulation dtype is ``alloc``'s tensor. It checks
    afterwards that the buffer DeepSpeed kept is that tensor, and raises otherwise (a DeepSpeed that allocates
    it differently)."""
    cls = _stage3().DeepSpeedZeroOptimizer_Stage3
    original = cls.__dict__["_setup_for_real_optimizer"]

    def _setup_for_real_optimizer(self):
        numel = sum(int(p.partition_numel()) for p in itertools.chain.from_iterable(self.fp16_groups))
        mode = _ZerosOnce(numel, self.gradient_accumulation_dtype, alloc)
        init_states = self.initialize_optimizer_states

        def initialize_optimizer_states(*a: Any, **kw: Any):
            out = init_states(*a, **kw)
            mode.armed = True
            return out

        with Patch("ZeRO-3 initialize_optimizer_states (arms the allocator)", self, "initialize_optimizer_states",
                   initialize_optimizer_states), mode:
            original(self)
        if mode.result is None or self.grad_partitions_flat_buffer.data_ptr() != mode.result.data_ptr():
            raise RuntimeError("titan: DeepSpeed's ZeRO-3 did not allocate its gradient partitions where titan "
                               "expected (DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer changed); set "
                               "titan.hms.gradient_buffer to \"dram\"")

    return Patch("DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer (gradient partitions allocator)", cls,
                 "_setup_for_real_optimizer", _setup_for_real_optimizer)


# ============================================================================================ instance seams
def override(obj: Any, name: str, fn: Any, what: str = "") -> Patch:
    """``obj.name = fn`` on the instance (not applied); refuses an attribute already overridden there."""
    if name in vars(obj):
        raise RuntimeError(f"{type(obj).__name__}.{name} is already overridden on this instance (titan installed "
                           f"twice?)")
    return Patch(what or f"{type(obj).__name__}.{name}", obj, name, fn)


def backend_bound_collectives(wrapper_of: Callable[[Any], Optional[Callable[..., Any]]]) -> list[Patch]:
    """Patches (not applied) that replace the ``torch.distributed`` functions DeepSpeed's running backend bound at
    start-up (``cdb.all_gather_function``, ``cdb.reduce_scatter_function``: ZeRO's parameter all-gathers and
    gradient reduce-scatters go through them, not through ``torch.distributed``'s names) by ``wrapper_of(fn)``;
    none where no backend runs yet, where it bound nothing, or where ``wrapper_of`` gives None."""
    cdb = getattr(_module("deepspeed.comm.comm"), "cdb", None)
    out = []
    for attr in INSTANCE_ATTRIBUTES["TorchBackend"]:
        fn = getattr(cdb, attr, None) if cdb is not None else None
        wrapper = wrapper_of(fn) if fn is not None else None
        if wrapper is not None:
            out.append(Patch(f"TorchBackend.{attr} (counted)", cdb, attr, wrapper))
    return out


def z0_allreduce_bucket(engine: Any, fn: Callable[..., Any]) -> Patch:
    """ZeRO-0: the engine all-reduces gradient buckets in ``allreduce_bucket`` (engine.py:3795)."""
    return override(engine, "allreduce_bucket", fn)


def z0_fp32_clip(engine: Any, fn: Callable[[], Any]) -> Patch:
    """ZeRO-0 without fp16/bf16: ``engine.clip_fp32_gradients`` (engine.py:3502), which ``_take_model_step`` calls
    before the optimizer step when ``gradient_clipping`` > 0."""
    return override(engine, "clip_fp32_gradients", fn)


def z12_reduce_seams(opt: Any, average_tensor: Callable[[Callable[..., Any]], Callable[..., Any]],
                     allreduce_bucket: Callable[..., Any], predivide: Callable[..., Any]) -> list[Patch]:
    """ZeRO-1/2: ``average_tensor`` (wrapped: ``average_tensor(original)``), ``allreduce_bucket`` and
    ``gradient_reduction_w_predivide`` of the optimizer wrapper (stage_1_and_2.py:1590, 2359, 1485)."""
    return [override(opt, "average_tensor", average_tensor(opt.average_tensor)),
            override(opt, "allreduce_bucket", allreduce_bucket),
            override(opt, "gradient_reduction_w_predivide", predivide)]


def z3_avg_scatter(opt: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Patch:
    """ZeRO-3: the name-mangled ``__avg_scatter_grads`` of this optimizer (stage3.py:1912), wrapped."""
    return override(opt, _Z3_AVG_SCATTER, wrap(getattr(opt, _Z3_AVG_SCATTER)), "DeepSpeedZeroOptimizer_Stage3.__avg_"
                    "scatter_grads")


def one_rank_reduce_scatter(tensors: Sequence[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
    """``reduce_scatter_coalesced`` (coalesced_collectives.py:81) over a group of one rank: each tensor's flat view.
    DeepSpeed's copies every tensor into one flat buffer, divides it by the world size (1: exact) and runs the
    collective, whose result over one rank is its input; so its outputs hold the same values as these views.
    (On this CPU the copies took ~5.7 s of a 67 s HMS step at 907M parameters: results/hms_profile.)"""
    return [t.view(-1) for t in tensors]


def z3_one_rank_scatter(opt: Any) -> Patch:
    """ZeRO-3 whose gradient partition group has one rank: this optimizer's ``__avg_scatter_grads``
    (stage3.py:1912) runs with :func:`one_rank_reduce_scatter` as ``stage3.reduce_scatter_coalesced`` for the
    length of each call (undone after it, so nothing else sees it); with more ranks it runs unchanged. The
    partitions it returns are views of the gradients, which ``partition_grads`` only reads (copies into its
    buffer) before it drops them. Not applied."""
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def avg_scatter_grads(params_to_reduce: Any, communication_data_type: Any) -> Any:
            group = opt._get_param_partition_group(params_to_reduce[0])
            if torch.distributed.get_world_size(group=group) != 1:
                return original(params_to_reduce, communication_data_type)
            with z3_reduce_scatter(one_rank_reduce_scatter):
                return original(params_to_reduce, communication_data_type)
        return avg_scatter_grads
    return z3_avg_scatter(opt, wrap)


def z3_grad_norm(opt: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Patch:
    """ZeRO-3's norm of one gradient partition, ``_constant_buffered_norm2(input, buffer_size)`` (stage3.py:1960:
    the partition converted to ``get_norm_dtype()``, fp64 here, its 2-norm), wrapped on this instance. Not
    applied."""
    return override(opt, "_constant_buffered_norm2", wrap(opt._constant_buffered_norm2))


def z3_unscale_and_clip(opt: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Patch:
    """ZeRO-3's ``unscale_and_clip_grads(sub_group_id, total_norm)`` (stage3.py:2979: ``combined_scale`` =
    ``loss_scale``, times ``clamp((total_norm / loss_scale + 1e-6) / clip_grad, min=1)`` when ``clip_grad > 0``;
    then the sub-group's fp32 gradient ``mul_(1 / combined_scale)``), wrapped on this instance. Not applied."""
    return override(opt, "unscale_and_clip_grads", wrap(opt.unscale_and_clip_grads))


def z3_combined_scale(opt: Any, total_norm: Any) -> Any:
    """The factor ZeRO-3's ``unscale_and_clip_grads`` divides a sub-group's gradient by (the same expression, its
    ``loss_scale`` and ``clip_grad``): a float, or a tensor where the norm is one."""
    combined = opt.loss_scale
    if opt.clip_grad > 0.:
        combined = torch.clamp(((total_norm / opt.loss_scale) + 1e-6) / opt.clip_grad, min=1.0) * opt.loss_scale
    return combined


def z3_norm_dtype() -> torch.dtype:
    """The dtype ZeRO-3 converts gradients to for their norms (``get_norm_dtype``, as stage3.py imports it)."""
    return _stage3().get_norm_dtype()


def engine_gradient_clipping(engine: Any, value: float) -> Patch:
    """The engine's ``gradient_clipping`` (read from ``engine._config`` by ``_take_model_step``)."""
    return Patch("engine._config.gradient_clipping", engine._config, "gradient_clipping", value)


def backward_allreduce(engine: Any, enabled: bool) -> Patch:
    """``engine.enable_backward_allreduce`` (engine.py:548): whether backward's epilogue all-reduces ``.grad``."""
    return Patch("engine.enable_backward_allreduce", engine, "enable_backward_allreduce", enabled)


# ============================================================================================ private reads
def engine_basic_optimizer(engine: Any, default: Any = None) -> Any:
    """The client optimizer inside a DeepSpeed engine (``default`` for anything that is not an engine)."""
    return getattr(engine, "basic_optimizer", default)


def zero_fp32_masters(opt: Any) -> list[torch.Tensor]:
    """The fp32 master partitions of a ZeRO-1/2 or ZeRO-3 optimizer wrapper ([] for anything else)."""
    return list(getattr(opt, "single_partition_of_fp32_groups", None) or
                getattr(opt, "fp32_partitioned_groups_flat", None) or [])


def zero12_reduced_gradients(opt: Any) -> list[torch.Tensor]:
    """ZeRO-1/2's reduced gradient partitions (``averaged_gradients``, by group; [] otherwise)."""
    averaged = getattr(opt, "averaged_gradients", None)
    return [x for g in (averaged.values() if isinstance(averaged, dict) else []) for x in (g or [])
            if isinstance(x, torch.Tensor)]


def data_parallel_group(engine: Any) -> Any:
    return getattr(engine, "data_parallel_group", None)


def seq_data_parallel_group(engine: Any) -> Any:
    return getattr(engine, "seq_data_parallel_group", None)


def dp_world_size(engine: Any) -> int:
    return int(getattr(engine, "dp_world_size", 1))


def gradient_average(obj: Any) -> bool:
    """Whether the engine (ZeRO-0) or ZeRO-1/2 optimizer averages (not sums) the reduced gradients."""
    return bool(obj.gradient_average)


def zero_dp_group(opt: Any) -> Any:
    """The data-parallel process group of a ZeRO optimizer wrapper."""
    return getattr(opt, "dp_process_group", None)


def sequence_parallel_size(opt: Any) -> float:
    return float(getattr(opt, "sequence_parallel_size", 1))


def ipg_bucket_params(opt: Any, dtype: torch.dtype) -> list[Any]:
    """ZeRO-1/2: the parameters in the IPG bucket of ``dtype``, in buffer order (``bucket.params`` holds
    (group, index, _) into ``bit16_groups``, the order DeepSpeed itself relies on)."""
    bucket = opt.ipg_buckets[dtype]
    return [opt.bit16_groups[g][i] for g, i, _ in bucket.params]


@dataclass
class FlatPartition:
    """One flat fp32 partition of a ZeRO optimizer and what it holds: ``params`` in order, each beginning at
    ``offsets[i]`` of the group's flat (ZeRO-1/2, with ``rank_numel`` elements a rank) or partitioned per
    parameter (ZeRO-3: ``offsets`` is None, each parameter has ``partition_numel()`` elements here)."""

    flat: torch.Tensor
    group: Any
    params: list[Any]
    offsets: Optional[list[int]]
    rank_numel: Optional[int]  # ZeRO-1/2: elements of the flat a rank owns
    numel: int  # the flat's size (ZeRO-3 with NVMe offload swaps the tensor out: 0 elements until its step)


def zero_partitions(opt: Any) -> Optional[list[FlatPartition]]:
    """The flat partitions of a ZeRO-1/2/3 optimizer wrapper (None for anything else)."""
    if hasattr(opt, "fp32_partitioned_groups_flat"):
        return [FlatPartition(flat, opt.sub_group_process_groups[s], list(opt.fp16_groups[s]), None, None,
                              flat.numel() or int(opt.fp16_partitioned_groups_flat_numel[s]))
                for s, flat in enumerate(opt.fp32_partitioned_groups_flat)]
    if hasattr(opt, "single_partition_of_fp32_groups"):
        return [FlatPartition(flat, opt.real_dp_process_group[i], list(opt.round_robin_bit16_groups[i]),
                              list(opt.round_robin_bit16_offsets[i]), int(opt.partition_size[i]), flat.numel())
                for i, flat in enumerate(opt.single_partition_of_fp32_groups)]
    return None


def z3_fp32_masters(opt: Any) -> list[torch.Tensor]:
    """ZeRO-3's flat fp32 master partitions, one per sub-group."""
    return opt.fp32_partitioned_groups_flat


def z3_partition_flats(opt: Any) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """ZeRO-3's (flat fp32 master, flat parameter partitions) of each sub-group; the second is None where the
    partitions are swapped (parameters on NVMe). After each sub-group's optimizer step ZeRO-3 copies the master
    into the partitions (``_reassign_or_swap_out_partitioned_parameters``, stage3.py:2854)."""
    return list(zip(opt.fp32_partitioned_groups_flat, opt.fp16_partitioned_groups_flat))


def z3_optimizer_swapper(opt: Any) -> Any:
    return getattr(opt, "optimizer_swapper", None)


def z3_reset_swap_buffers(opt: Any) -> None:
    """Rewrite every parameter partition from its (restored) fp32 master (stage3.py:3837)."""
    opt.reset_swap_buffers()


def z3_gradient_partitions(opt: Any) -> torch.Tensor:
    return opt.grad_partitions_flat_buffer


def zero_client_optimizer(opt: Any) -> Any:
    """The optimizer the user (or titan) gave DeepSpeed, inside its ZeRO wrapper."""
    return getattr(opt, "optimizer", None)


def zero_checkpoint_file(engine: Any, load_dir: str, tag: str) -> str:
    """This rank's ZeRO optimizer-state file of ``tag`` (engine.py:4331)."""
    return engine._get_zero_ckpt_name(load_dir, tag)


def is_zero_param(p: Any) -> bool:
    """Whether ``p`` was converted by ZeRO-3 (``deepspeed.zero.Init``)."""
    from deepspeed.runtime.zero.partition_parameters import is_zero_param as _is
    return bool(_is(p))


def param_swapper_of(p: Any) -> Any:
    """The swapper a ZeRO-3 parameter streams through (``param.nvme_swapper``; None without NVMe offload)."""
    return getattr(p, "nvme_swapper", None)


def zero_init_class() -> type:
    """DeepSpeed's own ``zero.Init`` class (``partition_parameters.Init``), also while :func:`route_zero_init`
    has replaced the public name ``deepspeed.zero.Init``."""
    return _module("deepspeed.runtime.zero.partition_parameters").Init


class _RoutedInitType(type):
    """The type of the class :func:`route_zero_init` puts in ``deepspeed.zero.Init``'s place: calling it calls the
    route; ``isinstance``/``issubclass`` and every other attribute answer as DeepSpeed's class would."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls.route(cls.original, *args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls.original)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls.original)

    def __getattr__(cls, name: str) -> Any:
        return getattr(cls.original, name)


def route_zero_init(route: Callable[..., Any]) -> Patch:
    """``deepspeed.zero.Init(...)`` (the attribute ``Init`` of ``deepspeed.runtime.zero``, which transformers looks
    up when it builds a model under ZeRO-3: ``modeling_utils.py`` ``get_init_context`` / ``_from_config``) calls
    ``route(original_class, *args, **kwargs)`` instead. The replacement is a class whose instance and subclass
    checks are the original's; DeepSpeed's own code uses ``partition_parameters.Init`` and is not affected. Not
    applied."""
    zero, original = _module("deepspeed.runtime.zero"), zero_init_class()
    routed = _RoutedInitType("Init", (), {"original": original, "route": staticmethod(route),
                                          "__doc__": f"deepspeed.zero.Init routed by titan_ds.install()\n\n"
                                                     f"{original.__doc__ or ''}",
                                          "__module__": __name__})
    return Patch("deepspeed.zero.Init (titan_ds.install)", zero, "Init", routed)


def register_external_parameter(module: Any, p: Any) -> None:
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter as _reg
    _reg(module, p)


@contextlib.contextmanager
def applied(patches: Sequence[Patch]) -> Iterator[None]:
    """Apply ``patches`` in order for the ``with`` body; undo them in reverse order after."""
    done: list[Patch] = []
    try:
        for p in patches:
            done.append(p.apply())
        yield
    finally:
        for p in reversed(done):
            p.undo()


def unwrap(fn: Any) -> Any:
    """The function under decorators, also those that keep no ``__wrapped__`` (DeepSpeed's ``instrument_w_nvtx``,
    ``torch.no_grad``): a ``(*args, **kwargs)`` wrapper is followed into the function its closure holds."""
    import inspect
    fn = inspect.unwrap(fn)
    try:
        kinds = [p.kind for p in inspect.signature(fn).parameters.values()]
    except (TypeError, ValueError):
        return fn
    if kinds == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
        for cell in getattr(fn, "__closure__", None) or ():
            if inspect.isfunction(cell.cell_contents):
                return unwrap(cell.cell_contents)
    return fn


def _definition(obj: Any) -> str:
    import inspect
    fn = unwrap(obj)
    try:
        path, line = inspect.getsourcefile(fn), inspect.getsourcelines(fn)[1]
    except (TypeError, OSError):
        return "(not Python source)"
    root = path[path.rfind("/deepspeed/") + 1:] if "/deepspeed/" in path else path
    return f"{root}:{line}"


def seam_table() -> str:
    """The canary list as a markdown table with where each symbol is defined in the installed DeepSpeed
    (docs/deepspeed_seams.md holds it; ``python -m titan_ds.deepspeed_compat`` prints it)."""
    rows = ["| symbol | what titan uses it for | defined at (DeepSpeed " + _installed_version() + ") |",
            "|---|---|---|"]
    for s in SYMBOLS:
        rows.append(f"| `{s.module}.{s.path}` | {s.what} | `{_definition(resolve(s))}` |")
    rows += ["", "| DeepSpeed class | private attributes titan reads (checked on a live instance) |", "|---|---|"]
    rows += [f"| `{cls}` | {', '.join(f'`{a}`' for a in attrs)} |" for cls, attrs in INSTANCE_ATTRIBUTES.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(seam_table())
