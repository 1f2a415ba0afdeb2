"""Soak run: every pillar on (HMS, TRD, MLME, ASDT + BSPS, compression), 2 ranks, ZeRO-3, checkpoints on a
period, for thousands of steps; then checks that nothing leaks and that resuming is bit-exact.

    python launch/bench/soak.py --steps 3000 --save-every 500 --out results/soak          # by hand (~1-2 h)
    python launch/bench/soak.py --steps 40 --save-every 10 --tiny --out /tmp/soak          # CI (test_soak.py)

How it measures. ``launch/train.py`` runs under the ``deepspeed`` launcher; this process samples every rank from
outside (``/proc``) every ``--sample-s`` seconds: RSS, open file descriptors, threads, ``/dev/shm`` files the
rank has mapped. It also counts the files in the run's private ``TMPDIR`` and HMS store. The step of a sample is
the number of lines in the metrics file at that moment. The training never knows it is watched.

What it asserts (exit status 1 and the failing checks printed otherwise):

1. **RSS after warm-up grows by <= ``--rss-growth`` (2%)** per rank: the median RSS over the last window of
   steps against the median over the window after the first checkpoint (one-off allocations of the first
   save and of lazily created state are warm-up, not growth). A window is ``--save-every`` steps long, at most.
   The same bound holds for the anonymous part (``RssAnon``): RSS also counts mapped library pages, which the
   kernel drops under another job's memory pressure, so RSS alone can fall without anything being freed.
2. **File descriptors, threads, mapped /dev/shm files, temporary files and HMS store files do not grow**: the
   minimum over the last window is at most the maximum over the reference window: a leak holds what it took
   in every later sample, while a file open for one checkpoint write is caught by a sample or two at most
   (``.tmp`` files, writes in flight, are not counted either). HMS holds one file per optimizer-state tensor, so a state tensor created after the
   reference window (ASDT's ``anchor`` when a BSPS block first turns Elastic) shows up here as growth.
3. **Resume is bit-exact**: a second job resumes from the last checkpoint before the end (``latest`` pointed
   at it) and trains to the end; its per-step losses equal the first job's, bit for bit (JSON floats are
   repr-exact).

Outputs under ``--out``: ``soak.md`` (the table the README quotes), ``soak.json`` (figures + checks),
``samples.jsonl`` (every sample), ``soak_rss.png`` (RSS per rank against steps, checkpoints marked).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from titan_ds.utils import free_port  # noqa: E402

MiB = 2**20
TINY = ["--layers", "2", "--width", "64", "--heads", "4", "--context", "32", "--micro-batch", "4",
        "--val-batches", "1"]
SMALL = ["--layers", "4", "--width", "128", "--heads", "4", "--context", "64", "--micro-batch", "8",
         "--val-batches", "4"]


def soak_config(work: Path) -> dict[str, Any]:
    """Every pillar: ``titan_all.json``'s TRD, MLME, ASDT, BSPS and compression on ZeRO-3 with the HMS NVMe
    offload of ``titan_zero3_nvme.json``. Compression under ZeRO-3 uses TGSS (HGE's ZeRO-3 path is the same
    reduce-scatter seam; the soak is about lifetimes, not the method)."""
    full = json.loads((ROOT / "launch" / "experiments" / "configs" / "titan_all.json").read_text())
    cfg = json.loads((ROOT / "launch" / "experiments" / "configs" / "titan_zero3_nvme.json").read_text())
    nvme = str(work / "nvme")
    for k in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][k]["nvme_path"] = nvme
    titan = {k: copy.deepcopy(v) for k, v in full["titan"].items()}
    titan["hms"] = dict(cfg["titan"]["hms"], nvme_path=nvme, spill_tiers=[])
    titan["compression"] = dict(titan["compression"], method="tgss")
    cfg["titan"] = titan
    return cfg


# ------------------------------------------------------------------------------------------------ sampling
def _rank_pids(launcher_pid: int) -> list[int]:
    """The rank processes (``train.py --local_rank=N``), in rank order. Their forked helpers inherit the same
    command line, so only processes whose parent is not itself a rank count."""
    import psutil
    try:
        kids = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    ranks: dict[int, int] = {}
    for k in kids:
        try:
            cmd, parent = k.cmdline(), k.parent()
            pcmd = parent.cmdline() if parent is not None else []
        except psutil.Error:
            continue
        local = [a for a in cmd if a.startswith("--local_rank=")]
        if local and not any(a.startswith("--local_rank=") for a in pcmd):
            ranks[int(local[0].split("=", 1)[1])] = k.pid
    return [ranks[r] for r in sorted(ranks)]


def _proc_stats(pid: int) -> Optional[dict[str, int]]:
    try:
        with open(f"/proc/{pid}/status") as f:
            status = {l.split(":")[0]: l.split()[1] for l in f if l.startswith(("VmRSS:", "RssAnon:", "RssFile:"))}
        rss = int(status["VmRSS"]) * 1024
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        threads = len(os.listdir(f"/proc/{pid}/task"))
        with open(f"/proc/{pid}/maps") as f:
            shm = len({l.split()[-1] for l in f if "/dev/shm/" in l})
    except (OSError, KeyError):
        return None
    # RssAnon is the process's own heap; RssFile (mapped libraries) shrinks when another job's memory pressure
    # makes the kernel drop clean pages, which is not the process freeing anything
    return {"rss": rss, "rss_anon": int(status.get("RssAnon", 0)) * 1024, "fds": fds, "threads": threads,
            "shm_maps": shm}


def _count_files(path: Path) -> int:
    """Complete files under ``path``: a ``.tmp`` is a write in flight (HMS and checkpoints write a temporary and
    rename it), counted apart so that a sample taken mid-write does not read as growth."""
    return sum(1 for _, _, files in os.walk(path) for f in files if not f.endswith(".tmp")) if path.exists() else 0


def _lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _sample(pids: list[int], metrics: Path, work: Path) -> dict[str, Any]:
    ranks = {}
    for r, pid in enumerate(pids):
        s = _proc_stats(pid)
        if s is not None:
            ranks[str(r)] = s
    return {"t": time.time(), "step": _lines(metrics), "ranks": ranks,
            "tmp_files": _count_files(work / "tmp"), "hms_files": _count_files(work / "nvme"),
            "dev_shm_files": len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else 0}


# ------------------------------------------------------------------------------------------------ running
def _env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = env.get("SOAK_OMP_THREADS", "1")  # 2 ranks on 2 cores: no oversubscription
    env["TMPDIR"] = str(work / "tmp")  # temporary files of this run only, counted
    return env


def _launch(args: argparse.Namespace, work: Path, cfg: Path, metrics: Path, extra: list[str],
            samples_out: Optional[Path], log: Path) -> tuple[int, list[dict[str, Any]]]:
    ds = Path(sys.executable).with_name("deepspeed")
    cmd = [str(ds), "--num_gpus", str(args.ranks), "--master_port", str(free_port()),
           str(ROOT / "launch" / "train.py"), "--deepspeed_config", str(cfg), "--steps", str(args.steps),
           "--metrics-out", str(metrics), "--no-progress", "--seed", str(args.seed),
           "--log-every", "1",  # a sample's step is the metrics file's line count: one line per step, as it runs
           *(TINY if args.tiny else SMALL), *extra]
    samples: list[dict[str, Any]] = []
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(work), stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        sink = open(samples_out, "w") if samples_out else None
        started = time.time()
        try:
            while proc.poll() is None:
                time.sleep(args.sample_s)
                pids = _rank_pids(proc.pid)
                if len(pids) == args.ranks and samples_out is not None:
                    s = _sample(pids, metrics, work)
                    samples.append(s)
                    sink.write(json.dumps(s) + "\n")
                    sink.flush()
                if args.timeout and time.time() - started > args.timeout:
                    raise TimeoutError(f"soak job ran past --timeout {args.timeout} s")
        finally:
            if sink:
                sink.close()
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return proc.returncode, samples


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


# ------------------------------------------------------------------------------------------------ checks
def _window(samples: list[dict[str, Any]], lo: int, hi: int) -> list[dict[str, Any]]:
    return [s for s in samples if lo <= s["step"] <= hi]


def analyse(samples: list[dict[str, Any]], *, steps: int, save_every: int, ranks: int,
            rss_growth: float) -> dict[str, Any]:
    """The checks of the module docstring over the samples of the first job."""
    w = min(save_every, max(2, steps // 4))
    ref = _window(samples, save_every + 1, save_every + w)   # after the first checkpoint
    end = _window(samples, steps - w, steps - 1)            # the last window, before the final validation/save
    checks: list[dict[str, Any]] = []
    figures: dict[str, Any] = {"reference_steps": [save_every + 1, save_every + w], "end_steps": [steps - w, steps - 1],
                               "samples": len(samples), "ref_samples": len(ref), "end_samples": len(end)}
    if len(ref) < 2 or len(end) < 2:
        checks.append({"check": "enough samples in both windows", "ok": False,
                       "detail": f"{len(ref)} and {len(end)} samples; lower --sample-s or run more steps"})
        return {"figures": figures, "checks": checks, "ok": False}
    for r in map(str, range(ranks)):
        a = statistics.median(s["ranks"][r]["rss"] for s in ref if r in s["ranks"])
        b = statistics.median(s["ranks"][r]["rss"] for s in end if r in s["ranks"])
        g = b / a - 1
        figures[f"rank{r}_rss_ref_mib"], figures[f"rank{r}_rss_end_mib"] = a / MiB, b / MiB
        figures[f"rank{r}_rss_growth"] = g
        if all("rss_anon" in s["ranks"][r] for s in ref + end if r in s["ranks"]):
            a2 = statistics.median(s["ranks"][r]["rss_anon"] for s in ref if r in s["ranks"])
            b2 = statistics.median(s["ranks"][r]["rss_anon"] for s in end if r in s["ranks"])
            figures[f"rank{r}_rss_anon_growth"] = b2 / a2 - 1
            checks.append({"check": f"rank {r} anonymous RSS growth <= {rss_growth:.0%}", "ok": b2 / a2 - 1 <= rss_growth,
                           "detail": f"{a2 / MiB:.1f} -> {b2 / MiB:.1f} MiB ({b2 / a2 - 1:+.2%})"})
        checks.append({"check": f"rank {r} RSS growth <= {rss_growth:.0%}", "ok": g <= rss_growth,
                       "detail": f"{a / MiB:.1f} -> {b / MiB:.1f} MiB ({g:+.2%})"})
        for key in ("fds", "threads", "shm_maps"):
            # a leak persists: every sample of the end window sits above the reference window's highest; a file
            # open for the length of one checkpoint write, caught by one sample, is not a leak (CI caught 18 -> 19)
            a = max(s["ranks"][r][key] for s in ref if r in s["ranks"])
            b = min(s["ranks"][r][key] for s in end if r in s["ranks"])
            figures[f"rank{r}_{key}"] = [a, b]
            checks.append({"check": f"rank {r} {key} do not grow", "ok": b <= a, "detail": f"{a} -> {b}"})
    for key in ("tmp_files", "hms_files"):
        a, b = max(s[key] for s in ref), min(s[key] for s in end)
        figures[key] = [a, b]
        checks.append({"check": f"{key} do not grow", "ok": b <= a, "detail": f"{a} -> {b}"})
    figures["dev_shm_files"] = [max(s["dev_shm_files"] for s in ref), max(s["dev_shm_files"] for s in end)]
    return {"figures": figures, "checks": checks, "ok": all(c["ok"] for c in checks)}


def plot(samples: list[dict[str, Any]], ranks: int, save_every: int, steps: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in map(str, range(ranks)):
        pts = [(s["step"], s["ranks"][r]["rss"] / MiB) for s in samples if r in s["ranks"]]
        ax1.plot(*zip(*pts), lw=0.8, label=f"rank {r}")
        pts = [(s["step"], s["ranks"][r]["threads"]) for s in samples if r in s["ranks"]]
        ax2.plot(*zip(*pts), lw=0.8, label=f"rank {r} threads")
        pts = [(s["step"], s["ranks"][r]["fds"]) for s in samples if r in s["ranks"]]
        ax2.plot(*zip(*pts), lw=0.8, ls="--", label=f"rank {r} fds")
    for ax in (ax1, ax2):
        for c in range(save_every, steps + 1, save_every):
            ax.axvline(c, color="grey", lw=0.5, ls=":")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    ax1.set_ylabel("RSS (MiB)")
    ax1.set_title("RSS per rank (dotted: checkpoints)")
    ax2.set_title("threads and open file descriptors")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_table(result: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    f = result["figures"]
    lines = [f"# Soak: every pillar, {args.ranks} ranks, ZeRO-3 + HMS, {args.steps} steps, checkpoint every "
             f"{args.save_every}", "",
             f"`{result['command']}`", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}. Model: {'tiny' if args.tiny else 'small'} "
             f"({result.get('trainable_params', '?')} trainable parameters). Wall time {result['wall_s'] / 60:.1f} min.",
             "", f"Reference window: steps {f['reference_steps'][0]}-{f['reference_steps'][1]} (after the first "
             f"checkpoint); end window: steps {f['end_steps'][0]}-{f['end_steps'][1]}; {f['samples']} samples.", "",
             "| check | result | measured |", "|---|---|---|"]
    for c in result["checks"]:
        lines.append(f"| {c['check']} | {'ok' if c['ok'] else '**FAIL**'} | {c['detail']} |")
    lines += ["", f"`/dev/shm` files on the machine (all processes, information only): {f.get('dev_shm_files')}",
              "", "![RSS](soak_rss.png)", ""]
    path.write_text("\n".join(lines))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="the tests' 2x64 model instead of the 4x128 one")
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--rss-growth", type=float, default=0.02)
    ap.add_argument("--timeout", type=float, default=0, help="seconds per job (0: none)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a new one under the system temp)")
    ap.add_argument("--out", default="results/soak")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (checkpoints, HMS store)")
    args = ap.parse_args(argv)
    if args.save_every * 2 > args.steps:
        ap.error("--steps must be at least 2 x --save-every (a reference window after the first checkpoint)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="titan_soak_"))
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    cfg = work / "soak.json"
    cfg.write_text(json.dumps(soak_config(work), indent=1))
    t0 = time.time()
    rc, samples = _launch(args, work, cfg, work / "full.jsonl",
                          ["--save-dir", str(work / "ck"), "--save-every", str(args.save_every),
                           "--summary-out", str(work / "summary.json")], out / "samples.jsonl", out / "soak_log.txt")
    result: dict[str, Any] = {"command": "python launch/bench/soak.py " + " ".join(argv if argv is not None
                                                                                   else sys.argv[1:]),
                              "wall_s": time.time() - t0}
    if rc != 0:
        print(f"soak job failed with exit status {rc}; see {out / 'soak_log.txt'}", file=sys.stderr)
        return 1
    summary = json.loads((work / "summary.json").read_text())
    result["trainable_params"] = summary.get("trainable_params")
    result.update(analyse(samples, steps=args.steps, save_every=args.save_every, ranks=args.ranks,
                          rss_growth=args.rss_growth))
    # resume from the last checkpoint before the end and train to the end: bit-exact losses
    last = (args.steps - 1) // args.save_every * args.save_every
    (work / "ck" / "latest").write_text(f"step{last}")
    rc2, _ = _launch(args, work, cfg, work / "resumed.jsonl", ["--load-dir", str(work / "ck")], None,
                     out / "soak_resume_log.txt")
    full, resumed = _losses(work / "full.jsonl"), (_losses(work / "resumed.jsonl") if rc2 == 0 else {})
    want = {s: v for s, v in full.items() if s > last}
    same = rc2 == 0 and resumed == want
    result["checks"].append({"check": f"resume from step {last} bit-exact", "ok": same,
                             "detail": f"{len(want)} steps, losses {'equal' if same else 'DIFFER'}"
                                       + ("" if rc2 == 0 else f" (resume job exit {rc2})")})
    result["ok"] = all(c["ok"] for c in result["checks"])
    result["wall_s"] = time.time() - t0
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    write_table(result, args, out / "soak.md")
    plot(samples, args.ranks, args.save_every, args.steps, out / "soak_rss.png")
    if not args.keep and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    for c in result["checks"]:
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['check']}: {c['detail']}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
