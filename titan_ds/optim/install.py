"""Optimizer pillar (:class:`OptimizerPillar`): build ASDT (+BSPS) for ``titan_ds.initialize``, or replace the
optimizer passed to it (through :mod:`titan_ds.replace_optimizer`, the one replacement path), and give it
DeepSpeed's layout. Its cross-field rules (step_in_backward, weight_dtype, the passed optimizer and scheduler) are
in :mod:`titan_ds.rules`."""
from __future__ import annotations

from typing import Any

import torch

from .. import deepspeed_compat as dsc
from ..config import TitanConfigError
from ..pillar import Pillar, View
from ..replace_optimizer import replace_passed_optimizer
from ..utils import get_logger
from .asdt import ASDT
from .layout import zero_layouts

__all__ = ["OptimizerPillar", "PILLAR", "attach_zero_layout", "build_plasticity", "build_optimizer",
           "asdt_groups_of"]

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
    return dict(lr=cfg.lr, betas=tuple(cfg.betas), density=1.0 if cfg.name == "lion" else cfg.density,
                weight_decay=cfg.weight_decay, importance=cfg.importance, state_dtype=cfg.state_dtype,
                granularity=cfg.granularity, block_size=cfg.block_size, sketch_width=cfg.sketch_width,
                sketch_depth=cfg.sketch_depth, update=cfg.update, eps=cfg.eps, update_clip=cfg.update_clip,
                second_moment=cfg.second_moment, second_dtype=cfg.second_dtype, rounding=cfg.rounding,
                rounding_seed=cfg.rounding_seed, compile=cfg.compile)


def _foreign_params(model: torch.nn.Module, passed: Any) -> list[str]:
    names = {id(p) for p in model.parameters()}
    out = []
    for i, g in enumerate(getattr(passed, "param_groups", [])):
        foreign = [tuple(p.shape) for p in g["params"] if id(p) not in names]
        if foreign:
            out.append(f"titan.optimizer: param_groups[{i}] of the optimizer passed to initialize holds tensors "
                       f"that are not parameters of the model (shapes {foreign[:3]})")
    return out


def asdt_groups_of(model: torch.nn.Module, cfg: Any, passed: torch.optim.Optimizer) -> ASDT:
    """ASDT over the parameter groups of ``passed`` (the HF ``Trainer`` always passes its AdamW).

    Each group keeps its parameters and its ``weight_decay`` (the Trainer's decay and no-decay groups). Its lr is
    ``titan.optimizer.lr`` when the section writes one, else the group's own base lr (``initial_lr`` when a
    scheduler was already built over ``passed``, else ``lr``: ``TrainingArguments.learning_rate``). The other
    hyper-parameters are titan's (Adam's betas/eps do not apply to sign momentum)."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [{"params": [(names[id(p)], p) for p in g["params"]], "weight_decay": g.get("weight_decay", 0.0),
               "lr": cfg.lr if "lr" in cfg.model_fields_set else g.get("initial_lr", g["lr"])}
              for g in passed.param_groups]
    return ASDT(groups, **_asdt_kwargs(cfg))


def _cast_weights(model: torch.nn.Module) -> None:
    """The model's floating parameters and buffers to bf16, in place (the Parameter objects stay the same, so an
    optimizer already built over them, as the HF Trainer's, still holds them)."""
    n = sum(p.numel() for p in model.parameters() if p.is_floating_point())
    model.to(torch.bfloat16)
    log.info("titan.optimizer.weight_dtype=bf16: the model's %d weights are bf16, with no fp32 master copy", n)


