"""``titan-ds plan``: calibrate its byte model, and measure how close its predicted peaks are.

Commands (from the repository root, as root on Linux with cgroup v1; PATH is a folder for HMS's files)::

    PYTHONPATH=$PWD python launch/bench/plan_accuracy.py --path /work/plan_bench --calibrate
    PYTHONPATH=$PWD python launch/bench/plan_accuracy.py --path /work/plan_bench

Each run trains the reference GPT for 2 steps (micro-batch 1, context 128, built under ``titan_ds.zero_init``
for ZeRO-3) with the config ``titan-ds plan`` would write for its mode (``titan_ds.plan.candidate_config``)
inside a memory cgroup, and records the group's peak anonymous memory (rss + shmem, sampled every 50 ms; page
cache out, see ``titan_ds/memcap.py``).

``--calibrate`` runs every mode at the calibration shapes (``--cal-shapes``), fits per mode the process baseline
and the bytes per parameter that the structural model does not explain (least squares over the shapes), and
writes ``titan_ds/plan_calibration.json``. Without it, the validation runs (other widths, depths and rank counts
than the fit saw) are compared with the prediction: ``results/plan_accuracy.{md,csv}``. Every run is saved at
once to ``<out>.runs.jsonl`` (``launch/bench/store.py``) and reused by a rerun from the same code (resumable;
``--reuse-stale``: from any code); ``python -m launch.bench table plan-accuracy --out <out>`` rewrites the table
from it and today's predictions without running anything.
"""
from __future__ import annotations

import argparse
import csv
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
from titan_ds.memcap import cgroup_available  # noqa: E402
from titan_ds.plan import (CALIBRATION_FILE, MODES, _structure, candidate_config, model_spec,  # noqa: E402
                           predict)
from titan_ds.utils import free_port  # noqa: E402

GiB = 1 << 30
# the validation runs: shapes the calibration did not see, every mode, and two ranks
VALIDATION = [("zero2", "gpt:6x1024", 1), ("zero3", "gpt:8x1024", 1), ("zero3_cpu", "gpt:12x1024", 1),
              ("hms", "gpt:24x1024", 1), ("hms_asdt", "gpt:24x1024", 1), ("zero2", "gpt:8x640", 2),
              ("hms_asdt_bf16", "gpt:24x1024", 1)]


def measure(mode: str, spec: str, ranks: int, *, path: str, cap_gib: float, logs: Path, timeout: float) -> dict:
    m = model_spec(spec)
    name = f"{mode}_{spec.split(':')[1]}_r{ranks}"
    nvme = os.path.join(path, name)
    work = Path(path) / "cfg"
    work.mkdir(parents=True, exist_ok=True)
    cfg_path, summary = work / f"{name}.json", work / f"{name}.summary.json"
    cfg_path.write_text(json.dumps(candidate_config(mode, nvme_path=nvme)))
    summary.unlink(missing_ok=True)
    args = [str(ROOT / "launch" / "train.py"), "--deepspeed_config", str(cfg_path), "--steps", "2", *m.gpt_args,
            "--micro-batch", "1", "--val-batches", "1", "--warmup", "1", "--no-progress", "--summary-out",
            str(summary)] + (["--zero-init"] if mode != "zero2" else [])
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1" if ranks > 1 else "2")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    port = str(free_port())
    if ranks == 1:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable] + args
    else:
        cmd = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", str(ranks), "--master_port", port] + args
    logs.mkdir(parents=True, exist_ok=True)
    r = run_capped_clean(cmd, int(cap_gib * GiB), logs / f"{name}.log", env=env, cwd=str(ROOT), timeout=timeout)
    shutil.rmtree(nvme, ignore_errors=True)
    ok = r.ok and summary.exists() and math.isfinite(json.loads(summary.read_text())["val_loss"])
    return {"mode": mode, "model": spec, "ranks": ranks, "params": m.params, "ok": ok,
            "measured_GiB": r.peak_anon_bytes / GiB, "max_usage_GiB": r.max_usage_bytes / GiB, "wall_s": r.wall_s,
            "status": "ok" if ok else ("OOM-killed" if r.oom_killed else f"failed (exit {r.returncode})")}


class Runs(ResultLog):
    """Every finished run, keyed by (mode, model, ranks), in the results store (``launch/bench/store.py``): a
    rerun reuses them under its rule (same code, or ``reuse_stale``)."""

    def __init__(self, path: Path, reuse_stale: bool = False):
        super().__init__(path, lambda r: (r["mode"], r["model"], r["ranks"]), suite="plan-accuracy",
                         reuse_stale=reuse_stale)

    def get(self, mode, spec, ranks, **kw) -> dict:  # type: ignore[override]
        return super().get((mode, spec, ranks), lambda: measure(mode, spec, ranks, **kw),
                           lambda r: f"{mode} {spec} x{ranks}: {r['status']}, peak anon "
                                     f"{r['measured_GiB']:.3f} GiB, {r['wall_s']:.0f} s")


