"""Write and read speed of HMS's store against DeepSpeed's aio handle on this disk, 40 MB tensors.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 flock /tmp/titan_timed.lock python launch/experiments/store_vs_aio.py --path DIR

Nine 10M-element fp32 tensors (one HMS sub-group's worth each) are written and read back three times: through a
``TensorStore`` as HMS builds it (4 I/O threads, O_DIRECT, swap files rewritten in place, checksums) and through
DeepSpeed's ``async_io`` handle (``sync_pwrite``/``sync_pread``, block 1 MiB, queue depth 8, one thread: its
recommended settings). Prints GB/s per round; the first store round creates the files, the others rewrite them.
Needs libaio for the aio half.
"""
from __future__ import annotations

import argparse
import os
import shutil
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from titan_ds.hms.io import AsyncIOHandle
    from titan_ds.hms.store import TensorStore, Tier
    shutil.rmtree(a.path, ignore_errors=True)
    os.makedirs(a.path)
    ts = [torch.randn(10_000_000) for _ in range(9)]
    gb = sum(t.numel() * 4 for t in ts) / 1e9
    out = torch.empty(10_000_000)
    st = TensorStore([Tier(os.path.join(a.path, "s"))], dram_cache_bytes=64 << 20,
                     io=AsyncIOHandle(threads=4, direct="on"), durable=False, overwrite_in_place=True)
    for rnd in range(a.rounds):
        t0 = time.perf_counter()
        for i, t in enumerate(ts):
            st.put(f"k{i}", t)
        w = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(len(ts)):
            st.get(f"k{i}", out=out)
        r = time.perf_counter() - t0
        print(f"store round {rnd}: write {gb / w:.2f} GB/s read {gb / r:.2f} GB/s", flush=True)
    st.close()
    h = AsyncIOBuilder().load(verbose=False).aio_handle(1 << 20, 8, False, True, 1)
    for rnd in range(a.rounds):
        t0 = time.perf_counter()
        for i, t in enumerate(ts):
            h.sync_pwrite(t, os.path.join(a.path, f"a{i}.bin"))
        w = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(len(ts)):
            h.sync_pread(out, os.path.join(a.path, f"a{i}.bin"))
        r = time.perf_counter() - t0
        print(f"aio round {rnd}: write {gb / w:.2f} GB/s read {gb / r:.2f} GB/s", flush=True)
    shutil.rmtree(a.path, ignore_errors=True)


if __name__ == "__main__":
    main()