class OptimizerPillar(Pillar):
    """``titan.optimizer`` (+ ``titan.plasticity``)."""

    key = "optimizer"

    def validate(self, view: View) -> list[str]:
        return _foreign_params(view.model, view.optimizer) if isinstance(view.optimizer, torch.optim.Optimizer) else []

    def apply(self, ctx: Any) -> None:
        """Build ASDT (+BSPS) from ``titan.optimizer`` / ``titan.plasticity``, in place of an optimizer passed to
        initialize."""
        cfg = self.cfg
        if cfg.weight_dtype == "bf16":
            _cast_weights(ctx.model)
        if ctx.optimizer is None:
            opt = build_optimizer(ctx.model, cfg)
            ctx.optimizer = opt
        else:
            lr_from = "titan.optimizer.lr" if "lr" in cfg.model_fields_set else "the passed optimizer's lr"
            opt = replace_passed_optimizer(ctx, lambda passed: asdt_groups_of(ctx.model, cfg, passed),
                                           f"titan.optimizer {cfg.name}, lr from {lr_from}")
        pcfg = self.titan.plasticity
        plasticity = build_plasticity(opt, ctx.model, pcfg) if pcfg is not None and pcfg.enabled else None
        stage = ctx.zero_stage()
        if plasticity is not None and stage >= 1:
            log.info("titan.bsps under ZeRO-%d: requires_grad is fixed at engine init, so Frozen/Sleeping blocks "
                     "still get (and hold) gradients; they hold no optimizer state and are not updated", stage)
        ctx.reports["optimizer"] = {"name": cfg.name, "density": opt.param_groups[0]["density"],
                                    "units": len(opt.units), "plasticity_blocks":
                                    len(plasticity.blocks) if plasticity is not None else 0}
        self.optimizer = opt
        n_params = sum(u.numel for u in opt.units)

        def metrics() -> dict[str, Any]:
            # called every step: no host read (asdt_changed_elements stays a device tensor until it is logged,
            # titan_ds.metrics.host_values); the byte counts are sums of shapes, known on the host
            out: dict[str, Any] = {"asdt_state_bytes": opt.state_bytes(),
                                   "asdt_state_bytes_per_param": opt.state_bytes() / max(n_params, 1),
                                   "asdt_grad_bytes": opt.grad_bytes, "asdt_grad_bytes_peak": opt.grad_bytes_peak,
                                   "asdt_changed_elements": opt.last_selected_lazy}
            if plasticity is not None:
                out["plasticity"] = plasticity.counts()
            return out

        ctx.add_metrics(metrics)
        # BSPS state is saved once, inside ASDT's state_dict (["asdt"]["plasticity"]), not also through
        # ctx.add_state: titan state goes to client_state, which only rank 0 writes and every rank reads, while
        # under ZeRO each rank saves and loads its own optimizer state, and between steps BSPS holds this rank's
        # part of the signals of blocks split across ranks (folded in at the next step). Checkpoints written
        # before this also hold client_state["titan"]["bsps"]; it is not read (nothing is registered under it).

    def attach(self, ctx: Any) -> None:
        """Hand ASDT the ZeRO optimizer's flat-offset -> parameter mapping (nothing to do at stage 0); with
        ``step_in_backward``, hook the updates into backward and turn off the engine's own gradient all-reduce."""
        attach_zero_layout(ctx.engine, self.optimizer)
        if self.cfg.step_in_backward:
            attach_backward_steps(ctx.engine, self.optimizer)


PILLAR = OptimizerPillar


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
    world = dsc.dp_world_size(engine)

    def average(g: torch.Tensor) -> None:
        import deepspeed.comm as dist
        dist.all_reduce(g, group=dsc.seq_data_parallel_group(engine))
        g.mul_(1.0 / world)  # as DeepSpeed's allreduce_bucket scales (sum, then * 1/world)

    max_norm = float(engine.gradient_clipping() or 0.0)
    dsc.backward_allreduce(engine, False).apply()  # the engine is the user's once initialize returns
    optimizer.attach_backward_steps(average if world > 1 else None, max_norm=max_norm)
    dsc.engine_gradient_clipping(engine, 0.0).apply()
    log.info("titan.optimizer.step_in_backward: each parameter is updated in its gradient hook and its gradient "
             "freed%s%s", f"; gradients averaged over {world} ranks in the hook" if world > 1 else "",
             f"; gradient_clipping={max_norm:g} clips by the previous step's global gradient norm (this step's "
             f"is known only when backward ends)" if max_norm > 0 else "")
