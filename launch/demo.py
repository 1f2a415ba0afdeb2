"""`make demo`: the recommended profile beside plain DeepSpeed, on the same model, data, seed and steps.

    python launch/demo.py --steps 300 --out results/tmp/demo   # what `make demo` runs (STEPS=N to change)
    python launch/demo.py --steps 100 --out results/demo    # the committed run behind the README's demo figures

Runs ``deepspeed --num_gpus 1 launch/train.py`` twice: ``ds_configs/baseline_adamw.json`` (plain DeepSpeed,
ZeRO-0, torch AdamW, 16 sequences a step) and ``ds_configs/titan_memory.json`` (the recommended profile: MLME +
ASDT adaptive with 4-bit momentum and second moment over bf16 weights with stochastic rounding, 4 micro-batches of
4 = the same 16 sequences a step). The profile is chosen from results/frontier_1000.md: at 1000 steps, 2 seeds,
it is no different from AdamW (-0.0075, spread 0.018) at 0.094 of AdamW's training state, the smallest of the
rows that match AdamW. Each run writes ``<out>/<name>/summary.json`` and ``metrics.jsonl`` and is recorded at once
in ``<out>/runs.jsonl`` (``launch/bench/store.py``: config = the ds_config, settings = steps and validation
batches); this script then writes ``<out>/demo.json`` (both summaries and the ratios), ``<out>/demo.md`` and
``<out>/demo.png`` from the records and prints a two-line summary. A rerun reuses a recorded run under the store's
rule (same config, settings and code); ``--reuse-stale`` also reuses runs from other code, and a summary.json from
before the store with the requested steps (code unknown). ``--table-only`` (``python -m launch.bench table demo
--out <out>``) rewrites the outputs from the records and runs nothing. What it prints is the progress bars and the
summary: the launcher runs at log level WARNING (``--verbose``: its INFO lines and the full commands).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from launch.bench.store import Store, add_store_args  # noqa: E402
RUNS = {"plain": "ds_configs/baseline_adamw.json", "titan_memory": "ds_configs/titan_memory.json"}
STATE = ("parameters", "gradients", "optimizer_state", "activations")


VAL_BATCHES = 16


def _identity(name: str, config: str, steps: int) -> dict:
    return {"row": name, "config": {"ds_config": json.loads((ROOT / config).read_text())},
            "settings": {"steps": steps, "val_batches": VAL_BATCHES}, "seed": 0}


def _legacy(name: str, steps: int, out: Path) -> Optional[dict]:
    """A run's summary.json from before the store, if it has these steps (code unknown)."""
    summary = out / name / "summary.json"
    if summary.exists() and json.loads(summary.read_text()).get("steps") == steps:
        return json.loads(summary.read_text())
    return None


