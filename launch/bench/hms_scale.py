"""HMS at scale: the largest reference GPT that trains 2 steps under a hard memory cap, plain DeepSpeed vs HMS.

Command (from the repository root, as root on Linux with cgroup v1; PATH is a folder on the disk HMS uses)::

    PYTHONPATH=$PWD python launch/bench/hms_scale.py --path /work/hms_bench --caps 2,4,8

For each cap C (GiB) and each mode, bisection on the depth of a GPT of width ``--width`` finds the largest model
that trains ``--steps`` steps with a finite loss inside a cgroup capped at C (``memory.limit_in_bytes`` and
``memory.memsw.limit_in_bytes``: no swap). Every model is built under ``titan_ds.zero_init`` (``deepspeed.zero.Init``
for plain DeepSpeed), so no mode ever holds the whole model in RAM. Modes:

- ``zero3_cpu``: plain DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to CPU, torch AdamW;
- ``zero_inf``: DeepSpeed's own NVMe offload (ZeRO-Infinity): ZeRO-3, optimizer state on NVMe through its
  ``async_io`` op with the ``aio`` settings this disk measured best (:func:`aio_settings`: a small
  ``ds_nvme_tune``-like sweep around DeepSpeed's recommended ones), parameters in CPU memory (``offload_param``
  to ``nvme`` fails in DeepSpeed 0.19.8 at the second step here, see :data:`ZERO_INF_PARAM`), and DeepSpeed's
  ``DeepSpeedCPUAdam`` built by DeepSpeed from the config's ``optimizer`` section (AdamW, the betas, lr and weight
  decay launch/train.py gives torch AdamW; the weight decay applies to every tensor, where train.py's client
  AdamW spares vectors). Needs libaio (``apt-get install libaio-dev``): checked at start
  (:func:`async_io_status`); without it the mode is skipped with a reason row;
- ``hms``: ZeRO-3 with titan HMS (parameters and optimizer state on disk), torch AdamW;
- ``hms_gdisk``: ``hms`` (torch AdamW) with ``titan.hms.gradient_buffer: "disk"`` (plan's candidate of that name): DeepSpeed's fp32 gradient
  partitions in a file mapping as ``hms_balanced`` has them (``hms`` keeps them in DRAM, 4 bytes a parameter), so
  the AdamW row and the titan-optimizer row differ only in the optimizer; ``hms_wb``: ``hms`` with
  ``titan.hms.param_write_behind`` (the updated parameter partitions written on the store's writer thread);
- ``hms_cpuadam``: ``hms`` stepping with DeepSpeed's ``DeepSpeedCPUAdam`` (its fused C++ op), built by DeepSpeed
  from the same ``optimizer`` section as ``zero_inf`` (so the optimizer is ZeRO-Infinity's, like for like; the
  weight decay applies to every tensor, as there); ``hms_cpuadam_wb``: the same with ``param_write_behind``;
- ``hms_dram`` / ``hms_dram_cpuadam``: ``hms`` / ``hms_cpuadam`` with ``titan.hms.param_tier: "dram"``: the
  parameter partitions in CPU memory as ZeRO-Infinity keeps them here, HMS only for the optimizer state
  (ZeRO-Infinity's form, like for like with ``zero_inf``);
- ``hms_dram_cpuadam_res`` / ``hms_balanced_res``: ``hms_dram_cpuadam`` / ``hms_balanced`` with
  ``titan.hms.optimizer_dram_mb`` 512 (``--optimizer-dram-mb``): the optimizer
  sub-groups that fit 512 MiB of the cap's DRAM stay in memory between steps (no I/O for them), the rest on disk
  (ZeRO-Infinity has no such setting: its optimizer offload is to NVMe or to CPU memory as a whole);
- ``hms_balanced``: HMS with titan's quality-tested optimizer, the ``optimizer`` section of
  ``ds_configs/titan_balanced.json`` (ASDT, adaptive update, density 1, 8-bit state), fp32 parameters, and
  ``gradient_buffer: "disk"`` as in ``hms_asdt``; never the sign mode; ``hms_balanced_wb``: the same with
  ``titan.hms.param_write_behind`` (the updated parameter partitions written in the background);
  ``hms_balanced_gs`` / ``hms_balanced_map``: the same with ``titan.hms.gradient_store`` set on / off (the
  gradient pieces written to the store in backward and punched out of the mapping, read back prefetched with the
  state; off: the step reads the mapping in place);
  ``hms_dram_balanced``: ``hms_dram`` with ``hms_balanced``'s optimizer section (the parameters and DeepSpeed's
  gradient partitions in CPU memory as ``zero_inf`` keeps them: titan's optimizer against ZeRO-Infinity's AdamW,
  the rest the same);
- ``hms_dram_cpuadam_4k`` / ``hms_balanced_4k``: ``hms_dram_cpuadam`` / ``hms_balanced`` with HMS's reused I/O
  buffers on ordinary 4 KiB pages (``TITAN_HMS_HUGE_PAGES=0``; titan_ds/hms/io.py): the A/B of huge pages;
- ``hms_balanced_fresh``: ``hms_balanced`` with the parameter partitions read into fresh buffers
  (``TITAN_HMS_PARAM_POOL=0``; titan_ds/hms/install.py), as before the parameter read pool: the A/B of that pool;
- ``hms_asdt``: ``hms`` with the titan optimizer (ASDT, bf16 state, density 0.1) and ``gradient_buffer: "disk"``;
- ``hms_asdt_bf16``: ``hms_asdt`` with bf16 parameters (``bf16.enabled``; the gradients still accumulate in fp32,
  ``data_types.grad_accum_dtype``, in the file mapping), ASDT's momentum in 8 bits, density 1 (no top-k
  selection: its cost dominated the step of a 405M model) and lr 1e-5 (sign steps at width 4096 need it):
  11 bytes/param on disk (bf16 partition 2, fp32 master 4, 8-bit momentum 1, fp32 gradient 4) where
  ``hms_asdt`` writes 14. For the full-size run.

``--speed-shape LAYERSxWIDTH`` adds s/step at one shape every mode fits, under ``--speed-cap`` GiB: ``--speed-repeats``
runs of each mode, alternated (the mode order reverses from one run to the next), each ``--speed-warmup`` + ``--speed-steps`` steps;
a run's s/step is the median of its steps after the warm-up, the table's the median over the runs
(``<out>.speed.{md,csv}``, trials in ``<out>.speed.jsonl``). ``--lock FILE`` holds ``flock FILE`` around each
trial and the aio sweep (one trial at a time, so a hold lasts one trial), for machines where timed jobs share.
``--no-run`` runs nothing and writes the tables from the recorded trials (give it the search options of the runs:
a search that needs a trial not yet run says so in its row). A trial's key is (mode, cap, depth, width): the
aio settings a ``zero_inf`` trial ran with are in its record, not its key. Trial logs: ``results/logs/<out name>/``.

``--mode-opts 'MODE:width=W,start=N,max_layers=N'`` (``;`` between modes) gives a mode its own width and search
bounds: a 5B model is 25 layers of 4096 (700 of 768), and one trial of it takes about half an hour here.

All modes get the same ZeRO-3 buffer bounds (``titan_ds.hms.install.ZERO3_BOUNDS``; HMS sets them by default, a
DeepSpeed user would have to), so the comparison is of where the model's bytes live, not of bucket sizes.
Every trial is saved at once to ``<out>.trials.jsonl`` (``launch/bench/store.py``); a rerun reuses them from the
same code (resumable; ``--reuse-stale``: from any code, e.g. the trials recorded before the store). Table:
``<out>.{md,csv}`` with the largest fitting model per (cap, mode), its cgroup peaks (anonymous memory sampled, and the kernel's
high-water mark with page cache), disk used, s/step, and the ratio of HMS's parameters to plain DeepSpeed's.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launch.bench.harness import ResultLog, run_capped_clean  # noqa: E402
from launch.bench.store import add_store_args  # noqa: E402
from titan_ds.hms.install import ZERO3_BOUNDS  # noqa: E402
from titan_ds.plan import candidate_config, model_spec  # noqa: E402
from titan_ds.memcap import cgroup_available  # noqa: E402
from titan_ds.utils import free_port  # noqa: E402

MODES = ("zero3_cpu", "zero_inf", "hms", "hms_cpuadam", "hms_dram", "hms_dram_cpuadam", "hms_dram_cpuadam_res",
         "hms_balanced", "hms_balanced_res", "hms_balanced_wb", "hms_dram_balanced", "hms_asdt", "hms_asdt_bf16",
         "hms_dram_cpuadam_4k", "hms_balanced_4k", "hms_gdisk", "hms_wb", "hms_cpuadam_wb", "hms_balanced_gs",
         "hms_balanced_map", "hms_balanced_fresh")
BASE_MODE = {"zero_inf": "zero3_cpu", "hms_balanced_res": "hms_balanced", "hms_balanced_wb": "hms_balanced",
             "hms_balanced_gs": "hms_balanced", "hms_balanced_map": "hms_balanced",
             "hms_cpuadam": "hms", "hms_dram_balanced": "hms", "hms_wb": "hms", "hms_cpuadam_wb": "hms",
             "hms_dram": "hms", "hms_dram_cpuadam": "hms", "hms_dram_cpuadam_res": "hms"}
CPU_ADAM_MODES = ("zero_inf", "hms_cpuadam", "hms_cpuadam_wb", "hms_dram_cpuadam", "hms_dram_cpuadam_res", "hms_dram_cpuadam_4k")
RESIDENT_MB = 512  # the *_res modes' titan.hms.optimizer_dram_mb (--optimizer-dram-mb)  # DeepSpeed builds DeepSpeedCPUAdam from the config's optimizer  # the titan_ds.plan mode each extra mode starts from
GiB = 1 << 30
# ZeRO-Infinity's parameter placement: "cpu". With "nvme", DeepSpeed 0.19.8 fails at the second step here ("param 3
# already assigned swap buffer id 10"; with fewer buffers "Not enough buffers"), so the parameters stay in CPU memory
ZERO_INF_PARAM = "cpu"
# DeepSpeed's recommended aio settings (its docs' "aio" block, the defaults of 0.19.8's aio_config.py; thread_count
# is intra_op_parallelism there) and the sweep around them (ds_nvme_tune sweeps these same knobs)
AIO_RECOMMENDED = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                   "overlap_events": True}
AIO_SWEEP = {"block_size": (262144, 1048576), "queue_depth": (8, 32), "intra_op_parallelism": (1, 2)}
# the optimizer section of DeepSpeed's own offload: AdamW as launch/train.py's client AdamW sets it
ZERO_INF_OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}}


def gpt_params(layers: int, width: int) -> int:
    return model_spec(f"gpt:{layers}x{width}").params


def async_io_status() -> str | None:
    """None when DeepSpeed's ``async_io`` op builds and loads here; else why not, with the fix."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        b = AsyncIOBuilder()
        if not b.is_compatible(verbose=False):
            return ("DeepSpeed's async_io op cannot be built: libaio is missing (as root: apt-get install -y "
                    "libaio-dev, then rerun)")
        b.load(verbose=False)
    except Exception as e:  # a failed JIT build raises whatever the toolchain raised
        return f"DeepSpeed's async_io op did not build or load ({type(e).__name__}: {e})"
    return None


