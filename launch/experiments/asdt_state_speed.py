"""ASDT's optimizer step with each state layout, on one thread: the cost of the 8-/4-bit state.

A one-off probe: it answered what the 8-bit/4-bit per-coordinate state costs per step against the bf16 row state
(results/asdt_state_speed.md); launch/bench/optim_step.py (the "optimizer-step" suite) replaces it.

    OMP_NUM_THREADS=1 python launch/experiments/asdt_state_speed.py --out results/asdt_state_speed.md

Times ``ASDT.step`` on the seed GPT's parameter shapes (4.9M parameters: the real model's tensors, random
gradients) for the shipped ``titan_balanced`` state (8-bit momentum, 4-bit per-coordinate second moment), the
previous one (bf16 momentum, one second moment per row), and a bf16 per-coordinate one; median of ``--repeats``
steps after one warm-up step. Reports seconds per step and the ratio to the first row (ratios only: a shared
2-core machine).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from titan_ds.models.gpt import GPT, GPTConfig  # noqa: E402
from titan_ds.optim.asdt import ASDT  # noqa: E402

ROWS = {
    "bf16 momentum, row second moment (titan_balanced before)": dict(granularity="row", state_dtype="bf16"),
    "bf16 momentum, bf16 coordinate second moment": dict(second_moment="coordinate", state_dtype="bf16",
                                                         second_dtype="bf16"),
    "8-bit momentum, 4-bit coordinate second moment (titan_balanced)": dict(second_moment="coordinate",
                                                                            state_dtype="8bit", second_dtype="4bit"),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    params = [q for q in GPT(GPTConfig()).parameters()]
    n = sum(q.numel() for q in params)
    lines = [f"ASDT step, {n:,} parameters (the seed GPT's shapes), {torch.get_num_threads()} thread(s), "
             f"median of {a.repeats}", "", "| state | s/step | vs first | optimizer bytes/param |", "|---|---|---|---|"]
    first = None
    for name, kw in ROWS.items():
        ps = [q.detach().clone().requires_grad_() for q in params]
        opt = ASDT(ps, lr=1e-3, betas=(0.9, 0.95), density=1.0, update="adaptive", weight_decay=0.1, **kw)
        for q in ps:
            q.grad = torch.randn_like(q)
        opt.step()
        times = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
        s = statistics.median(times)
        first = first or s
        lines.append(f"| {name} | {s:.3f} | {s / first:.2f} | {opt.state_bytes() / n:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        cmd = "OMP_NUM_THREADS=1 python launch/experiments/asdt_state_speed.py " + " ".join(sys.argv[1:])
        Path(a.out).write_text(f"### ASDT optimizer step by state layout\n\nCommand: `{cmd}`\n\n" + text)


if __name__ == "__main__":
    main()
