"""``titan_ds.initialize``: the one place that wires the pillars into ``deepspeed.initialize``.

Protocol (:mod:`titan_ds.pillar`): each pillar module exposes ``PILLAR``, a :class:`titan_ds.pillar.Pillar`
subclass built from the ``"titan"`` section, with ``validate`` (pure), ``apply`` (before
``deepspeed.initialize``) and ``attach`` (after). ``initialize``:

1. **validates** everything first: every pillar's ``validate`` and the cross-field rules (:mod:`titan_ds.rules`)
   see the whole section, a copy of the ds_config, the model, what was passed and the world size; all problems
   are raised together as one :class:`TitanConfigError` before any file, model or global is touched;
2. opens a :class:`~titan_ds.transaction.Transaction` (snapshot of the model, the passed optimizer and scheduler;
   the undo stack), runs every ``apply`` in :data:`PILLARS` order, sets the DeepSpeed flags the pillars need
   (:func:`titan_ds.rules.required_ds_flags`), calls ``deepspeed.initialize``, runs every ``attach`` and wraps the
   engine's ``step``/``save_checkpoint``/``load_checkpoint`` once;
3. on any exception rolls the transaction back (DeepSpeed's symbols, process settings, files, the user's
   objects and model; see :mod:`titan_ds.transaction`) and re-raises; on success commits it.

Order of :data:`PILLARS`:

1. ``hms``         titan_ds.hms.install     HMS swappers for ZeRO-3 NVMe offload; converts the model under zero.Init
                                            and publishes its parameter swapper in ``ctx.zero_init_kwargs``
2. ``trd``         titan_ds.inject.trd      replace nn.Linear by tensor-ring layers (under ZeRO-3 built inside
                                            zero.Init(**ctx.zero_init_kwargs), so new cores stream through HMS too)
3. ``mlme``        titan_ds.inject.mlme     tiled attention / StripeFFN / chunked loss / block recompute
4. ``optimizer``   titan_ds.optim.install   build ASDT (+BSPS), or replace the passed optimizer by it
5. ``compression`` titan_ds.comm.hooks      compressor on DeepSpeed's reduce path (after the engine exists)

HMS comes first because every parameter created afterwards under ZeRO-3 must use its swapper; module replacement
comes before the optimizer so that it is built over the final parameters; the compressor is attached last because
it hooks the engine instance. With no ``"titan"`` section this is exactly ``deepspeed.initialize``.

Lifecycle (:mod:`titan_ds.lifecycle`): pillars act around ``engine.step``, save and load only through callbacks
registered on the :class:`InitContext` in ``attach``; this module wraps the three engine methods once and runs
them.
"""
from __future__ import annotations

import argparse
import copy
import functools
import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from . import deepspeed_compat as dsc
from . import rules
from .config import TitanConfig, TitanConfigError, load_ds_config
from .lifecycle import Lifecycle, LoadCallback, Remove, SaveCallback, StepCallback
from .pillar import View
from .transaction import Transaction
from .utils import after_init_distributed

__all__ = ["initialize", "prepare", "validate", "InitContext", "TitanRuntime", "PILLARS", "PillarEntry",
           "clip_fp32_grads"]

log = logging.getLogger("titan_ds")


@dataclass(frozen=True)
class PillarEntry:
    """A row of :data:`PILLARS`: the ``"titan"`` section key and the module whose ``PILLAR`` implements it."""
    key: str       # key of the "titan" section
    module: str    # module exposing PILLAR, a titan_ds.pillar.Pillar subclass


PILLARS: tuple[PillarEntry, ...] = (
    PillarEntry("hms", "titan_ds.hms.install"),
    PillarEntry("trd", "titan_ds.inject.trd"),
    PillarEntry("mlme", "titan_ds.inject.mlme"),
    PillarEntry("optimizer", "titan_ds.optim.install"),
    PillarEntry("compression", "titan_ds.comm.hooks"),
)


