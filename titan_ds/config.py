"""The ``"titan"`` section of a ds_config.json, as typed, strict models.

Every sub-section is one pillar; a missing sub-section means that pillar is off. Parsing collects every
problem in the whole section and raises them together as one :class:`TitanConfigError`, each message
naming the key as the user wrote it (``titan.trd.rank must be >= 1, got 0``).

The seed's flat form ``TITANConfig(device="cuda", use_trd=True, trd_rank=16, nvme_path="./x")`` is accepted
too and converted to the same structure (:mod:`titan_ds.config_flat`); the messages are made in
:mod:`titan_ds.config_errors`.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .comm.qtopk import BITS as _QTOPK_BITS, DEFAULT_BITS, DEFAULT_CHUNK, MAX_CHUNK, qtopk_max_ratio
from .comm.registry import REGISTRY as _COMPRESSORS
from .config_errors import SECTION, TitanConfigError, find_auto, format_errors
from .config_flat import structured

__all__ = [
    "TitanConfig",
    "TitanConfigError",
    "HMSConfig",
    "OptimizerConfig",
    "PlasticityConfig",
    "CompressionConfig",
    "TRDConfig",
    "MLMEConfig",
    "load_ds_config",
    "ds_precision",
]

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=False)


class DiskTier(_Strict):
    """One disk tier of HMS below DRAM: a folder and an optional capacity (MiB) before spilling further."""

    path: str
    capacity_mb: Optional[int] = Field(default=None, ge=1)


class HMSConfig(_Strict):
    """Hierarchical Memory Streaming: tiered device / DRAM / NVMe store for ZeRO-3 swap.

    ``pipeline_optimizer`` (on by default) pipelines ZeRO-3's optimizer step over its sub-groups: while sub-group
    i steps, the state of i+1 is read and that of i-1 written in the background, at most ``pipeline_depth``
    sub-groups' writes in flight (each holds one more sub-group's fp32 master and state in DRAM). The writes are
    flushed at the end of every step, before a checkpoint and on close; a failed write is raised there, naming its
    key. Off: every sub-group's state is on disk before the next one steps. The results are bit-identical.

    ``param_write_behind`` (off by default: measured slower on this 2-core machine, 15.8 vs 13.0 s/step at
    12x768, its background writes competing with the optimizer state's for the CPU; at 907.7M no different, 0.92x
    and 1.03x in two invocations: results/hms_900m_wb, hms_900m_wb2) writes the parameter partitions the optimizer step updates in the
    background too (the store's parameter writer thread), at most ``pipeline_depth`` sub-groups' partitions in
    flight; they go on into the next forward, whose read of a partition waits for its write. They are flushed
    before a checkpoint is saved or loaded and on close; a failed write is raised by the next read of that
    partition, after the step, or there, naming its key. Off: each sub-group's partitions are on disk before the
    step goes on. The results are bit-identical.

    ``master_from_partitions`` (on by default): with partitions in the master's dtype (fp32), each sub-group's
    fp32 master is the concatenation of its parameter partitions, which the optimizer step writes anyway, so the
    master is read back from those files and not written a second time (4 bytes/param less written per step, and
    on disk from the first step on: initialize still writes every master once). A sub-group whose partitions were
    not all written from its master in that step (another dtype, a partition ZeRO-3 kept in memory) writes its
    master as before. Bit-identical either way. With ``param_tier: "dram"`` the partitions stay in CPU memory and
    ZeRO-3 copies the master into them after each sub-group's step: there the master is neither written nor read
    back (8 bytes/param less disk traffic per step; checked bit for bit against the partitions at each write).

    ``optimizer_dram_mb`` (default 0): a DRAM budget for optimizer sub-groups that are never written to disk.
    Each sub-group is admitted at its first swap-out while its state (and its fp32 master, unless the parameter
    partitions in RAM hold the master's bits) fits what is left; admitted ones keep their tensors in memory, so
    the step reads and writes only the others (ZeRO-3 visits every sub-group each step in the same order, so a
    fixed set saves what any cache of that size could). Checkpoints and resume hold them like the others.
    ``titan-ds plan`` does not set it: give it what the memory cap leaves beside HMS's peak.

    ``param_tier``: where the parameter partitions live between uses. ``"nvme"`` (default): in the store, streamed
    in by trace prefetch (models whose parameters do not fit in RAM). ``"dram"``: in CPU memory, as DeepSpeed's
    ``offload_param: {"device": "cpu"}`` keeps them (ZeRO-Infinity's form), and HMS keeps only the optimizer
    state (fp32 master, moments, gradients) on disk: no parameter reads or writes per step, for models whose
    parameters (2-4 bytes each) fit in RAM but whose optimizer state (12-16 bytes each) does not.
    ``titan-ds plan`` picks it where it fits.

    Memory check (``initialize``, before anything is touched; :mod:`titan_ds.hms.budget`): HMS reads the RAM
    the process may use (its memory cgroup's limit, v1 ``memory.limit_in_bytes`` or v2 ``memory.max``, else
    ``MemAvailable`` plus its own resident set) and estimates with ``titan-ds plan``'s calibrated model what
    ``initialize`` and a step will hold for this model and these settings (activations not counted; plan's 10%
    headroom kept). Where that does not fit, it lowers ``dram_cache_mb`` (not below 64) and/or sets
    ``gradient_buffer`` to ``"disk"``, only where the key is absent, and logs a warning saying what and why;
    where nothing it may change fits, ``initialize`` refuses, naming the bytes needed and available, where they
    were read, and the settings (a value the user set included, never changed) that would fit, or ``titan-ds
    plan``. Skipped with ``titan.trd`` (it changes the parameter count afterwards).
    """

    nvme_path: str
    param_tier: Literal["nvme", "dram"] = "nvme"
    dram_cache_mb: int = Field(default=2048, ge=0)
    device_budget_mb: Optional[int] = Field(default=None, ge=1)
    prefetch: Literal["trace", "lstm", "none"] = "trace"
    prefetch_depth: int = Field(default=2, ge=0)
    # whole-file reads in flight at once for prefetch (each split over the io_threads pool)
    prefetch_workers: int = Field(default=2, ge=1, le=64)
    io_threads: int = Field(default=4, ge=1, le=64)
    # "detect" (not "auto": the titan section rejects "auto" values, which HF accelerate would try to fill)
    direct_io: Literal["detect", "on", "off"] = "detect"
    # xxh3 checksums on the per-step swap files too (snapshots and checkpoints are always checked): off by
    # default, as a swap file never outlives the run; on to catch a disk that corrupts data while training
    swap_checksums: bool = False
    spill_tiers: list[DiskTier] = Field(default_factory=list)
    nvme_capacity_mb: Optional[int] = Field(default=None, ge=1)
    # where ZeRO-3's fp32 gradient partition lives (4 bytes/param, DeepSpeed's grad_partitions_flat_buffer):
    # "dram" as DeepSpeed allocates it; "disk" a file mapping under nvme_path, which the kernel writes back and
    # reclaims under memory pressure (for models whose gradients do not fit in RAM; slower). Absent: "dram", or
    # "disk" where the memory check finds that "dram" does not fit (logged)
    gradient_buffer: Literal["dram", "disk"] = "dram"
    # with gradient_buffer "disk": each gradient piece is written to the store (O_DIRECT) as ZeRO-3 hands it over
    # in backward and punched out of the mapping once on disk; the step reads it back prefetched with the state
    # instead of faulting the mapping's pages in (and the kernel never writes them back). Bit-identical; 0.910x the
    # 5.04B step, no different at 907.7M (results/hms_gstore_5b.speed.md, hms_gstore_900m). Not with fp16 (its
    # overflow check reads the whole buffer at the step): off there, refused if set
    gradient_store: bool = True
    # pipelined optimizer step: while sub-group i steps, i+1's state is read and i-1's written in the
    # background (write-behind); pipeline_depth sub-groups' writes in flight at most (each one more sub-group's
    # master and state in DRAM); all flushed at the end of the step, before a checkpoint and on close
    pipeline_optimizer: bool = True
    pipeline_depth: int = Field(default=1, ge=1, le=8)
    # the updated parameter partitions written behind as well (pipeline_depth sub-groups in flight at most)
    param_write_behind: bool = False
    # the optimizer state read into reused huge-page buffers instead of fresh tensors: 0.860x the step alone at
    # 12x768 (results/hms_ab_pool.md). The pool keeps a buffer only while a read still to come this step can reuse
    # it (io.BufferPool.expect), so it holds no more than fresh tensors do where no size repeats (plan's 8x768
    # config under 1.5 GiB: 1.455 GiB peak when it kept every buffer to the step's end, now as without it).
    # The parameter partitions too: each is read into a buffer of the parameter swapper's pool, given back when
    # ZeRO-3 releases the partition if no other tensor shares it (at most ZeRO-3's prefetch window kept free)
    pooled_reads: bool = True
    # fp32 partitions: each sub-group's fp32 master is kept as the parameter partitions ZeRO-3 writes from it (the
    # same bytes) instead of a second file (opt/<id>/fp32): 4 bytes/param less written per step
    master_from_partitions: bool = True
    # MiB of DRAM for optimizer sub-groups that stay in memory between steps instead of going to disk (their state,
    # and their fp32 master unless the partitions in RAM hold it): no reads or writes for them. 0: all on disk
    optimizer_dram_mb: int = Field(default=0, ge=0)

    @field_validator("nvme_path")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be a folder path, got an empty string")
        return v


class OptimizerConfig(_Strict):
    """The titan optimizer: ASDT, or its dense sign-momentum special case."""

    name: Literal["asdt", "lion"] = "asdt"
    lr: float = Field(default=1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.99)
    density: float = Field(default=0.1, gt=0, le=1)
    weight_decay: float = Field(default=0.0, ge=0)
    importance: Literal["momentum", "grad_weight", "sketch"] = "momentum"
    # the momentum's storage: "8bit"/"4bit" are block-wise quantized (torchao's quantizers; 1.02 / 0.53 bytes)
    state_dtype: Literal["fp32", "bf16", "8bit", "4bit"] = "fp32"
    granularity: Literal["tensor", "block", "row"] = "tensor"  # a unit: a parameter, a block, a matrix row
    block_size: int = Field(default=4096, ge=1)          # elements per unit when granularity="block"
    update: Literal["sign", "adaptive"] = "sign"         # sign of momentum, or Adam with one 2nd moment per unit
    eps: float = Field(default=1e-8, ge=0)               # update="adaptive": Adam's epsilon
    # update="adaptive": one second moment per unit (two fp32 numbers), or per coordinate (Adam's own) stored in
    # second_dtype ("8bit": 1.02 bytes an element, "4bit": 0.53)
    second_moment: Literal["unit", "coordinate"] = "unit"
    second_dtype: Literal["fp32", "bf16", "8bit", "4bit"] = "fp32"
    # update="adaptive": clamp each coordinate's step to [-update_clip, update_clip] (x lr); a coordinate whose
    # gradient is far above its unit's RMS (outlier features of pretrained models) otherwise moves 10-40x lr
    update_clip: Optional[float] = Field(default=None, gt=0)
    # update each parameter in its gradient hook during backward and free the gradient at once: the gradients
    # of the whole model never exist together (ZeRO 0, no gradient clipping, no accumulation, no BSPS)
    step_in_backward: bool = False
    # run the dense adaptive step (density 1) as compiled fused graphs (torch.compile: vectorized C++ on a CPU,
    # Triton on a GPU), bit for bit the eager loop; the first steps pay the compiles (seconds each, per state kind
    # and unit length). The environment variable TITAN_CORE_COMPILE=1 turns it on for every optimizer
    compile: bool = False
    # "bf16": titan casts the model to bf16 and no fp32 master copy is kept (ZeRO stage 0, no fp16/bf16 section):
    # each weight and its gradient take 2 bytes instead of 4. `rounding` says how ASDT writes an updated bf16
    # weight: "stochastic" (unbiased; the default) or "nearest" (drops every update under half a bf16 step)
    weight_dtype: Optional[Literal["bf16"]] = None
    rounding: Literal["stochastic", "nearest"] = "stochastic"
    rounding_seed: int = 0
    sketch_width: int = Field(default=1 << 16, ge=16)    # TGSS table (importance="sketch"): width x depth fp32
    sketch_depth: int = Field(default=3, ge=1, le=16)

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        for b in v:
            if not 0.0 <= b < 1.0:
                raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v

    @model_validator(mode="after")
    def _lion(self) -> "OptimizerConfig":
        if self.name == "lion" and self.update != "sign":
            raise ValueError(f"has update=\"{self.update}\" with name \"lion\": Lion is the sign update; use name "
                             f"\"asdt\" for update \"adaptive\"")
        if self.name == "lion" and "density" in self.model_fields_set and self.density != 1.0:
            raise ValueError(f"has density={self.density} with name \"lion\": Lion is the dense (density 1) "
                             f"sign-momentum optimizer; use name \"asdt\" for a sparse one")
        return self


class PlasticityConfig(_Strict):
    """BSPS: which parameter blocks may learn, Frozen -> Growth -> Elastic -> Sleeping."""

    enabled: bool = True
    max_active_fraction: float = Field(default=0.5, gt=0, le=1)
    block: Literal["module", "parameter"] = "module"
    warmup_steps: int = Field(default=50, ge=0)
    elastic_lr_scale: float = Field(default=0.3, gt=0, le=1)
    elastic_pull: float = Field(default=0.01, ge=0, le=1)
    sleep_after: int = Field(default=100, ge=1)
    wake_every: int = Field(default=50, ge=1)
    ema: float = Field(default=0.9, ge=0, lt=1)
    plateau_ratio: float = Field(default=0.5, gt=0, le=1)


# the choices of titan.compression.method: the names in titan_ds/comm/registry.py, nowhere else
_CompressionMethod = Literal[tuple(_COMPRESSORS)]  # type: ignore[valid-type]
# titan.compression keys every method takes; each method lists the others it uses in its class's config_keys
_EVERY_METHOD = {"method", "warmup_steps", "allow_dense_parameter_gather"}
# the local RMS preconditioner (titan_ds/comm/precondition.py) runs before any codec: every method but "none"
_PRECONDITION_KEYS = {"precondition", "precondition_beta1", "precondition_beta2", "precondition_eps",
                      "residuals_follow_lr"}
# local updates (DiLoCo, titan_ds/comm/diloco.py): the compressor then acts on the outer gradient
_LOCAL_KEYS = {"sync_every", "outer_lr", "outer_momentum", "outer_nesterov"}
# per-step gradient options that mean nothing for an outer gradient exchanged every sync_every steps
_PER_STEP_ONLY = ("warmup_steps", "momentum", "momentum_masking", "local_clip", "ratio_warmup_steps",
                  "ratio_warmup_start")


class CompressionConfig(_Strict):
    """Gradient compression on DeepSpeed's reduce path (titan_ds/comm, docs/compress.md).

    ``ratio`` is the target of dense bytes / bytes handed to the collective per rank; ``sketch_rows`` is the
    number of count-sketch rows (tgss) or holograms (hge); ``warmup_steps`` optimizer steps run uncompressed;
    ``seed`` keys the hashes and phases (identical on all ranks) and PowerSGD's first ``Q``.
    ``ratio_warmup_steps`` steps after those ramp the ratio geometrically from ``ratio_warmup_start`` to ``ratio``
    (DGC's sparsity warm-up; topk, tgss, hge). ``topk`` only: ``momentum`` (DGC's momentum correction factor; the
    residual accumulates velocity, so give the optimizer no momentum of its own), ``momentum_masking`` (zero the
    momentum where a value was sent), ``local_clip`` (max L2 norm of each parameter's local gradient before it is
    accumulated; DGC: the global clipping threshold / sqrt(ranks)). ``powersgd`` only: ``rank`` (of the low-rank
    approximation) and ``min_compression`` (a matrix is compressed only if it shrinks at least this much, else sent
    dense). ``qtopk`` only (SparseLoCo's message, titan_ds/comm/qtopk.py): ``bits`` (2, 4 or 8 bits per sent value,
    with a per-chunk scale), ``chunk`` (entries per chunk, 2 to 65536; each chunk sends its top values with
    in-chunk indices of 1 byte up to chunk 256, else 2 bytes; the ratio must fit one value per chunk,
    ``4 chunk / (index bytes + scale bytes + bits / 8)``: 195x at chunk 256 and 2 bits), ``scale_dtype`` (the
    per-chunk scale's dtype: ``fp32``, 4 bytes, or ``bf16``, 2 bytes: fp32's range, 3 significant digits; at one
    value a chunk the scale is most of the message, and bf16 frees its bytes for more values) and ``exchange``: ``all_gather``
    (every rank receives every other rank's message: bytes received grow with the number of ranks) or ``sharded``
    (each rank owns a shard of whole chunks; the messages' pieces go to their owners by an all-to-all, each owner
    sums its shard, re-compresses it with its own error feedback and all-gathers it: each rank receives about 2x
    its message whatever the number of ranks, like a ring all-reduce of it; ``gather_share``: the share of those
    bytes that the owners' re-compressed sums take, 0.5 = both messages at ``ratio``). ``precondition="rms"`` (every
    method but ``none``): each rank divides its gradient by the RMS of its own gradients (Adam's second moment,
    ``precondition_beta2``/``precondition_eps``, kept per rank) before error feedback and the compressor, so the
    reduced sum is an Adam-scaled update that plain SGD applies: titan turns the ds_config's Adam/AdamW (or the
    Adam/AdamW passed to initialize) into SGD with the same lr and weight decay (titan_ds/comm/precondition.py).
    ``precondition="rms_mean"`` (many ranks): each rank divides instead by its estimate of the RMS of the ranks'
    *mean* gradient (from its own first moment, ``precondition_beta1``, and second moment), and the SGD gets
    momentum and dampening ``beta1`` (the Adam's ``betas[0]`` unless ``precondition_beta1`` is set).
    ``precondition="rms_sketch"`` (many ranks): ``rms``'s per-rank second moment sets the denominator's shape, and
    one all-reduced float per tensor (a random sign projection of the gradient) sets its level to the RMS of the
    ranks' *mean* gradient; SGD without momentum, as for ``rms``. ``residuals_follow_lr`` (default true; with a
    ``precondition`` only): when the lr changes (a warm-up, a decay) the error-feedback residuals are rescaled by
    ``lr_before / lr_now``, so that they hold the update not yet applied in the parameter's units (EF-SGD's form):
    what a step at lr ``a`` left unsent moves the parameter by ``a`` times it when it is sent, not by the lr of
    the step that sends it. Bit for bit nothing changes under a constant lr; false: residuals in gradient units.
    A key that the chosen method does not use is an error, not ignored.

    Under ZeRO 1-3 DeepSpeed all-gathers the parameters densely (every step at 1-2, in forward and backward at 3),
    outside the gradient path titan compresses, so a rank receives at least half (ZeRO-3: all) the bytes of plain
    ZeRO-0 all-reduce whatever the compressor: ``initialize`` refuses the combination, naming the bound, unless
    ``allow_dense_parameter_gather`` is true (the run is then compressed on the gradient path only).

    ``sync_every=H > 1`` switches to **local updates** (DiLoCo; titan_ds/comm/diloco.py, docs/compress.md): every
    rank takes H steps of its own optimizer with no gradient all-reduce, then the ranks exchange their parameter
    change ``anchor - params`` through ``method``/``ratio``/``error_feedback`` (``none``: dense) and apply an outer
    Nesterov step (``outer_lr``, ``outer_momentum``, ``outer_nesterov``; DiLoCo's 0.7 / 0.9 / true).
    """

    method: _CompressionMethod = "topk"
    ratio: float = Field(default=50.0, ge=1)
    error_feedback: bool = True
    warmup_steps: int = Field(default=0, ge=0)
    sketch_rows: int = Field(default=3, ge=1, le=64)
    seed: int = Field(default=0, ge=0, lt=2**31)
    ratio_warmup_steps: int = Field(default=0, ge=0)
    ratio_warmup_start: float = Field(default=2.0, ge=1)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    momentum_masking: bool = True
    local_clip: Optional[float] = Field(default=None, gt=0)
    rank: int = Field(default=1, ge=1, le=1024)
    min_compression: float = Field(default=2.0, ge=1)
    bits: Literal[_QTOPK_BITS] = DEFAULT_BITS  # type: ignore[valid-type]
    chunk: int = Field(default=DEFAULT_CHUNK, ge=2, le=MAX_CHUNK)
    scale_dtype: Literal["fp32", "bf16"] = "fp32"
    exchange: Literal["all_gather", "sharded"] = "all_gather"
    gather_share: float = Field(default=0.5, gt=0, lt=1)
    precondition: Literal["none", "rms", "rms_mean", "rms_sketch"] = "none"
    precondition_beta1: float = Field(default=0.9, gt=0, lt=1)
    precondition_beta2: float = Field(default=0.999, gt=0, lt=1)
    precondition_eps: float = Field(default=1e-8, gt=0)
    residuals_follow_lr: bool = True
    sync_every: int = Field(default=1, ge=1)
    outer_lr: float = Field(default=0.7, gt=0)
    outer_momentum: float = Field(default=0.9, ge=0, lt=1)
    outer_nesterov: bool = True
    allow_dense_parameter_gather: bool = False

    @property
    def local_updates(self) -> bool:
        return self.sync_every > 1

    @model_validator(mode="after")
    def _local_keys(self) -> "CompressionConfig":
        outer = sorted((_LOCAL_KEYS - {"sync_every"}) & self.model_fields_set)
        if outer and not self.local_updates:
            raise ValueError(f"has {', '.join(outer)} but sync_every is {self.sync_every} (no local updates, no "
                             f"outer step); set sync_every > 1 (DiLoCo: 50-500) or remove them")
        if self.local_updates:
            per_step = [k for k in _PER_STEP_ONLY if k in self.model_fields_set]
            if per_step:
                raise ValueError(f"has {', '.join(per_step)} with sync_every={self.sync_every}: per-step gradient "
                                 f"options, while local updates compress the outer gradient once every "
                                 f"{self.sync_every} steps; remove {'it' if len(per_step) == 1 else 'them'}")
            if self.precondition != "none":
                raise ValueError(f"precondition={self.precondition!r} with sync_every={self.sync_every}: the outer "
                                 f"gradient is already a sum of Adam-scaled inner updates; remove precondition")
        return self

    @model_validator(mode="after")
    def _used_keys(self) -> "CompressionConfig":
        used = set(_COMPRESSORS[self.method].config_keys) | _EVERY_METHOD | _LOCAL_KEYS
        if self.method != "none":
            used |= _PRECONDITION_KEYS
        bad = sorted(self.model_fields_set - used)
        if bad:
            raise ValueError(f"has {', '.join(bad)}, which method={self.method!r} does not use; remove "
                             f"{'it' if len(bad) == 1 else 'them'} or choose a method that uses "
                             f"{'it' if len(bad) == 1 else 'them'}")
        top = qtopk_max_ratio(bits=self.bits, chunk=self.chunk, scale_dtype=self.scale_dtype)
        if self.method == "qtopk" and self.ratio > top:
            raise ValueError(f"has ratio={self.ratio:g} with method='qtopk' and chunk={self.chunk}, which sends at "
                             f"least one value per chunk: at most {top:.4g}x; raise chunk (in-chunk indices are 1 "
                             f"byte up to 256, 2 bytes up to {MAX_CHUNK}), set scale_dtype 'bf16' or lower ratio")
        if "gather_share" in self.model_fields_set and self.exchange != "sharded":
            raise ValueError("has gather_share but exchange is 'all_gather' (one message, nothing to share); set "
                             "exchange 'sharded' or remove gather_share")
        if self.method == "qtopk" and self.exchange == "sharded":
            passes = {"the pieces": self.ratio / (2 * (1 - self.gather_share)),
                      "the owners' sums": self.ratio / (2 * self.gather_share)}
            over = [f"{name} at {r:.4g}x" for name, r in passes.items() if r > top]
            if over:
                raise ValueError(f"has exchange='sharded' with ratio={self.ratio:g} and gather_share="
                                 f"{self.gather_share:g}, which sends {', '.join(over)}, above the {top:.4g}x that "
                                 f"chunk={self.chunk} allows (one value per chunk); raise chunk, lower ratio or move "
                                 f"gather_share toward 0.5")
        if self.exchange == "sharded" and not self.error_feedback:
            raise ValueError("has exchange='sharded' with error_feedback false: the sharded exchange compresses each "
                             "shard's sum a second time and keeps that error for the next step; set "
                             "error_feedback true or exchange 'all_gather'")
        if "ratio_warmup_start" in self.model_fields_set and self.ratio_warmup_steps == 0:
            raise ValueError("has ratio_warmup_start but ratio_warmup_steps is 0 (no ramp); set ratio_warmup_steps "
                             "or remove ratio_warmup_start")
        if self.ratio_warmup_steps > 0 and not self.ratio_warmup_start < self.ratio:
            raise ValueError(f"ratio_warmup_start={self.ratio_warmup_start:g} must be below ratio={self.ratio:g} "
                             f"(the warm-up ramps up to ratio); lower it or raise ratio")
        if ({"precondition_beta2", "precondition_eps"} & self.model_fields_set) and self.precondition == "none":
            raise ValueError("has precondition_beta2/precondition_eps but precondition is 'none'; set "
                             "precondition='rms' or remove them")
        if "residuals_follow_lr" in self.model_fields_set and self.precondition == "none":
            raise ValueError("has residuals_follow_lr but precondition is 'none' (without it the optimizer, not the "
                             "lr alone, turns the sum into the update); set precondition or remove "
                             "residuals_follow_lr")
        if "precondition_beta1" in self.model_fields_set and self.precondition != "rms_mean":
            raise ValueError(f"has precondition_beta1 but precondition is {self.precondition!r} (only 'rms_mean' keeps "
                             f"a first moment); set precondition='rms_mean' or remove precondition_beta1")
        if self.precondition != "none" and self.momentum > 0:
            raise ValueError(f"precondition={self.precondition!r} with momentum={self.momentum:g}: error feedback already accumulates "
                             f"the normalized gradients (DGC's momentum on top re-sends them); remove momentum")
        if self.precondition != "none" and self.warmup_steps > 0:
            raise ValueError(f"precondition={self.precondition!r} with warmup_steps={self.warmup_steps}: dense warm-up steps would "
                             f"hand raw gradients to the SGD that applies the normalized sums; ramp the ratio with "
                             f"ratio_warmup_steps instead")
        if "momentum_masking" in self.model_fields_set and self.momentum == 0:
            raise ValueError("has momentum_masking but momentum is 0 (no momentum to mask); set momentum (DGC: 0.9) "
                             "or remove momentum_masking")
        return self


# The linears of a transformer block: titan's GPT (qkv, proj, fc, out), HF Llama / Qwen2 / Mistral / Gemma
# (q/k/v/o_proj, gate/up/down_proj) and HF GPT-2 (Conv1D c_attn, c_fc, c_proj). Never the embedding or lm_head.
TRD_DEFAULT_INCLUDE = (r"\.(qkv|proj|fc|out|[qkvo]_proj|gate_proj|up_proj|down_proj|c_attn|c_fc|c_proj)$",)


class TRDConfig(_Strict):
    """Tensor-ring linear layers (titan_ds/inject/trd.py, docs/trd.md).

    ``rank``: one rank for every ring edge, or one per core (then every replaced layer must have that many
    cores). ``include``/``exclude``: regexes, ``re.search`` on qualified module names (``blocks.0.mlp.fc``,
    ``model.layers.0.self_attn.q_proj``; default :data:`TRD_DEFAULT_INCLUDE`).
    ``init``: ``random`` (variance-matched) or ``tr_svd`` (tensorly TR-SVD of the dense weight).
    ``min_features``: skip linears with ``min(in, out)`` below this. ``mode_size``: target size of the tensor
    modes the features are factored into. ``path``: ``cheapest`` picks the association with fewer multiply-adds per call.
    ``core_lr_scale``: the cores' learning rate as a multiple of the optimizer's (a reparametrization, so it holds
    under any lr schedule; exact for Adam-type and sign optimizers; docs/trd.md).
    """

    rank: Union[int, list[int]] = 16
    include: list[str] = Field(default_factory=lambda: list(TRD_DEFAULT_INCLUDE))
    exclude: list[str] = Field(default_factory=list)
    init: Literal["random", "tr_svd"] = "random"
    min_features: int = Field(default=64, ge=1)
    mode_size: int = Field(default=4, ge=2)
    path: Literal["cheapest", "factored", "dense"] = "cheapest"
    core_lr_scale: float = Field(default=1.0, gt=0, le=1000)

    @field_validator("rank")
    @classmethod
    def _rank(cls, v: Union[int, list[int]]) -> Union[int, list[int]]:
        ranks = v if isinstance(v, list) else [v]
        if not ranks:
            raise ValueError("must be an int >= 1 or a non-empty list of them, got []")
        for r in ranks:
            if r < 1:
                raise ValueError(f"must be >= 1, got {v}")
        return v

    @field_validator("include", "exclude")
    @classmethod
    def _regexes(cls, v: list[str]) -> list[str]:
        bad = []
        for pat in v:
            try:
                re.compile(pat)
            except re.error as e:
                bad.append(f"{pat!r} ({e})")
        if bad:
            raise ValueError("is not a valid regular expression: " + ", ".join(bad))
        return v


class MLMEConfig(_Strict):
    """Micro-layer materialization: tiled attention, StripeFFN, chunked cross-entropy.

    attention: "tiled" (titan_ds.kernels.attention), "sdpa" (torch SDPA), "off" (attention left as built);
    tile: query/key tile of the tiled attention (the Triton kernel caps its blocks at 128, 64 for head dims > 64);
    stripe_ffn: tokens per StripeFFN stripe, "budget" = the largest stripe whose hidden activations fit in
    titan_ds.kernels.stripe_ffn.STRIPE_BUDGET_BYTES (16 MiB), null = MLP left as built; stripe_ffn_saves: what
    StripeFFN keeps for backward, "input" (the MLP's input only; recomputes the input projections in backward,
    ~1.2x the eager MLP's time) or "pre_activation" (also the input projections' outputs, half of what the eager
    MLP keeps; recomputes only the activation, the eager MLP's time); chunked_loss: fuse the LM head with the
    cross-entropy (reference GPT's lm_loss; HF Llama/Qwen2/Qwen3/Mistral/Gemma/GPT-2 causal LMs in training with
    labels, titan_ds/inject/hf_loss.py; another HF family raises);
    loss_chunk: tokens per loss chunk; loss_vocab_chunk: classes per vocabulary chunk (null = whole vocabulary);
    recompute_blocks: keep only each transformer block's input for backward and recompute the block inside
    backward (one block's activations live at a time; costs one extra forward);
    recompute_ffn: "in_backward" (default): in that recomputation a StripeFFN whose output only enters the block's
    residual sum returns zeros and its backward computes the MLP once (checked on the replay's graph; a block that
    reads the MLP's output otherwise is replayed in full, with a warning); "replay": the MLP's forward runs in the
    recomputation as in the first forward (titan_ds/inject/recompute.py). Needs recompute_blocks.
    """

    attention: Literal["tiled", "sdpa", "off"] = "tiled"
    tile: int = Field(default=128, ge=16, le=1024)
    stripe_ffn: Union[int, Literal["budget"], None] = "budget"
    stripe_ffn_saves: Literal["input", "pre_activation"] = "input"
    chunked_loss: bool = True
    loss_chunk: int = Field(default=4096, ge=1)
    loss_vocab_chunk: Optional[int] = Field(default=None, ge=1)
    recompute_blocks: bool = False
    recompute_ffn: Literal["in_backward", "replay"] = "in_backward"

    @model_validator(mode="after")
    def _something_on(self) -> "MLMEConfig":
        if self.attention == "off" and self.stripe_ffn is None and not self.chunked_loss and not self.recompute_blocks:
            raise ValueError("switches nothing on (attention \"off\", stripe_ffn null, chunked_loss "
                             "false, recompute_blocks false); remove the \"mlme\" section or switch one on")
        if "recompute_ffn" in self.model_fields_set and not self.recompute_blocks:
            raise ValueError(f"recompute_ffn {self.recompute_ffn!r} is set but recompute_blocks is false: it says how a "
                             "recomputed block's MLP is replayed; set recompute_blocks true or remove recompute_ffn")
        return self

    @field_validator("stripe_ffn", mode="before")
    @classmethod
    def _stripe(cls, v: Any) -> Any:
        if v is None or v == "budget":
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"must be a number of tokens >= 1, \"budget\" or null, got {v!r}")
        return v

    @field_validator("tile")
    @classmethod
    def _pow2(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two (Triton tiles), got {v}")
        return v


_SUBSECTIONS = ("hms", "optimizer", "plasticity", "compression", "trd", "mlme")


class TitanConfig(_Strict):
    """The whole ``"titan"`` section. Build with ``TitanConfig.from_ds_config(cfg)`` or the seed's flat keywords."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    hms: Optional[HMSConfig] = None
    optimizer: Optional[OptimizerConfig] = None
    plasticity: Optional[PlasticityConfig] = None
    compression: Optional[CompressionConfig] = None
    trd: Optional[TRDConfig] = None
    mlme: Optional[MLMEConfig] = None

    def __init__(self, **data: Any):
        autos = find_auto(data, SECTION)
        try:
            super().__init__(**structured(data))
        except ValidationError as e:
            errors = format_errors(e, TitanConfig)
            # an "auto" value also fails its type check: report it once, with the reason
            auto_keys = {a.split(" ", 1)[0] for a in autos}
            raise TitanConfigError(autos + [m for m in errors if m.split(" ", 1)[0] not in auto_keys]) from None
        if autos:
            raise TitanConfigError(autos)

    @model_validator(mode="after")
    def _cross_checks(self) -> "TitanConfig":
        if self.plasticity is not None and self.plasticity.enabled and self.optimizer is None:
            raise ValueError("titan.plasticity needs titan.optimizer (BSPS schedules the titan optimizer); "
                             "add \"optimizer\": {\"name\": \"asdt\"} or remove \"plasticity\"")
        return self

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_ds_config(cls, config: Union[str, os.PathLike, Mapping[str, Any], None]) -> Optional["TitanConfig"]:
        """Parse the ``"titan"`` section of a whole ds_config (dict or json path).

        Returns None when there is no ``"titan"`` section. Raises only :class:`TitanConfigError`.
        """
        ds = load_ds_config(config)
        if SECTION not in ds:
            return None
        section = ds[SECTION]
        if not isinstance(section, Mapping):
            raise TitanConfigError([f"titan must be an object with sub-sections {list(_SUBSECTIONS)}, "
                                    f"got {type(section).__name__}"])
        return cls(**dict(section))

    @property
    def enabled_pillars(self) -> list[str]:
        return [k for k in _SUBSECTIONS if getattr(self, k) is not None]

    def to_section(self) -> dict[str, Any]:
        """The structured section as a plain dict (what goes under ``"titan"`` in a ds_config)."""
        return self.model_dump(mode="json", exclude_none=True)


TITANConfig = TitanConfig  # the seed's name; its flat keywords are mapped by titan_ds.config_flat


_TRUE = {"true", "1", "yes", "on", "t", "y", "auto"}


def _flag_on(value: Any) -> bool:
    """A ds_config ``enabled`` value as DeepSpeed's (pydantic) config reads it; ``"budget"`` (HF accelerate fills it
    from TrainingArguments) counts as on, so the rules that refuse a precision also refuse what may become it."""
    if isinstance(value, str):
        return value.strip().lower() in _TRUE
    return bool(value)


def ds_precision(ds: Mapping[str, Any]) -> str:
    """The one reader of a ds_config's precision sections: ``"fp16"``, ``"bf16"`` (also DeepSpeed's alias
    ``"bfloat16"``) or ``"fp32"``, by their ``enabled`` flags (:func:`_flag_on`)."""
    for key, name in (("fp16", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16")):
        section = ds.get(key)
        if isinstance(section, Mapping) and _flag_on(section.get("enabled", False)):
            return name
    return "fp32"


def load_ds_config(config: Union[str, os.PathLike, Mapping[str, Any], None]) -> dict[str, Any]:
    """A ds_config as a dict: from a dict (copied), a json path, or None (empty)."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return json.loads(json.dumps(config))  # deep copy; also rejects non-JSON values early
    path = Path(config)
    if not path.is_file():
        from .moved_configs import moved_message
        raise TitanConfigError([moved_message(path) or f"ds_config path {str(path)!r} does not exist or is not a file"])
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TitanConfigError([f"ds_config {str(path)!r} is not valid JSON: {e}"]) from None
