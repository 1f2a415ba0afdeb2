"""``titan-ds gpu-check``: the few-minute self-test to run first on a machine with a GPU.

    titan-ds gpu-check --out gpu_check.json                      # every shipped profile, 20 steps each (5 on a CPU)
    titan-ds gpu-check --profiles titan_memory --steps 5 --out x.json

For each shipped profile (:data:`PROFILES`, the ds_configs in ``--configs``):

1. **Parity.** The tiny reference GPT (:mod:`titan_ds.models.gpt`, :data:`MODEL`) trains ``--steps`` steps
   through ``titan_ds.initialize`` (DeepSpeed's engine with the profile's ds_config: what a user's job runs, not
   a stand-in loop) on the device, and again on the CPU with ``TITAN_KERNELS=reference`` (the pure-PyTorch
   kernels, the test oracle): same seed, same weights, same batches. Each step's loss must agree within the
   profile's tolerance (:data:`TOLERANCE`, derived below). The device side and the reference side each run in a
   fresh process: DeepSpeed takes one accelerator per process (the reference runs with ``DS_ACCELERATOR=cpu``),
   and ``TRITON_INTERPRET`` must be set before Triton kernels are defined. Without a GPU both sides share one CPU
   process (``TITAN_KERNELS`` is read per call).
2. **Memory.** The peak device memory of the device run (``torch.cuda.max_memory_allocated``, reset per run;
   without a GPU the process's peak RSS during the run, reset through /proc/self/clear_refs, labelled as such).
3. **The optimizer step's time** on one ``--time-numel``-element parameter: each profile's optimizer section
   (built as the engine builds it), torch AdamW (``fused=True``) and torchao AdamW8bit, timed with CUDA events on
   a GPU (``time.perf_counter`` on the CPU); median of ``--time-steps`` steps after 3 warm-up steps.

A table goes to the screen and everything to ``--out`` (JSON). The exit status is 1 when a profile fails (a loss
outside its tolerance, or a run that raised), else 0.

**Without a GPU** the device run is a CPU run with the Triton kernels under Triton's interpreter
(``TITAN_KERNELS=triton``, ``TRITON_INTERPRET=1``) where the kernel path supports it: fp32 profiles (the
interpreter runs fp32 only, ``kernels/_guard.py``: a bf16 profile takes the default kernels, and a run the Triton
path refuses is repeated with them; the row's ``kernels`` says which). Both the screen and the JSON say plainly
that no GPU was used (``"gpu": false``). torchao's row is off there by default (its CPU step is
``torch.compile``'d: minutes of compiling on a few cores; ``--baselines torchao`` adds it).

**Tolerance** (the largest relative difference of a step's loss, device against reference, over the steps).
The two sides should differ only in rounding: other summation orders (GPU GEMMs and reductions, tiled attention
against the reference's loop) and, with bf16 weights, other stochastic-rounding draws (a CUDA generator's are not
the CPU's). One rounding in the compute dtype is a relative error of at most its unit roundoff u (fp32 2^-24,
bf16 2^-8); the steps then carry such differences on. The tolerance is 2^14 u for fp32 (2^-10, 9.8e-4) and 8 u
for bf16 weights (2^-5, 3.1e-2: eight bf16 ulps). Measured on the CPU over 20 steps
(``launch/bench/gpu_check_tolerance.py``; docs/gpu.md has the table): rounding-only differences reach 1.2e-7 to
7.7e-7 with fp32 weights and 1.0e-3 with bf16 weights, a broken run 1.2e-1 (other data) and 2.1e-1 (lr x2).
Rounding differences on a GPU have not been measured (no GPU yet): widen a tolerance only from such a
measurement, never until green.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

__all__ = ["PROFILES", "TOLERANCE", "run", "main"]

# the shipped profiles the check trains (ds_configs/<name>.json): the one list
PROFILES = ("titan_exact", "titan_balanced", "titan_memory", "titan_lean", "hf_asdt_8bit")
CONFIG_DIR = Path(__file__).resolve().parents[1] / "ds_configs"
# relative loss difference per step allowed between the device run and the CPU reference (module docstring)
TOLERANCE = {"fp32": 2.0 ** 14 * 2.0 ** -24, "bf16": 8 * 2.0 ** -8}
# the tiny reference GPT of the check (titan_ds.models.gpt.GPTConfig fields)
MODEL = {"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 32, "vocab_size": 256}
_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
_AUTO = {"train_micro_batch_size_per_gpu": None, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}


# ------------------------------------------------------------------------------------------------ configs
def load_profile(name: str, config_dir: Path, micro_batch: int) -> dict[str, Any]:
    """The profile's ds_config with ``micro_batch`` sequences a micro-batch, its "auto" values (an HF profile's,
    which the Trainer fills) set as the Trainer's defaults would (1 accumulation step, clipping 1.0)."""
    path = Path(config_dir) / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"profile {name!r}: {path} does not exist; pass --configs DIR (the folder of the "
                                f"ds_configs), or --profiles from {', '.join(PROFILES)}")
    cfg = json.loads(path.read_text())
    cfg.pop("train_batch_size", None)
    for key, default in _AUTO.items():
        if cfg.get(key) == "auto":
            cfg[key] = default
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    return cfg


