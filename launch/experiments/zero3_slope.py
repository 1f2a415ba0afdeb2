"""Answered: plain ZeRO-3 + CPU offload needs 29-31 bytes of RAM per parameter (not "about 36"); in docs/plan.md.

The least-squares slope of peak anonymous memory against parameter count over the successful `zero3_cpu`
trials that launch/bench/hms_scale.py recorded (its results store, every record), per memory cap and over all of them:

    python launch/experiments/zero3_slope.py     # 2 GiB 29.3, 4 GiB 31.1, 8 GiB 7.7 (3 close sizes), all 30.1
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from launch.bench.store import Store  # noqa: E402
TRIALS = ("results/hms_scale_cap2.trials.jsonl", "results/hms_scale_cap8.trials.jsonl")


def slope(points: list[tuple[float, float]]) -> float:
    mx = sum(p for p, _ in points) / len(points)
    my = sum(b for _, b in points) / len(points)
    return sum((p - mx) * (b - my) for p, b in points) / sum((p - mx) ** 2 for p, _ in points)


def main() -> dict[str, float]:
    def flat(raw: dict) -> dict:  # a trial from before the store: every line counts, as recorded
        return {"row": "", "config": {}, "settings": {}, "seed": 0, "result": raw}
    rows = [rec["result"] for f in TRIALS for rec in Store(ROOT / f, suite="hms-scale", legacy=flat).records]
    ok = [(r["params"], r["peak_anon_GiB"] * 2**30, r["cap_GiB"]) for r in rows
          if r["mode"] == "zero3_cpu" and r["status"] == "ok"]
    out = {f"{cap:g} GiB": slope([(p, b) for p, b, c in ok if c == cap]) for cap in sorted({c for *_, c in ok})}
    out["all"] = slope([(p, b) for p, b, _ in ok])
    for k, v in out.items():
        print(f"{k}: {v:.1f} bytes/param")
    return out


if __name__ == "__main__":
    main()
