"""StepMetrics and memory accounting.

Memory is *accounted*: the bytes of the tensors DeepSpeed and the optimizer hold, by category, found by walking
them (deduplicated by storage), plus the saved-for-backward activations seen by ``saved_tensors_hooks`` (the
peak alive at once over forward and backward, so a block recomputed inside backward counts), plus the process's peak RSS. On a CUDA device ``torch.cuda.max_memory_allocated`` is reported too.
"""
from __future__ import annotations

import contextlib
import resource
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator, Optional, Union

import torch

from . import deepspeed_compat as dsc

__all__ = ["StepMetrics", "MemoryBreakdown", "accounted_memory", "ActivationCounter", "peak_rss_bytes",
           "optimizer_state_bytes", "host_values"]


def host_values(obj: Any) -> Any:
    """``obj`` with every tensor inside it (nested dicts, lists, tuples) read to the host: a 0-dim tensor to a
    Python number, any other to a list. On a GPU each read waits for the device (a host sync): the per-step
    metrics and the loss stay device tensors and are read here, when they are logged, not in the step."""
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.dim() == 0 else obj.tolist()
    if isinstance(obj, dict):
        return {k: host_values(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_values(v) for v in obj)
    return obj


@dataclass
class MemoryBreakdown:
    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    compression_state: int = 0  # gradient compression's error-feedback residuals (and, mid-step, their journal)
    peak_rss: int = 0
    device_max_allocated: Optional[int] = None  # torch.cuda.max_memory_allocated on a GPU, else None

    @property
    def training_state(self) -> int:
        """Parameters + gradients + optimizer state + activations + compression residuals: what the seed calls
        'active overhead'."""
        return self.parameters + self.gradients + self.optimizer_state + self.activations + self.compression_state

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["training_state"] = self.training_state
        return d


@dataclass
class StepMetrics:
    """What ``trainer.step`` returns next to the loss. A pillar that is off reports its neutral value: the
    compression ratios are 1.0 (nothing compressed) and ``*_on`` flags say whether the figure is real.

    ``loss`` and the per-step counters a pillar keeps on the device (``extra["asdt_changed_elements"]``) are
    0-dim device tensors, not read in the step; :meth:`to_dict` reads them (a host sync on a GPU: call it on the
    steps you log), as do ``float(m.loss)`` and ``f"{m.loss:.4f}"``."""

    step: int = 0
    loss: Union[float, torch.Tensor] = float("nan")
    tokens_per_s: float = 0.0
    trd_compression_ratio: float = 1.0
    trd_model_compression_ratio: float = 1.0
    # gradient bytes an uncompressed all-reduce would hand to collectives / bytes the compressor handed over:
    # this step's (the steady state once warm-up is over) and the whole run's, warm-up steps included
    wire_compression_ratio: float = 1.0
    wire_compression_ratio_run: float = 1.0
    wire_bytes: Optional[int] = None
    dense_grad_bytes: Optional[int] = None
    plasticity: Optional[dict[str, int]] = None
    hms: Optional[dict[str, Any]] = None
    skipped_step: bool = False
    trd_on: bool = False
    compression_on: bool = False
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hge_compression_ratio(self) -> float:
        """The seed's name (Quick Start) for :attr:`wire_compression_ratio`, which holds for every method."""
        return self.wire_compression_ratio

    @hge_compression_ratio.setter
    def hge_compression_ratio(self, value: float) -> None:
        self.wire_compression_ratio = value

    def update(self, values: dict[str, Any]) -> None:
        """Set known fields from a pillar's metric source; unknown keys go to ``extra``."""
        for k, v in values.items():
            if k == "hge_compression_ratio":
                self.wire_compression_ratio = v
            elif k in self.__dataclass_fields__ and k not in ("memory", "extra"):
                setattr(self, k, v)
            else:
                self.extra[k] = v
        if "trd_compression_ratio" in values:
            self.trd_on = True
        if "wire_compression_ratio" in values or "hge_compression_ratio" in values:
            self.compression_on = True

    def to_dict(self) -> dict[str, Any]:
        """Every field as Python values (device tensors read here: the one host sync of a logged step)."""
        d = asdict(self)
        d["memory"] = self.memory.to_dict()
        d["hge_compression_ratio"] = self.wire_compression_ratio  # the seed's alias
        return host_values(d)


def peak_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _key(t: torch.Tensor) -> tuple[int, int]:
    return (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else (id(t), 0)


def _leaves(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors that hold ``t``'s bytes. A tensor subclass that wraps others (torchao's 8-bit and 4-bit
    optimizer states: ``codes``, ``scale``, ``qmap``) reports the logical shape and dtype (fp32) and has no
    storage of its own: its bytes are those of its inner tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            yield from _leaves(getattr(t, name))
    else:
        yield t


def _sum_unique(tensors: Iterable[torch.Tensor], seen: set) -> int:
    total = 0
    for outer in tensors:
        if outer is None or not isinstance(outer, torch.Tensor):
            continue
        for t in _leaves(outer):
            if t.numel() == 0:
                continue
            k = _key(t)
            if k in seen:
                continue
            seen.add(k)
            total += _nbytes(t)
    return total


def _state_tensors(optimizer: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for s in getattr(optimizer, "state", {}).values():
        for v in (s.values() if isinstance(s, dict) else []):
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors in ``optimizer.state`` (every buffer and step counter, measured from the tensors,
    deduplicated by storage; wrapper subclasses such as torchao's quantized states by their inner tensors).

    ``optimizer`` is a torch optimizer or a DeepSpeed engine (its ``basic_optimizer``: the client optimizer,
    which under ZeRO holds the state of this rank's partition only). ZeRO's fp32 master copies are not
    optimizer state here (:func:`accounted_memory` counts them under ``optimizer_state``)."""
    optimizer = dsc.engine_basic_optimizer(optimizer, optimizer)
    return _sum_unique(_state_tensors(optimizer), set())


def _module_params(engine: Any) -> list[torch.Tensor]:
    module = getattr(engine, "module", engine)
    out = []
    for p in module.parameters():
        ds = getattr(p, "ds_tensor", None)  # ZeRO-3: this rank holds only its partition
        out.append(ds if ds is not None else p)
    return out


def _optimizer_tensors(engine: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(master weights, their grads, state tensors) held by the optimizer (ZeRO wrapper + client optimizer)."""
    opt = getattr(engine, "optimizer", None)
    basic = dsc.engine_basic_optimizer(engine, opt)
    masters, grads, state = [], [], []
    for t in dsc.zero_fp32_masters(opt):  # ZeRO-1/2, ZeRO-3 masters
        masters.append(t)
        if getattr(t, "grad", None) is not None:
            grads.append(t.grad)
    grads.extend(dsc.zero12_reduced_gradients(opt))  # ZeRO-1/2: reduced grad partitions by group
    if basic is not None and hasattr(basic, "state"):
        state = _state_tensors(basic)
    return masters, grads, state


def _backward_step_grads(engine: Any) -> int:
    """ASDT's step in backward frees each gradient in its hook, so none is left in ``.grad`` when this runs;
    count the largest one held at once during the backward instead (titan_ds.optim.asdt)."""
    opt = dsc.engine_basic_optimizer(engine) or getattr(engine, "optimizer", None)
    return opt.held_grad_bytes() if hasattr(opt, "held_grad_bytes") else 0


def _compression_bytes(engine: Any) -> int:
    hooks = getattr(getattr(engine, "titan", None), "reports", {}).get("compression")
    reducer = getattr(hooks, "reducer", None)
    return reducer.residuals.nbytes() if reducer is not None else 0


def accounted_memory(engine: Any, activations: int = 0) -> MemoryBreakdown:
    """Bytes by category of what ``engine`` (a DeepSpeed engine or a plain module) holds right now.

    Parameters are the module's (ZeRO-3: this rank's partitions). Gradients are the module's ``.grad`` plus the
    ZeRO partitions' gradients (with ASDT's step in backward: the largest gradient held at once). Optimizer state includes ZeRO's fp32 master partitions when they are separate
    copies of the parameters (deduplicated by storage, so nothing is counted twice).
    """
    seen: set = set()
    params = _module_params(engine)
    p_bytes = _sum_unique(params, seen)
    module = getattr(engine, "module", engine)
    masters, opt_grads, state = _optimizer_tensors(engine)
    g_bytes = _sum_unique([p.grad for p in module.parameters()] + opt_grads, seen) + _backward_step_grads(engine)
    o_bytes = _sum_unique(masters + state, seen)
    mem = MemoryBreakdown(parameters=p_bytes, gradients=g_bytes, optimizer_state=o_bytes, activations=activations,
                          compression_state=_compression_bytes(engine), peak_rss=peak_rss_bytes())
    if torch.cuda.is_available():
        mem.device_max_allocated = int(torch.cuda.max_memory_allocated())
    return mem


class ActivationCounter:
    """The activation memory of a training step: wrap its forward AND backward in :meth:`track`; ``bytes`` is
    the peak over the block of the saved-for-backward storages alive at once (distinct storages; the module's
    parameters are excluded: they are counted under 'parameters'). With ``titan.mlme.recompute_blocks`` a
    recomputed block's internals are saved again inside backward, beside the block inputs still waiting: that
    peak can exceed what forward saved, and it is what this counts. Inside the block ``bytes`` is the peak so
    far (an optimizer hook inside ``engine.step`` may read it). A thin wrapper of
    :class:`titan_ds.kernels.saved.SavedTensorMeter`."""

    def __init__(self, module: Optional[torch.nn.Module] = None):
        self.module = module
        self._bytes = 0
        self._meter = None

    @property
    def bytes(self) -> int:
        return self._meter.peak if self._meter is not None else self._bytes

    @contextlib.contextmanager
    def track(self) -> Iterator["ActivationCounter"]:
        from .kernels.saved import SavedTensorMeter
        params = [p for p in self.module.parameters() if p.numel()] if self.module is not None else []
        self._bytes = 0
        with SavedTensorMeter(exclude=params) as meter:
            self._meter = meter
            try:
                yield self
            finally:
                self._meter = None
                self._bytes = meter.peak