def weight_dtype(cfg: dict[str, Any]) -> str:
    """"bf16" when the profile trains bf16 weights (titan.optimizer.weight_dtype, or DeepSpeed's bf16 section),
    else "fp32": the key of :data:`TOLERANCE`."""
    opt = (cfg.get("titan") or {}).get("optimizer") or {}
    if opt.get("weight_dtype") == "bf16" or (cfg.get("bf16") or {}).get("enabled"):
        return "bf16"
    return "fp32"


def rel_diff(a: list[float], b: list[float]) -> float:
    """The largest relative difference |a - b| / |b| over the steps (inf where a loss is not finite or the lengths
    differ)."""
    if len(a) != len(b) or not a:
        return math.inf
    worst = 0.0
    for x, y in zip(a, b):
        if not (math.isfinite(x) and math.isfinite(y)):
            return math.inf
        worst = max(worst, abs(x - y) / max(abs(y), 1e-12))
    return worst


# ------------------------------------------------------------------------------------- one run (child process)
def _train(spec: dict[str, Any]) -> dict[str, Any]:
    """One run of ``spec`` in this process: the engine over the tiny GPT, ``steps`` steps; the losses and peak."""
    import torch

    import titan_ds
    from titan_ds.data import Batcher, load_corpus
    from titan_ds.models.gpt import GPT, GPTConfig
    from titan_ds.utils import ensure_dist_env

    ensure_dist_env()
    _set_env({"TITAN_KERNELS": spec["kernels"]})  # read per call by titan_ds.kernels
    cpu_peak = _reset_cpu_peak()
    base = 0
    if torch.cuda.is_available():  # the run's own peak: above what earlier runs of this process left allocated
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    cfg = spec["config"]
    torch.manual_seed(spec["seed"])
    model = GPT(GPTConfig(**spec["model"]))
    optimizer = None
    if not (cfg.get("titan") or {}).get("optimizer"):  # as launch/train.py: AdamW, decay on matrices only
        groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    engine, _, _, _ = titan_ds.initialize(model=model, optimizer=optimizer, config=cfg)
    cuda = engine.device.type == "cuda"
    micro, gas = cfg["train_micro_batch_size_per_gpu"], int(cfg.get("gradient_accumulation_steps", 1))
    batches = Batcher(load_corpus().train, micro * gas, spec["model"]["block_size"], seed=spec["data_seed"])
    losses = []
    t0 = time.perf_counter()
    for step in range(1, spec["steps"] + 1):
        x, y = batches.get(step)
        step_losses = []
        for xm, ym in zip(x.split(micro), y.split(micro)):
            loss = engine(xm.to(engine.device), ym.to(engine.device))
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.detach().float())
        losses.append(float(torch.stack(step_losses).mean()))  # a host read per step: the check, not a job
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base if cuda else _status_bytes("VmHWM")
    device = str(engine.device)
    engine.destroy()  # the next run of this process starts from what this one leaves
    del engine, model, optimizer
    gc.collect()
    return {"losses": losses, "seconds": seconds, "device": device, "peak_memory_bytes": peak,
            "peak_memory_kind": "torch.cuda.max_memory_allocated (above the process's start)" if cuda else
            ("process peak RSS during the run (no GPU)" if cpu_peak else "process peak RSS (no GPU)")}


