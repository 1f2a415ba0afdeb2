"""How far apart `titan-ds gpu-check`'s runs land when only rounding differs, against broken runs: the measurement
behind its tolerances (titan_ds.gpu_check.TOLERANCE; docs/gpu.md quotes the table).

    python launch/bench/gpu_check_tolerance.py --steps 20

Every run is gpu-check's training run (its tiny GPT, the profile's ds_config through titan_ds.initialize, seed 0,
micro-batch 4) on the CPU, in one process, and is compared with the same profile's reference run
(``TITAN_KERNELS=reference``) by gpu-check's own measure, the largest relative loss difference over the steps:

* rounding only: ``sdpa``, the default kernels (attention by torch's CPU SDPA kernel instead of the reference's
  tiled loop: the same attention in another summation order), for the four profiles with tiled attention;
  ``rounding seed 1``, titan_memory's bf16 stochastic rounding from other draws (as a CUDA generator's are);
* broken: ``other data`` (the batches of data seed 1) and ``lr x2``, titan_balanced.

Prints a markdown table; not timed, no file written.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from titan_ds import gpu_check as gc  # noqa: E402


def _set(key: str, value):
    return lambda cfg: cfg["titan"]["optimizer"].__setitem__(key, value)


def cases() -> list[tuple[str, str, dict]]:
    """(profile, what differs, the job's changes) of each compared run."""
    out = []
    for p in ("titan_exact", "titan_balanced", "titan_lean", "titan_memory"):
        out.append((p, "sdpa (rounding only)", {"kernels": None}))
    out.append(("titan_memory", "rounding seed 1 (rounding only)", {"mutate": _set("rounding_seed", 1)}))
    out.append(("titan_balanced", "other data (broken)", {"data_seed": 1}))
    out.append(("titan_balanced", "lr x2 (broken)", {"mutate": _set("lr", 0.002)}))
    return out


def _job(profile: str, steps: int, kernels: "str | None" = "reference", mutate=None, data_seed: int = 0) -> dict:
    """gpu-check's training job of ``profile`` (TITAN_KERNELS=``kernels``), its config changed by ``mutate``."""
    cfg = gc.load_profile(profile, gc.CONFIG_DIR, 4)
    if mutate is not None:
        mutate(cfg)
    return {"kind": "train", "config": cfg, "steps": steps, "seed": 0, "data_seed": data_seed, "model": gc.MODEL,
            "kernels": kernels}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    profiles = sorted({c[0] for c in cases()})
    jobs = [_job(prof, a.steps) for prof in profiles] + [_job(prof, a.steps, **change) for prof, _, change in cases()]
    res = gc._children({"tolerance": ({}, jobs)}, Path(tempfile.mkdtemp()), 3600)["tolerance"]
    ref = dict(zip(profiles, res[:len(profiles)]))
    print(f"| profile | run | max rel diff over {a.steps} steps | at step 2 | tolerance |")
    print("|---|---|---|---|---|")
    for (prof, what, _), r in zip(cases(), res[len(profiles):]):
        if "error" in r or "error" in ref[prof]:
            print(f"| {prof} | {what} | failed: {r.get('error') or ref[prof]['error']} | | |")
            continue
        lr, lf = r["losses"], ref[prof]["losses"]
        tol = gc.TOLERANCE[gc.weight_dtype(gc.load_profile(prof, gc.CONFIG_DIR, 4))]
        print(f"| {prof} | {what} | {gc.rel_diff(lr, lf):.2e} | {abs(lr[1] - lf[1]) / lf[1]:.2e} | {tol:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
