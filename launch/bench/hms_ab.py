"""One HMS change measured alone: the same hms_scale trial from two commits, alternated, with each one's timeline.

Command (from the repository root, as root with cgroup v1; BEFORE is a commit, the working tree is AFTER)::

    PYTHONPATH=$PWD python launch/bench/hms_ab.py --before HEAD~1 --mode hms_dram_cpuadam --shape 12x768 \\
        --cap 4 --steps 8 --repeats 3 --out results/hms_ab_pool

BEFORE is checked out into a temporary ``git worktree``; each repeat runs ``launch/bench/hms_scale.py``'s
``trial`` once from each tree in a child process (the order reverses from one repeat to the next), under the same
cap, one warm-up step then ``--steps`` timed ones. A row: the median over the repeats of each run's median step,
the ratio after/before, the losses of the first run (the change must leave them bit for bit: ``same_losses``),
and the mean seconds per step in each phase of the timeline (titan_ds/hms/timeline.py). Writes ``<out>.jsonl``
(every run) and ``<out>.md``. Timed: run it alone on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PHASES = ["param fetch", "forward", "backward", "param write", "opt read", "opt write", "opt compute", "wall",
          "opt write (bg)", "param write (bg)"]

CHILD = """
import json, sys
from pathlib import Path
from launch.bench.hms_scale import trial
a = json.loads(sys.argv[1])
r = trial(a["mode"], a["layers"], a["width"], a["cap"], path=a["path"], steps=a["steps"] + 1, timeout=a["timeout"],
          logs=Path(a["logs"]), warmup=1, tag=a["tag"], timeline=True)
print("RESULT " + json.dumps({k: r.get(k) for k in ("status", "step_s_median", "step_s_all", "loss_all", "phases")}))
"""


def run_one(tree: Path, args, tag: str) -> dict:
    spec = dict(mode=args.mode, layers=args.layers, width=args.width, cap=args.cap, path=args.path, steps=args.steps,
                timeout=args.timeout, logs=str(ROOT / "results" / "logs" / Path(args.out).name), tag=tag)
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))  # one build for both trees
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], cwd=str(tree), env=env, capture_output=True,
                       text=True)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"trial from {tree} failed (exit {p.returncode}): {p.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the commit before the change (a git ref)")
    ap.add_argument("--mode", default="hms_dram_cpuadam", help="an hms_scale mode")
    ap.add_argument("--shape", default="12x768", help="LAYERSxWIDTH")
    ap.add_argument("--cap", type=float, default=4.0, help="GiB")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run (after one warm-up)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--path", default="/work/hms_ab", help="a folder on the disk HMS uses")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    a.layers, a.width = (int(x) for x in a.shape.split("x"))
    sha = subprocess.run(["git", "rev-parse", a.before], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    after = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "titan_ds", "launch"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    runs = {"before": [], "after": []}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hms_ab_") as tmp:
        wt = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(wt), sha], cwd=ROOT, check=True, capture_output=True)
        try:
            with open(out.with_suffix(".jsonl"), "w") as log:
                for i in range(a.repeats):
                    order = [("before", wt), ("after", ROOT)]
                    for side, tree in (order if i % 2 == 0 else order[::-1]):
                        r = run_one(tree, a, f"_{side}{i}")
                        r.update(side=side, repeat=i)
                        runs[side].append(r)
                        log.write(json.dumps(r) + "\n")
                        log.flush()
                        print(f"{side} {i}: {r['status']}, {r['step_s_median']:.3f} s/step", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=ROOT, capture_output=True)
    write(runs, a, sha, after, dirty, out)


def write(runs: dict, a, sha: str, after: str, dirty: bool, out: Path) -> None:
    med = {s: statistics.median(r["step_s_median"] for r in rs) for s, rs in runs.items()}
    same = runs["before"][0]["loss_all"] == runs["after"][0]["loss_all"]
    lines = [f"### One HMS change alone: {a.mode} at {a.shape} under {a.cap:g} GiB", "",
             f"Command: `python launch/bench/hms_ab.py {' '.join(sys.argv[1:])}`", "",
             f"before: {sha[:8]}; after: {after[:8]}{' plus uncommitted changes' if dirty else ''}. {a.repeats} runs "
             f"of each, alternated; each run 1 warm-up + {a.steps} timed steps; step_s: the median over the runs of "
             f"each run's median step. Phases: mean s per timed step in the first run (titan_ds/hms/timeline.py). "
             f"Shared 2-core machine.", "",
             "| side | step_s | runs_step_s | x_before | same_losses | " + " | ".join(PHASES) + " |",
             "|---|---|---|---|---|" + "---|" * len(PHASES)]
    for side in ("before", "after"):
        rs = runs[side]
        ph = rs[0].get("phases") or {}
        each = " ".join(f"{r['step_s_median']:.2f}" for r in rs)
        lines.append(f"| {side} | {med[side]:.3f} | {each} | "
                     f"{med[side] / med['before']:.3f} | {same} | " +
                     " | ".join(f"{ph.get(k, 0.0):.3f}" for k in PHASES) + " |")
    lines += ["", f"losses (first run, warm-up included): {' '.join(f'{x:.4f}' for x in runs['after'][0]['loss_all'])}"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
