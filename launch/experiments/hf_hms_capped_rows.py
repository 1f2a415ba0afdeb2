"""HF ``Trainer`` + HMS against DeepSpeed's own offloads under a memory cap: rows for
docs/integrations.md.

    PYTHONPATH=$PWD python launch/experiments/hf_hms_capped_rows.py --work DIR --caps 6,2 --modes cpu,zinf,hms \\
        --out results/hf_hms_capped/rows.jsonl

Saves a 103M-parameter Llama (hidden 1024, 8 layers, vocab 256: the model of tests/test_hf_hms.py's capped test)
with ``save_pretrained`` into ``DIR/model`` once, then fine-tunes it 3 steps through ``tests/helpers/hf_hms_capped.py``
(``Trainer`` + ZeRO-3; ``cpu``: CPU offload of parameters and optimizer, ``zinf``: ZeRO-Infinity with the optimizer
on NVMe, ``hms``: ``ds_configs/hf_hms.json``) in a fresh cgroup per cap and mode. One JSON row per run is appended
to ``--out``: the outcome, the sampled peak of anonymous memory, the wall time and the losses (the helper's last
line). DeepSpeed's ops are built uncapped first (``launch/bench/hms_scale.build_ops``).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", required=True, help="folder for the model, the stores and the logs (outside the repo)")
    ap.add_argument("--caps", default="6,2", help="GiB, comma list")
    ap.add_argument("--modes", default="cpu,zinf,hms")
    ap.add_argument("--out", default=str(ROOT / "results" / "hf_hms_capped" / "rows.jsonl"))
    a = ap.parse_args()
    import transformers

    from launch.bench.hms_scale import build_ops
    from tests.helpers.launch import clean_env
    from titan_ds.memcap import run_capped
    work = Path(a.work)
    if not (work / "model" / "config.json").exists():
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=64)
        transformers.LlamaForCausalLM(cfg).save_pretrained(work / "model")
    build_ops(clean_env())
    for cap in (float(c) for c in a.caps.split(",")):
        for mode in a.modes.split(","):
            run_dir = work / f"{mode}_{cap:g}"
            run_dir.mkdir(parents=True, exist_ok=True)
            t = time.time()
            with open(run_dir / "log.txt", "w") as log:
                r = run_capped([sys.executable, str(ROOT / "tests" / "helpers" / "hf_hms_capped.py"), "--model-dir",
                                str(work / "model"), "--work", str(run_dir), "--mode", mode, "--steps", "3"],
                               int(cap * 2**30), env=clean_env(), stdout=log, stderr=subprocess.STDOUT, timeout=1500)
            last = (run_dir / "log.txt").read_text().strip().splitlines()[-1]
            try:
                losses = json.loads(last) if r.ok else None
            except ValueError:
                losses = None
            row = {"mode": mode, "cap_GiB": cap, "ok": r.ok, "oom_killed": r.oom_killed, "returncode": r.returncode,
                   "peak_anon_GiB": round(r.peak_anon_bytes / 2**30, 4), "wall_s": round(time.time() - t, 1),
                   "losses": losses, "date": time.strftime("%Y-%m-%d")}
            print(json.dumps(row), flush=True)
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
