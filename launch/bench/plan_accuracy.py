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
writes ``titan_ds/plan_calibration.json``; the modes fitted on committed ``hms_scale.py`` trials instead
(:data:`TRIAL_FIT`: ``zero_inf``, ``hms_balanced``) run nothing. ``--refit MODE,...`` refits only those modes
from their committed trials and rewrites their entries of the file, the others' as they are (no run, no cgroup).
Without ``--calibrate``, the validation runs (other widths, depths and rank counts than the fit saw, widths 2048
and 4096, each ``REPEATS`` times) are compared with the prediction for the code that ran (:data:`EARLIER_CODE`),
beside the held-out ZeRO-Infinity and ``hms_balanced`` trials of ``hms_scale.py`` and its width-4096 trials:
``results/plan_accuracy.{md,csv}``. ``--only MODEL,...`` runs a subset. Every run is saved at
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
from titan_ds.plan import (BASELINE_ONLY_MODES, CALIBRATION_FILE, MODES, PIPELINE_DEPTH,  # noqa: E402
                           candidate_config, load_step_temp, model_spec, predict)
from titan_ds.utils import free_port  # noqa: E402

GiB = 1 << 30
# the validation runs: shapes the calibration did not see, every mode, two ranks, and widths 2048 and 4096 (issue
# 29: the calibration saw widths 512 and 768 only); (mode, model, ranks)
VALIDATION_SHAPES = [("zero2", "gpt:6x1024", 1), ("zero3", "gpt:8x1024", 1), ("zero3_cpu", "gpt:12x1024", 1),
                     ("hms", "gpt:24x1024", 1), ("hms_asdt", "gpt:24x1024", 1), ("zero2", "gpt:8x640", 2),
                     ("hms_asdt_bf16", "gpt:24x1024", 1), ("hms", "gpt:4x2048", 1), ("hms_asdt_bf16", "gpt:2x4096", 1),
                     ("hms_asdt_bf16", "gpt:4x4096", 1), ("hms_dram", "gpt:12x1024", 1)]
REPEATS = 2  # each validation run is measured this many times (repeat 0, 1, ...): the table shows every repeat
VALIDATION = [(mode, spec, ranks, rep) for mode, spec, ranks in VALIDATION_SHAPES for rep in range(REPEATS)]
# What the runs recorded before the results store (no code_hash: every calibration run, the validation runs of
# 2026-11-30/12-01, the width-4096 hms_scale trials of 2026-12-01) ran: the optimizer step's temporaries plan held
# then (commit e93c8d8: torch AdamW 8, ASDT 25 with bf16 state, 28 with 8-bit state, bytes/element; today's core:
# titan_ds/step_temp.json) and no pipelined optimizer step (titan.hms.pipeline_optimizer, 92efbe0, 2026-12-02).
# Their residuals and predictions use the structure of that code; a run of today's code records its own.
EARLIER_CODE = {"step_temp": {"adamw": 8.0, "asdt_bf16": 25.0, "asdt_8bit": 28.0}, "pipeline_depth": 0}
# ZeRO-Infinity (plan mode zero_inf) is calibrated on launch/bench/hms_scale.py's committed zero_inf trials (its
# config is plan's candidate_config("zero_inf") with the aio block it swept): the bisection trials at these
# shapes fit it; every other successful zero_inf trial (12x768: 3 speed runs; 20x768, 30x768) is held out
ZINF_TRIALS = ["results/hms_scale_zinf.trials.jsonl", "results/hms_scale_zinf.speed.jsonl",
               "results/hms_scale_zinf_pipelined.speed.jsonl"]
ZINF_FIT = ("4x768", "8x768", "10x768")
# titan's shipped optimizer with HMS (plan mode hms_balanced, the config of hms_scale.py's hms_balanced) is calibrated
# on hms_scale.py's committed hms_balanced trials: the bisection trials of BALANCED_TRIALS[0] (32x768 and 41x768
# under 2 GiB, 121x768 under 4 GiB) fit its baseline; the others are held out: the 12x768 speed run, the 907.7M
# (128x768) speed runs and the 5.04B run (25x4096 under 8 GiB)
BALANCED_TRIALS = ["results/hms_scale_zinf.trials.jsonl", "results/hms_scale_zinf.speed.jsonl",
                   "results/hms_900m_1206_t1.speed.jsonl", "results/hms_900m_1206_t2.speed.jsonl",
                   "results/hms_5b_balanced_1206.speed.jsonl", "results/hms_5b_1207.speed.jsonl"]
