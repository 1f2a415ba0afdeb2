"""Peak RSS of the gradient reducer alone: top-k + rms at 100x over the seed GPT's parameter sizes in one bucket,
one process, no DeepSpeed (what docs/compress.md quotes for the reducer's own buffers).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python launch/bench/reducer_rss.py --calls 100 [--consume]

Prints the RSS every 50 calls and the process's maximum RSS (``ru_maxrss``) at the end. Run it twice: glibc's
heap makes single runs vary by tens of MiB.
"""
from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from titan_ds.comm.base import LocalCollective, Segment  # noqa: E402
from titan_ds.comm.compressor import GradientReducer  # noqa: E402
from titan_ds.comm.precondition import RMSOptions  # noqa: E402

# the seed GPT 6x256's parameters (embeddings, 6 blocks, head), in one bucket as ZeRO-0's default bucket holds them
SIZES = [65536, 32768] + [256 * 768, 768, 256 * 256, 256, 256 * 1024, 1024, 1024 * 256, 256, 256, 256, 256, 256] * 6 \
    + [256 * 256]


def rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--consume", action="store_true", help="the reducer works in the caller's buffer, as the hooks")
    a = p.parse_args()
    torch.manual_seed(0)
    layout, off = [], 0
    for i, s in enumerate(SIZES):
        layout.append(Segment(f"p{i}", 0, off, s, s))
        off += s
    red = GradientReducer("topk", 100, precondition=RMSOptions())
    grads = [torch.randn(off) for _ in range(4)]
    print(f"elements {off}, RSS at start {rss_mib()} MiB")
    for t in range(a.calls):
        red.reduce(grads[t % 4].clone(), layout, LocalCollective(), t, consume=a.consume)
        red.end_step()
        if t % 50 == 0:
            print(f"call {t}: RSS {rss_mib()} MiB")
    print(f"end: RSS {rss_mib()} MiB, max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB")


if __name__ == "__main__":
    main()
