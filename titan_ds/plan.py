"""``titan-ds plan``: which DeepSpeed/titan configuration fits a machine, predicted before anything is run.

For a model (the reference GPT ``gpt:LAYERSxWIDTH``, or a Hugging Face model ``hf:PATH_OR_CONFIG``), a sequence
length, a micro-batch and the memory of each tier (device, DRAM, disk), every candidate configuration gets a
prediction of the bytes it holds per tier, split into parameters, gradients, optimizer state, activations and
ZeRO's working buffers; the table marks those that fit, and the fastest fitting one is written out as a complete
ds_config with its ``"titan"`` section.

The model of each candidate has two parts:

1. **structure**, from DeepSpeed 0.19.8's source: what each ZeRO stage keeps resident, per rank. On this CPU
   accelerator the "device" is DRAM and the dtype is fp32: ZeRO-2 holds the full parameters and gradients and
   the partitioned fp32 master and optimizer state; ZeRO-3 holds partitions plus the gathered working set
   (``stage3_max_live_parameters``, the prefetch and reduce buckets); ZeRO-3 CPU offload adds the fp32
   gradient partition the CPU optimizer reads; HMS keeps on disk parameters, masters and optimizer state and
   holds in DRAM DeepSpeed's fp32 gradient partition (``grad_partitions_flat_buffer``, 4 bytes/param: the
   largest term left; ``hms_gdisk``, ``hms_balanced`` and ``hms_asdt`` map it to a file,
   ``titan.hms.gradient_buffer: "disk"``), one
   optimizer sub-group at a time (plus the master and state of the previous one while its write is in flight:
   ``titan.hms.pipeline_optimizer``) and the next one's read ahead, and its DRAM cache. ZeRO-Infinity
   (``zero_inf``) holds the parameter partitions and the fp32 gradient partition in CPU memory and
   ``buffer_count`` pinned swap buffers of the largest sub-group; masters, moments and gradients are on disk.
   The activations (forward/backward) and an HMS step's sub-group are never held together: the peak counts
   the larger (``Candidate.phase``).
2. **calibration**: per candidate, a process baseline (torch + DeepSpeed loaded, allocator, kernels) and the
   bytes per parameter the structure does not explain (none for the HMS modes, zero3_cpu's for zero_inf), fitted
   on measured runs by
   ``launch/bench/plan_accuracy.py --calibrate`` into ``titan_ds/plan_calibration.json`` (the file records the
   command, date and points; zero_inf and hms_balanced are fitted on committed hms_scale.py trials, which
   ``--refit MODE`` redoes alone). ``launch/bench/plan_accuracy.py`` then checks predictions against cgroup-measured
   peaks of runs that were not used for the fit (README: the accuracy table).

Predictions for a GPU device (``--gpu-mem``) use the same structure with bf16 parameters and gradients on the
device; they are not calibrated here (this machine has no GPU), and the table says so.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .hms.bounds import ZERO3_BOUNDS

__all__ = ["ModelSpec", "Candidate", "HMSLayout", "model_spec", "candidates", "plan", "candidate_config", "MODES",
           "CALIBRATION_FILE", "STEP_TEMP_FILE", "load_step_temp", "format_table"]

GiB = 1 << 30
CALIBRATION_FILE = Path(__file__).with_name("plan_calibration.json")
# candidates, fastest first (the order in which the best fitting one is chosen)
# sub-groups whose optimizer-state writes may be in flight during the step (HMSConfig's pipeline_depth default)
PIPELINE_DEPTH = 1
# the offload modes sit by their measured s/step at 12x768 under 4 GiB on a quiet machine, 3 alternated runs of each
# (results/hms_speed_rank.speed.md): zero3_cpu 2.532, hms_dram 4.050, zero_inf 4.473, hms 4.689; the run before it
# (results/hms_speed_onerank.speed.md) had the same order of hms_dram, zero_inf and hms; tests/test_plan_zinf.py
# checks the order against those files
# hms_balanced (HMS streaming, titan's shipped titan_balanced optimizer, gradients in a file mapping) between
# zero_inf and hms, by s/step at 12x768 under 4 GiB on one machine: hms_dram 1.680 < zero_inf 2.547 < hms 3.091
# (results/hms_speed_1207b.speed.md, 3 alternated runs) and hms_balanced 2.591 / 2.726 before / after the unscale fold
# (results/hms_ab_fold.md, 3 runs each, spread 2.31-2.88): slower than ZeRO-Infinity, faster than hms with torch
# AdamW, whose 8 bytes/param of moments it streams as 1.55; tests/test_plan.py checks the order against those two
# files. So where hms_balanced fits, plan writes it rather than hms or hms_gdisk (AdamW): those are written where it
# does not (its fitted process baseline, 0.32 GiB, is above the 0.18 of hms's that hms_gdisk borrows)
# hms_gdisk (hms with the gradient partitions in a file mapping) after hms: where the gradients fit in DRAM, hms keeps
# them there; where they do not, it is the AdamW candidate that still fits (results/hms_scale_zinf.md: 291.1M under
# 2 GiB at 1.13 GiB where hms stops at 227.3M), ahead of the hms_asdt modes
MODES = ("zero2", "zero3", "zero3_cpu", "hms_dram", "zero_inf", "hms_balanced", "hms", "hms_gdisk", "hms_asdt",
         "hms_asdt_bf16")
# modes whose optimizer is offloaded (ZeRO-3 takes each gradient partition's norm in fp64 in backward)
OFFLOAD_MODES = ("zero3_cpu", "zero_inf", "hms_dram", "hms_balanced", "hms", "hms_gdisk", "hms_asdt",
                 "hms_asdt_bf16")
# modes whose element-proportional bytes (partitions, masters, optimizer state) live on disk, and whose DRAM the
# structure already sizes by what grows (the gradient partition where it is in DRAM, one sub-group, activations):
# their calibration fits the process baseline only. A slope fitted on 0.01-0.2B-parameter shapes was noise
# (-0.19, -0.34, +0.49 bytes/param) that 5B parameters turned into +2.3 GiB (+68% at 25x4096). hms_dram
# (its partitions in RAM are in the structure) likewise: its slope fit (1.22 bytes/param, baseline 0.02 GiB) put
# gpt:8x768 at 1.32 GiB against 1.38 measured; the baseline alone at 1.39
BASELINE_ONLY_MODES = ("hms_dram", "hms_balanced", "hms", "hms_gdisk", "hms_asdt", "hms_asdt_bf16")
# modes whose DeepSpeed fp32 gradient partitions are a file mapping (titan.hms.gradient_buffer "disk") on the CPU
GRADS_ON_DISK_MODES = ("hms_balanced", "hms_gdisk", "hms_asdt", "hms_asdt_bf16")
# a mode without runs of its own in the calibration file borrows another's process baseline (and stays "calibrated:
# no"): hms_dram runs HMS's store and optimizer swapper with DeepSpeed's CPU parameter offload (a calibration file
# from before hms_dram had runs of its own); hms_gdisk is hms with its gradient partitions moved to a file mapping,
# which the structure accounts for
CALIBRATION_OF = {"hms_dram": "hms", "hms_gdisk": "hms"}
# ZeRO-Infinity runs DeepSpeed's ZeRO-3 offload code as zero3_cpu does (the same partitions in CPU memory, the
# same gradient partition): it shares zero3_cpu's fitted bytes/param and fits its own baseline
# ZeRO-Infinity as launch/bench/hms_scale.py trains it (its ``zero_inf`` mode): ZeRO-3, optimizer state (fp32
# masters, AdamW moments, the swapped gradients) on NVMe through DeepSpeed's async_io op, parameters in CPU
# memory (DeepSpeed 0.19.8's parameter swap to NVMe failed at the second step here), DeepSpeedCPUAdam
ZERO_INF_BUFFER_COUNT = 4  # offload_optimizer.buffer_count: pinned fp32 swap buffers of the largest sub-group
AIO_RECOMMENDED = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                   "overlap_events": True}
ZERO_INF_OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}}
# per parameter: AdamW exp_avg + exp_avg_sq; ASDT one momentum buffer in bf16, or in 8 bits (+ a scale per block);
# titan_balanced (ds_configs/titan_balanced.json: ASDT adaptive, state_dtype "8bit", second_moment "coordinate",
# second_dtype "4bit"): an 8-bit momentum code + one fp32 absmax per 256 values and a 4-bit second-moment code + one
# fp32 absmax per 128 (titan_ds/optim/qstate.py KINDS, nbytes_per_value), plus 8 bytes per unit (v, t: a tensor at
# granularity "tensor"), left out; tests/test_plan.py checks it against the state of a real ASDT
OPT_STATE_BYTES = {"adamw": 8, "asdt_bf16": 2, "asdt_8bit": 1,
                   "titan_balanced": (1 + 4 / 256) + (4 / 8 + 4 / 128)}
# per element of the sub-group being stepped: the optimizer step's temporaries above its resident state, measured
# (VmHWM over one step of a 2^26-element fp32 parameter, 1 thread) by launch/bench/optim_step.py into
# titan_ds/step_temp.json (the command is in the file): load_step_temp(); keys are MODE_OPTIMIZER's values and the
# shipped profiles ("titan_balanced", "titan_memory")
STEP_TEMP_FILE = Path(__file__).with_name("step_temp.json")
STEP_TEMP_COMMAND = ("python launch/bench/optim_step.py --what temp --sizes 67108864 --dtypes fp32 "
                     "--step-temp-json titan_ds/step_temp.json")
MODE_OPTIMIZER = {"zero2": "adamw", "zero3": "adamw", "zero3_cpu": "adamw", "zero_inf": "adamw", "hms": "adamw",
                  "hms_dram": "adamw", "hms_gdisk": "adamw", "hms_balanced": "titan_balanced",
                  "hms_asdt": "asdt_bf16", "hms_asdt_bf16": "asdt_8bit"}
# the titan.optimizer section of the shipped profile ds_configs/titan_balanced.json, which hms_balanced trains: kept
# here because an installed package has no ds_configs/ (tests/test_plan.py fails if the two ever differ)
BALANCED_OPTIMIZER: dict[str, Any] = {
    "name": "asdt", "update": "adaptive", "granularity": "tensor", "lr": 0.001, "betas": [0.9, 0.95],
    "density": 1.0, "weight_decay": 0.1, "state_dtype": "8bit", "second_moment": "coordinate",
    "second_dtype": "4bit"}
DESCRIPTION = {
    "zero2": "ZeRO-2, torch AdamW",
    "zero3": "ZeRO-3, torch AdamW",
    "zero3_cpu": "ZeRO-3 + CPU offload (params, optimizer), torch AdamW",
    "zero_inf": "ZeRO-Infinity: ZeRO-3, optimizer state on NVMe (DeepSpeed's async_io op: needs libaio-dev), "
                "params in CPU memory, DeepSpeedCPUAdam",
    "hms_dram": "ZeRO-3 + titan HMS for the optimizer state (on disk), params in CPU memory (param_tier dram), "
                "torch AdamW; needs no libaio",
    "hms": "ZeRO-3 + titan HMS (params, optimizer on disk), torch AdamW",
    "hms_gdisk": "hms with DeepSpeed's fp32 gradient partitions in a file mapping (titan.hms.gradient_buffer disk), "
                 "torch AdamW",
    "hms_balanced": "ZeRO-3 + titan HMS (params, optimizer on disk) + titan's shipped optimizer (titan_balanced: "
                    "ASDT adaptive, 8-bit momentum, 4-bit second moment), gradient partitions in a file mapping",
    "hms_asdt": "ZeRO-3 + titan HMS + titan optimizer (ASDT, bf16 state), gradient partitions in a file mapping",
    "hms_asdt_bf16": "hms_asdt with bf16 parameters (fp32 gradients and masters) and ASDT's momentum in 8 bits",
}


@dataclass
class ModelSpec:
    name: str
    params: int
    layers: int
    hidden: int
    heads: int
    vocab: int
    intermediate: int
    gpt_args: Optional[list[str]] = None  # launch/train.py arguments for the reference GPT
    largest: int = 0  # elements of the largest parameter (a ZeRO-3 sub-group never splits one)


def _count_meta(build) -> tuple[int, int]:
    """Parameters of the model ``build`` makes, and the largest one's, counted on the meta device."""
    import torch
    with torch.device("meta"):
        m = build()
    sizes = [p.numel() for p in m.parameters()]
    return sum(sizes), max(sizes, default=0)


