"""Optimizer pillar wiring: build ASDT (+BSPS) for ``titan_ds.initialize`` and give it DeepSpeed's layout."""
from __future__ import annotations

from typing import Any

import torch

from ..utils import get_logger

from ..config import TitanConfigError
from .asdt import ASDT
from .layout import zero_layouts

__all__ = ["before_initialize", "after_initialize", "attach_zero_layout", "build_plasticity", "build_optimizer"]

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
    if cfg.name == "lion" and "density" in cfg.model_fields_set and cfg.density != 1.0:
        raise TitanConfigError([f"titan.optimizer.density={cfg.density} with name \"lion\": Lion is the dense "
                                f"(density 1) sign-momentum optimizer; use name \"asdt\" for a sparse one"])
    density = 1.0 if cfg.name == "lion" else cfg.density
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # decoupled weight decay on matrices only, as the AdamW baseline of launch/train.py does
    is_matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for _, p in named]  # ds_shape: built under zero.Init
    groups = [{"params": [np for np, m in zip(named, is_matrix) if m], "weight_decay": cfg.weight_decay},
              {"params": [np for np, m in zip(named, is_matrix) if not m], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    return ASDT(groups, lr=cfg.lr, betas=tuple(cfg.betas), density=density, weight_decay=cfg.weight_decay,
                importance=cfg.importance, state_dtype=cfg.state_dtype, granularity=cfg.granularity,
                block_size=cfg.block_size, sketch_width=cfg.sketch_width, sketch_depth=cfg.sketch_depth)


def _offload_device(ds_config: dict) -> str:
    off = ds_config.get("zero_optimization", {}).get("offload_optimizer") or {}
    return str(off.get("device", "none")).lower()


def before_initialize(ctx: Any) -> None:
    """Build ASDT (+BSPS) from ``titan.optimizer`` / ``titan.plasticity``; set the ZeRO flags it needs."""
    cfg = ctx.titan.optimizer
    if ctx.optimizer is not None:
        raise TitanConfigError(["titan.optimizer is set but an optimizer was also passed to initialize(); "
                                "remove titan.optimizer to use yours, or pass optimizer=None"])
    if "optimizer" in ctx.ds_config:
        raise TitanConfigError(["titan.optimizer is set and the ds_config has an \"optimizer\" section too; "
                                "remove one (titan builds ASDT itself)"])
    opt = build_optimizer(ctx.model, cfg)
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
    if plasticity is not None:
        ctx.add_state("bsps", plasticity.state_dict, plasticity.load_state_dict)


def after_initialize(ctx: Any) -> None:
    """Hand ASDT the ZeRO optimizer's flat-offset -> parameter mapping (nothing to do at stage 0)."""
    attach_zero_layout(ctx.engine, ctx.optimizer)
