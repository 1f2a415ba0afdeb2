"""Answered (2026-11-30): raising ASDT's lr 3e-4 -> 1e-3 made titan_full (now titan_all.json) worse, +1.535 vs +1.332 nats; in docs/limits.md (the probe rewrites its table, results/seed_lr_probe.md, which is not committed).

Probe (2026-11-30): the seed table's titan_full profile of then (now ``launch/experiments/configs/titan_all.json``) with
ASDT's learning rate raised from 3e-4 to 1e-3.

    python launch/experiments/seed_lr_probe.py --steps 200 --out results/seed_lr_probe

The ASDT sweep (results/asdt_sweep.md) found 1e-3 better than 3e-4 for ASDT alone, and the TRD lr probe found
TR cores want a larger step than dense weights; the shipped titan_full still uses 3e-4. This runs plain DeepSpeed
(the seed table's baseline row, again) and titan_full at both learning rates side by side, same workload as
launch/bench/seed_table.py, and changes no shipped config.
"""
from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launch.bench.harness import compare  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--out", default="results/seed_lr_probe")
    p.add_argument("--lrs", default="3e-4,1e-3")
    p.add_argument("--train-args", default="--val-batches 32")
    a = p.parse_args()
    load = lambda n: json.loads((ROOT / "launch" / "experiments" / "configs" / f"{n}.json").read_text())  # noqa: E731
    rows = [("baseline_zero2", load("baseline_zero2"))]
    for lr in a.lrs.split(","):
        cfg = copy.deepcopy(load("titan_all"))
        cfg["titan"]["optimizer"]["lr"] = float(lr)
        rows.append((f"titan_full_asdt_lr{lr}", cfg))
    compare(rows, steps=a.steps, out=a.out, num_ranks=a.ranks, extra_args=shlex.split(a.train_args),
            title="Probe: titan_full with ASDT lr 3e-4 (shipped) and 1e-3",
            command="python launch/experiments/seed_lr_probe.py " + " ".join(shlex.quote(x) for x in sys.argv[1:]))


if __name__ == "__main__":
    main()