def aio_sweep(path: str, mib: int = 256) -> list[dict]:
    """Write then read a ``mib`` MiB file through DeepSpeed's aio handle (O_DIRECT) under each setting of
    :data:`AIO_SWEEP` (the rest as recommended): one row per setting with its GB/s."""
    import itertools

    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder
    aio = AsyncIOBuilder().load(verbose=False)
    os.makedirs(path, exist_ok=True)
    f, rows = os.path.join(path, "aio_sweep.bin"), []
    for values in itertools.product(*AIO_SWEEP.values()):
        s = dict(AIO_RECOMMENDED, **dict(zip(AIO_SWEEP, values)))
        h = aio.aio_handle(s["block_size"], s["queue_depth"], s["single_submit"], s["overlap_events"],
                           s["intra_op_parallelism"])
        buf = h.new_cpu_locked_tensor(mib << 20, torch.empty(0, dtype=torch.uint8))
        buf.random_(0, 128)
        speeds = {}
        for op in ("write", "read"):
            t = time.perf_counter()
            n = h.sync_pwrite(buf, f) if op == "write" else h.sync_pread(buf, f)
            if n < 0:
                raise RuntimeError(f"aio {op} of {f} failed under {s}")
            speeds[f"{op}_GBps"] = (mib << 20) / (time.perf_counter() - t) / 1e9
        h.free_cpu_locked_tensor(buf)
        rows.append({**s, **speeds})
    os.remove(f)
    return rows


def aio_settings(path: str, sweep_file: Path, lock: str | None) -> dict:
    """The ``aio`` block for ZeRO-Infinity: the swept setting with the best sum of read and write speed, measured
    once into ``sweep_file`` (reused while it exists)."""
    if sweep_file.exists():
        rows = json.loads(sweep_file.read_text())
    else:
        with timed_lock(lock):
            rows = aio_sweep(path)
        sweep_file.write_text(json.dumps(rows, indent=1))
    best = max(rows, key=lambda r: r["read_GBps"] + r["write_GBps"])
    return {k: best[k] for k in AIO_RECOMMENDED}


