"""Where one HMS step's CPU goes: py-spy samples of a capped ``launch/bench/hms_scale.py`` trial, per thread role.

Command (from the repository root, as root with cgroup v1; PY_SPY: a py-spy binary, e.g. from the py_spy wheel)::

    PYTHONPATH=$PWD python launch/experiments/hms_profile.py --path /work/hmsio_bench/prof --mode hms_cpuadam \\
        --shape 12x768 --cap 4 --warmup 1 --steps 4 --py-spy PY_SPY --lock /tmp/titan_timed.lock \\
        --out results/hms_profile/NAME

Runs ``launch/train.py`` with the mode's config (:func:`launch.bench.hms_scale.ds_config`) under the cap, with the
timeline recorder on (``--timeline-out``: wall seconds per phase, :func:`titan_ds.hms.timeline.breakdown`) and
``py-spy record --nonblocking --threads --format raw`` (on-CPU samples only: a thread waiting on a lock or sleeping is not sampled, but one blocked in an
O_DIRECT read or write, state D, is: the I/O workers' rows overstate their CPU; ``/proc/<pid>/task/*/stat`` has
the real figure, results/hms_profile/hms_balanced_5b_attached.md). Samples are summed by thread role (the main thread; ``titan-hms-io`` I/O workers;
``titan-hms-writer*``; ``titan-hms-prefetch``; others) and by the innermost frame of ours or torch's that names
the work (checksum, pwritev/preadv, tensor copy, ...). Samples of the main thread are split into ``init`` (before
the first training step) and ``steps``; other threads' samples cannot be split by time in the raw format and
include initialisation (the model's first writes), so the run is given several steps.

Outputs: ``<out>.md`` (tables), ``<out>.collapsed.txt`` (py-spy's raw collapsed stacks), ``<out>.timeline.json``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launch.bench.harness import run_capped_clean  # noqa: E402
from launch.bench.hms_scale import CPU_ADAM_MODES, GiB, build_ops, ds_config, timed_lock  # noqa: E402
from titan_ds.hms.timeline import breakdown  # noqa: E402
from titan_ds.utils import free_port  # noqa: E402

# (label, regex on a frame "func (file:line)") checked innermost-first: the first frame matching any label names it
LABELS = [
    ("checksum (xxh3/crc32)", r"^(crc|xxh3|_close_last_chunk) |xxhash|zlib"),
    ("pwritev/preadv (syscall)", r"^chunk \(titan_ds/hms/io\.py"),
    ("header/json/fsync", r"_encode_header|_read_header|fsync|json"),
    ("clone/copy (store cache, staging)", r"^(_cache_insert|_maybe_cache|clone|stage) |\bcopy_\b"),
    ("aligned_empty / alloc", r"aligned_empty|torch.empty|zeros"),
    ("optimizer compute (cpu_adam / AdamW)", r"cpu_adam|adamw|_single_tensor|_multi_tensor|step \(deepspeed/ops"),
    ("forward", r"^forward "),
    ("backward (autograd)", r"backward|run_backward"),
    ("store.put (other)", r"^_put |^put "),
    ("store.get / read (other)", r"^_read_file |^get "),
    ("swapper (other)", r"titan_ds/hms/(param_|optimizer_)?swapper\.py"),
    ("deepspeed stage3 (other)", r"deepspeed/runtime/zero"),
]


# the main thread's samples under the training loop, by the DeepSpeed / titan function they are in (checked in order
# on the whole stack, the first that matches names the sample): where the step's CPU goes at the level one can change
FUNCTIONS = [
    ("titan optimizer kernel (core_cpu)", r"core_cpu"),
    ("titan optimizer, outside the kernel (the warm-up's first quantization and placement, mostly)",
     r"titan_ds/optim/"),
    ("ZeRO-3 unscale_and_clip_grads (the sub-group's gradient scaled in place)", r"unscale_and_clip_grads"),
    ("ZeRO-3 partition_grads (the copy into the gradient buffer, and the norms)", r"partition_grads"),
    ("optimizer-state swap-in (_prepare_sub_group)", r"_prepare_sub_group|swap_in_optimizer_state"),
    ("optimizer-state swap-out (_release_sub_group)", r"_release_sub_group|swap_out_optimizer_state"),
    ("parameter partition writes", r"_partitioned_params_swap_out|swap_out_partitioned_params"),
    ("IPG buckets / reduce-scatter", r"__add_grad_to_ipg_bucket|reduce_independent_p_g_buckets|reduce_scatter"),
    ("parameter fetch / release (ZeRO-3 hooks)",
     r"fetch_sub_module|release_sub_module|_ensure_availability|pre_sub_module_forward|post_sub_module"),
    ("forward matmuls (zero/linear.py)", r"^forward \(deepspeed/runtime/zero/linear\.py"),
    ("backward matmuls (zero/linear.py)", r"^backward \(deepspeed/runtime/zero/linear\.py"),
]


def by_function(samples, rate: int) -> dict[str, float]:
    """CPU seconds of the main thread's samples under the training loop, by :data:`FUNCTIONS` (the rest: "other")."""
    out = collections.Counter()
    for thread, frames, n in samples:
        if role(thread) != "main" or not _in_steps(frames):
            continue
        name = next((lab for lab, rx in FUNCTIONS if any(re.search(rx, f) for f in frames)), "other in the step")
        out[name] += n
    return {k: v / rate for k, v in out.most_common()}


