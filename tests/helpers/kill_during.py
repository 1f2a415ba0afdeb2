"""Fault injector for the kill tests: run a training script and SIGKILL this process in the middle of a chosen
write, leaving the torn file on disk exactly as a crash would.

    python tests/helpers/kill_during.py --at {hms_write,checkpoint_file} --nth N [--rank R] -- SCRIPT ARGS...

``hms_write``: the N-th file the HMS store writes (optimizer state or parameters swapped out); half of its
payload reaches the disk. ``checkpoint_file``: the N-th file DeepSpeed's checkpoint engine saves; half of its
bytes reach the disk. Only rank ``R`` (default 0) is killed; under the ``deepspeed`` launcher the launcher then
takes the other ranks down. Writes ``KILL_DURING <point> <path>`` to stderr just before the kill.
"""
from __future__ import annotations

import argparse
import io
import os
import runpy
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _die(point: str, path: str) -> None:
    print(f"KILL_DURING {point} {path}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_hms(nth: int, contains: str = "") -> None:
    from titan_ds.hms.store import TensorStore
    original = TensorStore._write_file
    calls = [0]

    def write_file(self, path, meta, hlen, view, *, durable):
        if contains not in os.path.basename(path):  # counts only the files named so (--name-contains)
            return original(self, path, meta, hlen, view, durable=durable)
        calls[0] += 1
        if calls[0] < nth:
            return original(self, path, meta, hlen, view, durable=durable)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            half = view[: max(1, view.numel() // 2)].numpy().tobytes()
            os.pwrite(fd, half, hlen)  # the payload's first half, no header yet: a torn swap file
            os.fsync(fd)
        finally:
            os.close(fd)
        _die("hms_write", path)

    TensorStore._write_file = write_file


def _arm_checkpoint(nth: int) -> None:
    import torch
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    original = TorchCheckpointEngine.save
    calls = [0]

    def save(self, state_dict, path, *args, **kwargs):
        calls[0] += 1
        if calls[0] < nth:
            return original(self, state_dict, path, *args, **kwargs)
        buf = io.BytesIO()
        torch.save(state_dict, buf)
        data = buf.getvalue()
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])  # half a shard on disk
            f.flush()
            os.fsync(f.fileno())
        _die("checkpoint_file", path)

    TorchCheckpointEngine.save = save


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit(__doc__)
    cut = argv.index("--")
    own, script_argv = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser()
    ap.add_argument("--at", choices=["hms_write", "checkpoint_file"], required=True)
    ap.add_argument("--nth", type=int, required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--name-contains", default="",
                    help="hms_write: count only the store files whose name contains this (a quoted key: "
                         "%%2Fgrad%%2F for the gradient pieces of titan.hms.gradient_store)")
    ap.add_argument("--local_rank", default=None)  # the deepspeed launcher puts it first
    a = ap.parse_args(own)
    if int(os.environ.get("RANK", "0")) == a.rank:
        if a.at == "hms_write":
            _arm_hms(a.nth, a.name_contains)
        else:
            _arm_checkpoint(a.nth)
    script, args = script_argv[0], script_argv[1:]
    if a.local_rank is not None:
        args = [f"--local_rank={a.local_rank}", *args]
    sys.path.insert(0, ROOT)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
