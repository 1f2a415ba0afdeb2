"""The optimizer step's temporaries: peak RSS above the resident state during one step, per element.

Command (from the repository root)::

    PYTHONPATH=$PWD python launch/bench/step_temp.py --numel 67108864 --out results/step_temp.md

For each optimizer (torch AdamW; ASDT with a bf16 or an 8-bit momentum at density 1; ASDT bf16 at density 0.1) a
fresh process builds one fp32 parameter of ``--numel`` elements with a gradient, steps once (the state exists),
resets the kernel's RSS high-water mark (``/proc/self/clear_refs``), steps again, and reports (VmHWM - VmRSS
before the step) / numel. ``titan_ds.plan.STEP_TEMP_BYTES`` holds these figures: ``plan`` charges them per element
of the sub-group being stepped. One intra-op thread, glibc mmap threshold 1 MiB (as HMS sets it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = {"adamw": ("adamw", None, 1.0), "asdt_bf16": ("asdt", "bf16", 1.0), "asdt_8bit": ("asdt", "8bit", 1.0),
         "asdt_bf16_density0.1": ("asdt", "bf16", 0.1)}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def child(case: str, numel: int) -> None:
    import gc
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    kind, state, density = CASES[case]
    p = torch.nn.Parameter(torch.randn(numel) * 0.02)
    p.grad = torch.randn(numel)
    if kind == "adamw":
        opt = torch.optim.AdamW([p], lr=1e-3)
    else:
        from titan_ds.optim.asdt import ASDT
        opt = ASDT([p], lr=1e-5, density=density, state_dtype=state)
    opt.step()
    p.grad = torch.randn(numel)
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    opt.step()
    print(json.dumps({"case": case, "numel": numel, "bytes_per_element": (_status("VmHWM") - before) / numel}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 26)
    ap.add_argument("--out", default=str(ROOT / "results" / "step_temp.md"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.numel)
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="1048576", PYTHONPATH=str(ROOT))
    rows = []
    for case in CASES:
        out = subprocess.run([sys.executable, __file__, "--child", case, "--numel", str(a.numel)], env=env,
                             capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1])
    md = [f"### Optimizer step temporaries (one fp32 parameter of {a.numel:,} elements, 1 thread)", "",
          f"Command: `PYTHONPATH=$PWD python launch/bench/step_temp.py {' '.join(sys.argv[1:])}`", "",
          "| optimizer | bytes/element above the resident state |", "|---|---|"]
    md += [f"| {r['case']} | {r['bytes_per_element']:.2f} |" for r in rows]
    Path(a.out).write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