@dataclass
class InitContext:
    """What a pillar may read or change in ``apply`` and ``attach`` (after every ``validate`` passed).

    In ``apply`` pillars change ``model``/``optimizer``/``model_parameters``/``ds_config``; every other change
    (DeepSpeed's symbols, process settings, files) goes through ``txn``
    (:class:`~titan_ds.transaction.Transaction`), which undoes it if ``initialize`` fails. In ``attach`` they find
    the engine in ``engine`` and register per-step metric fields (``add_metrics``), checkpointable state
    (``add_state``) and callbacks around ``engine.step``, save and load (``on_before_step``, ``on_after_step``,
    ``on_save``, ``on_load``; order and rules: :mod:`titan_ds.lifecycle`). ``reports[key]`` is what a pillar
    publishes on ``engine.titan.reports`` (output only: nothing in titan reads it back).
    """

    titan: TitanConfig
    ds_config: dict[str, Any]
    model: torch.nn.Module
    optimizer: Any = None
    model_parameters: Any = None
    lr_scheduler: Any = None
    args: Any = None
    engine: Any = None
    world_size: int = 1
    txn: Optional[Transaction] = None
    reports: dict[str, Any] = field(default_factory=dict)
    metric_sources: list[Callable[[], dict[str, Any]]] = field(default_factory=list)
    state_sources: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = field(default_factory=dict)
    # keyword arguments every pillar passes to deepspeed.zero.Init when it creates parameters under ZeRO-3
    # (HMS puts its parameter swapper here)
    zero_init_kwargs: dict[str, Any] = field(default_factory=dict)
    lifecycle: Lifecycle = field(default_factory=Lifecycle)

    def add_metrics(self, fn: Callable[[], dict[str, Any]]) -> None:
        """Register ``fn() -> {StepMetrics field or extra key: value}``, called after every step."""
        self.metric_sources.append(fn)

    def add_state(self, name: str, get: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """Register state saved into checkpoints' ``client_state["titan"][name]`` and restored on load."""
        if name in self.state_sources:
            raise ValueError(f"titan state {name!r} registered twice")
        self.state_sources[name] = (get, load)

    def _engine_callback(self, kind: str, fn: Callable[..., None]) -> Remove:
        if self.engine is None:
            raise RuntimeError(f"titan: {kind} callbacks are registered in attach (the engine exists then, and "
                               f"pillars run in PILLARS order there)")
        return self.lifecycle.register(kind, fn)

    def on_before_step(self, fn: StepCallback) -> Remove:
        """``fn()`` runs before every ``engine.step``, in reverse registration order (the first is innermost)."""
        return self._engine_callback("before_step", fn)

    def on_after_step(self, fn: StepCallback) -> Remove:
        """``fn()`` runs after every ``engine.step`` that returned, in registration order."""
        return self._engine_callback("after_step", fn)

    def on_save(self, fn: SaveCallback) -> Remove:
        """``fn(save_dir, tag)`` runs on every rank after DeepSpeed wrote the tag on all ranks and before the
        manifest; an exception fails the save on every rank (CheckpointSaveError). Registration order."""
        return self._engine_callback("save", fn)

    def on_load(self, fn: LoadCallback) -> Remove:
        """``fn(load_dir, tag, load_checkpoint's keywords)`` runs after DeepSpeed loaded a tag and before the
        registered state (``add_state``) is restored. Registration order."""
        return self._engine_callback("load", fn)

    def patch(self, p: dsc.Patch) -> dsc.Patch:
        """Apply a DeepSpeed patch; it is undone if ``initialize`` fails (no transaction: applied for good)."""
        return self.txn.patch(p) if self.txn is not None else p.apply()

    def zero_stage(self) -> int:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0))


