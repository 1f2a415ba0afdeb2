"""What a fresh gradient buffer per sub-group costs against one reused buffer (titan_ds/hms/optimizer_swapper.py's
``_gradient_into``), under HMS's glibc mmap threshold (1 MiB, set here through ``MALLOC_MMAP_THRESHOLD_`` in a
child process, as HMS sets it with mallopt): every tensor of 1 MiB or more is then its own mapping, so a fresh one
is faulted in 4 KiB at a time and zeroed by the kernel, and freeing it unmaps it.

    python launch/experiments/grad_scratch.py [--numel 10000000] [--groups 20] [--repeats 5]

For each of ``--repeats`` rounds, ``--groups`` sub-groups of ``--numel`` fp32 elements (sub_group_size's default in
titan_ds/hms/install.py is 1e7) each read a gradient by ``copy_`` from a source tensor into (a) a fresh
``torch.empty`` freed after use, (b) one buffer allocated once; prints the median seconds per sub-group of each and
the difference. One thread."""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import statistics, sys, time, torch
torch.set_num_threads(1)
numel, groups, repeats = map(int, sys.argv[1:4])
src = torch.randn(numel)
def fresh():
    g = torch.empty(numel)
    g.copy_(src)
    del g
scratch = torch.empty(numel)
def reused():
    scratch[:numel].copy_(src)
out = {}
for name, fn in (("fresh", fresh), ("reused", reused)) * repeats:
    t = time.perf_counter()
    for _ in range(groups):
        fn()
    out.setdefault(name, []).append((time.perf_counter() - t) / groups)
print(statistics.median(out["fresh"]), statistics.median(out["reused"]))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=10_000_000)
    ap.add_argument("--groups", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CHILD, str(a.numel), str(a.groups), str(a.repeats)], env=env,
                         capture_output=True, text=True, check=True)
    fresh, reused = map(float, out.stdout.split())
    mb = a.numel * 4 / 1e6
    print(f"{a.numel} fp32 elements ({mb:.0f} MB) per sub-group, median of {a.repeats} rounds x {a.groups}:")
    print(f"  fresh tensor per sub-group: {fresh * 1e3:.2f} ms ({mb / 1e3 / fresh:.2f} GB/s)")
    print(f"  one reused buffer:          {reused * 1e3:.2f} ms ({mb / 1e3 / reused:.2f} GB/s)")
    print(f"  saved per sub-group:        {(fresh - reused) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
