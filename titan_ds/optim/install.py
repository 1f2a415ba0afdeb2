"""Optimizer pillar wiring: build ASDT (+BSPS) for ``titan_ds.initialize`` and give it DeepSpeed's layout."""
from __future__ import annotations

from typing import Any

import torch

from ..utils import get_logger

from ..config import TitanConfigError
from .asdt import ASDT
from .layout import zero_layouts

__all__ = ["before_initialize", "after_initialize", "attach_zero_layout", "build_plasticity", "build_optimizer",
           "replace_optimizer"]

log = get_logger("titan_ds.optim")


def attach_zero_layout(engine: Any, optimizer: ASDT) -> None:
    """Give ``optimizer`` the flat-offset -> parameter mapping of the engine's ZeRO optimizer (no-op at stage 0)."""
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
    if stage == 0:
        return
    names = {id(p): n for n, p in engine.module.named_parameters()}
    optimizer.attach_layouts(zero_layouts(engine.optimizer, names, optimizer.units_by_param))


def build_plasticity(optimizer: ASDT, model: torch.nn.Module, cfg: Any):
    """Attach a BSPS scheduler built from a ``PlasticityConfig`` to ``optimizer``; returns it."""
    from .bsps import Plasticity, block_name

    blocks: list[str] = []
    numels: dict[str, int] = {}
    for u in optimizer.units:
        b = block_name(u.param, cfg.block)
        if b not in numels:
            blocks.append(b)
            numels[b] = 0
        numels[b] += u.numel
    plasticity = Plasticity(blocks, [numels[b] for b in blocks], max_active_fraction=cfg.max_active_fraction,
                            warmup_steps=cfg.warmup_steps, elastic_lr_scale=cfg.elastic_lr_scale,
                            elastic_pull=cfg.elastic_pull, sleep_after=cfg.sleep_after, wake_every=cfg.wake_every,
                            ema=cfg.ema, plateau_ratio=cfg.plateau_ratio)
    index = {b: i for i, b in enumerate(blocks)}
    optimizer.attach_plasticity(plasticity, [index[block_name(u.param, cfg.block)] for u in optimizer.units])
    return plasticity