@dataclass
class TitanRuntime:
    """Attached to the engine as ``engine.titan``: config, pillar reports, metric and state sources, and the
    lifecycle callbacks that the engine's (once-wrapped) ``step``/``save_checkpoint``/``load_checkpoint`` run."""

    config: TitanConfig
    reports: dict[str, Any]
    metric_sources: list[Callable[[], dict[str, Any]]]
    state_sources: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]
    lifecycle: Lifecycle = field(default_factory=Lifecycle)

    def collect_metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for fn in self.metric_sources:
            out.update(fn())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {name: get() for name, (get, _) in self.state_sources.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = set(self.state_sources) - set(state)
        if missing:
            raise RuntimeError(f"checkpoint has no titan state for {sorted(missing)}: it was saved without "
                               f"these pillars; resume with the same \"titan\" section it was saved with")
        for name, (_, load) in self.state_sources.items():
            load(state[name])


def _resolve_config(args: Any, config: Any) -> Any:
    if config is not None:
        return config
    for attr in ("deepspeed_config", "deepscale_config"):
        value = getattr(args, attr, None) if args is not None else None
        if value:
            return value
    return None


def _deepspeed_initialize() -> Callable[..., Any]:
    """DeepSpeed's own ``initialize``, also under ``titan_ds.install()`` (its route keeps it in
    ``__titan_original__``)."""
    import deepspeed
    return getattr(deepspeed.initialize, "__titan_original__", deepspeed.initialize)


def _pillar_class(p: PillarEntry) -> type:
    return importlib.import_module(p.module).PILLAR


def _world_size() -> int:
    import os
    return int(os.environ.get("WORLD_SIZE", "1"))


def _wrap_engine(engine: Any, runtime: TitanRuntime) -> None:
    """Wrap the engine instance's ``step``, ``save_checkpoint`` and ``load_checkpoint``, once (each wrapper's
    ``__wrapped__`` is DeepSpeed's bound method), to run ``runtime.lifecycle``'s callbacks.

    Save and load are crash-safe and carry titan state in ``client_state["titan"]``
    (:func:`titan_ds.checkpoint.save_tag`/:func:`~titan_ds.checkpoint.load_tag`): DeepSpeed writes the shards
    (with ``save_latest=False``), the pillars' save callbacks run, rank 0 writes a checksum manifest, then
    ``latest`` is replaced atomically; a failure on any rank raises CheckpointSaveError on every rank. A load
    verifies the tag against its manifest before DeepSpeed reads it.
    """
    from . import checkpoint as ckpt

    lifecycle = runtime.lifecycle
    step, save, load = engine.step, engine.save_checkpoint, engine.load_checkpoint

    def titan_step(*a: Any, **kw: Any) -> Any:
        lifecycle.run_before_step()
        out = step(*a, **kw)
        lifecycle.run_after_step()
        return out

    def save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True, **kw):
        tag = tag or f"global_step{engine.global_steps}"
        state = dict(client_state or {})
        state["titan"] = runtime.state_dict()
        return ckpt.save_tag(engine, save, save_dir, tag, state, save_latest, lifecycle.run_save, **kw)

    def load_checkpoint(load_dir, tag=None, **kw):
        return ckpt.load_tag(load, load_dir, tag, lifecycle.run_load, runtime.load_state_dict, **kw)

    for name, wrapper, inner in (("step", titan_step, step), ("save_checkpoint", save_checkpoint, save),
                                 ("load_checkpoint", load_checkpoint, load)):
        wrapper.__wrapped__ = inner  # one level: tests check that nothing else wrapped the method on the instance
        dsc.override(engine, name, wrapper).apply()  # the engine is the user's only once initialize returns


