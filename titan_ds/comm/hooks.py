"""Install a gradient compressor on one DeepSpeed engine's reduce path (the ``compression`` pillar).

Seams (deepspeed_seams.md 3.1/3.3; each measured to carry all gradient bytes of its stage):

* ZeRO-0: ``engine.allreduce_bucket(bucket, dp_group, dp_world_size)``; bucket elements are ``param.grad``.
* ZeRO-1/2: ``optimizer.allreduce_bucket(bucket, dtype, rank, log, divide, process_group)`` (reduce-scatter
  path, slices of the IPG buffer) and ``optimizer.gradient_reduction_w_predivide(tensor, dtype)`` (the whole
  IPG buffer). ``optimizer.average_tensor`` is wrapped only to record which parameter sits at which offset of
  the IPG buffer (``bucket.params`` order, as DeepSpeed itself assumes), so residuals are keyed by parameter.
* ZeRO-3: the module global ``stage3.reduce_scatter_coalesced`` is replaced by a dispatcher (installed once,
  reference-counted, restored when the last engine uninstalls) that compresses only while **this**
  optimizer's ``__avg_scatter_grads`` is on the stack (a thread-local set by an instance-level wrapper); any
  other caller gets DeepSpeed's function unchanged.

Everything else is instance attributes on the engine's optimizer (or, ZeRO-0, the engine's ``allreduce_bucket``):
``uninstall()`` deletes them and the class methods apply again. Every one of these changes is a
:class:`~titan_ds.deepspeed_compat.Patch` of the seam module. Around ``engine.step`` the hooks register
lifecycle callbacks on the init context (:mod:`titan_ds.lifecycle`), which ``uninstall()`` removes; if
``initialize`` fails after the install, its transaction uninstalls (the ZeRO-3 global included).

The pillar (:class:`CompressionPillar`) has no ``validate`` of its own: its rules (world size, ZeRO options,
``precondition``) read the ds_config and are in :mod:`titan_ds.rules`.

A ``dist.reduce`` to one owner (``rank=dst``) is done as a compressed all-reduce: the same bytes per rank are
handed over, and every rank keeps its residual consistent.
"""
from __future__ import annotations

import logging
import math
import threading
from typing import Any, Callable, Optional

import torch

from .. import deepspeed_compat as dsc
from ..pillar import Pillar
from ..replace_optimizer import built_optimizer, replace_ds_optimizer_section, replace_passed_optimizer
from .base import Segment, workspace_zeros
from .compressor import GradientReducer
from .dgc import DGCOptions
from .precondition import RMSOptions
from .registry import REGISTRY
from .wire import DistCollective

__all__ = ["CompressionPillar", "PILLAR", "CompressionHooks", "DistCollective", "rms_options"]

log = logging.getLogger("titan_ds.comm")

