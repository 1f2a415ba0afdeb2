"""``titan-ds report``: what is available on this machine; ``titan-ds plan``: which configuration fits a model
on this machine (:mod:`titan_ds.plan`); ``titan-ds gpu-check``: the shipped profiles on this machine's device
beside the CPU reference, the optimizer step's time and the peak memory (:mod:`titan_ds.gpu_check`);
``titan-ds clean-shm``: free the shared memory that earlier DeepSpeed CPU runs leaked."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import sys
from typing import Any

__all__ = ["main", "report"]

from .engine import PILLARS

PILLAR_MODULES = {p.key: p.module for p in PILLARS}  # one list of pillars: titan_ds.engine.PILLARS


def _version(mod: str) -> str:
    try:
        return importlib.import_module(mod).__version__
    except Exception as e:  # a missing optional package is a line of the report, not a crash
        return f"not usable ({type(e).__name__}: {e})"


def _pillars() -> dict[str, str]:
    out = {}
    for key, mod in PILLAR_MODULES.items():
        try:
            importlib.import_module(mod)
            out[key] = "available"
        except ModuleNotFoundError as e:
            out[key] = f"not usable: it needs {e.name}, which is not installed"
        except Exception as e:  # report why a pillar cannot load here
            out[key] = f"fails to import: {type(e).__name__}: {e}"
    return out


def _kernels() -> dict[str, Any]:
    return importlib.import_module("titan_ds.kernels._guard").describe()


def _disk(path: str, mb: int) -> dict[str, Any]:
    os.makedirs(path, exist_ok=True)
    usage = shutil.disk_usage(path)
    out: dict[str, Any] = {"path": os.path.abspath(path), "free_GB": round(usage.free / 1e9, 1)}
    out.update(importlib.import_module("titan_ds.hms.diskprobe").measure_disk(path, mb))
    return out


def _aio() -> str:
    try:
        from .plan import aio_buildable
        return "buildable" if aio_buildable() else "not buildable here (needs libaio-dev); HMS does not need it"
    except Exception as e:  # the op builder itself may fail to import on exotic setups
        return f"unknown ({type(e).__name__}: {e})"


def report(nvme_path: str = "./titan_storage", probe_mb: int = 64) -> dict[str, Any]:
    import torch
    from deepspeed.accelerator import get_accelerator
    return {
        "python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
        "titan_ds": _version("titan_ds"), "torch": torch.__version__, "deepspeed": _version("deepspeed"),
        "tensorly": _version("tensorly"), "triton": _version("triton"),
        "accelerator": get_accelerator().device_name(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "kernels": _kernels(), "deepspeed_aio_op": _aio(),
        "hms_io": ("titan's I/O thread pool (os.preadv/pwritev, O_DIRECT where the folder accepts it, an XXH3-64 "
                   "checksum per 4 MiB on the I/O threads); DeepSpeed's async_io op is not used by HMS, built or not"),
        "nvme": _disk(nvme_path, probe_mb),
        "pillars": _pillars(),
    }


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _plan_arguments(p) -> None:
    p.add_argument("--model", required=True, help="gpt:LAYERSxWIDTH or hf:PATH_OR_CONFIG")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--gpu-mem", default=None, help="device memory per rank (e.g. 80G); omit on a CPU-only machine")
    p.add_argument("--cpu-mem", required=True, help="DRAM for the job (e.g. 24G)")
    p.add_argument("--disk", default="0", help="free disk for HMS (e.g. 60G)")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--nvme-path", default="./titan_storage", help="titan.hms.nvme_path written into an HMS config")
    p.add_argument("--out", default=None, help="write the best fitting config here (ds_config json)")
    p.add_argument("--aio", choices=["auto", "yes", "no"], default="auto",
                   help="whether DeepSpeed's async_io op (libaio) builds on the target machine; auto: check this one "
                        "(ZeRO-Infinity's candidate needs it)")
    p.add_argument("--json", action="store_true", help="print the candidates as JSON")


def _plan(a) -> int:
    """``titan-ds plan``: the candidates' table (titan_ds.plan), and the best fitting config written."""
    from pathlib import Path

    from .plan import (aio_buildable, candidate_config, format_table, model_spec, optimizer_dram_budget, parse_size,
                       plan)
    m = model_spec(a.model, a.seq)
    aio = aio_buildable() if a.aio == "auto" else a.aio == "yes"
    cands, best = plan(m, seq=a.seq, micro=a.micro_batch, cpu_mem=parse_size(a.cpu_mem), disk=parse_size(a.disk),
                       gpu_mem=None if a.gpu_mem is None else parse_size(a.gpu_mem), ranks=a.ranks, aio=aio)
    if a.json:
        print(json.dumps([{"mode": c.mode, "fits": c.fits, "why": c.why, "device": c.device, "dram": c.dram,
                           "disk": c.disk, "calibrated": c.calibrated} for c in cands], indent=1))
    else:
        print(format_table(m, cands, a.ranks))
    if best is None:
        print("\nnothing fits: more DRAM or disk, a smaller model, or a shorter sequence")
        return 1
    print(f"\nbest fitting: {best.mode} ({best.description})")
    resident = optimizer_dram_budget(best, parse_size(a.cpu_mem), a.ranks)
    if resident:
        print(f"titan.hms.optimizer_dram_mb {resident}: optimizer sub-groups kept in DRAM between steps, half of "
              f"what the cap leaves beside the predicted peak ({best.dram_peak / 2**30:.2f} GiB per rank)")
    if a.out:
        cfg = candidate_config(best.mode, nvme_path=a.nvme_path, micro_batch=a.micro_batch,
                               optimizer_dram_mb=resident)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(cfg, indent=1) + "\n")
        extra = f" (launch/train.py {' '.join(m.gpt_args)})" if m.gpt_args else ""
        print(f"wrote {a.out}{extra}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="titan-ds")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="versions, accelerator, Triton, aio op, disk speed, available pillars")
    r.add_argument("--nvme-path", default="./titan_storage")
    r.add_argument("--probe-mb", type=int, default=64)
    r.add_argument("--json", action="store_true")
    pl = sub.add_parser("plan", help="predicted bytes per tier of each candidate config; writes the best that fits")
    _plan_arguments(pl)
    from . import gpu_check
    gc = sub.add_parser("gpu-check", help="each shipped profile on this machine's device beside the CPU reference "
                                          "(losses within a stated tolerance), the optimizer step's time, the peak "
                                          "memory; a table and JSON (--out)")
    gpu_check.add_arguments(gc)
    c = sub.add_parser("clean-shm", help="remove /dev/shm files that earlier DeepSpeed CPU runs leaked "
                                         "(deepspeed_allreduce_buffer_*, 66 MB per rank and run; only unused ones)")
    c.add_argument("--dry-run", action="store_true", help="list them, remove nothing")
    a = p.parse_args(argv)
    if a.cmd == "plan":
        try:
            return _plan(a)
        except (ValueError, FileNotFoundError) as e:
            print(f"titan-ds plan: {e}", file=sys.stderr)
            return 2
    if a.cmd == "gpu-check":
        return gpu_check.main(args=a)
    if a.cmd == "clean-shm":
        from .utils import stale_deepspeed_shm, unlink_quietly
        stale = stale_deepspeed_shm()
        size = sum(_size(f) for f in stale)
        if not a.dry_run:
            unlink_quietly(stale)
        verb = "would remove" if a.dry_run else "removed"
        print(f"titan-ds clean-shm: {verb} {len(stale)} leaked DeepSpeed shared-memory file(s) ({size / 2**20:.0f} MiB)")
        for f in stale:
            print(f"  {f}")
        return 0
    if a.cmd == "report":
        rep = report(a.nvme_path, a.probe_mb)
        if a.json:
            print(json.dumps(rep, indent=1))
        else:
            for k, v in rep.items():
                if isinstance(v, dict):
                    print(f"{k}:")
                    for kk, vv in v.items():
                        print(f"  {kk}: {vv}")
                else:
                    print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