def _launch(config: str, steps: int, d: Path, verbose: bool) -> tuple[list[str], dict[str, str]]:
    """The training command of one run and its environment. Unless ``verbose``: DeepSpeed's launcher logs at
    WARNING (its INFO lines are the launcher's own bookkeeping), and on a machine where torch sees no CUDA device
    DeepSpeed is told it runs on the CPU (``DS_ACCELERATOR=cpu``, where the user set none) instead of each of its
    three processes warning that it fell back to the CPU."""
    launcher = Path(sys.executable).with_name("deepspeed")
    cmd = [str(launcher) if launcher.exists() else "deepspeed", "--num_gpus", "1"]
    env = dict(os.environ)
    if not verbose:
        cmd.append("--log_level=warning")
        import torch
        if not torch.cuda.is_available():
            env.setdefault("DS_ACCELERATOR", "cpu")
    cmd += ["launch/train.py", "--deepspeed_config", config, "--steps", str(steps), "--val-every",
            str(max(1, steps // 4)), "--val-batches", str(VAL_BATCHES), "--metrics-out", str(d / "metrics.jsonl"),
            "--summary-out", str(d / "summary.json")]
    return cmd, env


def _run(name: str, config: str, steps: int, out: Path, store: Store, verbose: bool = False) -> dict:
    rec = store.find(**_identity(name, config, steps))
    if rec is not None:
        return rec["result"]
    if store.reuse_stale and _legacy(name, steps, out) is not None:
        return _legacy(name, steps, out)
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    cmd, env = _launch(config, steps, d, verbose)
    print(f"demo: {name}: {' '.join(cmd)}" if verbose else f"demo: {name} ({config}), {steps} steps", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env=env)
    return store.append(**_identity(name, config, steps), result=json.loads((d / "summary.json").read_text()))["result"]


def _recorded(name: str, config: str, steps: int, out: Path, store: Store, verbose: bool = False) -> dict:
    """--table-only: the newest record of the run under these settings, else its summary from before the store."""
    recs = [r for r in store.latest(settings=_identity(name, config, steps)["settings"]) if r["row"] == name]
    found = recs[-1]["result"] if recs else _legacy(name, steps, out)
    if found is None:
        raise SystemExit(f"{out}: no recorded {name} run of {steps} steps; run launch/demo.py --steps {steps} first")
    return found


def _state_mib(s: dict) -> float:
    return sum(s["memory"].get(k) or 0 for k in STATE) / 2**20


def compare(runs: dict[str, dict]) -> dict:
    p, t = runs["plain"], runs["titan_memory"]
    return {"val_loss_plain": round(p["val_loss"], 4), "val_loss_titan": round(t["val_loss"], 4),
            "val_loss_delta": round(t["val_loss"] - p["val_loss"], 4),
            "train_state_mib_plain": round(_state_mib(p), 1), "train_state_mib_titan": round(_state_mib(t), 1),
            "train_state_vs_plain": round(_state_mib(t) / _state_mib(p), 3),
            "peak_rss_mib_plain": round(p["peak_rss"] / 2**20), "peak_rss_mib_titan": round(t["peak_rss"] / 2**20),
            "tokens_per_s_vs_plain": round(t["tokens_per_s"] / p["tokens_per_s"], 2)}


def lines(c: dict, steps: int) -> list[str]:
    tps = c["tokens_per_s_vs_plain"]
    speed = f"tokens/s {tps:.2f}x plain" if not math.isnan(tps) else "tokens/s not timed (runs time steps 4 on)"
    return [f"titan_memory vs plain DeepSpeed, {steps} steps: validation loss {c['val_loss_titan']:.4f} vs "
            f"{c['val_loss_plain']:.4f} ({c['val_loss_delta']:+.4f} nats)",
            f"training state {c['train_state_mib_titan']:.1f} vs {c['train_state_mib_plain']:.1f} MiB "
            f"({c['train_state_vs_plain']:.3f}x), peak RSS {c['peak_rss_mib_titan']} vs {c['peak_rss_mib_plain']} MiB, "
            + speed]


def plot(out: Path, runs: dict[str, dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, s in runs.items():
        hist = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines() if x.strip()]
        line, = ax1.plot([r["step"] for r in hist], [r["loss"] for r in hist], lw=0.8, label=f"{name} train")
        ax1.plot(*zip(*s["val_history"]), "o--", color=line.get_color(), label=f"{name} validation")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (nats/byte)")
    ax1.legend()
    names = list(runs)
    bottom = [0.0] * len(names)
    for k in STATE:
        vals = [(runs[n]["memory"].get(k) or 0) / 2**20 for n in names]
        ax2.bar(names, vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_ylabel("MiB (accounted training state, peak)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out / "demo.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="results/demo")
    ap.add_argument("--table-only", action="store_true", help="rewrite the outputs from the records; run nothing")
    ap.add_argument("--verbose", action="store_true",
                    help="the full training commands and DeepSpeed's launcher at its own (INFO) log level")
    add_store_args(ap)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = Store(out / "runs.jsonl", suite="demo", reuse_stale=args.reuse_stale)
    get = _recorded if args.table_only else _run
    runs = {name: get(name, cfg, args.steps, out, store, args.verbose) for name, cfg in RUNS.items()}
    c = compare(runs)
    cmd = f"python launch/demo.py --steps {args.steps} --out {args.out}"
    (out / "demo.json").write_text(json.dumps({"command": cmd, "steps": args.steps, "configs": RUNS,
                                               "compare": c, "runs": runs}, indent=1))
    rows = "\n".join(f"| {k} | {v} |" for k, v in c.items())
    (out / "demo.md").write_text(f"# make demo\n\nCommand: `{cmd}`\n\n| figure | value |\n|---|---|\n{rows}\n\n"
                                 + "\n".join(lines(c, args.steps)) + "\n")
    plot(out, runs)
    print("\n".join(lines(c, args.steps)))
    print(f"plot: {out / 'demo.png'}")
    return c


def table(out: str) -> None:
    """``python -m launch.bench table demo --out OUT``: OUT's outputs from its records, with the steps of its newest
    record (runs from before the store: the steps its demo.json records)."""
    store = Store(Path(out) / "runs.jsonl", suite="demo")
    steps = store.newest_settings()["steps"] if store.records else \
        json.loads((Path(out) / "demo.json").read_text())["steps"]
    main(["--steps", str(steps), "--out", str(out), "--table-only"])


if __name__ == "__main__":
    main()
