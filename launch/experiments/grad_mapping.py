"""What ``titan.hms.gradient_buffer: "disk"`` costs a step with and without punching each stepped sub-group's
pages out of the file (``MADV_REMOVE``; tried in HMS on branch ``exp/grad-punch`` and not merged: slower in the
real 907.7M step, docs/hms.md "Where the 907.7M step goes").

    python launch/experiments/grad_mapping.py --folder DIR [--numel 907.7e6] [--anon-gb 1.7] [--cap 4] [--steps 4]

A child process under a ``--cap`` GiB memory cgroup (``titan_ds.memcap.run_capped``) holds ``--anon-gb`` of
anonymous memory (the rest of an HMS step's working set) and a shared mapping of an unlinked sparse file of
``--numel`` fp32 elements (ZeRO-3's gradient partitions, as ``_DiskGradientBuffer`` maps them). Each step copies a
768x3072 partition's worth of gradient into the mapping at a time, last first (backward), then reads it back 1e7
elements at a time into one scratch buffer (the optimizer step's sub-groups), punching each range after reading it
in mode ``punch``, not in mode ``keep``. Prints seconds per phase per step for each mode; one thread.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, mmap, os, sys, time, torch
torch.set_num_threads(1)
numel, anon_gb, steps, folder, punch = int(float(sys.argv[1])), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "punch"
anon = torch.ones(int(anon_gb * 1e9) // 4)
path = os.path.join(folder, f"grad_buffer.{os.getpid()}.bin")
with open(path, "w+b") as f:  # as _DiskGradientBuffer.alloc: a sparse file, mapped shared, unlinked
    f.truncate(numel * 4)
    mm = mmap.mmap(f.fileno(), numel * 4, mmap.MAP_SHARED)
os.unlink(path)
g = torch.frombuffer(mm, dtype=torch.float32, count=numel)
P = mmap.PAGESIZE
def discard(lo, hi):  # the whole pages inside elements [lo, hi)
    a, b = -(-lo * 4 // P) * P, hi * 4 // P * P
    if b > a:
        mm.madvise(mmap.MADV_REMOVE, a, b - a)
piece, sub = 768 * 3072, 10_000_000
src, scratch = torch.randn(piece), torch.empty(sub)
rows = []
for step in range(steps):
    t0 = time.perf_counter()
    for lo in range(numel - piece, -1, -piece):
        g[lo:lo + piece].copy_(src)
    t1 = time.perf_counter()
    for lo in range(0, numel, sub):
        hi = min(numel, lo + sub)
        scratch[:hi - lo].copy_(g[lo:hi])
        if punch:
            discard(lo, hi)
    rows.append({"step": step, "copy_in_s": round(t1 - t0, 3), "read_back_s": round(time.perf_counter() - t1, 3)})
print(json.dumps(rows))
"""


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from titan_ds.memcap import run_capped
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", required=True, help="a folder on the disk HMS would use")
    ap.add_argument("--numel", type=float, default=907.7e6)
    ap.add_argument("--anon-gb", type=float, default=1.7)
    ap.add_argument("--cap", type=float, default=4.0, help="GiB")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    for mode in ("keep", "punch"):
        with tempfile.TemporaryFile("w+") as out:
            r = run_capped([sys.executable, "-c", CHILD, str(a.numel), str(a.anon_gb), str(a.steps), a.folder, mode], int(a.cap * (1 << 30)), stdout=out, stderr=subprocess.STDOUT,
                           env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
            out.seek(0)
            text = out.read()
        if r.returncode != 0:
            raise SystemExit(f"{mode}: exit {r.returncode}\n{text[-2000:]}")
        rows = json.loads(text.strip().splitlines()[-1])
        print(mode, " ".join(f"step {x['step']}: copy in {x['copy_in_s']} s, read back {x['read_back_s']} s;"
                             for x in rows))


if __name__ == "__main__":
    main()
