"""Every cross-field rule of the ``"titan"`` section, in one place.

A rule here reads more than one pillar's own sub-section: two pillars together, a pillar against the rest of the
ds_config, or a pillar against what was passed to ``initialize`` (the optimizer, the scheduler, the world size).
Rules inside one sub-section are its pydantic model's (:mod:`titan_ds.config`); checks of the model's structure
or the file system are the pillar's own ``validate``. :func:`problems` runs them all on a
:class:`~titan_ds.pillar.View`; ``initialize`` raises them together with the pillars' before touching anything.

:func:`required_ds_flags` is the one table of top-level DeepSpeed keys that the pillars need set; a user value
that contradicts one is a problem here, and ``initialize`` sets the missing ones (logged) after ``apply``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .pillar import View

__all__ = ["problems", "required_ds_flags"]


def _step_in_backward(v: View) -> list[str]:
    head = "titan.optimizer.step_in_backward=true"
    out = []
    if v.zero_stage() != 0:
        out.append(f"{head} needs ZeRO stage 0 (stage {v.zero_stage()} steps on flat partitions after the "
                   f"reduction); set zero_optimization.stage to 0 or step_in_backward to false")
    gas = v.gradient_accumulation_steps()
    if gas not in (1, None):
        out.append(f"{head} with gradient_accumulation_steps={gas!r}: each backward updates the weights; set "
                   f"it to 1 (HF Trainer: gradient_accumulation_steps=1)")
    if v.precision() != "fp32":
        out.append(f"{head} with {v.precision()}.enabled: DeepSpeed's {v.precision()} optimizer keeps its own "
                   f"gradient buffers; train in fp32 or set step_in_backward to false")
    if v.titan.plasticity is not None and v.titan.plasticity.enabled:
        out.append(f"{head} with titan.plasticity: BSPS needs the whole step's gradients; disable one of them")
    if v.titan.optimizer.importance == "sketch":
        out.append(f"{head} with importance=\"sketch\": the sketch needs the whole step's gradients; use "
                   f"importance \"momentum\"")
    if v.titan.compression is not None:
        out.append(f"{head} with titan.compression: the update happens before any reduction; remove one of them")
    if v.titan.hms is not None:
        out.append(f"{head} with titan.hms: HMS streams state around engine.step; remove one of them")
    return out


def _bf16_weights(v: View) -> list[str]:
    head = "titan.optimizer.weight_dtype=\"bf16\""
    out = []
    if v.zero_stage() != 0:
        out.append(f"{head} needs ZeRO stage 0: ZeRO-{v.zero_stage()} steps on fp32 master partitions of its own "
                   f"(DeepSpeed's bf16.bf16_master_weights_and_grads keeps them in bf16); set zero_optimization.stage "
                   f"to 0 or remove weight_dtype")
    if v.precision() != "fp32":
        p = v.precision()
        out.append(f"{head} with {p}.enabled: DeepSpeed's {p} optimizer keeps an fp32 master copy of every "
                   f"weight, which is what weight_dtype removes; set {p}.enabled to false (HF Trainer: "
                   f"TrainingArguments({p}=False)): titan casts the model to bf16 itself")
    if v.titan.hms is not None:
        out.append(f"{head} with titan.hms: HMS runs under ZeRO-3; remove one of them")
    return out


def _optimizer(v: View) -> list[str]:
    cfg, out = v.titan.optimizer, []
    if "optimizer" in v.ds_config:
        out.append("titan.optimizer is set and the ds_config has an \"optimizer\" section too; remove one (titan "
                   "builds its optimizer itself)")
    passed = v.optimizer
    if passed is not None and not isinstance(passed, torch.optim.Optimizer):
        out.append(f"titan.optimizer is set and initialize() was given optimizer={passed!r}, which is not a "
                   f"torch.optim.Optimizer; titan can replace an Optimizer instance only")
    if isinstance(passed, torch.optim.Optimizer):
        if "weight_decay" in cfg.model_fields_set:
            out.append(f"titan.optimizer.weight_decay={cfg.weight_decay} is set and an optimizer was passed to "
                       f"initialize (the HF Trainer passes one): titan keeps that optimizer's per-group weight decay "
                       f"(decay and no-decay groups); set it there (TrainingArguments(weight_decay=...)) and "
                       f"remove titan.optimizer.weight_decay")
        seen = v.lr_scheduler is not None and getattr(v.lr_scheduler, "optimizer", None) is passed
        bases = [g["initial_lr"] for g in passed.param_groups if "initial_lr" in g]
        if bases and not seen and "lr" in cfg.model_fields_set and any(b != cfg.lr for b in bases):
            out.append(f"titan.optimizer.lr={cfg.lr} is set but a learning-rate scheduler that initialize() was "
                       f"not given was built over the optimizer passed to it, with base lr {bases}; remove "
                       f"titan.optimizer.lr (titan then uses that base lr), or pass the scheduler as lr_scheduler=")
    return out


def _compression(v: View) -> list[str]:
    cfg, out = v.titan.compression, []
    if cfg.method != "none" and v.world_size < 2:
        out.append(f"titan.compression.method={cfg.method!r} needs at least 2 data-parallel ranks (there is "
                   f"nothing to communicate with {v.world_size}); launch with `deepspeed --num_gpus 2` or more, or "
                   f"remove \"compression\"")
    zero, stage = v.zero(), v.zero_stage()
    if stage not in (0, 1, 2, 3):
        out.append(f"zero_optimization.stage={stage} is not a ZeRO stage titan.compression knows (0, 1, 2, 3)")
    if stage == 3 and zero.get("reduce_scatter", True) is False:
        out.append("zero_optimization.reduce_scatter=false with stage 3 reduces gradients outside the seam "
                   "titan.compression hooks (stage3 __avg_scatter_contiguous_grads); remove it or set it to true")
    if zero.get("zero_quantized_gradients"):
        out.append("zero_optimization.zero_quantized_gradients (ZeRO++ qgZ) and titan.compression both compress "
                   "gradients; switch one off")
    if v.ds_config.get("sparse_gradients"):
        out.append("sparse_gradients=true sends sparse embedding gradients around titan.compression; remove it")
    if cfg.method != "none" and stage in (1, 2, 3) and not cfg.allow_dense_parameter_gather:
        out.append(dense_gather_error(stage, cfg.method))
    return out


def received_bound(stage: int) -> float:
    """The most a compressed gradient exchange can save under ZeRO ``stage`` in bytes received per rank against
    plain ZeRO-0 all-reduce (ring: ``2 (W-1)/W`` gradient bytes a parameter), since DeepSpeed all-gathers the
    parameters densely outside it (``(W-1)/W`` parameter bytes a parameter every step at 1-2, twice at 3: forward
    and backward), with gradients and parameters of the same width (fp32 both, or bf16/fp16 both): 2x at ZeRO 1-2,
    1x at 3, whatever the compressor."""
    return {0: float("inf"), 1: 2.0, 2: 2.0, 3: 1.0}[stage]


def dense_gather_error(stage: int, method: str) -> str:
    return (f"titan.compression.method={method!r} under zero_optimization.stage={stage}: DeepSpeed all-gathers the "
            f"parameters densely {'in every forward and backward' if stage == 3 else 'after every step'}, outside "
            f"the gradient exchange titan compresses, so each rank receives at least "
            f"{'as many bytes as' if stage == 3 else 'half the bytes of'} plain ZeRO-0 all-reduce: at most "
            f"{received_bound(stage):g}x fewer whatever the ratio. Set zero_optimization.stage to 0 for the compressed exchange to hold its ratio, "
            f"or set titan.compression.allow_dense_parameter_gather to true to run it anyway")


def _local_updates(v: View) -> list[str]:
    cfg, out = v.titan.compression, []
    head = f"titan.compression.sync_every={cfg.sync_every} (local updates)"
    if v.zero_stage() != 0:
        out.append(f"{head} needs ZeRO stage 0: ZeRO-{v.zero_stage()} partitions the optimizer state across the "
                   f"ranks it would average over, so no rank can step on its own; set zero_optimization.stage to 0")
    if v.precision() != "fp32":
        out.append(f"{head} with {v.precision()}.enabled: DeepSpeed's {v.precision()} optimizer keeps master "
                   f"weights the outer step would not see; train in fp32")
    if float(v.ds_config.get("gradient_clipping", 0) or 0) > 0:
        out.append(f"{head} with gradient_clipping={v.ds_config['gradient_clipping']}: each rank would clip its own "
                   f"gradient by its own norm, not DeepSpeed's global one (untested); set gradient_clipping to 0")
    if v.world_size < 2 and cfg.method == "none":
        out.append(f"{head} needs at least 2 data-parallel ranks (there is nothing to average with "
                   f"{v.world_size}); launch with 2 or more, or remove sync_every")
    opt = v.titan.optimizer
    if opt is not None and opt.step_in_backward:
        out.append(f"{head} with titan.optimizer.step_in_backward: the inner step would still all-reduce each "
                   f"gradient in its hook; set step_in_backward to false")
    if opt is not None and opt.weight_dtype == "bf16":
        out.append(f"{head} with titan.optimizer.weight_dtype=\"bf16\": the outer step keeps fp32 parameters; "
                   f"remove weight_dtype")
    if v.titan.hms is not None:
        out.append(f"{head} with titan.hms: HMS runs under ZeRO-3; remove one of them")
    return out


def _precondition(v: View) -> list[str]:
    ds, out = v.ds_config, []
    pre = v.titan.compression.precondition
    head = f"titan.compression.precondition={pre!r}"
    if v.titan.optimizer is not None:
        out.append(f"{head} hands the optimizer Adam-scaled updates to apply with plain SGD; it cannot run with "
                   f"titan.optimizer (ASDT); remove one of them")
    if v.precision() != "fp32":
        out.append(f"{head} with {v.precision()}.enabled: the loss scale / low-precision reduction is not handled "
                   f"by the normalization (untested); train in fp32 or remove precondition")
    if float(ds.get("gradient_clipping", 0) or 0) > 0:
        out.append(f"gradient_clipping={ds['gradient_clipping']} would clip the summed Adam-scaled update, not a "
                   f"gradient, under {head}; set gradient_clipping to 0 (HF: TrainingArguments(max_grad_norm=0)) "
                   f"and clip each rank's gradient with local_clip if wanted")
    section = ds.get("optimizer")
    if section is not None:
        kind = str(section.get("type", "")).lower()
        params = section.get("params") or {}
        if kind == "adam" and params.get("adam_w_mode") is False:
            out.append(f"the ds_config's Adam has adam_w_mode=false (L2 in the gradient); {head} applies "
                       f"decoupled weight decay: use AdamW")
        elif kind == "sgd" and pre == "rms_mean":
            out.append(f"{head} needs the ds_config's optimizer to be Adam/AdamW: titan builds the SGD (with "
                       f"momentum beta1 from the Adam's betas) itself; replace the SGD section by AdamW")
        elif kind == "sgd" and float(params.get("momentum", 0) or 0) != 0:
            out.append(f"the ds_config's SGD has momentum={params['momentum']}: under {head} error feedback is the "
                       f"accumulation; set momentum to 0")
        elif kind not in ("adam", "adamw", "sgd"):
            out.append(f"{head} needs the optimizer to be Adam/AdamW (titan turns it into SGD) or SGD without "
                       f"momentum, not {section.get('type')!r}")
    passed = v.optimizer
    if passed is not None and v.titan.optimizer is None:
        from .replace_optimizer import built_optimizer
        params = v.model_parameters if isinstance(v.model_parameters, (list, tuple)) else None  # (not consumed)
        passed = built_optimizer(passed, v.model, params)  # a factory: what it builds, to check its type
        if isinstance(passed, torch.optim.SGD) and pre == "rms_mean":
            out.append(f"{head} needs Adam/AdamW passed to initialize (titan builds the SGD with momentum beta1 from "
                       f"it); initialize() was given an SGD")
        elif isinstance(passed, torch.optim.SGD):
            if any(g.get("momentum", 0) for g in passed.param_groups):
                out.append(f"the SGD passed to initialize has momentum: under {head} error feedback is the "
                           f"accumulation; use momentum=0")
        elif not isinstance(passed, (torch.optim.Adam, torch.optim.AdamW)):
            out.append(f"{head} needs Adam/AdamW (titan turns it into SGD) or SGD without momentum; initialize() "
                       f"was given {type(passed).__name__}")
    return out


def _hms(v: View) -> list[str]:
    from .config import TitanConfigError
    from .hms.install import configure_ds_config
    try:
        configure_ds_config(dict(v.ds_config), v.titan.hms.nvme_path, v.titan.hms.param_tier)
    except TitanConfigError as e:
        return list(e.errors)
    return []


def required_ds_flags(v: View) -> list[tuple[str, Any, str]]:
    """``(key, value, why)`` for each top-level DeepSpeed key the switched-on pillars need."""
    out: list[tuple[str, Any, str]] = []
    stage, t = v.zero_stage(), v.titan
    rms = t.compression is not None and t.compression.precondition != "none"
    if t.hms is not None and v.client_optimizer():
        out += [("zero_force_ds_cpu_optimizer", False, "titan.hms with a client optimizer (offloaded state on the "
                 "CPU)"), ("zero_allow_untested_optimizer", True, "titan.hms with a client optimizer")]
    if t.optimizer is not None and stage >= 1:
        out.append(("zero_allow_untested_optimizer", True, "titan.optimizer (a client optimizer under ZeRO)"))
    if t.optimizer is not None and v.offload_device() in ("cpu", "nvme"):
        out.append(("zero_force_ds_cpu_optimizer", False,
                    "titan.optimizer with offload_optimizer (titan's optimizer steps the CPU partitions itself)"))
    if rms and stage >= 1:  # DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS has Adam/AdamW/Adagrad/Lion, not SGD
        out.append(("zero_allow_untested_optimizer", True,
                    f"titan.compression.precondition={t.compression.precondition!r} (SGD applies the normalized "
                    f"sums)"))
    return out


def _flag_conflicts(v: View) -> list[str]:
    out, seen = [], set()
    for key, value, why in required_ds_flags(v):
        if key in v.ds_config and v.ds_config[key] != value and key not in seen:
            seen.add(key)
            out.append(f"{key}={v.ds_config[key]!r} in the ds_config conflicts with {why}, which needs "
                       f"{key}={value!r}; set it to {value!r} or remove it")
    return out


_RULES: tuple[tuple[Callable[[View], bool], Callable[[View], list[str]]], ...] = (
    (lambda v: v.titan.optimizer is not None, _optimizer),
    (lambda v: v.titan.optimizer is not None and v.titan.optimizer.step_in_backward, _step_in_backward),
    (lambda v: v.titan.optimizer is not None and v.titan.optimizer.weight_dtype == "bf16", _bf16_weights),
    (lambda v: v.titan.compression is not None, _compression),
    (lambda v: v.titan.compression is not None and v.titan.compression.precondition != "none", _precondition),
    (lambda v: v.titan.compression is not None and v.titan.compression.local_updates, _local_updates),
    (lambda v: v.titan.hms is not None, _hms),
    (lambda v: True, _flag_conflicts),
)


def problems(v: View) -> list[str]:
    """Every cross-field problem of ``v``, each naming the keys and the fix."""
    out: list[str] = []
    for applies, rule in _RULES:
        if applies(v):
            out += rule(v)
    return list(dict.fromkeys(out))