@contextlib.contextmanager
def timed_lock(path: str | None):
    """``flock path`` (exclusive, waiting) for the block; nothing when path is None."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ds_config(mode: str, nvme: str, aio: dict | None = None) -> dict:
    """The ds_config a mode trains: ``titan_ds.plan.candidate_config`` (what ``titan-ds plan --out`` writes) for its
    modes (``hms_balanced`` included); ``zero_inf`` starts from ``zero3_cpu``, the other extra modes from ``hms`` or
    ``hms_balanced`` (so the same ZeRO-3 buffer bounds), and change only what the docstring says. ``aio``:
    ZeRO-Infinity's aio block (default: recommended)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if mode.endswith("_4k"):  # the same config; trial() turns huge pages off in its environment
        return ds_config(mode[:-3], nvme, aio)
    if mode.endswith("_fresh"):  # the same config; trial() turns the parameter read pool off in its environment
        return ds_config(mode[:-6], nvme, aio)
    cfg = candidate_config(BASE_MODE.get(mode, mode), nvme_path=nvme, micro_batch=1)
    if mode == "zero_inf":
        z = cfg["zero_optimization"]
        z["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_count": 4,
                                  "fast_init": False}
        z["offload_param"] = {"device": ZERO_INF_PARAM, "pin_memory": True}
        cfg["aio"] = dict(aio or AIO_RECOMMENDED)
        cfg["optimizer"] = json.loads(json.dumps(ZERO_INF_OPTIMIZER))
        cfg["zero_force_ds_cpu_optimizer"] = True  # DeepSpeed builds DeepSpeedCPUAdam from "optimizer"
        cfg.pop("zero_allow_untested_optimizer")
    if mode in ("hms_dram", "hms_dram_cpuadam", "hms_dram_cpuadam_res", "hms_dram_balanced"):
        cfg["titan"]["hms"]["param_tier"] = "dram"
    if mode.endswith("_res"):
        cfg["titan"]["hms"]["optimizer_dram_mb"] = RESIDENT_MB
    if mode in ("hms_cpuadam", "hms_cpuadam_wb", "hms_dram_cpuadam", "hms_dram_cpuadam_res"):
        cfg["optimizer"] = json.loads(json.dumps(ZERO_INF_OPTIMIZER))
        cfg["zero_force_ds_cpu_optimizer"] = True  # HMS offloads the optimizer to "nvme": DeepSpeedCPUAdam
        cfg.pop("zero_allow_untested_optimizer")
    if mode in ("hms_balanced_gs", "hms_balanced_map"):  # the A/B of titan.hms.gradient_store (on by default
        # since 2026-12-07; results/hms_gstore_*, measured at 121687f, where hms_balanced had it off)
        cfg["titan"]["hms"]["gradient_store"] = mode == "hms_balanced_gs"
    if mode in ("hms_balanced_wb", "hms_wb", "hms_cpuadam_wb"):
        cfg["titan"]["hms"]["param_write_behind"] = True
    if mode == "hms_dram_balanced":  # hms_balanced's optimizer section; the speed row against zero_inf keeps
        # DeepSpeed's gradients in DRAM (hms_balanced, _res and _wb: plan's candidate_config("hms_balanced"))
        balanced = json.loads((ROOT / "ds_configs" / "titan_balanced.json").read_text())["titan"]["optimizer"]
        cfg["titan"]["optimizer"] = balanced
    return cfg


def _set_resident_mb(mb: int) -> None:
    global RESIDENT_MB
    RESIDENT_MB = int(mb)


def build_ops(env: dict) -> None:
    """Build (or find cached) DeepSpeed's ``cpu_adam`` and ``async_io`` ops and titan's CPU optimizer kernel
    (``titan_ds.optim.core_cpu``) for ``env``'s TORCH_EXTENSIONS_DIR, uncapped: a JIT build inside a capped trial
    measures g++ (and can be OOM-killed or time out), not training. (Without titan's, the first ``titan_balanced``
    trial from a new checkout compiled it inside its cgroup: a 2.93 GiB peak against 1.42 for the same run after,
    results/hms_grad_inplace/README.md.)"""
    # async_io only where it can build (libaio present): without it zero_inf is skipped with a reason row
    # (main: async_io_status), and the other modes must still run
    code = ("from deepspeed.ops.op_builder import CPUAdamBuilder, AsyncIOBuilder; "
            "CPUAdamBuilder().load(verbose=False); b = AsyncIOBuilder(); "
            "b.load(verbose=False) if b.is_compatible(verbose=False) else None; "
            "from titan_ds.optim import core_cpu; core_cpu.available()")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(ROOT), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"DeepSpeed's cpu_adam/async_io ops did not build: {r.stderr[-2000:]}")


def set_lr(cfg: dict, lr: float) -> bool:
    """Set the peak lr of ``cfg``'s optimizer where the config builds it: titan's section, else DeepSpeed's
    ``optimizer`` section. False when neither is there (``launch/train.py``'s client AdamW: pass ``--lr``)."""
    opt = cfg.get("titan", {}).get("optimizer")
    if opt is not None:
        opt["lr"] = lr
        return True
    if "optimizer" in cfg:
        cfg["optimizer"].setdefault("params", {})["lr"] = lr
        return True
    return False


