"""HMS at scale: the largest reference GPT that trains 2 steps under a hard memory cap, plain DeepSpeed vs HMS.

Command (from the repository root, as root on Linux with cgroup v1; PATH is a folder on the disk HMS uses)::

    PYTHONPATH=$PWD python launch/bench/hms_scale.py --path /work/hms_bench --caps 2,4,8

For each cap C (GiB) and each mode, bisection on the depth of a GPT of width ``--width`` finds the largest model
that trains ``--steps`` steps with a finite loss inside a cgroup capped at C (``memory.limit_in_bytes`` and
``memory.memsw.limit_in_bytes``: no swap). Every model is built under ``titan_ds.zero_init`` (``deepspeed.zero.Init``
for plain DeepSpeed), so no mode ever holds the whole model in RAM. Modes:

- ``zero3_cpu``: plain DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to CPU, torch AdamW;
- ``hms``: ZeRO-3 with titan HMS (parameters and optimizer state on disk), torch AdamW;
- ``hms_asdt``: the same with the titan optimizer (ASDT, bf16 state, density 0.1) and ``gradient_buffer: "disk"``;
- ``hms_asdt_bf16``: ``hms_asdt`` with bf16 parameters (``bf16.enabled``; the gradients still accumulate in fp32,
  ``data_types.grad_accum_dtype``, in the file mapping), ASDT's momentum in 8 bits, density 1 (no top-k
  selection: its cost dominated the step of a 405M model) and lr 1e-5 (sign steps at width 4096 need it):
  11 bytes/param on disk (bf16 partition 2, fp32 master 4, 8-bit momentum 1, fp32 gradient 4) where
  ``hms_asdt`` writes 14. For the full-size run (issue 16).

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
import json
import logging
import math
import os
import shutil
import signal
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

MODES = ("zero3_cpu", "hms", "hms_asdt", "hms_asdt_bf16")  # titan_ds.plan.MODES that stream or offload
GiB = 1 << 30


def gpt_params(layers: int, width: int) -> int:
    return model_spec(f"gpt:{layers}x{width}").params


def ds_config(mode: str, nvme: str) -> dict:
    return candidate_config(mode, nvme_path=nvme, micro_batch=1)  # what `titan-ds plan --out` writes


def trial(mode: str, layers: int, width: int, cap_gib: float, *, path: str, steps: int, timeout: float,
          logs: Path) -> dict:
    """Train once under the cap; the outcome and its measurements."""
    nvme = os.path.join(path, f"{mode}_{layers}x{width}")
    work = Path(path) / "cfg"
    work.mkdir(parents=True, exist_ok=True)
    name = f"{mode}_c{cap_gib:g}_{layers}x{width}"
    cfg_path, summary = work / f"{name}.json", work / f"{name}.summary.json"
    cfg_path.write_text(json.dumps(ds_config(mode, nvme)))
    summary.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--deepspeed_config", str(cfg_path), "--steps",
           str(steps), "--layers", str(layers), "--width", str(width), "--heads", str(max(1, width // 64)),
           "--micro-batch", "1", "--val-batches", "1", "--warmup", "1", "--no-progress", "--zero-init",
           "--summary-out", str(summary), "--metrics-out", str(work / f"{name}.metrics.jsonl")]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=str(ROOT))
    env.setdefault("OMP_NUM_THREADS", "2")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    logs.mkdir(parents=True, exist_ok=True)
    r = run_capped_clean(cmd, int(cap_gib * GiB), logs / f"{name}.log", env=env, cwd=str(ROOT), timeout=timeout)
    out = {"mode": mode, "layers": layers, "width": width, "cap_GiB": cap_gib, "params": gpt_params(layers, width),
           "peak_anon_GiB": r.peak_anon_bytes / GiB, "max_usage_GiB": r.max_usage_bytes / GiB, "wall_s": r.wall_s,
           "returncode": r.returncode, "oom_killed": r.oom_killed, "timed_out": r.timed_out}
    s = json.loads(summary.read_text()) if summary.exists() else None
    finite = s is not None and math.isfinite(s["val_loss"]) and math.isfinite(s["train_loss_last10"])
    out["fits"] = bool(r.ok and finite)
    out["status"] = ("ok" if out["fits"] else "OOM-killed" if r.oom_killed else
                     f"not finished in {timeout:.0f} s" if r.timed_out else
                     "non-finite loss" if s is not None else f"failed (exit {r.returncode})")
    if s is not None:
        hms = s.get("titan_metrics", {}).get("hms", {})
        hist = [json.loads(x) for x in (work / f"{name}.metrics.jsonl").read_text().splitlines()[1:]]
        steps_s = [h["step_s"] for h in hist]
        moved = [h["hms"]["bytes_read"] + h["hms"]["bytes_written"] for h in hist if "hms" in h]
        out["GiB_moved_per_step"] = sum(moved) / len(moved) / GiB if moved else 0.0
        out.update(trainable=s["trainable_params"], step_s=sum(steps_s) / max(1, len(steps_s)), peak_rss_GiB=s["peak_rss"] / GiB,
                   disk_GiB=hms.get("disk_bytes", 0) / GiB, val_loss=s["val_loss"])
    shutil.rmtree(nvme, ignore_errors=True)
    return out


class Trials(ResultLog):
    """The trial log: every finished trial, keyed by (mode, cap, layers, width), in the results store
    (``launch/bench/store.py``); a rerun reuses them under its rule (same code, or ``reuse_stale``)."""

    def __init__(self, path: Path, reuse_stale: bool = False):
        def load(r: dict) -> dict:
            r["params"] = gpt_params(r["layers"], r["width"])  # counted on the meta device
            return r
        super().__init__(path, lambda r: self.key(r["mode"], r["cap_GiB"], r["layers"], r["width"]), load,
                         suite="hms-scale", reuse_stale=reuse_stale)

    @staticmethod
    def key(mode, cap, layers, width) -> tuple:
        return (mode, float(cap), int(layers), int(width))

    def run(self, mode, cap, layers, width, **kw) -> dict:
        return self.get(self.key(mode, cap, layers, width), lambda: trial(mode, layers, width, cap, **kw),
                        lambda r: f"{mode} cap {cap:g} GiB {layers}x{width} ({r['params'] / 1e6:.0f}M): "
                                  f"{r['status']}, peak anon {r['peak_anon_GiB']:.2f} GiB, {r['wall_s']:.0f} s")


def largest(trials: Trials, mode: str, cap: float, width: int, start: int, max_layers: int, rel: float,
            **kw) -> dict | None:
    """Largest depth that fits: doubling from ``start`` to bracket, then bisection to ``rel`` relative width."""
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


def _speeds() -> tuple[float, float]:
    """fp32 GFLOP/s of a 1024^3 matmul (measured once) and dd's direct read GB/s from results/hms_streaming.csv
    (bench_hms.py part a), the bounds of today's HMS tables."""
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
    return _SPEEDS[0], _SPEEDS[1]


