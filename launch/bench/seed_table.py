"""The seed's benchmark table, reproduced with quality stated.

    python launch/bench/seed_table.py --steps 200 --out results/seed_table

The seed claims, for a 6-layer, 256-wide transformer: ~35.1x weight compression (TRD), ~49.7x gradient
compression (HGE) and ~103 MB of "VRAM". This runs plain DeepSpeed (torch AdamW, ZeRO-2) and the shipped titan
profiles side by side on the seed workload, 2 ranks (gradient compression needs a collective), same model, data,
seed and tokens, and adds what the seed left out: validation loss and its delta vs dense, tokens/s ratio and the
training-state memory by category (accounted on the CPU; torch.cuda.max_memory_allocated on a GPU).

Targets (the project's): weight compression >= 35x, gradient compression >= 100x, training-state memory <= 1/10 of
plain DeepSpeed, all within 0.10 nats of dense. The table reports the real numbers whether or not they are met.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launch.bench.harness import compare  # noqa: E402

PROFILES = ["baseline_zero2", "titan_full", "titan_memory"]
MiB = 2**20


def seed_summary(results: list[dict], out: Path) -> str:
    base = results[0]
    lines = ["| figure | seed claim | target | " + " | ".join(r["name"] for r in results[1:]) + " |",
             "|---|---|---|" + "---|" * (len(results) - 1)]

    def cell(r, f):
        return f(r) if r.get("status") == "ok" else r.get("status", "?")[:40]

    rows = [
        ("weight compression, block linears (TRD)", "~35.1x", ">= 35x",
         lambda r: f"{r['titan_metrics'].get('trd_compression_ratio', 1.0):.1f}x"),
        ("weight compression, whole model", "-", "-",
         lambda r: f"{r['titan_metrics'].get('trd_model_compression_ratio', 1.0):.2f}x"),
        ("gradient compression on the wire (last step / whole run)", "~49.7x", ">= 100x",
         lambda r: f"{r['titan_metrics'].get('wire_compression_ratio', 1.0):.1f}x / "
                   f"{r['titan_metrics'].get('wire_compression_ratio_run', 1.0):.1f}x"),
        ("training-state memory (params+grads+optim+activations)", "~103 MB", "<= 1/10 of DeepSpeed",
         lambda r: f"{r['memory']['training_state'] / MiB:.1f} MiB "
                   f"({r['memory']['training_state'] / base['memory']['training_state']:.3f} of DeepSpeed's "
                   f"{base['memory']['training_state'] / MiB:.1f} MiB)"),
        ("validation loss (delta vs dense AdamW)", "not stated", "within 0.10 nats",
         lambda r: f"{r['val_loss']:.3f} ({r['val_loss'] - base['val_loss']:+.3f}; dense {base['val_loss']:.3f})"),
        ("tokens/s vs DeepSpeed", "not stated", "-", lambda r: f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x"),
        ("peak RSS", "-", "-", lambda r: f"{r['peak_rss'] / MiB:.0f} MiB (DeepSpeed {base['peak_rss'] / MiB:.0f})"),
    ]
    for name, claim, target, f in rows:
        lines.append(f"| {name} | {claim} | {target} | " + " | ".join(cell(r, f) for r in results[1:]) + " |")
    md = "\n".join(lines) + "\n"
    with open(out.with_suffix(".md"), "a") as fh:
        fh.write("\n#### The seed's figures\n\n" + md)
    return md


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--out", default="results/seed_table")
    p.add_argument("--profiles", default=",".join(PROFILES))
    p.add_argument("--train-args", default="--val-batches 32")
    a = p.parse_args(argv)
    names = a.profiles.split(",")
    rows = [(n, json.loads(next(p for d in ("ds_configs", "launch/experiments/configs") if (p := ROOT / d / f"{n}.json").exists()).read_text())) for n in names]
    cmd = "python launch/bench/seed_table.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    results = compare(rows, steps=a.steps, out=a.out, num_ranks=a.ranks, extra_args=a.train_args.split(),
                      title="Seed table: plain DeepSpeed vs titan profiles (seed workload)", command=cmd)
    print(Path(a.out).with_suffix(".md").read_text())
    if results[0].get("status") == "ok":
        print(seed_summary(results, Path(a.out)))


if __name__ == "__main__":
    main()