def trial(mode: str, layers: int, width: int, cap_gib: float, *, path: str, steps: int, timeout: float,
          logs: Path, aio: dict | None = None, lock: str | None = None, warmup: int = 1, tag: str = "",
          lr: float | None = None, timeline: bool = False, lr_warmup: int = 1) -> dict:
    """Train once under the cap; the outcome and its measurements. ``aio``: ZeRO-Infinity's aio block; ``lock``:
    held around the run (:func:`timed_lock`); ``warmup``: first steps left out of s/step; ``tag``: file names;
    ``lr``: the optimizer's peak lr (None: the mode's own); ``lr_warmup``: steps of linear lr warm-up (then
    launch/train.py's cosine to 10% over the run); ``timeline``: record the step's spans
    (``launch/train.py --timeline-out``) and keep each phase's seconds, the mean over the timed steps
    (:func:`titan_ds.hms.timeline.breakdown`), as ``phases``."""
    out = {"mode": mode, "layers": layers, "width": width, "cap_GiB": cap_gib, "params": gpt_params(layers, width)}
    if lr is not None:
        out["lr"] = lr
    if lr_warmup != 1:
        out["lr_warmup"] = lr_warmup
    nvme = os.path.join(path, f"{mode}_{layers}x{width}{tag}")
    work = Path(path) / "cfg"
    work.mkdir(parents=True, exist_ok=True)
    name = f"{mode}_c{cap_gib:g}_{layers}x{width}{tag}"
    cfg_path, summary = work / f"{name}.json", work / f"{name}.summary.json"
    cfg = ds_config(mode, nvme, aio)
    client_lr = lr is not None and not set_lr(cfg, lr)
    cfg_path.write_text(json.dumps(cfg))
    if "aio" in cfg:
        out["aio"] = cfg["aio"]
    summary.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--deepspeed_config", str(cfg_path), "--steps",
           str(steps), "--layers", str(layers), "--width", str(width), "--heads", str(max(1, width // 64)),
           "--micro-batch", "1", "--val-batches", "1", "--warmup", str(lr_warmup), "--no-progress", "--zero-init",
           "--summary-out", str(summary), "--metrics-out", str(work / f"{name}.metrics.jsonl")]
    if client_lr:
        cmd += ["--lr", str(lr)]
    tl_path = work / f"{name}.timeline.json"
    tl_path.unlink(missing_ok=True)
    if timeline:
        cmd += ["--timeline-out", str(tl_path)]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=str(ROOT))
    env.setdefault("OMP_NUM_THREADS", "2")
    if mode.endswith("_4k"):
        env["TITAN_HMS_HUGE_PAGES"] = "0"
    if mode.endswith("_fresh"):
        env["TITAN_HMS_PARAM_POOL"] = "0"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    out["omp_threads"] = int(env["OMP_NUM_THREADS"])
    logs.mkdir(parents=True, exist_ok=True)
    if mode in CPU_ADAM_MODES:
        build_ops(env)
    with timed_lock(lock):
        r = run_capped_clean(cmd, int(cap_gib * GiB), logs / f"{name}.log", env=env, cwd=str(ROOT), timeout=timeout)
    out.update({"peak_anon_GiB": r.peak_anon_bytes / GiB, "max_usage_GiB": r.max_usage_bytes / GiB, "wall_s": r.wall_s,
           "returncode": r.returncode, "oom_killed": r.oom_killed, "timed_out": r.timed_out})
    s = json.loads(summary.read_text()) if summary.exists() else None
    finite = s is not None and math.isfinite(s["val_loss"]) and math.isfinite(s["train_loss_last10"])
    # DeepSpeed's offload must run DeepSpeed's own optimizer: a run that fell back to another is not the mode
    wrong_opt = mode in CPU_ADAM_MODES and s is not None and s.get("optimizer") != "DeepSpeedCPUAdam"
    out["fits"] = bool(r.ok and finite and not wrong_opt)
    out["status"] = ("ok" if out["fits"] else f"optimizer {s.get('optimizer')}, not DeepSpeedCPUAdam" if wrong_opt else "OOM-killed" if r.oom_killed else
                     f"not finished in {timeout:.0f} s" if r.timed_out else
                     "non-finite loss" if s is not None else f"failed (exit {r.returncode})")
    if s is not None:
        hms = s.get("titan_metrics", {}).get("hms", {})
        hist = [json.loads(x) for x in (work / f"{name}.metrics.jsonl").read_text().splitlines()[warmup:]]
        steps_s = [h["step_s"] for h in hist]
        out["step_s_all"] = steps_s
        out["step_s_median"] = statistics.median(steps_s) if steps_s else float("nan")
        out["optimizer"] = s.get("optimizer")
        moved = [h["hms"]["bytes_read"] + h["hms"]["bytes_written"] for h in hist if "hms" in h]
        out["GiB_moved_per_step"] = sum(moved) / len(moved) / GiB if moved else 0.0
        for k in ("read", "written"):
            per = [h["hms"][f"bytes_{k}"] for h in hist if "hms" in h]
            if per:
                out[f"GiB_{k}_per_step"] = sum(per) / len(per) / GiB
        out["loss_all"] = [json.loads(x)["loss"] for x in (work / f"{name}.metrics.jsonl").read_text().splitlines()]
        if timeline and tl_path.exists() and hist:
            from titan_ds.hms.timeline import breakdown
            spans = json.loads(tl_path.read_text())["spans"]
            per = [breakdown(spans, h["step"]) for h in hist]
            out["phases"] = {k: statistics.fmean(p[k] for p in per) for k in per[0]}
        out.update(trainable=s["trainable_params"], step_s=sum(steps_s) / max(1, len(steps_s)), peak_rss_GiB=s["peak_rss"] / GiB,
                   disk_GiB=hms.get("disk_bytes", 0) / GiB, val_loss=s["val_loss"])
    shutil.rmtree(nvme, ignore_errors=True)
    return out


class NotMeasured(Exception):
    """A trial the store does not hold, asked for under ``--no-run`` (tables from the store only)."""


class Trials(ResultLog):
    """The trial log: every finished trial, keyed by (mode, cap, layers, width), in the results store
    (``launch/bench/store.py``); a rerun reuses them under its rule (same code, or ``reuse_stale``)."""

    def __init__(self, path: Path, reuse_stale: bool = False):
        def load(r: dict) -> dict:
            r["params"] = gpt_params(r["layers"], r["width"])  # counted on the meta device
            return r
        super().__init__(path, lambda r: self.key(r["mode"], r["cap_GiB"], r["layers"], r["width"]), load,
                         suite="hms-scale", reuse_stale=reuse_stale)
        self.no_run = False  # True: a trial the store lacks raises NotMeasured instead of running

    @staticmethod
    def key(mode, cap, layers, width) -> tuple:
        return (mode, float(cap), int(layers), int(width))

    def run(self, mode, cap, layers, width, **kw) -> dict:
        def go() -> dict:
            if self.no_run:
                raise NotMeasured(f"{mode} cap {cap:g} GiB {layers}x{width}")
            return trial(mode, layers, width, cap, **kw)
        return _same_lr(self.get(self.key(mode, cap, layers, width), go,
                        lambda r: f"{mode} cap {cap:g} GiB {layers}x{width} ({r['params'] / 1e6:.0f}M): "
                                  f"{r['status']}, peak anon {r['peak_anon_GiB']:.2f} GiB, {r['wall_s']:.0f} s"),
                        kw.get("lr"))


def _same_lr(r: dict, lr: float | None) -> dict:
    """A recorded trial reused only at the lr it ran with (the trial key does not hold the lr)."""
    if r.get("lr") != lr:
        raise SystemExit(f"--lr {lr}: the store holds this trial at lr {r.get('lr')} (None: the mode's own); "
                         f"give another --out for another lr")
    return r


class SpeedTrials(ResultLog):
    """The speed runs: keyed by (mode, cap, layers, width, warm-up, steps, repeat), in ``<out>.speed.jsonl``."""

    def __init__(self, path: Path, reuse_stale: bool = False):
        super().__init__(path, lambda r: self.key(r["mode"], r["cap_GiB"], r["layers"], r["width"], r["warmup"],
                                                  r["steps"], r["repeat"]),
                         suite="hms-scale-speed", reuse_stale=reuse_stale)
        self.no_run = False

    @staticmethod
    def key(mode, cap, layers, width, warmup, steps, repeat) -> tuple:
        return (mode, float(cap), int(layers), int(width), int(warmup), int(steps), int(repeat))

    def run(self, mode, cap, layers, width, warmup, steps, repeat, **kw) -> dict:
        def go() -> dict:
            if self.no_run:
                raise NotMeasured(f"speed {mode} cap {cap:g} GiB {layers}x{width} run {repeat}")
            r = trial(mode, layers, width, cap, steps=warmup + steps, warmup=warmup, tag=f"_speed{repeat}", **kw)
            return dict(r, warmup=warmup, steps=steps, repeat=repeat)
        return _same_lr(self.get(self.key(mode, cap, layers, width, warmup, steps, repeat), go,
                        lambda r: f"speed {mode} cap {cap:g} GiB {layers}x{width} run {repeat}: {r['status']}, "
                                  f"{r.get('step_s_median', float('nan')):.2f} s/step"), kw.get("lr"))