_REPORT_KEY = "compression"


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A bucket's gradients, concatenated into a fresh buffer (``_flatten_dense_tensors``'s values; never a view,
    also for a one-tensor bucket, where DeepSpeed's flatten returns the gradient itself), which the reducer then
    works in and keeps as the residual (``consume``). On the host it is a buffer of its own mapping
    (:func:`~titan_ds.comm.base.workspace_zeros`): kept past the step, a heap buffer would keep the heap's pages
    around it (measured: docs/compress.md)."""
    if not tensors:
        raise RuntimeError("titan compression: an empty gradient bucket reached the reduce seam")
    out = workspace_zeros(sum(t.numel() for t in tensors), tensors[0].device, tensors[0].dtype)
    return torch.cat([t.detach().reshape(-1) for t in tensors], out=out)


# ------------------------------------------------------------------------------- ZeRO-3 dispatcher
_Z3 = threading.local()
_Z3_INSTALLS: dict[str, Any] = {"count": 0, "patch": None}


def _z3_dispatch(tensors, group=None):
    hooks = getattr(_Z3, "active", None)
    if hooks is None:
        return _Z3_INSTALLS["patch"].original(tensors, group)
    return hooks._reduce_scatter(tensors, group)


def _z3_acquire() -> None:
    if _Z3_INSTALLS["count"] == 0:
        _Z3_INSTALLS["patch"] = dsc.z3_reduce_scatter(_z3_dispatch).apply()
    _Z3_INSTALLS["count"] += 1


def _z3_release() -> None:
    _Z3_INSTALLS["count"] -= 1
    if _Z3_INSTALLS["count"] == 0:
        _Z3_INSTALLS["patch"].undo()
        _Z3_INSTALLS["patch"] = None


# ------------------------------------------------------------------------------- the hooks
class CompressionHooks:
    """The reducer installed on one engine; ``install()``/``uninstall()``; residual state for checkpoints."""

    def __init__(self, engine: Any, reducer: GradientReducer, stage: int):
        self.engine, self.reducer, self.stage = engine, reducer, stage
        self.names = {id(p): n for n, p in engine.module.named_parameters()}
        self._ipg: Optional[tuple[int, int, int, list[Segment]]] = None  # (base ptr, elsize, numel, segments)
        self._z3_params: Optional[list[Any]] = None
        self._installed: list[dsc.Patch] = []
        self._removers: list[Callable[[], None]] = []  # the lifecycle callbacks' removers
        self._z3_held = False
        self._steps_before = 0
        self.seam_calls: dict[str, int] = {}

    def __repr__(self) -> str:
        r = self.reducer
        return (f"CompressionHooks(method={r.method!r}, ratio={r.ratio}, stage={self.stage}, "
                f"error_feedback={r.error_feedback}, warmup_steps={r.warmup_steps}, "
                f"precondition={r.precondition}, seam_calls={self.seam_calls})")

    # ---------------------------------------------------------------- install / uninstall
    def _set(self, patch: dsc.Patch) -> None:
        self._installed.append(patch.apply())

    def install(self, ctx: Any) -> "CompressionHooks":
        """Override the reduce seams of this engine's stage; register the step callbacks on ``ctx`` (an
        :class:`~titan_ds.engine.InitContext` in ``attach``) and the uninstall with its transaction."""
        eng, opt = self.engine, self.engine.optimizer
        if ctx.txn is not None:  # first: a failure from here on undoes the install
            self._removers.append(ctx.txn.on_undo("uninstall titan.compression", self.uninstall))
        if self.stage == 0:
            self._set(dsc.z0_allreduce_bucket(eng, self._z0_allreduce_bucket))
        elif self.stage in (1, 2):
            for p in dsc.z12_reduce_seams(opt, self._z12_average_tensor, self._z12_allreduce_bucket,
                                          self._z12_predivide):
                self._set(p)
        else:
            self._set(dsc.z3_avg_scatter(opt, self._z3_avg_scatter))
            _z3_acquire()
            self._z3_held = True
        self._removers += [ctx.on_before_step(self._before_step), ctx.on_after_step(self._after_step)]
        return self

    def _before_step(self) -> None:
        self._steps_before = self.engine.global_steps

    def _after_step(self) -> None:
        """After each optimizer step the residual journal goes (a skipped step's writes were already undone)."""
        if self.engine.global_steps != self._steps_before:
            self.reducer.end_step()

    def uninstall(self) -> None:
        """Remove everything ``install`` did (idempotent): lifecycle callbacks, instance overrides, ZeRO-3 global."""
        for remove in self._removers:
            remove()
        self._removers.clear()
        for patch in reversed(self._installed):
            patch.undo()
        self._installed.clear()
        if self._z3_held:
            _z3_release()
            self._z3_held = False

    def _count(self, seam: str) -> None:
        self.seam_calls[seam] = self.seam_calls.get(seam, 0) + 1

    # ---------------------------------------------------------------- layouts (parameter, offset)
    def _key(self, p: Any) -> str:
        name = self.names.get(id(p))
        if name is not None:
            return name
        ds_id = getattr(p, "ds_id", None)
        if ds_id is None:
            raise RuntimeError("titan compression: a gradient belongs to a parameter that is not in the engine's "
                               "module; residuals could not be keyed")
        return f"ds_id:{ds_id}"

    @staticmethod
    def _shape(p: Any) -> tuple[int, ...]:
        """The parameter's own shape (ZeRO-3 keeps it in ``ds_shape``; ``p.shape`` is the empty partition's)."""
        return tuple(getattr(p, "ds_shape", None) or p.shape)

    def _grad_owners(self) -> dict[int, tuple[str, int, tuple[int, ...]]]:
        return {p.grad.data_ptr(): (self._key(p), p.numel(), self._shape(p)) for p in self.engine.module.parameters()
                if p.grad is not None}

    def _layout(self, tensors: list[torch.Tensor]) -> list[Segment]:
        """Segments of the flat concatenation of ``tensors``, each mapped to (parameter, offset)."""
        out: list[Segment] = []
        owners: Optional[dict[int, tuple[str, int, tuple[int, ...]]]] = None
        flat_off = 0
        for t in tensors:
            n = t.numel()
            ptr = t.data_ptr()
            if self._ipg is not None and self._ipg[0] <= ptr < self._ipg[0] + self._ipg[1] * self._ipg[2]:
                base, es, _, segs = self._ipg
                lo = (ptr - base) // es
                hi = lo + n
                for s in segs:
                    a, b = max(lo, s.flat_offset), min(hi, s.flat_offset + s.numel)
                    if a < b:
                        out.append(Segment(s.key, s.param_offset + a - s.flat_offset, flat_off + a - lo, b - a,
                                           s.param_numel, s.shape))
            else:
                owners = owners if owners is not None else self._grad_owners()
                if ptr not in owners or owners[ptr][1] != n:
                    raise RuntimeError(f"titan compression: a bucket element of {n} elements is neither in the "
                                       f"recorded gradient buffer nor a parameter's .grad; cannot key residuals")
                key, numel, shape = owners[ptr]
                out.append(Segment(key, 0, flat_off, n, numel, shape))
            flat_off += n
        return out

    def _comm(self, group: Any) -> DistCollective:
        return DistCollective(group)

    def _lr(self) -> Optional[float]:
        """The lr the optimizer applies this step's sum with (``engine.get_lr()``: its first param group; the
        schedulers scale every group alike), read where the reducer follows it (``residuals_follow_lr``)."""
        if not self.reducer.lr_follows:
            return None
        lrs = self.engine.get_lr()
        return float(lrs[0]) if lrs else None

    # ---------------------------------------------------------------- ZeRO-0
    def _z0_allreduce_bucket(self, bucket, dp_group, dp_world_size=None):
        eng = self.engine
        self._count("engine.allreduce_bucket")
        flat = _flatten(list(bucket))
        layout = self._layout(list(bucket))
        comm = self._comm(dp_group)
        world = dp_world_size if dp_world_size is not None else comm.world_size
        summed = self.reducer.reduce(flat, layout, comm, eng.global_steps, consume=True,
                                     lr=self._lr())
        if dsc.gradient_average(eng):
            summed.div_(world)
        return summed

    # ---------------------------------------------------------------- ZeRO-1/2
    def _z12_average_tensor(self, original):
        opt = self.engine.optimizer

        def titan_average_tensor(tensor, communication_data_type):
            segs, off = [], 0
            for p in dsc.ipg_bucket_params(opt, communication_data_type):
                segs.append(Segment(self._key(p), 0, off, p.numel(), p.numel(), self._shape(p)))
                off += p.numel()
            if off != tensor.numel():
                raise RuntimeError(f"titan compression: IPG bucket holds {tensor.numel()} elements but its "
                                   f"parameters add up to {off}; DeepSpeed's bucket layout changed")
            self._ipg = (tensor.data_ptr(), tensor.element_size(), tensor.numel(), segs)
            try:
                return original(tensor, communication_data_type)
            finally:
                self._ipg = None

        return titan_average_tensor

    def _z12_allreduce_bucket(self, bucket, communication_data_type, rank=None, log=None, divide=True,
                              process_group=None):
        opt = self.engine.optimizer
        self._count("zero.allreduce_bucket" + ("" if rank is None else "(reduce)"))
        group = dsc.zero_dp_group(opt) if process_group is None else process_group
        comm = self._comm(group)
        flat = _flatten(list(bucket))
        prescale = 1.0
        if divide and dsc.gradient_average(opt):
            prescale = dsc.sequence_parallel_size(opt) / comm.world_size
            flat.div_(comm.world_size / dsc.sequence_parallel_size(opt))
        return self.reducer.reduce(flat, self._layout(list(bucket)), comm, self.engine.global_steps,
                                   prescale=prescale, consume=True, lr=self._lr())

    def _z12_predivide(self, tensor, communication_data_type):
        opt = self.engine.optimizer
        if tensor.numel() == 0:
            return tensor
        self._count("zero.gradient_reduction_w_predivide")
        comm = self._comm(dsc.zero_dp_group(opt))
        flat = _flatten([tensor])
        prescale = 1.0
        if dsc.gradient_average(opt):
            prescale = dsc.sequence_parallel_size(opt) / comm.world_size
            flat.div_(comm.world_size / dsc.sequence_parallel_size(opt))
        summed = self.reducer.reduce(flat, self._layout([tensor]), comm, self.engine.global_steps,
                                     prescale=prescale, consume=True, lr=self._lr())
        tensor.copy_(summed)
        return tensor

    # ---------------------------------------------------------------- ZeRO-3
    def _z3_avg_scatter(self, original):
        def avg_scatter_grads(params_to_reduce, communication_data_type):
            _Z3.active, self._z3_params = self, list(params_to_reduce)
            try:
                return original(params_to_reduce, communication_data_type)
            finally:
                _Z3.active, self._z3_params = None, None

        return avg_scatter_grads

    def _reduce_scatter(self, tensors, group):
        """Same contract as ``reduce_scatter_coalesced``: averaged, this rank's ceil(n/W) chunk of each tensor."""
        self._count("stage3.reduce_scatter_coalesced")
        params = self._z3_params
        if params is None or len(params) != len(tensors):
            raise RuntimeError("titan compression: ZeRO-3 reduce-scatter called with tensors that do not match "
                               "the parameters being reduced")
        comm = self._comm(group)
        world = comm.world_size
        rank = comm.dist.get_rank(group=group)
        segs, off = [], 0
        for t, p in zip(tensors, params):
            shape = self._shape(p)
            segs.append(Segment(self._key(p), 0, off, t.numel(), t.numel(),
                                shape if math.prod(shape) == t.numel() else None))
            off += t.numel()
        flat = _flatten(list(tensors)).div_(world)  # DeepSpeed pre-divides here too
        summed = self.reducer.reduce(flat, segs, comm, self.engine.global_steps, prescale=1.0 / world,
                                     consume=True, lr=self._lr())
        out, off = [], 0
        for t in tensors:
            n = t.numel()
            chunk = math.ceil(n / world)
            lo, hi = min(n, rank * chunk), min(n, (rank + 1) * chunk)
            out.append(summed.narrow(0, off + lo, hi - lo).to(t.dtype))
            off += n
        return out

    # ---------------------------------------------------------------- checkpoint state
    def _dp_group(self) -> Any:
        return dsc.zero_dp_group(self.engine.optimizer) or dsc.seq_data_parallel_group(self.engine)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's residuals (gathered: DeepSpeed writes client_state from one rank only)."""
        from deepspeed import comm as dist
        local = self.reducer.state_dict()
        group = self._dp_group()
        world = dist.get_world_size(group=group)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, local, group=group)
        return {"world_size": world, "per_rank": gathered}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from deepspeed import comm as dist
        group = self._dp_group()
        world = dist.get_world_size(group=group)
        if state["world_size"] != world:
            raise RuntimeError(f"titan compression residuals were saved with {state['world_size']} data-parallel "
                               f"ranks but this run has {world}; resume with the same number of ranks")
        self.reducer.load_state_dict(state["per_rank"][dist.get_rank(group=group)])


