"""One-off probe (the HF row's speed): one ``opt.step()`` of ds_configs/hf_asdt_8bit.json's ASDT over
SmolLM2-135M's parameters (random gradients, seeded), at a given ``core.CHUNK``; prints each step's seconds and a
hash of the weights after 3 steps (the same hash at every CHUNK: chunking does not change the bits).

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD CHUNK=65536 flock /tmp/titan_timed.lock python launch/experiments/hf_optim_chunks.py
    CPROF=1 ...   # and a cProfile of a 4th step (top 18 by own time)

Measured 2026-12-03 (1 thread, machine shared with nice-19 runs): CHUNK 64K: 5.62 / 6.02 s (steps 2-3), 256K:
3.20 / 3.61 s, 1M: 3.41 / 2.96 s; hash 9ae2c7530dffaf61 for all three.
"""
import cProfile
import hashlib
import json
import os
import pstats
import time
from pathlib import Path

import torch
import transformers

from titan_ds.config import OptimizerConfig
from titan_ds.optim import core
from titan_ds.optim.install import build_optimizer

ROOT = Path(__file__).resolve().parents[2]
if os.environ.get("CHUNK"):
    core.CHUNK = int(os.environ["CHUNK"])
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_pretrained(
    Path(os.environ.get("TITAN_CACHE", ROOT / ".cache")) / "hf" / "smollm2-135m-instruct", dtype=torch.float32)
section = json.loads((ROOT / "ds_configs" / "hf_asdt_8bit.json").read_text())["titan"]["optimizer"]
if os.environ.get("COMPILE"):  # COMPILE=1/0: the section's "compile" (the compiled per-unit chunks) on/off
    section["compile"] = os.environ["COMPILE"] == "1"
opt = build_optimizer(model, OptimizerConfig(**{k: v for k, v in section.items() if k != "step_in_backward"}))
params = [p for p in model.parameters() if p.requires_grad]


def grads() -> None:
    torch.manual_seed(1)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3


for _ in range(int(os.environ.get("STEPS", "3"))):
    grads()
    t0 = time.perf_counter()
    opt.step()
    print("step", time.perf_counter() - t0, flush=True)
if os.environ.get("CPROF"):
    grads()
    cProfile.run("opt.step()", "/tmp/hf_optim_chunks.prof")
    pstats.Stats("/tmp/hf_optim_chunks.prof").sort_stats("tottime").print_stats(18)
h = hashlib.sha256()
for p in params:
    h.update(p.detach().numpy().tobytes())
print("hash", h.hexdigest()[:16])
