"""One optimizer row of ``launch/bench/optim_step.py`` stepped on a single 2^24-element fp32 parameter, for
before/after comparisons of the C++ kernel across two checkouts (run each from its own checkout, with its own
``TORCH_EXTENSIONS_DIR``, alternated):

    ROOT=$PWD PYTHONPATH=$PWD python launch/experiments/optim_step_loop.py titan_balanced 30

3 warm-up steps, then N timed ``opt.step()``; prints the fastest and the median step and M elements/s from the
fastest. ``DTYPE=bf16``: bf16 parameters (default fp32). ``ROOT``: the checkout whose launch/bench/optim_step.py (and, through PYTHONPATH, titan_ds) is used."""
from __future__ import annotations

import importlib.util
import os
import sys
import time

ROOT = os.environ.get("ROOT", os.getcwd())
sys.path.insert(0, ROOT)


def main(row: str, steps: int) -> None:
    spec = importlib.util.spec_from_file_location("optim_step", os.path.join(ROOT, "launch", "bench", "optim_step.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.modules["optim_step"] = bench  # its dataclasses look the module up
    spec.loader.exec_module(bench)
    numel = 1 << 24
    dtype = os.environ.get("DTYPE", "fp32")  # fp32 or bf16 parameters
    model = bench._model(numel, dtype)
    opt = bench.ROWS[row].build(model, dtype)
    for _ in range(3):
        opt.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    times.sort()
    print(f"{row} {dtype} min {times[0]:.5f} s median {times[len(times) // 2]:.5f} s M/s {numel / times[0] / 1e6:.1f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)
