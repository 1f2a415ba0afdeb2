"""`make demo`: the recommended profile beside plain DeepSpeed, on the same model, data, seed and steps.

    python launch/demo.py --steps 300 --out results/tmp/demo   # what `make demo` runs (STEPS=N to change)
    python launch/demo.py --steps 100 --out results/demo    # the committed run behind the README's demo figures

Runs ``deepspeed --num_gpus 1 launch/train.py`` twice: ``ds_configs/baseline_adamw.json`` (plain DeepSpeed,
ZeRO-0, torch AdamW, 16 sequences a step) and ``ds_configs/titan_memory.json`` (the recommended profile: MLME +
ASDT adaptive with 4-bit momentum and second moment over bf16 weights with stochastic rounding, 4 micro-batches of
4 = the same 16 sequences a step). The profile is chosen from results/frontier_1000.md: at 1000 steps, 2 seeds,
it is no different from AdamW (-0.0075, spread 0.018) at 0.094 of AdamW's training state, the smallest of the
rows that match AdamW. Each run writes ``<out>/<name>/summary.json`` and ``metrics.jsonl``; this script then
writes ``<out>/demo.json`` (both summaries and the ratios), ``<out>/demo.md`` and ``<out>/demo.png`` and prints
a two-line summary. A run whose summary already has the requested steps is not run again.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"plain": "ds_configs/baseline_adamw.json", "titan_memory": "ds_configs/titan_memory.json"}
STATE = ("parameters", "gradients", "optimizer_state", "activations")


def _run(name: str, config: str, steps: int, out: Path) -> dict:
    d = out / name
    summary = d / "summary.json"
    if summary.exists() and json.loads(summary.read_text()).get("steps") == steps:
        return json.loads(summary.read_text())
    d.mkdir(parents=True, exist_ok=True)
    launcher = Path(sys.executable).with_name("deepspeed")
    cmd = [str(launcher) if launcher.exists() else "deepspeed", "--num_gpus", "1", "launch/train.py",
           "--deepspeed_config", config, "--steps", str(steps), "--val-every", str(max(1, steps // 4)),
           "--val-batches", "16", "--metrics-out", str(d / "metrics.jsonl"), "--summary-out", str(summary)]
    print(f"demo: {name}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ))
    return json.loads(summary.read_text())


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
    return [f"titan_memory vs plain DeepSpeed, {steps} steps: validation loss {c['val_loss_titan']:.4f} vs "
            f"{c['val_loss_plain']:.4f} ({c['val_loss_delta']:+.4f} nats)",
            f"training state {c['train_state_mib_titan']:.1f} vs {c['train_state_mib_plain']:.1f} MiB "
            f"({c['train_state_vs_plain']:.3f}x), peak RSS {c['peak_rss_mib_titan']} vs {c['peak_rss_mib_plain']} MiB, "
            f"tokens/s {c['tokens_per_s_vs_plain']:.2f}x plain"]


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
    args = ap.parse_args(argv)
    out = Path(args.out)
    runs = {name: _run(name, cfg, args.steps, out) for name, cfg in RUNS.items()}
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


if __name__ == "__main__":
    main()
