"""Run ds_configs side by side on the seed workload and write a CSV + markdown table.

    python launch/bench/compare.py --steps 300 --out results/baseline \
        ds_configs/baseline_adamw.json tests/configs/demo.json

The first config is the baseline row (plain DeepSpeed with torch AdamW). Every row trains the same GPT
(6 layers, width 256, context 128, micro-batch 16), on the same data and seed, for the same number of steps.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch.bench.harness import compare  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("configs", nargs="+", help="ds_config json files; the first is the baseline")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--out", default="results/compare")
    p.add_argument("--title", default="")
    p.add_argument("--train-args", default="", help="extra launch/train.py flags, e.g. '--val-batches 16'")
    a = p.parse_args(argv)
    rows = [(Path(c).stem, json.loads(Path(c).read_text())) for c in a.configs]
    compare(rows, steps=a.steps, out=a.out, num_ranks=a.ranks, extra_args=a.train_args.split(),
            title=a.title or f"compare: {', '.join(n for n, _ in rows)}",
            command="python launch/bench/compare.py " + shlex.join(argv if argv is not None else sys.argv[1:]))
    print(Path(a.out).with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
