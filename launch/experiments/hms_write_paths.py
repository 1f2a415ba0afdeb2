"""Store writes of ZeRO-3-like parameter partitions (unaligned slices of one fp32 master), by I/O path.

Command (from the repository root; as root with cgroup v1 for the cap)::

    PYTHONPATH=$PWD python launch/experiments/hms_write_paths.py --path /work/hmsio_bench/wp --cap 4 --rounds 3

The partitions of a GPT of ``--layers`` x ``--width`` (each layer: ln, qkv, proj, ln, fc, fc2 weights and biases,
in module order, so most slices start at an address that is not 4 KiB-aligned) are views of one fp32 master and
are written with ``TensorStore.put`` (durable False, no DRAM cache), as HMS's parameter swapper writes them after
each sub-group's optimizer step; then read back with ``get``. Paths, alternated per round: ``buffered`` (an
unaligned slice written through the page cache: the store before the bounce buffer) and ``bounce`` (O_DIRECT
through each I/O thread's aligned block). Prints one JSON line per (round, path) with MB/s, and checks the values.
With ``--cap`` the measurement runs in a memory cgroup of that many GiB (as the training runs do).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def layout(layers: int, width: int) -> list[int]:
    w = width
    per = [w, w, 3 * w * w, 3 * w, w * w, w, w, w, 4 * w * w, 4 * w, 4 * w * w, w]
    return [n for _ in range(layers) for n in per]


def measure(a) -> None:
    import torch

    from titan_ds.hms.io import AsyncIOHandle, aligned_empty
    from titan_ds.hms.store import TensorStore, Tier
    sizes = layout(a.layers, a.width)
    total = sum(sizes)
    master = aligned_empty(total * 4)[:total * 4].view(torch.float32)
    master.copy_(torch.randn(total))
    for r in range(a.rounds):
        for path in (("buffered", "bounce") if r % 2 == 0 else ("bounce", "buffered")):
            folder = os.path.join(a.path, f"{path}_r{r}")
            shutil.rmtree(folder, ignore_errors=True)
            io = AsyncIOHandle(threads=4)
            io.bounce = path == "bounce"
            store = TensorStore([Tier(folder)], io=io, durable=False)
            t0 = time.perf_counter()
            off = 0
            for i, n in enumerate(sizes):
                store.put(f"param/{i}", master.narrow(0, off, n), durable=False)
                off += n
            tw = time.perf_counter() - t0
            t0 = time.perf_counter()
            off, ok = 0, True
            out = torch.empty(total)
            for i, n in enumerate(sizes):
                store.get(f"param/{i}", out=out.narrow(0, off, n))
                off += n
            tr = time.perf_counter() - t0
            ok = bool(torch.equal(out, master))
            store.close()
            shutil.rmtree(folder, ignore_errors=True)
            print(json.dumps({"round": r, "path": path, "MB": total * 4 / 1e6, "files": len(sizes),
                              "write_s": round(tw, 3), "write_MBps": round(total * 4 / 1e6 / tw, 1),
                              "read_into_slices_s": round(tr, 3), "read_MBps": round(total * 4 / 1e6 / tr, 1),
                              "equal": ok}), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", required=True)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cap", type=float, default=0.0, help="GiB; 0: no cgroup")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.inner or not a.cap:
        measure(a)
        return
    from titan_ds.memcap import run_capped
    cmd = [sys.executable, __file__, "--inner", "--path", a.path, "--layers", str(a.layers), "--width",
           str(a.width), "--rounds", str(a.rounds)]
    r = run_capped(cmd, int(a.cap * (1 << 30)), env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=1800)
    print(json.dumps({"cap_GiB": a.cap, "returncode": r.returncode, "peak_anon_GiB": r.peak_anon_bytes / (1 << 30)}))


if __name__ == "__main__":
    main()