# ------------------------------------------------------------------------------- the pillar
def rms_options(ctx: Any) -> RMSOptions:
    """``precondition='rms'``/``'rms_mean'``: the reduced sum is an Adam-scaled update, so the optimizer becomes SGD.

    The ds_config's ``Adam``/``AdamW`` section becomes SGD (same lr and weight decay; SGD's decay on an update is
    AdamW's decoupled one), and so does an Adam/AdamW instance passed to initialize (the HF ``Trainer``'s), over
    the same group dicts, through the one replacement path (:mod:`titan_ds.replace_optimizer`). Under ``rms`` the
    SGD has no momentum (error feedback is the accumulation); under ``rms_mean`` it has momentum and dampening
    ``beta1`` (Adam's first moment, taken after the reduction). An SGD without momentum is kept under ``rms``;
    anything else was refused by :mod:`titan_ds.rules`. Returns the preconditioner's options:
    ``precondition_beta1``/``beta2``/``eps`` where the section sets them, else the Adam's ``betas``/``eps``, else
    Adam's defaults."""
    cfg, ds = ctx.titan.compression, ctx.ds_config
    beta1 = beta2 = eps = None
    section = ds.get("optimizer")
    mean = cfg.precondition == "rms_mean"
    why = (f"titan.compression.precondition={cfg.precondition!r}: the Adam's betas/eps drive the per-rank moments"
           + (" and its beta1 the SGD's momentum" if mean else ""))
    fields = cfg.model_fields_set

    def pick_beta1(found: Optional[float]) -> float:
        return cfg.precondition_beta1 if "precondition_beta1" in fields or found is None else found

    if section is not None and str(section.get("type", "")).lower() in ("adam", "adamw"):
        params = dict(section.get("params", {}) or {})
        betas = params.get("betas")
        pair = isinstance(betas, (list, tuple)) and len(betas) == 2
        beta1 = float(betas[0]) if pair else None
        beta2 = float(betas[1]) if pair else None
        eps = float(params["eps"]) if "eps" in params else None
        sgd = {"lr": params.get("lr", 1e-3), "weight_decay": params.get("weight_decay", 0.0)}
        if mean:
            sgd.update(momentum=pick_beta1(beta1), dampening=pick_beta1(beta1))
        replace_ds_optimizer_section(ds, {"type": "SGD", "params": sgd}, why)
    if ctx.optimizer is not None and not isinstance(ctx.optimizer, torch.optim.Optimizer):
        # a factory (valid DeepSpeed): built here, on the parameters DeepSpeed would give it, so that its Adam
        # lends its betas and becomes SGD like a passed one; DeepSpeed gets the built optimizer
        if ctx.model_parameters is not None and not isinstance(ctx.model_parameters, (list, tuple)):
            ctx.model_parameters = list(ctx.model_parameters)  # an iterator: DeepSpeed reads it again after us
        ctx.optimizer = built_optimizer(ctx.optimizer, ctx.model, ctx.model_parameters)
    passed = ctx.optimizer
    if isinstance(passed, (torch.optim.Adam, torch.optim.AdamW)):
        g0 = passed.param_groups[0]
        beta1 = beta1 if beta1 is not None else float(g0["betas"][0])
        beta2 = beta2 if beta2 is not None else float(g0["betas"][1])
        eps = eps if eps is not None else float(g0["eps"])
        momentum = pick_beta1(beta1) if mean else 0.0
        # the same group dicts: a scheduler built over ``passed`` keeps setting the lr SGD reads
        replace_passed_optimizer(ctx, lambda p: torch.optim.SGD(p.param_groups, lr=p.param_groups[0]["lr"],
                                                                momentum=momentum, dampening=momentum), why)
    return RMSOptions(beta2=cfg.precondition_beta2 if "precondition_beta2" in fields or beta2 is None else beta2,
                      eps=cfg.precondition_eps if "precondition_eps" in fields or eps is None else eps,
                      kind=cfg.precondition, beta1=pick_beta1(beta1))