def _in_steps(frames: list[str]) -> bool:
    return any(re.search(r"^(forward|backward|step) \(deepspeed/runtime/engine\.py", f) for f in frames)


def role(thread: str) -> str:
    for prefix, name in (("titan-hms-io", "io workers"), ("titan-hms-writer-param", "param writer"),
                         ("titan-hms-writer", "opt writer"), ("titan-hms-prefetch", "prefetch")):
        if prefix in thread:
            return name
    return "main" if "MainThread" in thread or "python" in thread.lower() else f"other"


def label(frames: list[str]) -> str:
    for f in reversed(frames):
        for name, rx in LABELS:
            if re.search(rx, f):
                return name
    return "other"


# py-spy 0.4.3 names a frame by its qualified name ("DeepSpeedEngine.forward (...)", "f.<locals>.g (...)"), 0.4.2
# by the bare one the labels above expect: the qualifier is dropped
_QUALIFIER = re.compile(r"^[\w<>.]*\.(?=[\w<>]+ \()")


def parse(collapsed: Path) -> list[tuple[str, list[str], int]]:
    out = []
    for line in collapsed.read_text(errors="replace").splitlines():  # py-spy writes raw bytes of native frames
        stack, _, n = line.rpartition(" ")
        parts = stack.split(";")
        out.append((parts[0], [_QUALIFIER.sub("", f) for f in parts[1:]], int(n)))
    return out


def summarize(samples, rate: int) -> tuple[dict, dict]:
    by_role = collections.Counter()
    by_label = collections.defaultdict(collections.Counter)
    for thread, frames, n in samples:
        r = role(thread)
        if r == "main":
            r = "main (steps)" if _in_steps(frames) else "main (init/other)"
        by_role[r] += n
        by_label[r][label(frames)] += n
    return ({k: v / rate for k, v in by_role.items()},
            {k: {lab: v / rate for lab, v in c.most_common()} for k, c in by_label.items()})


