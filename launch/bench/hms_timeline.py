"""Where an HMS training step's time goes, beside ZeRO-Infinity's.

Command (from the repository root, as root with cgroup v1; PATH on the disk HMS uses)::

    PYTHONPATH=$PWD python launch/bench/hms_timeline.py --path /work/hms_bench_tl --shape 12x768 --cap 4 \\
        --warmup 1 --steps 3 --repeats 2 --lock /tmp/titan_timed.lock

Each trial trains the reference GPT ``--shape`` under a ``--cap`` GiB cgroup with the ``hms`` config of
``launch/bench/hms_scale.py`` (``titan_ds.plan.candidate_config``), ``launch/train.py --timeline-out`` recording
the step's spans (:mod:`titan_ds.hms.timeline`). Modes (``--modes``): ``hms_off`` (``titan.hms.pipeline_optimizer``
and ``param_write_behind`` false: every write synchronous), ``hms_pw_off`` (the optimizer state written behind,
the parameter partitions synchronously), ``hms_on`` (both behind), and ``zero_inf``
(hms_scale.py's ZeRO-Infinity config; its aio block the best of ``--aio-sweep``): a **coarse** row, forward,
backward and step only, since DeepSpeed's own swaps run inside those without spans of their own. The modes alternate (their order reverses from one repeat to the next); every
trial is written at once to ``<out>/<mode>_r<repeat>.json`` and reused by a rerun (delete it to measure again).

Outputs in ``--out``: ``timeline.png`` (one strip per mode: the last timed step of its first repeat, one row per
lane: the training script's forward/backward/step, the swappers' waits and writes inside them, the background
writer), ``table.md`` (seconds per phase per timed step; s/step median per mode over its timed steps, and per
repeat), ``disk.json`` (this disk's O_DIRECT speeds, :func:`titan_ds.hms.diskprobe.measure_disk`, the store's
4 MiB transfer chunks, ``io_threads`` threads) and the bounds: I/O = bytes read / read speed + bytes written /
write speed (the store's counts of the step), compute = 6 x params x tokens at the measured fp32 matmul rate.

``zero_inf`` needs DeepSpeed's async_io op (libaio): without it the mode is skipped with the reason
(:func:`launch.bench.hms_scale.async_io_status`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launch.bench.harness import run_capped_clean  # noqa: E402
from launch.bench.hms_scale import (GiB, aio_settings, async_io_status, build_ops, ds_config, gpt_params,  # noqa: E402
                                    timed_lock)
from titan_ds.hms.timeline import INNER, TOP, breakdown  # noqa: E402
from titan_ds.utils import free_port  # noqa: E402

# titan.hms (pipeline_optimizer, param_write_behind); zero_inf: DeepSpeed's own offload
MODES = {"hms_off": (False, False), "hms_pw_off": (True, False), "hms_on": (True, True), "zero_inf": None}
PHASE_COLS = ["param fetch", "forward", "backward", "grad write", "opt read", "opt compute", "param write",
              "opt write", "idle", "wall", "opt write (bg)", "param write (bg)", "grad write (bg)"]
COLORS = {"forward": "#4c72b0", "backward": "#55a868", "step": "#c44e52", "param fetch": "#8172b2",
          "param write": "#937860", "grad write": "#da8bc3", "opt read": "#ccb974", "opt write": "#64b5cd",
          "opt write (bg)": "#1f5f7a", "param write (bg)": "#5a4632", "grad write (bg)": "#8e3b76"}


def trial(mode: str, rep: int, a, logs: Path) -> dict:
    layers, width = a.layers, a.width
    nvme = os.path.join(a.path, f"{mode}_{layers}x{width}_r{rep}")
    work = Path(a.path) / "cfg"
    work.mkdir(parents=True, exist_ok=True)
    name = f"{mode}_{layers}x{width}_r{rep}"
    if mode == "zero_inf":
        cfg = ds_config("zero_inf", nvme, a.aio)
    else:
        cfg = ds_config("hms", nvme)
        cfg["titan"]["hms"]["pipeline_optimizer"], cfg["titan"]["hms"]["param_write_behind"] = MODES[mode]
    cfg_path = work / f"{name}.json"
    cfg_path.write_text(json.dumps(cfg))
    summary, metrics, tl = (work / f"{name}.{x}.json" for x in ("summary", "metrics", "timeline"))
    for f in (summary, metrics, tl):
        f.unlink(missing_ok=True)
    steps = a.warmup + a.steps
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--deepspeed_config", str(cfg_path), "--steps",
           str(steps), "--layers", str(layers), "--width", str(width), "--heads", str(max(1, width // 64)),
           "--micro-batch", "1", "--val-batches", "1", "--warmup", "1", "--no-progress", "--zero-init",
           "--summary-out", str(summary), "--metrics-out", str(metrics), "--timeline-out", str(tl)]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=str(ROOT))
    env.setdefault("OMP_NUM_THREADS", "2")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    logs.mkdir(parents=True, exist_ok=True)
    if mode == "zero_inf":
        build_ops(env)  # uncapped, before the timed run (cached: a no-op after the first build)
    with timed_lock(a.lock):
        r = run_capped_clean(cmd, int(a.cap * GiB), logs / f"{name}.log", env=env, cwd=str(ROOT), timeout=a.timeout)
    out = {"mode": mode, "repeat": rep, "layers": layers, "width": width, "cap_GiB": a.cap, "warmup": a.warmup,
           "config": cfg,
           "steps": a.steps, "params": gpt_params(layers, width), "returncode": r.returncode,
           "oom_killed": r.oom_killed, "peak_anon_GiB": r.peak_anon_bytes / GiB, "wall_s": r.wall_s,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if r.ok and tl.exists():
        out["metrics"] = [json.loads(x) for x in metrics.read_text().splitlines()]
        out["timeline"] = json.loads(tl.read_text())
    shutil.rmtree(nvme, ignore_errors=True)
    return out


def bounds(a, disk: dict, rate_gflops: float) -> dict:
    return {"read_GBps": disk["raw_read_GBps"], "write_GBps": disk["raw_write_GBps"], "matmul_GFLOPs": rate_gflops,
            "compute_s": 6 * gpt_params(a.layers, a.width) * 128 / (rate_gflops * 1e9)}  # micro-batch 1 x 128


def matmul_rate(threads: int) -> float:
    """fp32 GFLOP/s of a 1024^3 matmul on ``threads`` threads (the trainer's OMP_NUM_THREADS)."""
    import torch
    torch.set_num_threads(threads)
    x = torch.randn(1024, 1024)
    x @ x
    t = time.perf_counter()
    for _ in range(10):
        x @ x
    return 10 * 2 * 1024**3 / (time.perf_counter() - t) / 1e9


def rows_of(res: dict, b: dict) -> list[dict]:
    rows = []
    spans = res["timeline"]["spans"]
    for m in res["metrics"][res["warmup"]:]:
        step = m["step"]
        bd = breakdown(spans, step)
        h = m.get("hms", {})
        io_s = h.get("bytes_read", 0) / (b["read_GBps"] * 1e9) + h.get("bytes_written", 0) / (b["write_GBps"] * 1e9)
        rows.append({"mode": res["mode"], "repeat": res["repeat"], "step": step, **{k: bd[k] for k in PHASE_COLS},
                     "GB_read": h.get("bytes_read", 0) / 1e9, "GB_written": h.get("bytes_written", 0) / 1e9,
                     "io_bound_s": io_s, "compute_bound_s": b["compute_s"]})
    return rows


def draw(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    firsts = [r for r in results if "timeline" in r and r["repeat"] == min(x["repeat"] for x in results
                                                                       if x["mode"] == r["mode"])]
    fig, axes = plt.subplots(len(firsts), 1, figsize=(14, 2.2 * len(firsts) + 0.6), squeeze=False)
    lanes = [("script", lambda s: s["lane"] == "main" and s["phase"] in TOP),
             ("swappers", lambda s: s["lane"] == "main" and s["phase"] in INNER),
             ("opt writer (bg)", lambda s: s["lane"] == "writer"),
             ("param writer (bg)", lambda s: s["lane"] == "param writer")]
    for ax, res in zip(axes[:, 0], firsts):
        step = res["metrics"][-1]["step"]
        spans = [s for s in res["timeline"]["spans"] if s["step"] == step]
        wall = next(s for s in spans if s["phase"] == "wall")
        for y, (lane, keep) in enumerate(reversed(lanes)):
            for ph in COLORS:
                bars = [(s["start"] - wall["start"], s["end"] - s["start"]) for s in spans if keep(s) and s["phase"] == ph]
                if bars:
                    ax.broken_barh(bars, (y + 0.1, 0.8), color=COLORS[ph], label=ph)
        ax.set_yticks([0.5 + i for i in range(len(lanes))], [ln for ln, _ in reversed(lanes)])
        ax.set_xlim(0, wall["end"] - wall["start"])
        ax.set_title(f"{res['mode']}{' (coarse: forward/backward/step only)' if res['mode'] == 'zero_inf' else ''} "
                     f"({res['layers']}x{res['width']}, step {step}): "
                     f"{wall['end'] - wall['start']:.1f} s", fontsize=10)
    axes[-1, 0].set_xlabel("seconds since the step began")
    handles = {h.get_label(): h for ax in axes[:, 0] for h in ax.get_legend_handles_labels()[0]}
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)


def table(results: list[dict], b: dict, disk: dict, a) -> str:
    rows = [r for res in results if "timeline" in res for r in rows_of(res, b)]
    cols = ["mode", "repeat", "step", *PHASE_COLS, "GB_read", "GB_written", "io_bound_s", "compute_bound_s"]

    def f(v):
        return f"{v:.2f}" if isinstance(v, float) else str(v)
    lines = ["### HMS step timeline beside ZeRO-Infinity's", "",
             f"Command: `PYTHONPATH=$PWD python launch/bench/hms_timeline.py {' '.join(sys.argv[1:])}`", "",
             f"GPT {a.layers}x{a.width} ({gpt_params(a.layers, a.width) / 1e6:.1f}M params), micro-batch 1, "
             f"context 128, under a {a.cap:g} GiB cgroup; the `hms` config of hms_scale.py (sub_group_size 1e7), "
             f"hms_off: titan.hms.pipeline_optimizer and param_write_behind false; hms_pw_off: the optimizer state "
             f"written behind, the parameter partitions synchronously; hms_on: both behind (depth 1); "
             f"zero_inf: hms_scale.py's ZeRO-Infinity config (DeepSpeedCPUAdam, optimizer state on NVMe through "
             f"async_io, aio {json.dumps(a.aio) if a.aio else '-'}), a coarse row: forward/backward/step only "
             f"(DeepSpeed's swaps run inside them), so its param fetch/write and opt columns are 0 and its opt "
             f"compute is its whole optimizer step. Modes run here: {', '.join(a.modes)}. {a.warmup} warm-up + "
             f"{a.steps} timed steps per run, runs alternated, OMP_NUM_THREADS={a.threads}. 2 shared CPU cores "
             f"(nice-19 background jobs ran on the machine): indicative.", "",
             "## s/step (median of the timed steps)", "", "| mode | all runs | per run |", "|---|---|---|"]
    for mode in a.modes:
        walls = [r["wall"] for r in rows if r["mode"] == mode]
        if walls:
            per = [statistics.median([r["wall"] for r in rows if r["mode"] == mode and r["repeat"] == k])
                   for k in sorted({r["repeat"] for r in rows if r["mode"] == mode})]
            lines.append(f"| {mode} | {statistics.median(walls):.2f} | {', '.join(f'{x:.2f}' for x in per)} |")
    failed = [f"{r['mode']} r{r['repeat']}: exit {r['returncode']}{' (OOM-killed)' if r['oom_killed'] else ''}"
              for r in results if "timeline" not in r]
    if failed:
        lines += ["", "Failed runs: " + "; ".join(failed)]
    lines += ["", "## Seconds per phase per timed step", "",
              "Each span counted once, in its innermost phase: forward/backward exclude the parameter fetches "
              "(waits in swap_in/synchronize_reads) and gradient writes inside them; opt compute is engine.step "
              "less its opt read (waits for the state), param write and opt write (pipelining off: the synchronous "
              "writes; on: waits for the previous sub-group's writes and the end-of-step flush); idle: the rest of "
              "the step's wall time. opt write (bg): the background writes' own durations (they overlap the main "
              "thread; not part of the wall sum); param write (bg): the same for the parameter partitions' background "
              "writes (hms_on).", "",
              f"Bounds: I/O = GB_read / {b['read_GBps']:.2f} GB/s + GB_written / {b['write_GBps']:.2f} GB/s (this "
              f"disk, O_DIRECT, {disk.get('block_MiB', 4)} MiB blocks, {disk['io_threads']} threads: disk.json); "
              f"compute = 6 x params x 128 tokens at {b['matmul_GFLOPs']:.1f} GFLOP/s (fp32 1024^3 matmul, "
              f"{a.threads} threads).", "",
              "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f(r[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", required=True, help="folder on the disk HMS uses")
    ap.add_argument("--shape", default="12x768")
    ap.add_argument("--cap", type=float, default=4.0)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--modes", default="hms_on,zero_inf", help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--aio-sweep", default=None,
                    help="zero_inf's aio sweep (hms_scale.py's <out>.aio_sweep.json; measured into <out>/aio_sweep.json "
                         "when not given and absent)")
    ap.add_argument("--threads", type=int, default=2, help="the trainer's OMP_NUM_THREADS (matmul rate)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--lock", default=None, help="flock this file around each trial and the disk probe")
    ap.add_argument("--out", default=str(ROOT / "results" / "hms_timeline"))
    ap.add_argument("--no-run", action="store_true", help="tables and plot from the recorded trials only")
    a = ap.parse_args(argv)
    a.layers, a.width = (int(x) for x in a.shape.lower().split("x"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    a.modes = [m for m in a.modes.split(",") if m]
    for m in a.modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r}; choose from {', '.join(MODES)}")
    a.aio = None
    if "zero_inf" in a.modes:
        why = async_io_status()
        if why is not None:
            print(f"zero_inf skipped: {why}", flush=True)
            a.modes.remove("zero_inf")
        else:
            sweep = Path(a.aio_sweep) if a.aio_sweep else out / "aio_sweep.json"
            if sweep.exists() or not a.no_run:
                a.aio = aio_settings(a.path, sweep, a.lock)
    disk_path = out / "disk.json"
    if not disk_path.exists() and not a.no_run:
        from titan_ds.hms.diskprobe import measure_disk
        with timed_lock(a.lock):
            disk = measure_disk(a.path, mb=256, threads=4, block_mb=4, repeats=2)
            disk.update(block_MiB=4, matmul_GFLOPs=matmul_rate(a.threads), threads=a.threads,
                        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        disk_path.write_text(json.dumps(disk, indent=1))
    disk = json.loads(disk_path.read_text())
    b = bounds(a, disk, disk["matmul_GFLOPs"])
    results = []
    for rep in range(a.repeats):
        order = list(a.modes) if rep % 2 == 0 else list(reversed(a.modes))
        for mode in order:
            f = out / f"{mode}_{a.layers}x{a.width}_r{rep}.json"
            if not f.exists():
                if a.no_run:
                    continue
                res = trial(mode, rep, a, out / "logs")
                f.write_text(json.dumps(res))
            res = json.loads(f.read_text())
            print(f"{mode} r{rep}: exit {res['returncode']}, "
                  f"steps {[round(m['step_s'], 2) for m in res.get('metrics', [])]}", flush=True)
            results.append(res)
    (out / "table.md").write_text(table(results, b, disk, a))
    if any("timeline" in r for r in results):
        draw(results, out / "timeline.png")


if __name__ == "__main__":
    main()