def _md(rows: list[dict], keys: list[str]) -> str:
    def f(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] +
                     ["| " + " | ".join(f(r.get(k, "-")) for k in keys) + " |" for r in rows]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", required=True, help="folder for HMS's files (on the disk to use, outside the repo)")
    ap.add_argument("--caps", default="2,4,8", help="GiB, comma list")
    ap.add_argument("--modes", default="zero3_cpu,hms")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--mode-opts", default="",
                    help="'MODE:width=W,start=N,max_layers=N[;MODE:...]': a mode's own width and search bounds")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--start", type=int, default=4, help="first depth tried")
    ap.add_argument("--max-layers", type=int, default=512)
    ap.add_argument("--rel", type=float, default=0.1, help="stop bisecting at this relative bracket width")
    ap.add_argument("--timeout", type=float, default=1500, help="seconds per trial")
    ap.add_argument("--out", default=str(ROOT / "results" / "hms_scale_cap"))
    add_store_args(ap)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="  %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run_capped's cleanup then removes the cgroup
    if not cgroup_available():
        raise SystemExit("hms_scale.py needs root and a cgroup v1 memory controller at /sys/fs/cgroup/memory")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    trials = Trials(out.with_suffix(".trials.jsonl"), a.reuse_stale)
    kw = dict(path=a.path, steps=a.steps, timeout=a.timeout, logs=out.parent / "logs" / "hms_scale_cap")
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
    for cap in sorted(float(c) for c in a.caps.split(",")):
        base = None
        for mode in a.modes.split(","):
            if mode not in MODES:
                raise SystemExit(f"--modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")
            # a larger cap starts where the smaller one ended
            o = opts[mode]
            width = o["width"]
            best = largest(trials, mode, cap, width, max(o["start"], prev.get(mode, 0)), o["max_layers"], a.rel,
                           **kw)
            prev[mode] = best["layers"] if best else 0
            fail = [r for r in trials.rows.values() if r["mode"] == mode and r["cap_GiB"] == cap and not r["fits"]
                    and r["width"] == width]
            first_fail = min(fail, key=lambda r: r["layers"]) if fail else None
            row = {"cap_GiB": cap, "mode": mode}
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
                if mode == "zero3_cpu":
                    base = best["params"]
                row["x_zero3_cpu"] = best["params"] / base if base else "-"
            rows.append(row)
            write(rows, out, a)
    write(rows, out, a)


def write(rows: list[dict], out: Path, a) -> None:
    import csv
    gflops, disk_gbps = _speeds()
    for r in rows:
        if "params" in r:
            r["compute_bound_s"] = 6 * r["params"] * 128 / (gflops * 1e9)
            if r.get("GiB_moved_per_step") is not None:
                r["io_bound_s"] = r["GiB_moved_per_step"] * GiB / (disk_gbps * 1e9)
    keys = ["cap_GiB", "mode", "shape", "params_M", "x_zero3_cpu", "peak_anon_GiB", "max_usage_GiB", "peak_rss_GiB",
            "disk_GiB", "step_s", "io_bound_s", "compute_bound_s", "next_fails"]
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    notes = [f"Command: `PYTHONPATH=$PWD python launch/bench/hms_scale.py {' '.join(sys.argv[1:])}`",
             f"Machine: {os.cpu_count()} CPU cores (shared), "
             f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB RAM; {time.strftime('%Y-%m-%d')}",
             f"GPT of width {a.width} unless the shape says otherwise (heads width/64, vocab 256, context 128), micro-batch 1, {a.steps} steps, "
             f"built under titan_ds.zero_init; depth bisected to {a.rel:.0%}. All modes: ZeRO-3 with "
             f"{', '.join(f'{k} {v:.0e}' for k, v in ZERO3_BOUNDS.items())}. peak_anon: sampled max of the cgroup's "
             f"rss + shmem; max_usage: the kernel's high-water mark (includes page cache, which the cap reclaims); "
             f"peak_rss: the process's VmHWM (counts mapped files too). s/step: the steps after the first. io_bound_s: HMS's bytes read + written per step / dd's direct read speed (results/hms_streaming.csv); compute_bound_s: 6 x params x 128 tokens / the measured fp32 matmul GFLOP/s. next_fails: the smallest depth tried that did not fit, and why. "
             f"s/step on a shared 2-core machine (other jobs ran beside it): indicative only."]
    md = "### HMS at scale: largest GPT trained under a memory cap\n\n" + "\n".join(notes) + "\n\n" + _md(rows, keys)
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