class CompressionPillar(Pillar):
    """``titan.compression``: build the reducer (``apply``), install it on the engine (``attach``)."""

    key = "compression"

    def apply(self, ctx: Any) -> None:
        cfg = self.cfg
        note = getattr(REGISTRY.get(cfg.method), "experimental", "")
        if note:  # measured behind the recommended section: said once, before training
            log.warning("titan.compression.method=%r is experimental: %s", cfg.method, note)
        if cfg.local_updates:  # the compressor acts on the outer gradient (titan_ds/comm/diloco.py)
            self.reducer = GradientReducer(cfg.method, cfg.ratio, error_feedback=cfg.error_feedback,
                                           rows=cfg.sketch_rows, seed=cfg.seed, rank=cfg.rank,
                                           min_compression=cfg.min_compression, bits=cfg.bits, chunk=cfg.chunk,
                                           exchange=cfg.exchange, gather_share=cfg.gather_share,
                                           scale_dtype=cfg.scale_dtype)
            return
        precondition = rms_options(ctx) if cfg.precondition != "none" else None
        self.reducer = GradientReducer(
            cfg.method, cfg.ratio, error_feedback=cfg.error_feedback, warmup_steps=cfg.warmup_steps,
            rows=cfg.sketch_rows, seed=cfg.seed, rank=cfg.rank, min_compression=cfg.min_compression,
            dgc=DGCOptions(momentum=cfg.momentum, momentum_masking=cfg.momentum_masking, local_clip=cfg.local_clip),
            ratio_warmup_steps=cfg.ratio_warmup_steps, ratio_warmup_start=cfg.ratio_warmup_start,
            precondition=precondition, bits=cfg.bits, chunk=cfg.chunk, exchange=cfg.exchange,
            gather_share=cfg.gather_share, residuals_follow_lr=cfg.residuals_follow_lr, scale_dtype=cfg.scale_dtype)

    def attach(self, ctx: Any) -> None:
        """Install the reducer on ``ctx.engine``; publish byte metrics and residual state."""
        if self.cfg.local_updates:
            self._attach_local(ctx)
            return
        hooks = CompressionHooks(ctx.engine, self.reducer, ctx.zero_stage()).install(ctx)
        ctx.reports[_REPORT_KEY] = hooks
        ctx.add_metrics(self.reducer.take_metrics)
        ctx.add_state(_REPORT_KEY, hooks.state_dict, hooks.load_state_dict)
        log.info("titan: %r", hooks)


    def _attach_local(self, ctx: Any) -> None:
        from .diloco import OuterStep
        from .local_hooks import LocalUpdateHooks
        cfg = self.cfg
        outer = OuterStep(list(ctx.engine.module.named_parameters()), self.reducer, outer_lr=cfg.outer_lr,
                          outer_momentum=cfg.outer_momentum, nesterov=cfg.outer_nesterov)
        hooks = LocalUpdateHooks(ctx.engine, outer, cfg.sync_every).install(ctx)
        ctx.reports[_REPORT_KEY] = hooks
        ctx.add_metrics(self.reducer.take_metrics)
        ctx.add_state(_REPORT_KEY, hooks.state_dict, hooks.load_state_dict)
        log.info("titan: %r", hooks)


PILLAR = CompressionPillar