def calibrate(runs: Runs, shapes: list[str], kw: dict) -> dict:
    """Per mode, least squares of (measured - structure) = baseline + extra * params over the shapes."""
    out = {"command": "PYTHONPATH=$PWD python launch/bench/plan_accuracy.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores, CPU accelerator (fp32)",
           "measure": "cgroup peak anonymous memory (rss + shmem), 2 training steps, micro-batch 1, context 128",
           "modes": {}}
    for mode in MODES:
        pts = []
        for spec in shapes:
            r = runs.get(mode, spec, 1, **kw)
            if not r["ok"]:
                raise SystemExit(f"calibration run {mode} {spec} failed: {r['status']}")
            m = model_spec(spec)
            s = sum(_structure(mode, m, 1, 128, 1, False)["dram"].values())
            pts.append((m.params, r["measured_GiB"] * GiB - s))
        n = len(pts)
        mx = sum(p for p, _ in pts) / n
        my = sum(y for _, y in pts) / n
        sxx = sum((p - mx) ** 2 for p, _ in pts)
        extra = sum((p - mx) * (y - my) for p, y in pts) / sxx
        base = my - extra * mx
        out["modes"][mode] = {"baseline_bytes": base, "extra_bytes_per_param": extra,
                              "points": [{"params": p, "residual_bytes": y} for p, y in pts]}
        print(f"{mode}: baseline {base / GiB:.3f} GiB, unexplained {extra:.2f} bytes/param")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", required=True)
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--cal-shapes", default="gpt:4x512,gpt:8x768,gpt:16x768")
    ap.add_argument("--cap", type=float, default=20, help="GiB: a cap no run reaches (measurement, not a limit)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(ROOT / "results" / "plan_accuracy"))
    add_store_args(ap)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="  %(message)s")
    if not cgroup_available():
        raise SystemExit("plan_accuracy.py needs root and a cgroup v1 memory controller")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run_capped's cleanup removes the cgroup
    out = Path(a.out)
    runs = Runs(out.with_name(out.name + (".cal" if a.calibrate else "") + ".runs.jsonl"), a.reuse_stale)
    kw = dict(path=a.path, cap_gib=a.cap, logs=out.parent / "logs" / "plan_accuracy", timeout=a.timeout)
    if a.calibrate:
        cal = calibrate(runs, a.cal_shapes.split(","), kw)
        CALIBRATION_FILE.write_text(json.dumps(cal, indent=1) + "\n")
        print(f"wrote {CALIBRATION_FILE}")
        return
    for mode, spec, ranks in VALIDATION:
        runs.get(mode, spec, ranks, **kw)
    write_table(runs, out, f"PYTHONPATH=$PWD python launch/bench/plan_accuracy.py {' '.join(sys.argv[1:])}")


def write_table(runs: Runs, out: Path, command: str) -> None:
    """``<out>.md``/``.csv``: every validation run recorded in ``runs`` beside today's prediction for it."""
    rows = []
    for mode, spec, ranks in VALIDATION:
        r = runs.rows.get((mode, spec, ranks))
        if r is None:
            continue
        c = predict(mode, model_spec(spec), ranks=ranks)
        pred = c.dram_peak * ranks / GiB
        rows.append({"mode": mode, "model": spec, "params_M": r["params"] / 1e6, "ranks": ranks,
                     "predicted_GiB": pred, "measured_GiB": r["measured_GiB"] if r["ok"] else r["status"],
                     "error_pct": 100 * (pred - r["measured_GiB"]) / r["measured_GiB"] if r["ok"] else "-"})
    keys = ["mode", "model", "params_M", "ranks", "predicted_GiB", "measured_GiB", "error_pct"]
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)

    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)
    errs = [abs(r["error_pct"]) for r in rows if isinstance(r["error_pct"], float)]
    dates = [rec["date"] for rec in runs.store.records if rec.get("date")]
    md = ["### `titan-ds plan`: predicted vs measured peak DRAM", "",
          f"Command: `{command}`",
          f"Calibration: `{json.loads(CALIBRATION_FILE.read_text())['command']}` (shapes not used below). "
          f"Measured: cgroup peak anonymous memory (rss + shmem, all ranks), 2 steps, micro-batch 1, context 128. "
          f"{max(dates) if dates else time.strftime('%Y-%m-%d')}.", "",
          f"Largest |error|: {max(errs):.1f}% over {len(errs)} runs (target: within 15%)." if errs else "", "",
          "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    md += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def table(out: str) -> None:
    """``python -m launch.bench table plan-accuracy --out OUT``: ``OUT.md``/``.csv`` from ``OUT.runs.jsonl`` and
    today's predictions, running nothing (the command is the one the existing ``OUT.md`` records)."""
    import re
    out_p = Path(out)
    old = out_p.with_suffix(".md").read_text() if out_p.with_suffix(".md").exists() else ""
    m = re.search(r"Command: `([^`]*)`", old)
    write_table(Runs(out_p.with_name(out_p.name + ".runs.jsonl")), out_p, m.group(1) if m else "")


if __name__ == "__main__":
    main()