def _set_env(values: dict[str, Optional[str]]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _status_bytes(key: str) -> int:
    """``key`` of /proc/self/status in bytes (ru_maxrss's peak where it cannot be read)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_cpu_peak() -> bool:
    """Reset the process's peak RSS to its current RSS (Linux: /proc/self/clear_refs), so a run's peak is its own;
    False where it cannot (the peak is then the process's so far)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _timer(device: str):
    """A function timing ``fn()`` once on ``device``, in milliseconds (CUDA events on a GPU)."""
    import torch
    if device.startswith("cuda"):
        def cuda_ms(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        return cuda_ms

    def cpu_ms(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return cpu_ms


def _optimizers(spec: dict[str, Any], device: str):
    """(name, build) of each timed optimizer: a profile's section as the engine builds it, torch fused AdamW,
    torchao AdamW8bit. ``build(param)`` returns the optimizer (param already of the dtype it trains)."""
    import torch
    out = []
    for name, cfg in spec["sections"].items():
        def titan_opt(p, cfg=cfg):
            from titan_ds.config import TitanConfig
            from titan_ds.optim.install import build_optimizer
            section = TitanConfig.from_ds_config({"titan": {"optimizer": cfg}}).optimizer
            return build_optimizer(torch.nn.ParameterList([p]), section)
        out.append((name, "bf16" if cfg.get("weight_dtype") == "bf16" else "fp32", titan_opt))
    out.append(("torch AdamW fused", "fp32",
                lambda p: torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)))
    if "torchao" in spec["baselines"]:
        def torchao_8bit(p):
            from torchao.optim import AdamW8bit
            return AdamW8bit([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        out.append(("torchao AdamW8bit", "fp32", torchao_8bit))
    return out


def _time(spec: dict[str, Any]) -> dict[str, Any]:
    """The optimizer step's time of each optimizer on one ``numel``-element parameter (rows of 1024)."""
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    timer, rows = _timer(device), []
    n = spec["numel"]
    for name, dtype, build in _optimizers(spec, device):
        row: dict[str, Any] = {"optimizer": name, "weights": dtype}
        try:
            gen = torch.Generator(device="cpu").manual_seed(0)
            p = torch.nn.Parameter(torch.randn(n // 1024, 1024, generator=gen).to(
                device, torch.bfloat16 if dtype == "bf16" else torch.float32))
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(device, p.dtype)
            opt = build(p)
            for _ in range(3):  # the state exists, any compile is done
                opt.step()
            times = [timer(opt.step) for _ in range(spec["steps"])]
            row["ms"] = statistics.median(times)
        except Exception as e:  # noqa: BLE001 (a baseline that cannot run here is a row saying why)
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    base = next((r.get("ms") for r in rows if r["optimizer"] == "torch AdamW fused"), None)
    for r in rows:
        if base and r.get("ms"):
            r["x_adamw_fused"] = r["ms"] / base
    return {"numel": n, "device": device, "timer": "CUDA events" if device == "cuda" else "time.perf_counter",
            "steps": spec["steps"], "rows": rows}


def _one(spec: dict[str, Any]) -> dict[str, Any]:
    """One job; a training run the Triton path refuses here (the interpreter runs fp32 only) is run again with the
    default kernels, and says so."""
    from titan_ds.kernels._guard import KernelBackendError
    try:
        return _train(spec) if spec["kind"] == "train" else _time(spec)
    except KernelBackendError as e:
        if spec["kind"] != "train" or spec["kernels"] != "triton":
            return {"error": f"{type(e).__name__}: {e}"}
        refused = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 (a run that raises is a failed row, reported by the parent)
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        return dict(_train(dict(spec, kernels=None)), kernels_used=f"default (the Triton path refused: {refused})")
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def _worker(jobs_file: str) -> int:
    """Run the jobs listed in ``jobs_file`` in order, writing each result beside it as it finishes."""
    jobs = json.loads(Path(jobs_file).read_text())
    for i, spec in enumerate(jobs):
        Path(f"{jobs_file}.{i}").write_text(json.dumps(_one(spec)))
    return 0


# ------------------------------------------------------------------------------------------ the parent
def _children(groups: dict[str, tuple[dict[str, Optional[str]], list[dict[str, Any]]]], tmp: Path,
              timeout: float) -> dict[str, list[dict[str, Any]]]:
    """Run each group's jobs in one fresh interpreter with the group's process environment (added to this one's;
    None removes a variable); each job's result, in order."""
    root = str(Path(__file__).resolve().parents[1])
    out: dict[str, list[dict[str, Any]]] = {}
    for name, (env, jobs) in groups.items():
        # each worker is a one-process world of its own: a launcher's (or a test session's) RANK, WORLD_SIZE and
        # MASTER_PORT would make it rendezvous on a port the parent's process group already holds
        full = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
        full["PYTHONPATH"] = root + (os.pathsep + full["PYTHONPATH"] if full.get("PYTHONPATH") else "")
        for key, value in env.items():
            if value is None:
                full.pop(key, None)
            else:
                full[key] = value
        jobs_file = tmp / f"{name}.json"
        jobs_file.write_text(json.dumps(jobs))
        try:
            proc = subprocess.run([sys.executable, "-m", "titan_ds.gpu_check", "--worker", str(jobs_file)], env=full,
                                  capture_output=True, text=True, timeout=timeout)
            why = f"the {name} process exited {proc.returncode}: {proc.stderr.strip()[-2000:]}"
        except subprocess.TimeoutExpired:
            why = f"the {name} process ran past {timeout:.0f} s"
        results = []
        for i in range(len(jobs)):
            done = Path(f"{jobs_file}.{i}")
            results.append(json.loads(done.read_text()) if done.is_file() else {"error": why})
            done.unlink(missing_ok=True)
        jobs_file.unlink()
        out[name] = results
    return out


def _plan_processes(gpu: bool, triton: bool) -> tuple[dict, Optional[str], str, dict, bool]:
    """The device side's process environment, its kernels (TITAN_KERNELS, set per run) and their description, the
    reference side's process environment, and whether both sides share one process (no GPU: both on the CPU)."""
    if gpu:
        # DeepSpeed takes one accelerator per process: the reference is a CPU process
        return ({"TRITON_INTERPRET": None}, None, "default (Triton on CUDA tensors)",
                {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}, False)
    cpu = {"TRITON_INTERPRET": "1"}  # read when Triton kernels are defined: before the process imports them
    if triton:
        return (cpu, "triton", "triton under the interpreter (TITAN_KERNELS=triton, TRITON_INTERPRET=1) on the CPU",
                cpu, True)
    return cpu, None, "default (Triton is not installed: the CPU kernels)", cpu, True


def run(profiles: list[str], *, steps: int, seed: int, micro_batch: int, config_dir: Path, time_numel: int,
        time_steps: int, baselines: list[str], timeout: float = 3600.0) -> dict[str, Any]:
    """The check (module docstring); the report as a dict (what ``--out`` holds)."""
    import torch

    from .kernels._guard import triton_available
    gpu = torch.cuda.is_available()
    dev_env, dev_kernels, kernels, ref_env, shared = _plan_processes(gpu, triton_available())
    configs = {name: load_profile(name, config_dir, micro_batch) for name in profiles}  # all errors before any run
    train = [{"kind": "train", "config": cfg, "steps": steps, "seed": seed, "data_seed": seed, "model": MODEL}
             for cfg in configs.values()]
    # Triton's interpreter runs fp32 only (kernels/_guard.py): a bf16 profile's CPU device run takes the defaults
    interpreted = dev_kernels == "triton" and not gpu
    bf16_note = "default (bf16 weights: Triton's interpreter runs fp32 only)"
    row_kernels = [bf16_note if interpreted and weight_dtype(cfg) == "bf16" else kernels for cfg in configs.values()]
    device_jobs = [dict(t, kernels=None if k == bf16_note else dev_kernels) for t, k in zip(train, row_kernels)]
    reference_jobs = [_reference_spec(dict(t, kernels="reference")) for t in train]
    sections = {name: cfg["titan"]["optimizer"] for name, cfg in configs.items()
                if (cfg.get("titan") or {}).get("optimizer")}
    timing = {"kind": "time", "sections": sections, "numel": time_numel, "steps": time_steps, "baselines": baselines}
    tmp = Path(tempfile.mkdtemp(prefix="titan_gpu_check_"))  # the jobs and their results, read back and removed
    if shared:
        got = _children({"cpu": (dev_env, device_jobs + reference_jobs + [timing])}, tmp, timeout)["cpu"]
        dev, ref, timed = got[:len(train)], got[len(train):2 * len(train)], got[-1]
    else:
        both = _children({"device": (dev_env, device_jobs + [timing]), "reference": (ref_env, reference_jobs)},
                         tmp, timeout)
        dev, timed, ref = both["device"][:-1], both["device"][-1], both["reference"]
    tmp.rmdir()
    report: dict[str, Any] = {
        "gpu": gpu,
        "device": torch.cuda.get_device_name() if gpu else f"cpu ({platform.processor() or platform.machine()})",
        "note": ("" if gpu else "NO GPU WAS USED: this machine has no CUDA device; the device runs ran on the CPU, "
                 "so this checks the kernel paths under Triton's interpreter, not a GPU"),
        "kernels": {"device_run": kernels, "reference_run": "reference (TITAN_KERNELS=reference) on the CPU"},
        "versions": _versions(),
        "settings": {"steps": steps, "seed": seed, "micro_batch": micro_batch, "model": MODEL,
                     "config_dir": str(config_dir)},
        "tolerance": {"rule": "max over steps of |loss_device - loss_reference| / |loss_reference|", **TOLERANCE},
        "profiles": [_row(name, cfg, k, d, r)
                     for (name, cfg), k, d, r in zip(configs.items(), row_kernels, dev, ref)],
        "optimizer_step": timed,
    }
    report["ok"] = all(r["ok"] for r in report["profiles"]) and "error" not in timed
    return report


def _versions() -> dict[str, str]:
    from importlib import metadata
    out = {"python": platform.python_version()}
    for dist in ("torch", "deepspeed", "titan-ds", "triton", "torchao"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _row(name: str, cfg: dict[str, Any], kernels: str, dev: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """A profile's line of the report from its device and reference runs."""
    row: dict[str, Any] = {"profile": name, "weights": weight_dtype(cfg), "kernels": dev.get("kernels_used", kernels)}
    row["tolerance"] = TOLERANCE[row["weights"]]
    for key, res in (("device", dev), ("reference", ref)):
        if "error" in res:
            row.setdefault("errors", {})[key] = res["error"]
        else:
            row[f"losses_{key}"] = res["losses"]
            row[f"seconds_{key}"] = res["seconds"]
    if "error" not in dev:
        row.update(peak_memory_bytes=dev["peak_memory_bytes"], peak_memory_kind=dev["peak_memory_kind"],
                   device_run_on=dev["device"])
    row["max_rel_diff"] = rel_diff(row.get("losses_device", []), row.get("losses_reference", []))
    row["ok"] = "errors" not in row and row["max_rel_diff"] <= row["tolerance"]
    return row


def _reference_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The CPU reference run of a profile: the device run's spec with the reference kernels (a seam the tests use
    to break one side)."""
    return spec


# ---------------------------------------------------------------------------------------------- screen
def _mib(b: Optional[int]) -> str:
    return "-" if b is None else f"{b / 2**20:.1f} MiB"


def format_report(rep: dict[str, Any]) -> str:
    lines = []
    if not rep["gpu"]:
        lines += [rep["note"], ""]
    lines.append(f"device: {rep['device']}; device-run kernels: {rep['kernels']['device_run']}")
    lines.append(f"{'profile':<16} {'weights':<7} {'loss dev':>9} {'loss ref':>9} {'max rel diff':>12} "
                 f"{'tolerance':>9} {'peak memory':>22}  result")
    for r in rep["profiles"]:
        last = lambda k: f"{r[k][-1]:.4f}" if r.get(k) else "-"  # noqa: E731
        peak = _mib(r.get("peak_memory_bytes")) + (" (RSS)" if not rep["gpu"] and "peak_memory_bytes" in r else "")
        verdict = "ok" if r["ok"] else ("FAILED: " + "; ".join(f"{k}: {v[:160]}" for k, v in r["errors"].items())
                                       if "errors" in r else "FAILED: outside the tolerance")
        lines.append(f"{r['profile']:<16} {r['weights']:<7} {last('losses_device'):>9} {last('losses_reference'):>9} "
                     f"{r['max_rel_diff']:>12.2e} {r['tolerance']:>9.1e} {peak:>22}  {verdict}")
    t = rep["optimizer_step"]
    if "error" in t:
        lines.append(f"optimizer step timing failed: {t['error'][:300]}")
    else:
        lines.append(f"\noptimizer step, one {t['numel']:,}-element parameter on {t['device']} ({t['timer']}, "
                     f"median of {t['steps']}):")
        for r in t["rows"]:
            if "error" in r:
                lines.append(f"  {r['optimizer']:<22} {r['weights']:<5} not run: {r['error'][:200]}")
            else:
                ratio = f"  {r['x_adamw_fused']:.2f}x fused AdamW" if "x_adamw_fused" in r else ""
                lines.append(f"  {r['optimizer']:<22} {r['weights']:<5} {r['ms']:9.3f} ms{ratio}")
    lines.append("\nresult: " + ("ok" if rep["ok"] else "FAILED"))
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profiles", default=",".join(PROFILES),
                   help=f"comma-separated shipped profiles (default: all of {', '.join(PROFILES)})")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per run (default 20 on a GPU; 5 on the CPU, where Triton's interpreter runs "
                        "each kernel program in Python)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch (default 4)")
    p.add_argument("--configs", default=str(CONFIG_DIR), help="the folder of the profiles' ds_configs")
    p.add_argument("--time-numel", type=int, default=None,
                   help="elements of the timed parameter (default 2^26 on a GPU, 2^20 on the CPU)")
    p.add_argument("--time-steps", type=int, default=None, help="timed optimizer steps (default 20 GPU, 5 CPU)")
    p.add_argument("--baselines", default=None,
                   help="timed baselines beside torch fused AdamW: 'torchao' (AdamW8bit) or 'none' (default torchao "
                        "on a GPU, none on the CPU, where torchao's step is torch.compile'd: minutes on few cores)")
    p.add_argument("--out", default="gpu_check.json", help="the JSON report (default gpu_check.json)")


def main(argv: Optional[list[str]] = None, args: Optional[argparse.Namespace] = None) -> int:
    if args is None:
        p = argparse.ArgumentParser(prog="titan-ds gpu-check", description=__doc__.split("\n\n")[0])
        add_arguments(p)
        p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
        args = p.parse_args(argv)
    if getattr(args, "worker", None):
        return _worker(args.worker)
    import torch
    gpu = torch.cuda.is_available()
    profiles = [s for s in args.profiles.split(",") if s]
    unknown = [s for s in profiles if s not in PROFILES]
    if unknown or not profiles:
        print(f"titan-ds gpu-check: unknown profile(s) {unknown}; choose from {', '.join(PROFILES)}", file=sys.stderr)
        return 2
    baselines = args.baselines if args.baselines is not None else ("torchao" if gpu else "none")
    if baselines not in ("torchao", "none"):
        print(f"titan-ds gpu-check: --baselines {baselines!r}: choose torchao or none", file=sys.stderr)
        return 2
    if args.steps is None:
        args.steps = 20 if gpu else 5
    if args.steps < 1:
        print(f"titan-ds gpu-check: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        rep = run(profiles, steps=args.steps, seed=args.seed, micro_batch=args.micro_batch,
                  config_dir=Path(args.configs),
                  time_numel=args.time_numel or (1 << 26 if gpu else 1 << 20),
                  time_steps=args.time_steps or (20 if gpu else 5),
                  baselines=[] if baselines == "none" else [baselines])
    except FileNotFoundError as e:
        print(f"titan-ds gpu-check: {e}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1) + "\n")
    print(format_report(rep))
    print(f"wrote {out}")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