def speed_rows(st: SpeedTrials, modes: list[str], cap: float, layers: int, width: int, warmup: int, steps: int,
               repeats: int, skip: dict, **kw) -> list[dict]:
    """s/step of each mode at one shape: ``repeats`` runs, the modes alternated within each; a run's s/step is
    the median of its steps after ``warmup``, the row's the median over the runs that trained."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(repeats):
        for m in (modes if rep % 2 == 0 else modes[::-1]):  # alternate the order, so no mode always goes first
            if m not in skip:
                try:
                    runs[m].append(st.run(m, cap, layers, width, warmup, steps, rep, **kw))
                except NotMeasured:
                    pass
    rows = []
    for m in modes:
        row = {"cap_GiB": cap, "mode": m, "shape": f"{layers}x{width}", "params_M": gpt_params(layers, width) / 1e6}
        ok = [r for r in runs[m] if r["fits"]]
        if m in skip:
            row["status"] = f"skipped: {skip[m]}"
        elif not ok:
            row["status"] = "; ".join(sorted({r["status"] for r in runs[m]})) or "not measured"
        else:
            per_run = [r["step_s_median"] for r in ok]
            row.update(status="ok", runs=len(ok), step_s=statistics.median(per_run),
                       runs_step_s=" ".join(f"{x:.2f}" for x in per_run),
                       peak_anon_GiB=max(r["peak_anon_GiB"] for r in ok), optimizer=ok[0].get("optimizer"))
            if "lr" in ok[0]:
                row["lr"] = f"{ok[0]['lr']:g}"
            if "loss_all" in ok[0]:  # the first run's train loss at each step, warm-up included
                row["losses"] = " ".join(f"{x:.2f}" for x in ok[0]["loss_all"])
            if "phases" in ok[0]:
                row["phases"] = ok[0]["phases"]
            if "omp_threads" in ok[0]:
                row["threads"] = ok[0]["omp_threads"]
            if "GiB_read_per_step" in ok[0]:
                row["io_bound_s"], row["compute_bound_s"] = bounds(ok[0])
                row["x_bound"] = row["step_s"] / max(row["io_bound_s"], row["compute_bound_s"])
        rows.append(row)
    base = next((r["step_s"] for r in rows if r["mode"] == "zero_inf" and "step_s" in r), None)
    for r in rows:
        r["x_zero_inf"] = r["step_s"] / base if base and "step_s" in r else "-"
    return rows


def largest(trials: Trials, mode: str, cap: float, width: int, start: int, max_layers: int, rel: float,
            **kw) -> dict | None:
    """Largest depth that fits: doubling from ``start`` to bracket, then bisection to ``rel`` relative width.
    Under ``trials.no_run`` the search stops at the first trial the store lacks: the largest recorded fit, with
    ``unfinished`` naming that trial."""
    try:
        return _largest(trials, mode, cap, width, start, max_layers, rel, **kw)
    except NotMeasured as e:
        done = [r for r in trials.rows.values() if (r["mode"], r["cap_GiB"], r["width"]) == (mode, cap, width)]
        best = max((r for r in done if r["fits"]), key=lambda r: r["layers"], default=None)
        return dict(best or {}, unfinished=f"search unfinished: {e} not run")  # without "layers": no fit yet


def _largest(trials: Trials, mode: str, cap: float, width: int, start: int, max_layers: int, rel: float,
             **kw) -> dict | None:
    def fits(n: int) -> bool:
        return trials.run(mode, cap, n, width, **kw)["fits"]

    n = max(1, min(start, max_layers))
    lo, hi = (n, None) if fits(n) else (0, n)  # lo fits (0: none known); hi does not (None: none known)
    while hi is None and lo < max_layers:  # bracket upwards by doubling
        n = min(max_layers, lo * 2)
        lo, hi = (n, None) if fits(n) else (lo, n)
    while lo == 0 and hi > 1:  # ... or downwards by halving
        n = hi // 2
        lo, hi = (n, hi) if fits(n) else (0, n)
    while hi is not None and hi - lo > max(1, int(lo * rel)):
        mid = (lo + hi) // 2
        if trials.run(mode, cap, mid, width, **kw)["fits"]:
            lo = mid
        else:
            hi = mid
    return trials.rows[trials.key(mode, cap, lo, width)] if lo else None


_SPEEDS: list = []


# this invocation's disk speeds (:func:`disk_speeds`): the I/O bounds' prices
_DISK: dict = {}
STALE_DISK = ROOT / "results" / "hms_timeline" / "disk.json"  # an earlier day's probe: the fallback


def disk_speeds(path: str, record: Path, no_run: bool = False) -> dict:
    """This disk's O_DIRECT read and write GB/s under ``path`` (``titan_ds.hms.diskprobe.measure_disk``: 256 MiB,
    4 MiB blocks, 4 threads, best of 2), measured once per invocation and kept in ``record`` (OUT.disk.json),
    which a rerun of the same table reuses; with ``no_run`` and no record, the earlier day's
    results/hms_timeline/disk.json (named in the table's notes)."""
    if not _DISK:
        if record.exists():
            _DISK.update(json.loads(record.read_text()), source=record.name)
        elif no_run:
            _DISK.update(_disk())
        else:
            from titan_ds.hms.diskprobe import measure_disk
            d = measure_disk(os.path.join(path, ".disk_probe"), mb=256, threads=4, block_mb=4)
            d["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            d["fp32_matmul_GFLOPs"] = _speeds()[0]  # the compute bound's price, measured before any trial runs
            record.write_text(json.dumps(d, indent=1))
            _DISK.update(d, source=record.name)
    return _DISK


def _disk() -> dict:
    """The disk speeds the bounds use: this invocation's probe, else the earlier day's file (with its source)."""
    return _DISK or {**json.loads(STALE_DISK.read_text()), "source": str(STALE_DISK.relative_to(ROOT))}


def bounds(r: dict) -> tuple[float, float]:
    """(I/O bound, compute bound) seconds of one step of trial ``r``: its bytes read and written per step at this
    disk's O_DIRECT read and write speeds (:func:`disk_speeds`, measured by this invocation; an earlier day's
    results/hms_timeline/disk.json where it has not run), and 6 x params x 128 tokens at the fp32 matmul rate
    measured here (the trials train fp32 unless the mode says bf16; bf16 is not priced differently)."""
    gflops, _ = _speeds()
    disk = _disk()
    io = (r["GiB_read_per_step"] * GiB / (disk["raw_read_GBps"] * 1e9)
          + r["GiB_written_per_step"] * GiB / (disk["raw_write_GBps"] * 1e9))
    return io, 6 * r["params"] * 128 / (gflops * 1e9)


def _speeds() -> tuple[float, float]:
    """fp32 GFLOP/s of a 1024^3 matmul (the invocation's disk record's, where it kept one: a table rewritten later
    on a busy machine keeps the price its runs were measured at; else measured once) and dd's direct read GB/s
    from results/hms_streaming.csv (bench_hms.py part a), the bounds of today's HMS tables."""
    if not _SPEEDS:
        import torch
        x = torch.randn(1024, 1024)
        x @ x
        t = time.perf_counter()
        for _ in range(10):
            x @ x
        gflops = 10 * 2 * 1024**3 / (time.perf_counter() - t) / 1e9
        rows = (ROOT / "results" / "hms_streaming.csv").read_text().splitlines()
        _SPEEDS.extend([gflops, next(float(r.split(",")[1]) for r in rows if r.startswith("dd_read"))])
    return _DISK.get("fp32_matmul_GFLOPs") or _SPEEDS[0], _SPEEDS[1]


def _md(rows: list[dict], keys: list[str]) -> str:
    def f(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] +
                     ["| " + " | ".join(f(r.get(k, "-")) for k in keys) + " |" for r in rows]) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", required=True, help="folder for HMS's files (on the disk to use, outside the repo)")
    ap.add_argument("--caps", default="2,4,8", help="GiB, comma list (empty: none, e.g. speed rows only)")
    ap.add_argument("--modes", default="zero3_cpu,hms", help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--mode-opts", default="",
                    help="'MODE:width=W,start=N,max_layers=N[;MODE:...]': a mode's own width and search bounds")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--start", type=int, default=4, help="first depth tried")
    ap.add_argument("--max-layers", type=int, default=512)
    ap.add_argument("--rel", type=float, default=0.1, help="stop bisecting at this relative bracket width")
    ap.add_argument("--timeout", type=float, default=1500, help="seconds per trial")
    ap.add_argument("--optimizer-dram-mb", type=int, default=RESIDENT_MB,
                    help="titan.hms.optimizer_dram_mb of the *_res modes")
    ap.add_argument("--speed-shape", default="", help="LAYERSxWIDTH: s/step of every mode at this shape")
    ap.add_argument("--speed-cap", type=float, default=4.0, help="GiB cap of the speed runs")
    ap.add_argument("--speed-steps", type=int, default=3, help="timed steps per speed run, after the warm-up")
    ap.add_argument("--speed-warmup", type=int, default=2, help="untimed first steps of a speed run")
    ap.add_argument("--speed-repeats", type=int, default=3, help="speed runs per mode, alternated")
    ap.add_argument("--no-run", action="store_true",
                    help="run nothing: the tables from the recorded trials (an unfinished search says so)")
    ap.add_argument("--lr", type=float, default=None,
                    help="peak lr of every mode's optimizer (default: each mode's own); give a new --out for it")
    ap.add_argument("--lr-warmup", type=int, default=1,
                    help="steps of linear lr warm-up in every run (default 1); give a new --out for another value")
    ap.add_argument("--lock", default=None, help="flock this file around each trial (e.g. /tmp/titan_timed.lock)")
    ap.add_argument("--timeline", action="store_true",
                    help="speed runs record the step's timeline (seconds per phase, a second table)")
    ap.add_argument("--loss-reference", default="",
                    help="LAYERSxWIDTH: also train this small dense model (ds_configs/baseline_adamw.json, torch "
                         "AdamW, no cap) on the speed runs' batches, lr and warm-up, and plot its loss beside "
                         "theirs (<out>.speed.losses.png): which steps are hard batches for any model")
    ap.add_argument("--out", default=str(ROOT / "results" / "hms_scale_cap"))
    add_store_args(ap)
    a = ap.parse_args(argv)
    _set_resident_mb(a.optimizer_dram_mb)
    a.cmdline = " ".join(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="  %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run_capped's cleanup then removes the cgroup
    modes = a.modes.split(",")
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"--modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")
    speed = None
    if a.speed_shape:
        try:
            speed = tuple(int(x) for x in a.speed_shape.lower().split("x"))
            assert len(speed) == 2 and min(speed) > 0
        except (ValueError, AssertionError):
            raise SystemExit(f"--speed-shape {a.speed_shape!r}: write LAYERSxWIDTH, e.g. 12x768") from None
    if not cgroup_available():
        raise SystemExit("hms_scale.py needs root and a cgroup v1 memory controller at /sys/fs/cgroup/memory")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    skip, aio = {}, None
    if "zero_inf" in modes:
        why = async_io_status()
        if why is not None:
            logging.warning("zero_inf is skipped: %s", why)
            skip["zero_inf"] = why
        elif not (a.no_run and not out.with_suffix(".aio_sweep.json").exists()):  # --no-run measures nothing
            aio = aio_settings(a.path, out.with_suffix(".aio_sweep.json"), a.lock)
            logging.info("zero_inf: aio %s (the best of the sweep in %s)", aio, out.with_suffix(".aio_sweep.json"))
    kw = dict(path=a.path, timeout=a.timeout, logs=out.parent / "logs" / out.name, aio=aio, lock=a.lock, lr=a.lr)
    if a.lr_warmup != 1:
        kw["lr_warmup"] = a.lr_warmup
    if speed is not None:
        with timed_lock(a.lock):
            disk_speeds(a.path, out.with_suffix(".disk.json"), a.no_run)
        st = SpeedTrials(out.with_suffix(".speed.jsonl"), a.reuse_stale)
        st.no_run = a.no_run
        srows = speed_rows(st, modes, a.speed_cap, *speed, a.speed_warmup, a.speed_steps, a.speed_repeats, skip,
                           **kw, **({"timeline": True} if a.timeline else {}))
        write_speed(srows, out, a)
        if any("loss_all" in r for r in st.rows.values()):
            ref = reference_losses(a, out) if a.loss_reference else None
            plot_losses(st, out, a, ref)
        if a.timeline:
            plot_timeline(st, out, a.path)
    trials = Trials(out.with_suffix(".trials.jsonl"), a.reuse_stale)
    trials.no_run = a.no_run
    kw["steps"] = a.steps
    opts = {m: dict(width=a.width, start=a.start, max_layers=a.max_layers) for m in MODES}
    for item in filter(None, a.mode_opts.split(";")):
        m, _, rest = item.partition(":")
        try:
            opts[m].update({k: int(v) for k, v in (kv.split("=") for kv in rest.split(","))})
        except (KeyError, ValueError):
            raise SystemExit(f"--mode-opts: {item!r} is not MODE:width=W,start=N,max_layers=N with MODE one of "
                             f"{', '.join(MODES)}")
        if set(opts[m]) != {"width", "start", "max_layers"}:
            raise SystemExit(f"--mode-opts: {item!r}: the keys are width, start and max_layers")
    rows, prev = [], {}
    for cap in sorted(float(c) for c in filter(None, a.caps.split(","))):
        base = None
        for mode in modes:
            row = {"cap_GiB": cap, "mode": mode}
            if mode in skip:
                rows.append(dict(row, status=f"skipped: {skip[mode]}"))
                continue
            # a larger cap starts where the smaller one ended
            o = opts[mode]
            width = o["width"]
            best = largest(trials, mode, cap, width, max(o["start"], prev.get(mode, 0)), o["max_layers"], a.rel,
                           **kw)
            if best is not None and "layers" not in best:
                rows.append(dict(row, status=best["unfinished"]))
                continue
            prev[mode] = best["layers"] if best else 0
            fail = [r for r in trials.rows.values() if r["mode"] == mode and r["cap_GiB"] == cap and not r["fits"]
                    and r["width"] == width]
            first_fail = min(fail, key=lambda r: r["layers"]) if fail else None
            if best is None:
                row.update(status="nothing fits")
            else:
                row.update({k: best.get(k) for k in ("layers", "params", "peak_anon_GiB", "max_usage_GiB",
                                                     "peak_rss_GiB", "disk_GiB", "step_s", "val_loss",
                                                     "GiB_moved_per_step")})
                row["params_M"] = best["params"] / 1e6
                row["shape"] = f"{best['layers']}x{width}"
                row["next_fails"] = (f"{first_fail['layers']}x{width}: {first_fail['status']}"
                                     if first_fail else "-")
                if best.get("unfinished"):
                    row["next_fails"] = "; ".join(x for x in (row["next_fails"], best["unfinished"]) if x != "-")
                if mode == "zero3_cpu":
                    base = best["params"]
                row["x_zero3_cpu"] = best["params"] / base if base else "-"
            rows.append(row)
            write(rows, out, a)
    if rows:
        write(rows, out, a)


def _zero_inf_note(out: Path) -> str:
    sweep = out.with_suffix(".aio_sweep.json")
    aio = (json.dumps({k: v for k, v in max(json.loads(sweep.read_text()), key=lambda r: r["read_GBps"] +
                                               r["write_GBps"]).items() if k in AIO_RECOMMENDED})
           if sweep.exists() else "not measured (async_io unavailable)")
    return (f"zero_inf: DeepSpeed ZeRO-3 with offload_optimizer nvme (its async_io op; aio {aio}, the best of the "
            f"sweep in {sweep.name}), offload_param {ZERO_INF_PARAM}, DeepSpeedCPUAdam from the config's optimizer "
            f"section. hms_balanced: HMS with ds_configs/titan_balanced.json's optimizer section (ASDT adaptive, "
            f"8-bit state, density 1), gradient_buffer disk.")


def _write_table(base: Path, title: str, rows: list[dict], keys: list[str], notes: list[str], a) -> None:
    """``base``.csv and ``base``.md (the command and machine first, then ``notes``, then the table)."""
    import csv
    with open(base.parent / f"{base.name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    head = [f"Command: `PYTHONPATH=$PWD python launch/bench/hms_scale.py {a.cmdline}`",
            f"Machine: {os.cpu_count()} CPU cores (shared), "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB RAM; {time.strftime('%Y-%m-%d')}"]
    md = f"### {title}\n\n" + "\n".join(head + notes) + "\n\n" + _md(rows, keys)
    (base.parent / f"{base.name}.md").write_text(md)
    print(md)


def write_speed(rows: list[dict], out: Path, a) -> None:
    keys = ["cap_GiB", "mode", "shape", "params_M", "step_s", "x_zero_inf", "runs", "runs_step_s", "peak_anon_GiB",
            "optimizer", "status"]
    if any("x_bound" in r for r in rows):
        keys[-1:-1] = ["io_bound_s", "compute_bound_s", "x_bound"]
    if any("losses" in r for r in rows):
        keys[-1:-1] = ["lr", "losses"] if any("lr" in r for r in rows) else ["losses"]
    notes = [f"Every mode at one shape under a {a.speed_cap:g} GiB cap, micro-batch 1, context 128: {a.speed_repeats} "
             f"runs per mode, the modes' order alternated between runs; each run {a.speed_warmup} warm-up + "
             f"{a.speed_steps} timed steps. step_s: median over the runs of each run's median timed step "
             f"(runs_step_s: each run's); x_zero_inf: step_s / ZeRO-Infinity's. optimizer: the engine's "
             f"basic_optimizer. Modes and configs: launch/bench/hms_scale.py's docstring. Shared 2-core machine: "
             f"indicative only.", _zero_inf_note(out)]
    if any("x_bound" in r for r in rows):
        disk = _disk()
        notes.append("io_bound_s: the first run's bytes read and written per timed step at this disk's O_DIRECT read "
                     f"and write speeds ({disk['raw_read_GBps']:.3f} / {disk['raw_write_GBps']:.3f} GB/s, "
                     f"{disk['source']}, {disk.get('date', '')}); compute_bound_s: 6 x params x 128 tokens at "
                     + (f"{disk['fp32_matmul_GFLOPs']:.1f} fp32 matmul GFLOP/s (measured with the disk, before the "
                        "runs)" if disk.get("fp32_matmul_GFLOPs") else
                        "the fp32 matmul GFLOP/s measured by the process writing this table")
                     + "; x_bound: step_s / the larger. losses: the first run's train loss at each step, warm-up "
                     "included; lr: set by --lr (else the mode's own)."
                     + (f" The train losses are plotted in {out.name}.speed.losses.png" + (
                         f", beside a small dense model's on the same batches ({out.name}.speed.reference.json)"
                         if getattr(a, "loss_reference", "") else "") + "." if any(
                         r.get("losses") for r in rows) else ""))
    if any("threads" in r for r in rows):
        keys[-1:-1] = ["threads"]
    _write_table(out.parent / f"{out.name}.speed", "HMS vs DeepSpeed's offload: s/step at one shape", rows, keys,
                 notes, a)
    timed = [r for r in rows if r.get("phases")]
    if timed:
        from titan_ds.hms.timeline import BACKGROUND, INNER, TOP
        cols = [c for c in ("param fetch", "forward", "backward") + INNER[1:] + ("opt compute", "idle", "wall")
                + BACKGROUND if c in timed[0]["phases"]]
        md = ("\n#### Where the step goes (timeline, the first run, mean over its timed steps; s)\n\n"
              "Each span counted once, in its innermost phase (titan_ds/hms/timeline.py: forward and backward "
              "less the parameter fetches and gradient writes inside them; opt compute: the engine's step less the "
              "swappers' waits; the (bg) columns run on the writer threads beside the main lane, not in wall).\n\n"
              + _md([dict(mode=r["mode"], **r["phases"]) for r in timed], ["mode"] + cols))
        path = out.parent / f"{out.name}.speed.md"
        path.write_text(path.read_text() + md)
        print(md)


UNIFORM_LOSS = math.log(256)  # a byte-level model that knows nothing: 5.545


def reference_losses(a, out: Path) -> dict:
    """The train loss of a small dense model (``--loss-reference``, ds_configs/baseline_adamw.json: torch AdamW,
    ZeRO 0, uncapped) at each step of the speed runs' schedule: the same data order (seed 0), micro-batch 1, peak
    lr (--lr, else AdamW's 1e-3) and warm-up, so a step that is hard for it is a hard batch, not an unstable
    optimizer. Kept in ``<out>.speed.reference.json`` (a rerun reuses it; delete it to run again)."""
    record = out.parent / f"{out.name}.speed.reference.json"
    layers, width = (int(x) for x in a.loss_reference.lower().split("x"))
    steps = a.speed_warmup + a.speed_steps
    want = {"shape": f"{layers}x{width}", "steps": steps, "lr": a.lr, "lr_warmup": a.lr_warmup,
            "config": "ds_configs/baseline_adamw.json"}
    if record.exists():
        got = json.loads(record.read_text())
        if {k: got.get(k) for k in want} == want:
            return got
    if a.no_run:
        raise SystemExit(f"--loss-reference: {record} lacks this reference and --no-run runs nothing")
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--deepspeed_config", want["config"], "--steps",
               str(steps), "--layers", str(layers), "--width", str(width), "--heads", str(max(1, width // 64)),
               "--micro-batch", "1", "--val-batches", "1", "--warmup", str(a.lr_warmup), "--no-progress",
               "--log-every", "1", "--metrics-out", str(metrics)] + (["--lr", str(a.lr)] if a.lr else [])
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2"))
        losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines() if '"loss"' in line]
    got = dict(want, losses=losses, date=time.strftime("%Y-%m-%d"))
    record.write_text(json.dumps(got, indent=1))
    return got


def plot_losses(st, out: Path, a, ref: dict | None) -> Path:
    """``<out>.speed.losses.png``: each speed run's train loss per step (warm-up included), the uniform-byte loss
    and, with ``ref``, the small dense model's loss on the same batches."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for r in st.rows.values():
        if r.get("loss_all"):
            lr = f", lr {r['lr']:g}" if "lr" in r else ""
            ax.plot(range(len(r["loss_all"])), r["loss_all"], marker=".", label=(
                f"{r['mode']} {gpt_params(r['layers'], r['width']) / 1e6:.1f}M ({r['layers']}x{r['width']}) under "
                f"{r['cap_GiB']:g} GiB{lr}, warm-up {r.get('lr_warmup', 1)}"))
    if ref:
        ax.plot(range(len(ref["losses"])), ref["losses"], color="grey", lw=1, label=(
            f"dense AdamW {ref['shape']}, no cap, the same batches, lr and warm-up (reference)"))
    ax.axhline(UNIFORM_LOSS, color="red", ls="--", lw=1, label=f"uniform over 256 bytes ({UNIFORM_LOSS:.3f})")
    ax.set_xlabel("step (micro-batch 1 x 128 bytes)")
    ax.set_ylabel("train loss (nats/byte)")
    ax.legend(fontsize=7)
    ax.grid(alpha=.3)
    fig.tight_layout()
    path = out.parent / f"{out.name}.speed.losses.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timeline(st, out: Path, path: str) -> Path | None:
    """``<out>.speed.timeline.png``: the last timed step of each mode's first run, lane by lane
    (launch/bench/hms_timeline.py's drawing), from the spans and metrics its trial left in ``path``/cfg (they stay
    out of the repository); None where no run left them."""
    from launch.bench.hms_timeline import draw
    runs = []
    for r in st.rows.values():
        if r.get("repeat") != 0 or not r.get("phases"):
            continue
        name = f"{r['mode']}_c{r['cap_GiB']:g}_{r['layers']}x{r['width']}_speed0"  # trial()'s file names
        tl, metrics = (Path(path) / "cfg" / f"{name}.{x}" for x in ("timeline.json", "metrics.jsonl"))
        if tl.exists() and metrics.exists():
            runs.append(dict(mode=r["mode"], repeat=0, layers=r["layers"], width=r["width"],
                             timeline=json.loads(tl.read_text()),
                             metrics=[json.loads(x) for x in metrics.read_text().splitlines()]))
    if not runs:
        return None
    png = out.parent / f"{out.name}.speed.timeline.png"
    draw(runs, png)
    return png


def write(rows: list[dict], out: Path, a) -> None:
    gflops, disk_gbps = _speeds()
    for r in rows:
        if "params" in r:
            r["compute_bound_s"] = 6 * r["params"] * 128 / (gflops * 1e9)
            if r.get("GiB_moved_per_step") is not None:
                r["io_bound_s"] = r["GiB_moved_per_step"] * GiB / (disk_gbps * 1e9)
    keys = ["cap_GiB", "mode", "shape", "params_M", "x_zero3_cpu", "peak_anon_GiB", "max_usage_GiB", "peak_rss_GiB",
            "disk_GiB", "step_s", "io_bound_s", "compute_bound_s", "next_fails", "status"]
    notes = [f"GPT of width {a.width} unless the shape says otherwise (heads width/64, vocab 256, context 128), micro-batch 1, {a.steps} steps, "
             f"built under titan_ds.zero_init; depth bisected to {a.rel:g} of the depth (at least 1 layer). All modes: ZeRO-3 with "
             f"{', '.join(f'{k} {v:.0e}' for k, v in ZERO3_BOUNDS.items())}. peak_anon: sampled max of the cgroup's "
             f"rss + shmem; max_usage: the kernel's high-water mark (includes page cache, which the cap reclaims); "
             f"peak_rss: the process's VmHWM (counts mapped files too). s/step: the steps after the first. io_bound_s: HMS's bytes read + written per step / dd's direct read speed (results/hms_streaming.csv); compute_bound_s: 6 x params x 128 tokens / the measured fp32 matmul GFLOP/s. next_fails: the smallest depth tried that did not fit, and why. "
             f"s/step on a shared 2-core machine (other jobs ran beside it): indicative only."]
    if "zero_inf" in a.modes.split(","):
        notes.append(_zero_inf_note(out))
    _write_table(out, "HMS at scale: largest GPT trained under a memory cap", rows, keys, notes, a)


if __name__ == "__main__":
    main()
