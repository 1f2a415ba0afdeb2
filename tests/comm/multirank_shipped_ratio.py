"""Run by ``deepspeed --num_gpus 2`` from test_shipped_ratio.py (not collected by pytest itself).

Each ds_config given is trained as shipped (its ZeRO stage, its optimizer section, its titan section) by
``launch/train.py``'s ``main`` in this one launch, with every collective counted from before ``initialize``
(``--count-wire``); then plain DeepSpeed (``baseline_adamw.json``: ZeRO-0, dense all-reduce) on the same model and
steps. Rank 0 writes each run's received bytes per rank, whole run and initialize's share, to a JSON file.
"""
from __future__ import annotations

import argparse
import json

p = argparse.ArgumentParser()
p.add_argument("--configs", required=True, help="comma-separated ds_config paths")
p.add_argument("--baseline", default="ds_configs/baseline_adamw.json")
p.add_argument("--steps", type=int, default=12)
p.add_argument("--out", required=True)
p.add_argument("--local_rank", type=int, default=0)
args = p.parse_args()


def main() -> None:
    import torch.distributed as dist

    from launch import train
    model = ["--layers", "4", "--width", "128", "--heads", "4", "--steps", str(args.steps), "--val-batches", "2",
             "--no-progress", "--count-wire"]
    out = {}
    for cfg in args.configs.split(",") + [args.baseline]:
        summary = train.main(["--deepspeed_config", cfg, *model])
        out[cfg] = [{"received": w["received"], "init": w["init"]["received"], "calls": w["calls"]}
                    for w in summary["wire_per_rank"]]
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