def model_spec(spec: str, seq: int = 128) -> ModelSpec:
    """``gpt:LAYERSxWIDTH`` (the reference GPT of launch/train.py, vocab 256, heads width/64) or
    ``hf:PATH_OR_CONFIG`` (a folder or hub id with a config.json, or a config.json path). Parameters are
    counted by building the model on the meta device (nothing is allocated)."""
    kind, _, arg = spec.partition(":")
    if kind == "gpt":
        try:
            layers, width = (int(x) for x in arg.lower().split("x"))
        except ValueError:
            raise ValueError(f"--model {spec!r}: write gpt:LAYERSxWIDTH, e.g. gpt:12x768") from None
        from .models import GPT, GPTConfig
        heads = max(1, width // 64)
        cfg = GPTConfig(n_layer=layers, n_embd=width, n_head=heads, block_size=max(seq, 128), vocab_size=256)
        n, largest = _count_meta(lambda: GPT(cfg))
        return ModelSpec(spec, n, layers, width, heads, 256, 4 * width,
                         ["--layers", str(layers), "--width", str(width), "--heads", str(heads), "--context",
                          str(max(seq, 128))], largest)
    if kind == "hf":
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError:
            raise ValueError("--model hf:... needs transformers: pip install 'titan-ds[hf]'") from None
        path = arg[:-len("config.json")] if arg.endswith("config.json") else arg
        cfg = AutoConfig.from_pretrained(path or ".")
        n, largest = _count_meta(lambda: AutoModelForCausalLM.from_config(cfg))
        hidden = int(getattr(cfg, "hidden_size", getattr(cfg, "n_embd", 0)))
        return ModelSpec(spec, n, int(getattr(cfg, "num_hidden_layers", getattr(cfg, "n_layer", 0))), hidden,
                         int(getattr(cfg, "num_attention_heads", getattr(cfg, "n_head", 1))),
                         int(cfg.vocab_size), int(getattr(cfg, "intermediate_size", 4 * hidden) or 4 * hidden),
                         largest=largest)
    raise ValueError(f"--model {spec!r}: write gpt:LAYERSxWIDTH or hf:PATH_OR_CONFIG")


def candidate_config(mode: str, *, nvme_path: str = "./titan_storage", micro_batch: int = 1,
                     dram_cache_mb: int = 64, aio: Optional[dict] = None,
                     optimizer_dram_mb: int = 0) -> dict[str, Any]:
    """The complete ds_config of a candidate (what ``plan --out`` writes and the benchmarks train). ``aio``:
    ZeRO-Infinity's aio block (default DeepSpeed's recommended settings; ``hms_scale.py`` sweeps them).
    ``optimizer_dram_mb``: an HMS candidate's ``titan.hms.optimizer_dram_mb`` (:func:`optimizer_dram_budget`)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "steps_per_print": 10**9, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {"stage": 2 if mode == "zero2" else 3}}
    z = cfg["zero_optimization"]
    if mode != "zero2":
        z.update(stage3_param_persistence_threshold=0, **ZERO3_BOUNDS)
    else:
        z.update(reduce_bucket_size=ZERO3_BOUNDS["reduce_bucket_size"],
                 allgather_bucket_size=ZERO3_BOUNDS["reduce_bucket_size"])
    if mode == "zero3_cpu":
        z["offload_param"] = {"device": "cpu"}
        z["offload_optimizer"] = {"device": "cpu"}
    if mode == "zero_inf":  # the keys of launch/bench/hms_scale.py's zero_inf config (tests/test_plan_zinf.py)
        z["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True,
                                  "buffer_count": ZERO_INF_BUFFER_COUNT, "fast_init": False}
        z["offload_param"] = {"device": "cpu", "pin_memory": True}
        cfg["aio"] = dict(aio or AIO_RECOMMENDED)
        cfg["optimizer"] = json.loads(json.dumps(ZERO_INF_OPTIMIZER))
        cfg["zero_force_ds_cpu_optimizer"] = True  # DeepSpeed builds DeepSpeedCPUAdam from "optimizer"
        cfg.pop("zero_allow_untested_optimizer")
    if mode.startswith("hms"):
        cfg["titan"] = {"hms": {"nvme_path": nvme_path, "dram_cache_mb": dram_cache_mb, "prefetch": "trace",
                                "prefetch_depth": 2}}
        if mode == "hms_dram":
            cfg["titan"]["hms"]["param_tier"] = "dram"
        if optimizer_dram_mb > 0:
            cfg["titan"]["hms"]["optimizer_dram_mb"] = int(optimizer_dram_mb)
        # written out either way: the layout predicted is the one run (HMS's memory check adapts only settings a
        # config leaves out, and the benchmarks measure each mode as named)
        cfg["titan"]["hms"]["gradient_buffer"] = "disk" if mode in GRADS_ON_DISK_MODES else "dram"
        if mode == "hms_balanced":
            cfg["titan"]["optimizer"] = balanced_optimizer()
        if mode == "hms_asdt":
            cfg["titan"]["optimizer"] = {"name": "asdt", "lr": 1e-3, "density": 0.1, "state_dtype": "bf16"}
        if mode == "hms_asdt_bf16":
            # bf16 partitions; the gradients accumulate in fp32 (the master's dtype), so the optimizer reads them
            # from the file mapping in place; density 1 skips the top-k selection (most of the step of a 405M
            # model); sign steps over every coordinate of a 4096-wide matrix need a small lr
            cfg["bf16"] = {"enabled": True}
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
            cfg["titan"]["optimizer"] = {"name": "asdt", "lr": 1e-5, "density": 1.0, "state_dtype": "8bit"}
    return cfg


def balanced_optimizer() -> dict[str, Any]:
    """The ``titan.optimizer`` section of the shipped ``ds_configs/titan_balanced.json`` (``hms_balanced``'s), a copy."""
    return json.loads(json.dumps(BALANCED_OPTIMIZER))


@dataclass
class Candidate:
    mode: str
    description: str
    device: dict[str, float] = field(default_factory=dict)  # bytes by kind; empty on a CPU-only machine
    dram: dict[str, float] = field(default_factory=dict)
    disk: dict[str, float] = field(default_factory=dict)
    fits: bool = False
    why: str = ""
    calibrated: bool = True
    # kinds held only during one phase of the step: "activations" in forward/backward, an HMS optimizer's
    # sub-group working set in the optimizer step. They are never held together (the saved activations are freed
    # by the end of backward), so a tier's peak is what every phase holds plus the larger phase
    phase: dict[str, str] = field(default_factory=dict)

    def peak(self, tier: dict[str, float]) -> float:
        phases: dict[str, float] = {}
        for k, v in tier.items():
            if k in self.phase:
                phases[self.phase[k]] = phases.get(self.phase[k], 0.0) + v
        return sum(v for k, v in tier.items() if k not in self.phase) + max(phases.values(), default=0.0)

    @property
    def dram_peak(self) -> float:
        return self.peak(self.dram)

    @property
    def device_peak(self) -> float:
        return self.peak(self.device)

    @property
    def disk_total(self) -> float:
        return sum(self.disk.values())


def load_calibration(path: Path = CALIBRATION_FILE) -> dict[str, Any]:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python launch/bench/plan_accuracy.py --calibrate`")
    return json.loads(path.read_text())


@functools.lru_cache(maxsize=None)
def load_step_temp(path: Path = STEP_TEMP_FILE) -> dict[str, float]:
    """Bytes per element of the optimizer step's temporaries, by optimizer (``titan_ds/step_temp.json``)."""
    fix = f"regenerate it: {STEP_TEMP_COMMAND}"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {fix}")
    try:
        table = json.loads(path.read_text())["bytes_per_element"]
        out = {str(k): float(v) for k, v in table.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is malformed ({type(e).__name__}: {e}); it must hold \"bytes_per_element\": "
                         f"{{optimizer: bytes}}; {fix}") from None
    missing = sorted(set(MODE_OPTIMIZER.values()) - set(out))
    bad = sorted(k for k, v in out.items() if not v >= 0)
    if missing or bad:
        raise ValueError(f"{path}: " + "; ".join(
            ([f"no figure for {', '.join(missing)}"] if missing else []) +
            ([f"{', '.join(bad)} not a number >= 0"] if bad else [])) + f"; {fix}")
    return out


def activation_bytes(m: ModelSpec, seq: int, micro: int, elem: int = 4) -> float:
    """Saved activations of one micro-batch, per layer s*b*(34h + 5*a*s) half-precision bytes (Korthikanti et
    al. 2022) scaled to ``elem`` bytes, plus the logits and their softmax (2 x b*s*vocab)."""
    per_layer = seq * micro * (34 * m.hidden + 5 * m.heads * seq) * elem / 2
    return m.layers * per_layer + 2 * micro * seq * m.vocab * elem


@dataclass(frozen=True)
class HMSLayout:
    """Where an HMS run keeps what, as its ``titan.hms`` section and ds_config say: an HMS mode's defaults are
    :meth:`of_mode` (what ``plan`` writes for it); :mod:`titan_ds.hms.budget` builds one from the config a user
    passes to ``initialize``."""

    optimizer: str = "adamw"       # a key of OPT_STATE_BYTES and of step_temp.json
    weight_bytes: int = 4          # bytes of a parameter partition element on the CPU accelerator (2: bf16/fp16)
    params_in_dram: bool = False   # titan.hms.param_tier "dram"
    grads_on_disk: bool = False    # titan.hms.gradient_buffer "disk"
    cache_bytes: int = 64 * 2**20  # titan.hms.dram_cache_mb (plan's candidates: 64)
    resident_bytes: int = 0        # titan.hms.optimizer_dram_mb
    bounds: tuple[tuple[str, int], ...] = tuple(ZERO3_BOUNDS.items())  # ZeRO-3's working-buffer bounds

    @classmethod
    def of_mode(cls, mode: str) -> "HMSLayout":
        return cls(optimizer=MODE_OPTIMIZER[mode], weight_bytes=2 if mode == "hms_asdt_bf16" else 4,
                   params_in_dram=mode == "hms_dram", grads_on_disk=mode in GRADS_ON_DISK_MODES)


def _structure(mode: str, m: ModelSpec, ranks: int, seq: int, micro: int, gpu: bool,
               step_temp: Optional[dict] = None, pipeline_depth: int = PIPELINE_DEPTH,
               layout: Optional[HMSLayout] = None) -> dict[str, dict[str, float]]:
    """Bytes per rank by tier and kind, before calibration (``phase``: the kinds held in one phase only).
    ``step_temp`` and ``pipeline_depth``: the optimizer's temporaries and sub-groups in flight of the code that ran
    (default today's: titan_ds/step_temp.json, PIPELINE_DEPTH), for runs measured on earlier code. ``layout``: an
    HMS mode's settings where they are not the mode's own (:class:`HMSLayout`; default ``HMSLayout.of_mode``)."""
    P, N = m.params, ranks
    hl = None  # the HMS modes' layout
    if mode.startswith("hms"):
        hl = layout if layout is not None else HMSLayout.of_mode(mode)
    bounds = dict(hl.bounds) if hl is not None else ZERO3_BOUNDS
    S = OPT_STATE_BYTES[hl.optimizer if hl is not None else MODE_OPTIMIZER[mode]]
    # parameter/gradient bytes on the device: bf16 on a GPU, fp32 on the CPU accelerator unless the mode is bf16
    w = 2 if gpu else hl.weight_bytes if hl is not None else 4
    # the optimizer step holds one sub-group; ZeRO-3 never splits a parameter, so a larger one is its own
    sub = max(min(bounds["sub_group_size"], P / N), min(m.largest, P / N))
    # gathered parameters: ZeRO-3 fetches a module's parameters whole whatever stage3_max_live_parameters says
    # (partitioned_param_coordinator.py fetch_sub_module: the bound only limits the prefetch), so a parameter larger
    # than the bound (a 4096-wide MLP matrix, 67M elements) is live whole
    live = min(max(bounds["stage3_max_live_parameters"], m.largest), P)
    dev: dict[str, float] = {"activations": activation_bytes(m, seq, micro, w)}
    if mode in OFFLOAD_MODES:
        # backward's working set beside a parameter's gathered copy (counted in ``live``): its gradient (w), that
        # gradient's partition in fp32 when w is 2 (stage3.py:1944) and its fp64 copy for the norm that ZeRO-3
        # takes with the optimizer offloaded (_constant_buffered_norm2; titan_ds/hms/gradnorm.py keeps it for the
        # whole backward); the largest parameter sets it: measured 1.85 GiB at gpt:2x4096 hms_asdt_bf16 in
        # backward where the rest of the structure gave 0.58 (results/hms_memprofile/bf16_2x4096.json)
        dev["backward"] = min(m.largest, P / N) * (w + (4 if w != 4 else 0) + 8)
    dram: dict[str, float] = {}
    disk: dict[str, float] = {}
    if mode == "zero2":
        dev.update(parameters=w * P, gradients=w * P + (4 * P / N if gpu else 0),
                   optimizer=4 * P / N + S * P / N,
                   buffers=2 * 4 * ZERO3_BOUNDS["reduce_bucket_size"])
    elif mode == "zero3":
        dev.update(parameters=w * P / N + w * live, gradients=w * P / N, optimizer=4 * P / N + S * P / N,
                   buffers=4 * (ZERO3_BOUNDS["reduce_bucket_size"] + ZERO3_BOUNDS["stage3_prefetch_bucket_size"]))
    elif mode == "zero3_cpu":
        dev.update(parameters=w * live, gradients=w * P / N,
                   buffers=4 * (ZERO3_BOUNDS["reduce_bucket_size"] + ZERO3_BOUNDS["stage3_prefetch_bucket_size"]))
        dram.update(parameters=w * P / N, gradients=4 * P / N, optimizer=4 * P / N + S * P / N)
    elif mode == "zero_inf":
        # DeepSpeed 0.19.8 stage3.py: the parameter partitions stay in CPU memory (offload_param cpu); the fp32
        # gradient partition (grad_partitions_flat_buffer) is allocated whatever the offload; every sub-group is
        # swappable, so its fp32 master is an empty tensor and the master, both moments and the gradient are on
        # NVMe; optimizer_utils.py's SwapBufferManager pins buffer_count buffers of the largest sub-group (fp32)
        # at initialize, into which each sub-group's master, moments and gradient are read and DeepSpeedCPUAdam
        # steps them in place (fused: no temporaries)
        dev.update(parameters=w * live,
                   buffers=4 * (ZERO3_BOUNDS["reduce_bucket_size"] + ZERO3_BOUNDS["stage3_prefetch_bucket_size"]))
        dram.update(parameters=w * P / N, gradients=4 * P / N, optimizer=ZERO_INF_BUFFER_COUNT * 4 * sub)
        disk.update(optimizer=(4 + S) * P / N, gradients=4 * P / N)
    else:  # hms*: partitions, masters and optimizer state on disk; one sub-group in DRAM during the step
        grads_on_disk = hl.grads_on_disk and not gpu  # titan.hms.gradient_buffer "disk" (a file mapping)
        dev.update(parameters=w * live, gradients=0 if grads_on_disk else w * P / N,
                   buffers=w * (bounds["reduce_bucket_size"] + bounds["stage3_prefetch_bucket_size"]))
        if hl.params_in_dram:  # titan.hms.param_tier "dram": the partitions in CPU memory (offload_param cpu)
            dram["parameters"] = w * P / N
        if gpu and not hl.grads_on_disk:
            # with the optimizer offloaded, ZeRO-3 keeps its fp32 gradient partition in CPU memory on a GPU too
            # (DeepSpeed 0.19.8 stage3.py:333 self.device "cpu", :791 grad_partitions_flat_buffer), as zero3_cpu's
            # and zero_inf's structure count it
            dram["gradients"] = 4 * P / N
        # the sub-group's master, gradient and state, and the step's temporaries; plus the previous sub-group's
        # master and state still being written (titan.hms.pipeline_optimizer, on by default, depth 1)
        # and the next sub-group's master and state, read ahead while this one steps
        # (titan_ds/hms/optimizer_swapper.py: swap_in_optimizer_state prefetches async_parameter's keys; before the
        # pipelined step too)
        temp = (step_temp or load_step_temp())[hl.optimizer]
        dram.update(optimizer=sub * (4 + 4 + S + temp) + sub * (4 + S) * (pipeline_depth + 1),
                    cache=hl.cache_bytes)
        if hl.resident_bytes:  # titan.hms.optimizer_dram_mb: sub-groups kept in DRAM between steps
            dram["resident"] = hl.resident_bytes
        # fp32 masters + state; the gradients are read where ZeRO-3 keeps them (its CPU buffer, or the file
        # mapping of gradient_buffer "disk", counted on disk)
        disk.update(optimizer=(4 + S) * P / N, gradients=4 * P / N if grads_on_disk else 0)
        if not hl.params_in_dram:
            disk["parameters"] = w * P / N
    phase = {"activations": "forward/backward", "backward": "forward/backward"}
    if mode.startswith("hms"):
        phase["optimizer"] = "optimizer step"
    if gpu:
        return {"device": dev, "dram": dram, "disk": disk, "phase": phase}
    for k, v in dev.items():  # the CPU accelerator: the device is DRAM
        dram[k] = dram.get(k, 0) + v
    return {"device": {}, "dram": dram, "disk": disk, "phase": phase}


def predict(mode: str, m: ModelSpec, *, ranks: int = 1, seq: int = 128, micro: int = 1, gpu: bool = False,
            calibration: Optional[dict] = None, step_temp: Optional[dict] = None,
            pipeline_depth: int = PIPELINE_DEPTH, layout: Optional[HMSLayout] = None) -> Candidate:
    t = _structure(mode, m, ranks, seq, micro, gpu, step_temp, pipeline_depth, layout)
    c = Candidate(mode, DESCRIPTION[mode], device=t["device"], dram=t["dram"], disk=t["disk"], phase=t["phase"])
    modes = (calibration or load_calibration())["modes"]
    cal = modes.get(mode, modes.get(CALIBRATION_OF.get(mode, "")))
    if mode not in modes or gpu:
        c.calibrated = False
    if cal is not None:  # the process baseline, and bytes/param the structure does not explain
        c.dram["baseline"] = cal["baseline_bytes"]
        c.dram["unexplained"] = cal["extra_bytes_per_param"] * m.params / ranks
    return c


# the share of the DRAM a candidate may be predicted to use: the prediction is within 15% of the measured peak on
# every held-out run and was up to 14% low (results/plan_accuracy.md), so a candidate predicted at the whole cap
# could be OOM-killed (tests/test_plan.py's 1.5 GiB check: hms_dram predicted at 1.32 GiB, measured 1.38 before
# its resident optimizer sub-groups); plan keeps this much of the cap as headroom for its own error
HEADROOM = 0.10
# the share of what the cap leaves beside an HMS candidate's predicted peak (less the headroom) that plan gives to
# optimizer sub-groups kept in memory (titan.hms.optimizer_dram_mb); the rest stays as margin
RESIDENT_SHARE = 0.5


def usable_dram(cpu_mem: float) -> float:
    """The DRAM plan lets a candidate's predicted peak reach: ``cpu_mem`` less :data:`HEADROOM`."""
    return cpu_mem * (1 - HEADROOM)


def optimizer_dram_budget(c: Candidate, cpu_mem: float, ranks: int = 1) -> int:
    """MiB of ``titan.hms.optimizer_dram_mb`` for candidate ``c`` under ``cpu_mem`` bytes of DRAM shared by
    ``ranks`` processes: :data:`RESIDENT_SHARE` of what each rank has left of :func:`usable_dram` beside ``c``'s
    predicted DRAM peak; 0 for a candidate without HMS or with nothing left."""
    if not c.mode.startswith("hms"):
        return 0
    return max(0, int((usable_dram(cpu_mem) / ranks - c.dram_peak) * RESIDENT_SHARE) // (1 << 20))


# The candidates that need DeepSpeed's async_io op (a C++ op over libaio): refused where it does not build.
NEEDS_AIO = ("zero_inf",)


def aio_buildable() -> bool:
    """Whether DeepSpeed's async_io op builds here (its builder's own check: libaio's headers and library)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder
    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def candidates(m: ModelSpec, *, seq: int, micro: int, cpu_mem: float, disk: float, gpu_mem: Optional[float] = None,
               ranks: int = 1, calibration: Optional[dict] = None, aio: Optional[bool] = None) -> list[Candidate]:
    """Every candidate with its prediction and whether it fits (all sizes in bytes; DRAM and disk are for the
    whole machine, shared by ``ranks`` processes; the device memory is per rank). ``aio``: whether DeepSpeed's
    async_io op builds on the target machine (False: the :data:`NEEDS_AIO` candidates do not fit; None: not
    checked, as for a machine other than this one)."""
    out = []
    for mode in MODES:
        c = predict(mode, m, ranks=ranks, seq=seq, micro=micro, gpu=gpu_mem is not None, calibration=calibration)
        reasons = []
        if c.dram_peak * ranks > usable_dram(cpu_mem):
            reasons.append(f"DRAM {c.dram_peak * ranks / GiB:.2f} > {usable_dram(cpu_mem) / GiB:.2f} GiB "
                           f"({1 - HEADROOM:.0%} of {cpu_mem / GiB:.1f}: plan's headroom for its error)")
        if gpu_mem is not None and c.device_peak > gpu_mem:
            reasons.append(f"device {c.device_peak / GiB:.1f} > {gpu_mem / GiB:.1f} GiB")
        if c.disk_total * ranks > disk:
            reasons.append(f"disk {c.disk_total * ranks / GiB:.1f} > {disk / GiB:.1f} GiB")
        if aio is False and mode in NEEDS_AIO:
            reasons.append("DeepSpeed's async_io op does not build here: apt-get install libaio-dev "
                           "(or pass --aio yes when planning for another machine)")
        c.fits, c.why = not reasons, "; ".join(reasons) or "fits"
        out.append(c)
    return out


def plan(m: ModelSpec, **kw) -> tuple[list[Candidate], Optional[Candidate]]:
    cands = candidates(m, **kw)
    return cands, next((c for c in cands if c.fits), None)


def format_table(m: ModelSpec, cands: list[Candidate], ranks: int) -> str:
    kinds = ["parameters", "gradients", "optimizer", "activations", "backward", "buffers", "cache", "baseline", "unexplained"]
    lines = [f"model {m.name}: {m.params / 1e6:,.1f}M parameters ({m.layers} layers, hidden {m.hidden}); "
             f"per rank, GiB; DRAM is the peak: the activations (forward/backward) and an HMS optimizer step's "
             f"sub-group (dram:optimizer of the hms modes) are never held together, so it counts the larger", ""]
    head = ["config", "fits", "device", "DRAM", "disk"] + [f"dram:{k}" for k in kinds] + ["calibrated", "why"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for c in cands:
        cells = [c.mode, "yes" if c.fits else "no", f"{c.device_peak / GiB:.2f}" if c.device else "-",
                 f"{c.dram_peak / GiB:.2f}", f"{c.disk_total / GiB:.2f}"]
        cells += [f"{c.dram.get(k, 0) / GiB:.2f}" for k in kinds]
        cells += ["yes" if c.calibrated else "no", c.why]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_size(text: str) -> float:
    """'24G', '512M', '2.5GiB', '60' (GiB) -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    if t and t[-1] in mult:
        return float(t[:-1]) * mult[t[-1]]
    try:
        return float(t) * GiB
    except ValueError:
        raise ValueError(f"size {text!r}: write e.g. 24G, 512M or a number of GiB") from None
