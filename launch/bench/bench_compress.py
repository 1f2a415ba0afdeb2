"""Gradient compression on DeepSpeed's reduce path: uncompressed vs topk vs tgss vs hge, 2 ranks, seed workload.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python launch/bench/bench_compress.py --steps 200 \
        --ratios 10,100 --methods topk,tgss,hge --out results/compress

Every row trains the reference GPT (6 layers, width 256, context 128, micro-batch 16 per rank) on the same
data, seed and tokens with 2 data-parallel ranks (`deepspeed --num_gpus 2`), ZeRO stage 0 (the gradient
all-reduce goes through ``DeepSpeedEngine.allreduce_bucket``). The first row is plain DeepSpeed (dense
all-reduce). Compressed rows run ``warmup_steps`` dense steps first (default 10), then compress with error
feedback. Columns added to the standard table: ``wire_x`` (last step, dense bytes / bytes handed to the
collective per rank), ``wire_x_run`` (whole run, warm-up included), ``step_time_ratio``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from titan_ds.bench import baseline_config, compare  # noqa: E402


def rows(methods: list[str], ratios: list[float], warmup: int, stage: int) -> list[tuple[str, dict]]:
    out = [("dense_allreduce", baseline_config(stage=stage))]
    for ratio in ratios:
        for m in methods:
            comp = {"method": m, "ratio": ratio, "error_feedback": True, "warmup_steps": warmup}
            out.append((f"{m}_{ratio:g}x", baseline_config(stage=stage, titan={"compression": comp})))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ratios", default="10,100")
    p.add_argument("--methods", default="topk,tgss,hge")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--out", default="results/compress")
    p.add_argument("--train-args", default="", help="extra launch/train.py flags")
    a = p.parse_args(argv)
    r = rows(a.methods.split(","), [float(x) for x in a.ratios.split(",")], a.warmup, a.stage)
    results = compare(r, steps=a.steps, out=a.out, num_ranks=2, extra_args=a.train_args.split(),
            title=f"gradient compression, 2 ranks, ZeRO-{a.stage}, {a.steps} steps",
            command="python launch/bench/bench_compress.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    append_step_time(results, Path(a.out))
    print(Path(a.out).with_suffix(".md").read_text())


def append_step_time(results: list[dict], out: Path) -> None:
    """Add the step-time ratio (mean seconds per step after the first 3, vs the dense row) to the markdown."""
    base = results[0].get("step_s")
    lines = ["", "| config | step_time_ratio | val_loss | delta_vs_dense | wire_x (last step) | wire_x (whole run) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        if r.get("status") != "ok":
            lines.append(f"| {r['name']} | {r.get('status')} | | | | |")
            continue
        tm = r.get("titan_metrics", {})
        ratio = r["step_s"] / base if base else float("nan")
        wire = tm.get("wire_compression_ratio") or 1.0
        total = tm.get("wire_compression_ratio_run") or 1.0
        lines.append(f"| {r['name']} | {ratio:.2f} | {r['val_loss']:.3f} | "
                     f"{r['val_loss'] - results[0].get('val_loss', float('nan')):+.3f} | {wire:.1f} | {total:.1f} |")
    md = out.with_suffix(".md")
    md.write_text(md.read_text() + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