# the modes fitted on committed hms_scale trials rather than runs of their own: mode -> (the store, the shapes of
# it that fit; None: all of them)
TRIAL_FIT = {"zero_inf": (ZINF_TRIALS[0], ZINF_FIT), "hms_balanced": (BALANCED_TRIALS[0], None)}
# hms_scale trials at width 4096 (the 5B run and its two probes; earlier code) checked beside the validation runs
WIDE_TRIALS = ["results/hms_scale_probe4096.trials.jsonl", "results/hms_scale_cap8.trials.jsonl"]


def hms_scale_trials(files: list[str], mode: str) -> list[dict]:
    """The successful trials of ``mode`` in committed hms_scale stores: mode, shape, params, peak, file, as_run."""
    out = []
    for f in files:
        for line in (ROOT / f).read_text().splitlines():
            rec = json.loads(line)
            r = rec.get("result", rec)
            if r.get("mode") == mode and r.get("fits"):
                out.append({"mode": mode, "shape": f"{r['layers']}x{r['width']}", "params": r["params"],
                            "measured_GiB": r["peak_anon_GiB"], "cap_GiB": r["cap_GiB"], "file": f,
                            "as_run": as_run_of(rec)})
    return out


def fit(pts: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = base + slope * x."""
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return my - slope * mx, slope


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
        # a run recorded before repeats were counted is repeat 0
        super().__init__(path, lambda r: (r["mode"], r["model"], r["ranks"], r.get("repeat", 0)),
                         lambda r: {**r, "repeat": r.get("repeat", 0)}, suite="plan-accuracy",
                         reuse_stale=reuse_stale)
        self.as_run = {}  # key -> predict()'s step_temp/pipeline_depth for the code the run measured
        for rec in self.store.records:
            r = rec["result"]
            self.as_run[self._key({**r, "repeat": r.get("repeat", 0)})] = as_run_of(rec)

    def get(self, mode, spec, ranks, repeat=0, **kw) -> dict:  # type: ignore[override]
        today = {"step_temp": dict(load_step_temp()), "pipeline_depth": PIPELINE_DEPTH}  # a run measured now
        r = super().get((mode, spec, ranks, repeat),
                        lambda: {**measure(mode, spec, ranks, **kw), "repeat": repeat, **today},
                        lambda r: f"{mode} {spec} x{ranks} #{repeat}: {r['status']}, peak anon "
                                  f"{r['measured_GiB']:.3f} GiB, {r['wall_s']:.0f} s")
        self.as_run[mode, spec, ranks, repeat] = {k: r[k] for k in ("step_temp", "pipeline_depth") if k in r} or today
        return r


def as_run_of(rec: dict) -> dict:
    """predict()'s ``step_temp``/``pipeline_depth`` for the code a stored run measured: :data:`EARLIER_CODE` for the
    runs recorded before the results store (no ``code_hash``), else what the run recorded."""
    if rec.get("code_hash") is None:
        return EARLIER_CODE
    return {k: rec["result"][k] for k in ("step_temp", "pipeline_depth") if k in rec["result"]}


def _command() -> str:
    return "PYTHONPATH=$PWD python launch/bench/plan_accuracy.py " + " ".join(sys.argv[1:])


def trial_points(mode: str) -> list[tuple]:
    """(model, measured - structure, source) of the committed hms_scale trials that fit ``mode`` (:data:`TRIAL_FIT`),
    the structure being that of the code each trial ran."""
    store, shapes = TRIAL_FIT[mode]
    pts = []
    for t in hms_scale_trials([store], mode):
        if shapes is None or t["shape"] in shapes:
            m = model_spec(f"gpt:{t['shape']}")
            s = predict(mode, m, calibration={"modes": {}}, **t["as_run"]).dram_peak
            pts.append((m, t["measured_GiB"] * GiB - s, f"{t['file']} cap {t['cap_GiB']:g}"))
    if not pts:
        raise SystemExit(f"no successful {mode} trial in {store} to fit it on")
    return pts


def fit_mode(mode: str, pts: list[tuple], zero3_cpu_extra: float) -> dict:
    """A mode's calibration entry from its points: BASELINE_ONLY_MODES fit the baseline alone (extra 0), zero_inf its
    baseline with zero3_cpu's extra, the others least squares of baseline + extra * params."""
    if mode in BASELINE_ONLY_MODES or mode == "zero_inf":
        extra = 0.0 if mode != "zero_inf" else zero3_cpu_extra
        base = sum(y - extra * m.params for m, y, _ in pts) / len(pts)
    else:
        base, extra = fit([(m.params, y) for m, y, _ in pts])
    print(f"{mode}: baseline {base / GiB:.3f} GiB, unexplained {extra:.2f} bytes/param")
    return {"baseline_bytes": base, "extra_bytes_per_param": extra,
            "points": [{"model": m.name, "params": m.params, "residual_bytes": y, "source": src}
                       for m, y, src in pts]}


def refit(modes: list[str]) -> dict:
    """The calibration file with the entries of ``modes`` (of :data:`TRIAL_FIT`) fitted again on their committed
    trials, each recording this command and date; every other entry as the file has it. Runs nothing."""
    unknown = [mo for mo in modes if mo not in TRIAL_FIT]
    if unknown:
        raise SystemExit(f"--refit: {', '.join(unknown)} not fitted on committed trials; choose from "
                         f"{', '.join(TRIAL_FIT)} (the others need --calibrate's runs)")
    cal = json.loads(CALIBRATION_FILE.read_text())
    for mode in modes:
        extra = cal["modes"]["zero3_cpu"]["extra_bytes_per_param"]
        cal["modes"][mode] = {**fit_mode(mode, trial_points(mode), extra), "command": _command(),
                              "date": time.strftime("%Y-%m-%d")}
    return cal


def calibrate(runs: Runs, shapes: list[str], kw: dict) -> dict:
    """Per mode, least squares of (measured - structure) = baseline + extra * params over the shapes, the structure
    being that of the code each run measured; BASELINE_ONLY_MODES fit the baseline alone (extra 0); the
    :data:`TRIAL_FIT` modes fit on their committed hms_scale trials (zero_inf its baseline, with zero3_cpu's extra)."""
    out = {"command": _command(),
           "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores, CPU accelerator (fp32)",
           "measure": "cgroup peak anonymous memory (rss + shmem), 2 training steps, micro-batch 1, context 128",
           "modes": {}}
    for mode in sorted(MODES, key=lambda mo: mo == "zero_inf"):  # zero_inf after zero3_cpu, whose slope it takes
        pts = []
        if mode in TRIAL_FIT:
            pts = trial_points(mode)
        else:
            for spec in shapes:
                r = runs.get(mode, spec, 1, **kw)
                if not r["ok"]:
                    raise SystemExit(f"calibration run {mode} {spec} failed: {r['status']}")
                m = model_spec(spec)
                s = predict(mode, m, calibration={"modes": {}}, **runs.as_run[mode, spec, 1, 0]).dram_peak
                pts.append((m, r["measured_GiB"] * GiB - s, runs.path.name))
        out["modes"][mode] = fit_mode(mode, pts, out["modes"].get("zero3_cpu", {}).get("extra_bytes_per_param", 0.0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", default=None, help="a folder for HMS's files (every command but --refit)")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--refit", default="", help=f"comma list of {', '.join(TRIAL_FIT)}: fit only these modes again "
                    "on their committed hms_scale trials and rewrite their entries of the calibration file (runs "
                    "nothing)")
    ap.add_argument("--cal-shapes", default="gpt:4x512,gpt:8x768,gpt:16x768")
    ap.add_argument("--cap", type=float, default=20, help="GiB: a cap no run reaches (measurement, not a limit)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(ROOT / "results" / "plan_accuracy"))
    ap.add_argument("--only", default="", help="comma-separated models: run only these validation runs (the "
                    "table still lists every recorded one)")
    add_store_args(ap)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="  %(message)s")
    if a.refit:
        CALIBRATION_FILE.write_text(json.dumps(refit(a.refit.split(",")), indent=1) + "\n")
        print(f"wrote {CALIBRATION_FILE}")
        return
    if not a.path:
        ap.error("--path is required (but with --refit)")
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
    only = set(a.only.split(",")) if a.only else None
    for mode, spec, ranks, rep in VALIDATION:
        if only is None or spec in only:
            runs.get(mode, spec, ranks, rep, **kw)
    write_table(runs, out, _command())


def _row(mode: str, spec: str, ranks: int, repeat, measured, as_run: dict, source: str) -> dict:
    """A table row: the prediction for the code the run measured (``as_run``) beside its measured peak."""
    m = model_spec(spec)
    pred = predict(mode, m, ranks=ranks, **as_run).dram_peak * ranks / GiB
    ok = isinstance(measured, float)
    code = "earlier" if as_run.get("pipeline_depth", PIPELINE_DEPTH) == 0 else "current"
    return {"mode": mode, "model": spec, "params_M": m.params / 1e6, "ranks": ranks, "repeat": repeat,
            "code": code, "predicted_GiB": pred, "measured_GiB": measured,
            "error_pct": 100 * (pred - measured) / measured if ok else "-", "source": source}


def write_table(runs: Runs, out: Path, command: str) -> None:
    """``<out>.md``/``.csv``: every validation run recorded in ``runs``, the held-out ZeRO-Infinity and
    ``hms_balanced`` trials, the width-4096 hms_scale trials and the ``hms_gdisk`` bisection trials, each beside the
    prediction for the code it ran (:data:`EARLIER_CODE`)."""
    rows = []
    for mode, spec, ranks, rep in VALIDATION:
        r = runs.rows.get((mode, spec, ranks, rep))
        if r is not None:
            rows.append(_row(mode, spec, ranks, rep, r["measured_GiB"] if r["ok"] else r["status"],
                             runs.as_run.get((mode, spec, ranks, rep), {}), runs.path.name))
    for t in hms_scale_trials(ZINF_TRIALS, "zero_inf"):
        if not (t["file"] == ZINF_TRIALS[0] and t["shape"] in ZINF_FIT):  # held out of the calibration
            rows.append(_row("zero_inf", f"gpt:{t['shape']}", 1, "-", t["measured_GiB"], t["as_run"],
                             f"{Path(t['file']).name} (cap {t['cap_GiB']:g})"))
    for t in hms_scale_trials(WIDE_TRIALS, "hms_asdt_bf16"):
        rows.append(_row("hms_asdt_bf16", f"gpt:{t['shape']}", 1, "-", t["measured_GiB"], t["as_run"],
                         f"{Path(t['file']).name} (cap {t['cap_GiB']:g})"))
    for t in hms_scale_trials(BALANCED_TRIALS, "hms_balanced"):
        if t["file"] != TRIAL_FIT["hms_balanced"][0]:  # held out of the calibration
            rows.append(_row("hms_balanced", f"gpt:{t['shape']}", 1, "-", t["measured_GiB"], t["as_run"],
                             f"{Path(t['file']).name} (cap {t['cap_GiB']:g})"))
    for t in hms_scale_trials(ZINF_TRIALS[:1], "hms_gdisk"):  # plan has no runs of its own for it (borrows hms's)
        rows.append(_row("hms_gdisk", f"gpt:{t['shape']}", 1, "-", t["measured_GiB"], t["as_run"],
                         f"{Path(t['file']).name} (cap {t['cap_GiB']:g})"))
    keys = ["mode", "model", "params_M", "ranks", "repeat", "code", "predicted_GiB", "measured_GiB", "error_pct",
            "source"]
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)

    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)
    errs = [abs(r["error_pct"]) for r in rows if isinstance(r["error_pct"], float)]
    worst = max((r for r in rows if isinstance(r["error_pct"], float)), key=lambda r: abs(r["error_pct"]),
                default=None)
    dates = [rec["date"] for rec in runs.store.records if rec.get("date")]
    md = ["### `titan-ds plan`: predicted vs measured peak DRAM", "",
          f"Command: `{command}`",
          f"Calibration: `{json.loads(CALIBRATION_FILE.read_text())['command']}` (shapes not used below; "
          f"zero_inf from the hms_scale_zinf trials at {', '.join(ZINF_FIT)}, hms_balanced from "
          f"{Path(TRIAL_FIT['hms_balanced'][0]).name}'s, the others here are held out). "
          f"Measured: cgroup peak anonymous memory (rss + shmem, all ranks), 2 steps (the zero_inf speed runs: "
          f"their warm-up and timed steps), micro-batch 1, context 128. "
          f"{max(dates) if dates else time.strftime('%Y-%m-%d')}.", "",
          "code: the prediction is for the code that ran. `earlier`: the runs recorded before the results store "
          "(the optimizer step's temporaries then: AdamW 8, ASDT 25 / 28 bytes/element, no pipelined optimizer "
          "step, `EARLIER_CODE`); `current`: today's (titan_ds/step_temp.json, one sub-group in flight). "
          "repeat: the run's index where the validation run was measured more than once.", "",
          (f"Largest |error|: {max(errs):.1f}% over {len(errs)} runs ({worst['mode']} {worst['model']}, "
           f"{worst['source']}; target: within 15%)." if errs else ""), "",
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
