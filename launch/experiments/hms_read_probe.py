"""Why did the checked store read at ~70% of dd's best? Answered 2026-12-05: the destination's
pages, not the checksum, the block size or the thread count (docs/hms.md, "Reads at 1.2x dd's best").

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python launch/experiments/hms_read_probe.py --path /work/hms_probe \\
        --rounds 6 --out results/hms_read_probe.md

One 1 GiB store file; every round reads it once with each method, the methods in a rotating order (this virtual
disk's speed drifts): ``dd`` (8 MiB blocks, ``iflag=direct``, into /dev/null); raw O_DIRECT reads into a reused 1 GiB
buffer on 4 KiB pages with 8 or 4 MiB blocks and 1 or 4 threads; one thread through one reused 8 MiB buffer (dd's
pattern); the store (header, checksum verified) into the 4 KiB-page buffer and into a huge-page one. Per method:
best and median GB/s and the median of its per-round ratio to dd. Also: XXH3-64 over 512 MiB in 4 MiB chunks.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import xxhash  # noqa: E402

from launch.bench.bench_hms import _dd  # noqa: E402
from titan_ds.hms.io import AsyncIOHandle, aligned_empty  # noqa: E402
from titan_ds.hms.store import Tier, TensorStore  # noqa: E402

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "results" / "hms_read_probe.md"))
    a = ap.parse_args()
    nbytes = 1 << 30
    src = aligned_empty(nbytes, huge=True)
    src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    small = aligned_empty(nbytes)
    small.zero_()
    huge = aligned_empty(nbytes, huge=True)
    huge.zero_()
    block8 = aligned_empty(8 * MiB)
    block8.zero_()
    ios = {t: AsyncIOHandle(block_size=8 * MiB, intra_op_parallelism=t) for t in (1, 4)}
    store = TensorStore([Tier(os.path.join(a.path, "store"))], io=ios[4], durable=True)
    store.put("x", src.view(torch.float32))
    f, hlen = store.path("x"), os.path.getsize(store.path("x")) - nbytes

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return nbytes / (time.perf_counter() - t) / 1e9

    def raw(threads: int, block_mib: int):
        return lambda: timed(lambda: ios[threads].transfer_with(False, small, f, hlen, block_mib * MiB,
                                                                lambda lo, hi: 0))

    def through_8mib() -> float:
        def go():
            fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
            try:
                for off in range(0, nbytes, 8 * MiB):
                    os.preadv(fd, [memoryview(block8.numpy())], hlen + off)
            finally:
                os.close(fd)
        return timed(go)

    methods = {"dd": lambda: _dd([f"if={f}", "of=/dev/null", "bs=8M", "iflag=direct"]),
               "raw 4 KiB pages, 8 MiB blocks, 4 threads": raw(4, 8),
               "raw 4 KiB pages, 4 MiB blocks, 4 threads": raw(4, 4),
               "raw 4 KiB pages, 8 MiB blocks, 1 thread": raw(1, 8),
               "1 thread through one reused 8 MiB buffer (dd's pattern)": through_8mib,
               "store into 4 KiB pages": lambda: timed(lambda: store.get("x", out=small.view(torch.float32))),
               "store into huge pages": lambda: timed(lambda: store.get("x", out=huge.view(torch.float32)))}
    names = list(methods)
    res: dict[str, list[float]] = {k: [] for k in names}
    for r in range(a.rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            res[k].append(methods[k]())
    mv = memoryview(src[:512 * MiB].numpy())
    t = time.perf_counter()
    for lo in range(0, 512 * MiB, 4 * MiB):
        xxhash.xxh3_64_intdigest(mv[lo:lo + 4 * MiB])
    hash_s = time.perf_counter() - t
    shutil.rmtree(os.path.join(a.path, "store"))
    lines = ["### Why the store read at ~70% of dd's best: the destination's pages", "",
             f"Command: `python {' '.join(sys.argv)}`; {time.strftime('%Y-%m-%d')}; {a.rounds} rounds of a 1 GiB "
             f"store file, methods in a rotating order (launch/experiments/hms_read_probe.py). XXH3-64 over 512 MiB "
             f"in 4 MiB chunks: {hash_s:.3f} s.", "",
             "| method | best GB/s | median GB/s | median of per-round ratio to dd |", "|---|---|---|---|"]
    for k in names:
        v = res[k]
        ratio = statistics.median(x / d for x, d in zip(v, res["dd"]))
        lines.append(f"| {k} | {max(v):.3f} | {statistics.median(v):.3f} | {ratio:.3f} |")
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