def build_optimizer(model: torch.nn.Module, cfg: Any) -> ASDT:
    """ASDT over ``model.named_parameters()`` (trainable ones) from an ``OptimizerConfig``."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # decoupled weight decay on matrices only, as the AdamW baseline of launch/train.py does
    is_matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for _, p in named]  # ds_shape: built under zero.Init
    groups = [{"params": [np for np, m in zip(named, is_matrix) if m], "weight_decay": cfg.weight_decay},
              {"params": [np for np, m in zip(named, is_matrix) if not m], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    return ASDT(groups, **_asdt_kwargs(cfg))


def _asdt_kwargs(cfg: Any) -> dict[str, Any]:
    if cfg.name == "lion" and cfg.update != "sign":
        raise TitanConfigError([f"titan.optimizer.update=\"{cfg.update}\" with name \"lion\": Lion is the sign "
                                f"update; use name \"asdt\" for update \"adaptive\""])
    if cfg.name == "lion" and "density" in cfg.model_fields_set and cfg.density != 1.0:
        raise TitanConfigError([f"titan.optimizer.density={cfg.density} with name \"lion\": Lion is the dense "
                                f"(density 1) sign-momentum optimizer; use name \"asdt\" for a sparse one"])
    return dict(lr=cfg.lr, betas=tuple(cfg.betas), density=1.0 if cfg.name == "lion" else cfg.density,
                weight_decay=cfg.weight_decay, importance=cfg.importance, state_dtype=cfg.state_dtype,
                granularity=cfg.granularity, block_size=cfg.block_size, sketch_width=cfg.sketch_width,
                sketch_depth=cfg.sketch_depth, update=cfg.update, eps=cfg.eps, update_clip=cfg.update_clip,
                second_moment=cfg.second_moment, second_dtype=cfg.second_dtype, rounding=cfg.rounding,
                rounding_seed=cfg.rounding_seed)


def replace_optimizer(model: torch.nn.Module, cfg: Any, passed: torch.optim.Optimizer) -> ASDT:
    """ASDT over the parameter groups of ``passed`` (the HF ``Trainer`` always passes its AdamW).

    Each group keeps its parameters and its ``weight_decay`` (the Trainer's decay and no-decay groups). Its lr is
    ``titan.optimizer.lr`` when the section writes one, else the group's own base lr (``initial_lr`` when a
    scheduler was already built over ``passed``, else ``lr``: ``TrainingArguments.learning_rate``). The other
    hyper-parameters are titan's (Adam's betas/eps do not apply to sign momentum). ``passed`` is not stepped;
    its ``param_groups`` becomes ASDT's list, so a scheduler built over ``passed`` and never handed to
    ``initialize`` (``accelerator.prepare(model, opt, dl, sched)``) still sets ASDT's lr.
    """
    if "weight_decay" in cfg.model_fields_set:
        raise TitanConfigError([f"titan.optimizer.weight_decay={cfg.weight_decay} is set and an optimizer was "
                                f"passed to initialize (the HF Trainer passes one): titan keeps that optimizer's "
                                f"per-group weight decay (decay and no-decay groups); set it there "
                                f"(TrainingArguments(weight_decay=...)) and remove titan.optimizer.weight_decay"])
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for i, g in enumerate(passed.param_groups):
        foreign = [tuple(p.shape) for p in g["params"] if id(p) not in names]
        if foreign:
            raise TitanConfigError([f"titan.optimizer: param_groups[{i}] of the optimizer passed to initialize "
                                    f"holds tensors that are not parameters of the model (shapes {foreign[:3]})"])
        base = g.get("initial_lr", g["lr"])
        groups.append({"params": [(names[id(p)], p) for p in g["params"]], "weight_decay": g.get("weight_decay", 0.0),
                       "lr": cfg.lr if "lr" in cfg.model_fields_set else base})
    opt = ASDT(groups, **_asdt_kwargs(cfg))
    log.info("titan.optimizer: replaced the %s passed to initialize by %s over its %d param groups "
             "(weight_decay %s, lr %s%s)", type(passed).__name__, cfg.name, len(groups),
             [g["weight_decay"] for g in opt.param_groups], [g["lr"] for g in opt.param_groups],
             " from titan.optimizer.lr" if "lr" in cfg.model_fields_set else " from the passed optimizer")
    return opt


def _redirect(passed: torch.optim.Optimizer, opt: ASDT, scheduler: Any, cfg: Any) -> None:
    """Make the schedule act on ``opt``: ``scheduler`` (given to initialize) and any unseen one over ``passed``.

    A torch scheduler given to initialize is re-pointed at ``opt`` with ASDT's lrs as its base lrs; DeepSpeed's
    own schedulers (absolute lrs) get the new ``optimizer`` only. A scheduler that initialize does not see keeps
    its base lrs, so it is refused when titan.optimizer.lr would differ from them.
    """
    seen = scheduler is not None and getattr(scheduler, "optimizer", None) is passed
    bases = [g["initial_lr"] for g in passed.param_groups if "initial_lr" in g]
    if bases and not seen and "lr" in cfg.model_fields_set and any(b != cfg.lr for b in bases):
        raise TitanConfigError([f"titan.optimizer.lr={cfg.lr} is set but a learning-rate scheduler that "
                                f"initialize() was not given was built over the optimizer passed to it, with base "
                                f"lr {bases}; remove titan.optimizer.lr (titan then uses that base lr), or pass "
                                f"the scheduler as lr_scheduler="])
    for old, new in zip(passed.param_groups, opt.param_groups):
        base_old = old.get("initial_lr", old["lr"])
        if "initial_lr" in old:
            new["initial_lr"] = new["lr"]
            # a scheduler has already set a fraction of the base lr (e.g. 0 at warm-up step 0): keep the fraction
            new["lr"] = new["initial_lr"] * (old["lr"] / base_old) if base_old else old["lr"]
    if seen:
        scheduler.optimizer = opt
        if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            scheduler.base_lrs = [g["initial_lr"] for g in opt.param_groups]
            scheduler._last_lr = [g["lr"] for g in opt.param_groups]
        else:  # DeepSpeed's schedulers set absolute lrs, already written into passed's groups at construction
            for old, new in zip(passed.param_groups, opt.param_groups):
                new["lr"] = old["lr"]
    passed.param_groups = opt.param_groups


def _offload_device(ds_config: dict) -> str:
    off = ds_config.get("zero_optimization", {}).get("offload_optimizer") or {}
    return str(off.get("device", "none")).lower()


def _enabled(section: Any) -> bool:
    return section is not None and getattr(section, "enabled", True)


def _step_in_backward_problems(ctx: Any) -> list[str]:
    """What in the configs rules out ``titan.optimizer.step_in_backward``, each with its fix."""
    cfg, ds = ctx.titan.optimizer, ctx.ds_config
    head = "titan.optimizer.step_in_backward=true"
    out = []
    if ctx.zero_stage() != 0:
        out.append(f"{head} needs ZeRO stage 0 (stage {ctx.zero_stage()} steps on flat partitions after the "
                   f"reduction); set zero_optimization.stage to 0 or step_in_backward to false")
    gas = ds.get("gradient_accumulation_steps", 1)
    if gas != 1:
        out.append(f"{head} with gradient_accumulation_steps={gas!r}: each backward updates the weights; set "
                   f"it to 1 (HF Trainer: gradient_accumulation_steps=1)")
    for key in ("fp16", "bf16"):
        if (ds.get(key) or {}).get("enabled") in (True, "auto"):
            out.append(f"{head} with {key}.enabled: DeepSpeed's {key} optimizer keeps its own gradient buffers; "
                       f"train in fp32 or set step_in_backward to false")
    if _enabled(ctx.titan.plasticity):
        out.append(f"{head} with titan.plasticity: BSPS needs the whole step's gradients; disable one of them")
    if cfg.importance == "sketch":
        out.append(f"{head} with importance=\"sketch\": the sketch needs the whole step's gradients; use "
                   f"importance \"momentum\"")
    if ctx.titan.compression is not None:
        out.append(f"{head} with titan.compression: the update happens before any reduction; remove one of them")
    if ctx.titan.hms is not None:
        out.append(f"{head} with titan.hms: HMS streams state around engine.step; remove one of them")
    return out


def _bf16_weight_problems(ctx: Any) -> list[str]:
    """What in the configs rules out ``titan.optimizer.weight_dtype="bf16"``, each with its fix."""
    head = "titan.optimizer.weight_dtype=\"bf16\""
    out = []
    if ctx.zero_stage() != 0:
        out.append(f"{head} needs ZeRO stage 0: ZeRO-{ctx.zero_stage()} steps on fp32 master partitions of its own "
                   f"(DeepSpeed's bf16.bf16_master_weights_and_grads keeps them in bf16); set zero_optimization.stage "
                   f"to 0 or remove weight_dtype")
    for key in ("fp16", "bf16"):
        if (ctx.ds_config.get(key) or {}).get("enabled") in (True, "auto"):
            out.append(f"{head} with {key}.enabled: DeepSpeed's {key} optimizer keeps an fp32 master copy of every "
                       f"weight, which is what weight_dtype removes; set {key}.enabled to false (HF Trainer: "
                       f"TrainingArguments({key}=False)): titan casts the model to bf16 itself")
    if ctx.titan.hms is not None:
        out.append(f"{head} with titan.hms: HMS runs under ZeRO-3; remove one of them")
    return out


def _cast_weights(model: torch.nn.Module) -> None:
    """The model's floating parameters and buffers to bf16, in place (the Parameter objects stay the same, so an
    optimizer already built over them, as the HF Trainer's, still holds them)."""
    n = sum(p.numel() for p in model.parameters() if p.is_floating_point())
    model.to(torch.bfloat16)
    log.info("titan.optimizer.weight_dtype=bf16: the model's %d weights are bf16, with no fp32 master copy", n)