def _install_nonfinite_guard(engine: Any) -> None:
    """ZeRO-1/2/3 already skip a step whose gradients hold NaN/Inf (an all-reduced overflow flag, also in fp32).
    Without ZeRO and without an fp16/bf16 wrapper the client optimizer steps on them. Give that optimizer the same
    behaviour: a MAX all-reduce of a local non-finite flag over the data-parallel group, and on a hit no update
    and ``optimizer.overflow = True``, which DeepSpeed reads to count the skip and hold the lr schedule."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() != 0 or opt is None or opt is not dsc.engine_basic_optimizer(engine):
        return
    import deepspeed.comm as dist
    inner_step = opt.step
    group = dsc.data_parallel_group(engine)

    # functools.wraps: the guard wraps whatever ``opt.step`` is, often the step a torch LRScheduler built over
    # ``opt`` wrapped to see that the optimizer steps before it; copying that wrapper's marker (and calling it)
    # keeps the scheduler's check true, instead of its "optimizer.step() has been overridden" warning.
    @functools.wraps(inner_step)
    def step(*a: Any, **kw: Any):
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if not grads and (engine.world_size == 1 or getattr(opt, "step_in_backward", False)):
            # no rank holds a gradient (ASDT's step in backward updated and freed each one in its hook): nothing
            # to check, and no flag to read back from the device
            opt.overflow = False
            return inner_step(*a, **kw)
        # the one host read of a ZeRO-0 step: whether to step at all is decided on the host
        bad = torch.zeros(1, device=engine.device)
        if grads:
            bad += (~torch.stack([torch.isfinite(g).all() for g in grads]).all()).float()
        if dist.is_initialized() and engine.world_size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        opt.overflow = bool(bad.item())
        if opt.overflow:
            log.warning("titan: non-finite gradients at step %d; step skipped on every rank (parameters and "
                        "optimizer state unchanged)", engine.global_steps + 1)
            return None
        return inner_step(*a, **kw)

    opt.overflow = False
    opt.step = step


def clip_fp32_grads(params: Any, max_norm: float, group: Any = None) -> Optional[torch.Tensor]:
    """DeepSpeed 0.19.8's ``clip_grad_norm_`` (``runtime/utils.py``; norm 2, no model parallelism) with its two
    constants made on the device: it builds ``max_norm`` and ``1.0`` with ``torch.tensor([...], device=)``, a
    blocking host-to-device copy each, which on a GPU waits for all the work queued before it, every step. Here
    they are fills (``torch.full``); the operations and their order are DeepSpeed's, so the gradients come out
    bit for bit the same (tests/test_engine_meta.py). Returns the global norm (None: no gradient)."""
    import deepspeed.comm as dist
    params = [p for p in params if p.grad is not None]
    if not params:
        return None
    total = torch.stack([p.grad.data.detach().float().norm(2.0) for p in params]).pow(2.0).sum().float()
    total = total.pow(1.0 / 2.0)
    scaled = total * 1.0 / float(dist.get_world_size(group=group))  # averaged over the group as DeepSpeed does
    dist.all_reduce(scaled, group=group)
    coef = torch.full((1,), float(max_norm), device=scaled.device) / (scaled + 1e-6)
    coef = torch.min(torch.ones(1, device=coef.device), coef)
    for p in params:
        p.grad.data.mul_(coef)
    return scaled


def _install_device_clip(engine: Any) -> None:
    """ZeRO-0 in fp32: the engine's gradient clipping by :func:`clip_fp32_grads`, with no host-to-device copy
    (DeepSpeed's own stays where it differs: model parallelism, MoE, torch autocast's scaler)."""
    if engine.zero_optimization_stage() != 0 or engine.fp16_enabled() or engine.bfloat16_enabled() or \
            engine.mpu is not None or engine.has_moe_layers or engine.torch_autocast_z0_gradscaler is not None:
        return
    group = dsc.data_parallel_group(engine)
    # gradient_clipping read at each step: step in backward sets it to 0 after this (and the engine then never
    # calls the clipping)
    dsc.z0_fp32_clip(engine, lambda: clip_fp32_grads(engine.module.parameters(), engine.gradient_clipping(),
                                                     group)).apply()


def initialize(args: Any = None, model: Optional[torch.nn.Module] = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               config: Any = None, **kwargs: Any):
    """Same signature and return value as ``deepspeed.initialize``: ``(engine, optimizer, dataloader, scheduler)``.

    Reads the ``"titan"`` section from ``config`` (dict or json path) or ``args.deepspeed_config``; validates it
    against the ds_config, the model and what was passed (all problems at once, :class:`TitanConfigError`,
    before anything is touched); applies the switched-on pillars in the order of :data:`PILLARS`, then calls
    ``deepspeed.initialize``. If anything fails after validation, every change is undone (see the module
    docstring). Without a ``"titan"`` section the call is passed through unchanged.
    """
    if config is None:  # DeepSpeed's older name for config=, which accelerate passes
        config = kwargs.pop("config_params", None)
    raw = _resolve_config(args, config)
    titan = TitanConfig.from_ds_config(raw) if raw is not None else None
    if titan is None:
        out = _deepspeed_initialize()(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                      training_data=training_data, lr_scheduler=lr_scheduler, config=config,
                                      **kwargs)
        after_init_distributed()
        return out
    if model is None:
        raise ValueError("titan_ds.initialize needs model=; the titan pillars act on the model")
    ds_config = load_ds_config(raw)
    titan_section = ds_config.pop("titan")
    ctx = InitContext(titan=titan, ds_config=ds_config, model=model, optimizer=optimizer,
                      model_parameters=model_parameters, lr_scheduler=lr_scheduler, args=args,
                      world_size=_world_size())
    pillars, view = _validated(ctx)
    ctx.txn = Transaction(model, optimizer, lr_scheduler, keep_data=view.zero_stage() < 3)
    try:
        out = _apply_pillars(ctx, pillars, view, titan_section, args, training_data, kwargs)
    except BaseException as e:
        ctx.txn.rollback(e)
        raise
    ctx.txn.commit()
    ctx.txn = None
    return out


def prepare(ctx: InitContext) -> list[Any]:
    """What ``initialize`` does before ``deepspeed.initialize``, on a context built by hand (tests, tools):
    validate everything (raises :class:`TitanConfigError`), then every switched-on pillar's ``apply``. Returns the
    pillar objects (their state, e.g. the compression pillar's ``reducer``)."""
    pillars, view = _validated(ctx)
    for p in pillars:
        p.apply(ctx)
    _set_required_flags(ctx, view)
    return pillars


def _validated(ctx: InitContext) -> tuple[list[Any], View]:
    """The switched-on pillars of ``ctx.titan`` and the view they were validated on (raises on any problem)."""
    pillars = [_pillar_class(p)(ctx.titan) for p in PILLARS if getattr(ctx.titan, p.key) is not None]
    view = View.of(ctx.titan, ctx.ds_config, ctx.model, optimizer=ctx.optimizer, lr_scheduler=ctx.lr_scheduler,
                   model_parameters=ctx.model_parameters, world_size=ctx.world_size)
    validate(pillars, view)
    return pillars, view


def validate(pillars: list[Any], view: View) -> None:
    """Every pillar's ``validate`` and the cross-field rules; raises one :class:`TitanConfigError` with all."""
    problems: list[str] = []
    for p in pillars:
        problems += p.validate(view)
    problems += rules.problems(view)
    if problems:
        raise TitanConfigError(list(dict.fromkeys(problems)))


def _set_required_flags(ctx: InitContext, view: View) -> None:
    """The DeepSpeed keys the pillars need (:func:`titan_ds.rules.required_ds_flags`; conflicts were refused by
    validation), set where the user left them out."""
    for key, value, why in rules.required_ds_flags(view):
        if key not in ctx.ds_config:
            ctx.ds_config[key] = value
            log.info("titan: set %s=%r (%s)", key, value, why)


def _apply_pillars(ctx: InitContext, pillars: list[Any], view: View, titan_section: dict[str, Any], args: Any,
                   training_data: Any, kwargs: dict[str, Any]):
    """``apply`` of each pillar, ``deepspeed.initialize``, ``attach`` of each pillar, then the engine's once-only
    wrappers. Raises through ``initialize``, which rolls the transaction back."""
    for p in pillars:
        p.apply(ctx)
    _set_required_flags(ctx, view)
    log.info("titan: pillars on: %s", ", ".join(p.key for p in pillars) or "none")
    ds_config = ctx.ds_config
    ds_config["titan"] = titan_section  # DeepSpeed keeps unknown top-level keys; checkpoints record it
    if args is not None and getattr(args, "deepspeed_config", None):
        args = copy.copy(args)
        args.deepspeed_config = None  # the (possibly adjusted) dict wins; DeepSpeed rejects both at once
    engine, opt, dl, sched = _deepspeed_initialize()(
        args=args, model=ctx.model, optimizer=ctx.optimizer, model_parameters=ctx.model_parameters,
        training_data=training_data, lr_scheduler=ctx.lr_scheduler, config=ds_config, **kwargs)
    after_init_distributed()
    ctx.engine = engine
    for p in pillars:
        p.attach(ctx)
    runtime = TitanRuntime(config=ctx.titan, reports=ctx.reports, metric_sources=ctx.metric_sources,
                           state_sources=ctx.state_sources, lifecycle=ctx.lifecycle)
    engine.titan = runtime
    _wrap_engine(engine, runtime)
    _install_nonfinite_guard(engine)
    _install_device_clip(engine)
    return engine, opt, dl, sched


def add_titan_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Same as ``deepspeed.add_config_arguments``: adds --deepspeed/--deepspeed_config."""
    import deepspeed
    return deepspeed.add_config_arguments(parser)