def role_tables(collapsed: Path, rate: int, steps: int) -> list[str]:
    """The tables of ``collapsed``'s samples: by thread role and work, and the main thread's step samples by
    function (:data:`FUNCTIONS`, also per step: the run's ``steps`` steps, warm-up included)."""
    samples = parse(collapsed)
    by_role, by_label = summarize(samples, rate)
    lines = ["| role | CPU s | top work (CPU s) |", "|---|---|---|"]
    for k, v in sorted(by_role.items(), key=lambda kv: -kv[1]):
        top = "; ".join(f"{lab} {s:.1f}" for lab, s in list(by_label[k].items())[:6])
        lines.append(f"| {k} | {v:.1f} | {top} |")
    lines += ["", f"The main thread under the training loop, by function (CPU s over the {steps} steps, warm-up "
              "included, and per step; an OpenMP worker's matmul share is not sampled, only the main thread's "
              "wait in it):", "", "| function | CPU s | per step |", "|---|---|---|"]
    lines += [f"| {k} | {v:.1f} | {v / steps:.1f} |" for k, v in by_function(samples, rate).items()]
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", required=True)
    ap.add_argument("--mode", default="hms_cpuadam")
    ap.add_argument("--shape", default="12x768")
    ap.add_argument("--cap", type=float, default=4.0)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rate", type=int, default=50)
    ap.add_argument("--py-spy", default=None, help="a py-spy binary (required unless --summarize-only)")
    ap.add_argument("--lock", default=None)
    ap.add_argument("--set", action="append", default=[], help="titan.hms KEY=JSON override (repeatable)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--summarize-only", action="store_true",
                    help="run nothing: print the tables of OUT.collapsed.txt (--rate, --warmup, --steps as it ran)")
    a = ap.parse_args(argv)
    if a.summarize_only:
        print("\n".join(role_tables(Path(str(a.out) + ".collapsed.txt"), a.rate, a.warmup + a.steps)))
        return
    if not a.py_spy:
        raise SystemExit("--py-spy PATH: a py-spy binary (e.g. pip install --target DIR py-spy; DIR/bin/py-spy)")
    layers, width = map(int, a.shape.split("x"))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    nvme = os.path.join(a.path, f"{a.mode}_{a.shape}")
    work = Path(a.path) / "cfg"
    work.mkdir(parents=True, exist_ok=True)
    cfg = ds_config(a.mode, nvme)
    for kv in a.set:
        k, v = kv.split("=", 1)
        cfg["titan"]["hms"][k] = json.loads(v)
    cfg_path = work / f"{out.name}.json"
    cfg_path.write_text(json.dumps(cfg))
    metrics, tl, coll = work / f"{out.name}.metrics.jsonl", work / f"{out.name}.timeline.json", \
        Path(str(out) + ".collapsed.txt")
    for f in (metrics, tl, coll):
        f.unlink(missing_ok=True)
    train = [sys.executable, str(ROOT / "launch" / "train.py"), "--deepspeed_config", str(cfg_path), "--steps",
             str(a.warmup + a.steps), "--layers", str(layers), "--width", str(width), "--heads",
             str(max(1, width // 64)), "--micro-batch", "1", "--val-batches", "1", "--warmup", "1", "--no-progress",
             "--zero-init", "--metrics-out", str(metrics), "--timeline-out", str(tl)]
    cmd = [a.py_spy, "record", "--nonblocking", "--threads", "--format", "raw", "--rate", str(a.rate),
           "-o", str(coll), "--", *train]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=str(ROOT))
    env.setdefault("OMP_NUM_THREADS", "2")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    if a.mode in CPU_ADAM_MODES:
        build_ops(env)
    log = Path(str(out) + ".log")
    with timed_lock(a.lock):
        t0 = time.time()
        r = run_capped_clean(cmd, int(a.cap * GiB), log, env=env, cwd=str(ROOT), timeout=3600)
        wall = time.time() - t0
    shutil.rmtree(nvme, ignore_errors=True)
    if not r.ok:
        raise SystemExit(f"trial failed (exit {r.returncode}, oom {r.oom_killed}); see {log}")
    hist = [json.loads(x) for x in metrics.read_text().splitlines()]
    timed = hist[a.warmup:]
    spans = json.loads(tl.read_text())
    shutil.copy(tl, str(out) + ".timeline.json")
    phases = [breakdown(spans["spans"], m["step"]) for m in timed]
    lines = [f"### HMS profile: {a.mode} {a.shape} under {a.cap:g} GiB", "",
             f"Command: `PYTHONPATH=$PWD python launch/experiments/hms_profile.py {' '.join(sys.argv[1:])}`",
             f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; OMP_NUM_THREADS={env['OMP_NUM_THREADS']}; "
             f"load average at the end {os.getloadavg()[0]:.2f}; wall {wall:.0f} s; peak anon "
             f"{r.peak_anon_bytes / GiB:.3f} GiB; titan.hms overrides {a.set or 'none'}", "",
             f"s/step (timed steps, py-spy sampling at {a.rate} Hz, non-blocking): "
             + ", ".join(f"{m['step_s']:.2f}" for m in timed)
             + f"; median {statistics.median(m['step_s'] for m in timed):.2f}", "",
             "Wall seconds per phase (timeline, mean over the timed steps):", "",
             "| phase | s/step |", "|---|---|"]
    for k in phases[0]:
        lines.append(f"| {k} | {statistics.mean(p[k] for p in phases):.2f} |")
    h = [m.get("hms", {}) for m in timed]
    lines += ["", f"Bytes per timed step: read {statistics.mean(x.get('bytes_read', 0) for x in h) / 1e9:.2f} GB, "
              f"written {statistics.mean(x.get('bytes_written', 0) for x in h) / 1e9:.2f} GB", "",
              "On-CPU seconds by thread role over the whole run (py-spy samples / rate; `main (steps)`: samples "
              "under the training loop; other roles include initialisation):", "",
              "| role | CPU s | top work (CPU s) |", "|---|---|---|"]
    lines += role_tables(coll, a.rate, a.warmup + a.steps)
    Path(str(out) + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