def before_initialize(ctx: Any) -> None:
    """Build ASDT (+BSPS) from ``titan.optimizer`` / ``titan.plasticity``, in place of an optimizer passed to
    initialize (:func:`replace_optimizer`); set the ZeRO flags it needs."""
    cfg = ctx.titan.optimizer
    if cfg.step_in_backward:
        problems = _step_in_backward_problems(ctx)
        if problems:
            raise TitanConfigError(problems)
    if "optimizer" in ctx.ds_config:
        raise TitanConfigError(["titan.optimizer is set and the ds_config has an \"optimizer\" section too; "
                                "remove one (titan builds ASDT itself)"])
    if cfg.weight_dtype == "bf16":
        problems = _bf16_weight_problems(ctx)
        if problems:
            raise TitanConfigError(problems)
        _cast_weights(ctx.model)
    passed = ctx.optimizer
    if passed is not None and not isinstance(passed, torch.optim.Optimizer):
        raise TitanConfigError([f"titan.optimizer is set and initialize() was given optimizer={passed!r}, which "
                                f"is not a torch.optim.Optimizer; titan can replace an Optimizer instance only"])
    opt = build_optimizer(ctx.model, cfg) if passed is None else replace_optimizer(ctx.model, cfg, passed)
    if passed is not None:
        _redirect(passed, opt, ctx.lr_scheduler, cfg)
    pcfg = ctx.titan.plasticity
    plasticity = build_plasticity(opt, ctx.model, pcfg) if pcfg is not None and pcfg.enabled else None
    ctx.optimizer = opt
    stage = ctx.zero_stage()
    if stage >= 1:
        ctx.set_ds_flag("zero_allow_untested_optimizer", True, "titan.optimizer (ASDT is a client optimizer)")
    if _offload_device(ctx.ds_config) in ("cpu", "nvme"):
        ctx.set_ds_flag("zero_force_ds_cpu_optimizer", False,
                        "titan.optimizer with offload_optimizer (ASDT runs on the CPU partitions itself)")
    if plasticity is not None and stage >= 1:
        log.info("titan.bsps under ZeRO-%d: requires_grad is fixed at engine init, so Frozen/Sleeping blocks "
                 "still get (and hold) gradients; they hold no optimizer state and are not updated", stage)
    ctx.reports["optimizer"] = {"name": cfg.name, "density": opt.param_groups[0]["density"],
                                "units": len(opt.units), "plasticity_blocks":
                                len(plasticity.blocks) if plasticity is not None else 0}
    n_params = sum(u.numel for u in opt.units)

    def metrics() -> dict[str, Any]:
        out: dict[str, Any] = {"asdt_state_bytes": opt.state_bytes(),
                               "asdt_state_bytes_per_param": opt.state_bytes() / max(n_params, 1),
                               "asdt_grad_bytes": opt.grad_bytes, "asdt_grad_bytes_peak": opt.grad_bytes_peak,
                               "asdt_changed_elements": opt.last_selected}
        if plasticity is not None:
            out["plasticity"] = plasticity.counts()
        return out

    ctx.add_metrics(metrics)
    # BSPS state is saved once, inside ASDT's state_dict (["asdt"]["plasticity"]), not also through
    # ctx.add_state: titan state goes to client_state, which only rank 0 writes and every rank reads, while
    # under ZeRO each rank saves and loads its own optimizer state, and between steps BSPS holds this rank's
    # part of the signals of blocks split across ranks (folded in at the next step). Checkpoints written
    # before this also hold client_state["titan"]["bsps"]; it is not read (nothing is registered under it).


