"""How fast HMS's store writes one sub-group's parameter partitions: the 48 partitions of four GPT-768 blocks
(113 MB, views of one fp32 master, as ``HMSParamSwapper.swap_out_partitioned_params`` hands them over), rewritten
in place (``overwrite_in_place``, as ``titan_ds/hms/install.py`` builds the store) one after another and
``--threads`` at a time.

    python launch/experiments/hms_put_rate.py --folder DIR [--threads 4] [--rounds 6]

Prints the median seconds and GB/s of each over ``--rounds`` alternated rounds. One intra-op thread.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from titan_ds.hms.store import Tier, TensorStore  # noqa: E402
from titan_ds.models.gpt import Block, GPTConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", required=True)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = GPTConfig(n_layer=1, n_embd=768, n_head=12, block_size=128, vocab_size=50304)
    sizes = [p.numel() for _ in range(4) for p in Block(cfg).parameters()]
    master = torch.randn(sum(sizes))
    views = list(torch.split(master, sizes))
    store = TensorStore([Tier(a.folder)], overwrite_in_place=True)
    pool = cf.ThreadPoolExecutor(a.threads)
    try:
        for i, v in enumerate(views):  # the files exist: every timed put is a rewrite in place
            store.put(f"p{i}", v, durable=False)
        times: dict[str, list[float]] = {"one after another": [], f"{a.threads} at a time": []}
        for _ in range(a.rounds):
            for mode in times:
                t = time.perf_counter()
                if mode == "one after another":
                    for i, v in enumerate(views):
                        store.put(f"p{i}", v, durable=False)
                else:
                    for f in [pool.submit(store.put, f"p{i}", v, durable=False) for i, v in enumerate(views)]:
                        f.result()
                times[mode].append(time.perf_counter() - t)
        print(f"{len(views)} partitions, {master.numel() * 4 / 1e6:.1f} MB")
        for mode, ts in times.items():
            m = statistics.median(ts)
            print(f"{mode}: median {m:.4f} s, {master.numel() * 4 / 1e9 / m:.2f} GB/s")
    finally:
        pool.shutdown()
        store.close()


if __name__ == "__main__":
    main()