def after_initialize(ctx: Any) -> None:
    """Hand ASDT the ZeRO optimizer's flat-offset -> parameter mapping (nothing to do at stage 0); with
    ``step_in_backward``, hook the updates into backward and turn off the engine's own gradient all-reduce."""
    attach_zero_layout(ctx.engine, ctx.optimizer)
    if ctx.titan.optimizer.step_in_backward:
        attach_backward_steps(ctx.engine, ctx.optimizer)


def attach_backward_steps(engine: Any, optimizer: ASDT) -> None:
    """Stage 0: ASDT updates each parameter in its gradient hook (:meth:`ASDT.attach_backward_steps`). DeepSpeed's
    backward epilogue all-reduces ``.grad`` after backward and fills a missing one with zeros, which would hand
    ``step()`` a full set of zero gradients; it is turned off, and with more than one data-parallel rank each
    gradient is averaged in its hook instead (every rank fires the hooks in the same order). DeepSpeed's own
    clipping (``_take_model_step``) would find no gradient (and fails on an empty list): the hooks clip instead,
    by the previous step's global norm, and the engine's ``gradient_clipping`` is set to 0."""
    gas = engine.gradient_accumulation_steps()
    if gas != 1:
        raise TitanConfigError([f"titan.optimizer.step_in_backward=true with gradient_accumulation_steps={gas}: "
                                f"each backward updates the weights; set it to 1"])
    world = engine.dp_world_size if hasattr(engine, "dp_world_size") else 1
    def average(g: torch.Tensor) -> None:
        import deepspeed.comm as dist
        dist.all_reduce(g, group=getattr(engine, "seq_data_parallel_group", None))
        g.mul_(1.0 / world)  # as DeepSpeed's allreduce_bucket scales (sum, then * 1/world)

    max_norm = float(engine.gradient_clipping() or 0.0)
    engine.enable_backward_allreduce = False
    optimizer.attach_backward_steps(average if world > 1 else None, max_norm=max_norm)
    engine._config.gradient_clipping = 0.0
    log.info("titan.optimizer.step_in_backward: each parameter is updated in its gradient hook and its gradient "
             "freed%s%s", f"; gradients averaged over {world} ranks in the hook" if world > 1 else "",
             f"; gradient_clipping={max_norm:g} clips by the previous step's global gradient norm (this step's "
             f"is known only when backward ends)" if max_norm > 0 else "")
