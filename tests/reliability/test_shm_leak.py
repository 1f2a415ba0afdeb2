"""DeepSpeed 0.19.8 leaks a 66 MB /dev/shm file per CPU process and run (its shm all-reduce never unlinks its
buffer; hundreds of runs fill the machine's RAM). titan_ds.initialize releases it, so that even a process killed
with -9 leaves nothing behind; ``titan-ds clean-shm`` frees what earlier runs leaked, never a file in use."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.launch import ROOT, clean_env
from titan_ds import cli
from titan_ds.utils import SHM_DIR, free_port, stale_deepspeed_shm

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm on this system")

CHILD = r"""
import os, sys, time, torch
import deepspeed
import titan_ds
from tests.helpers.equal_run import TINY, ds_config
from titan_ds.models import GPT
path = sys.argv[1]
deepspeed.init_distributed()
print("created_by_deepspeed", os.path.exists(path), flush=True)
model = GPT(TINY)
engine, *_ = titan_ds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=ds_config(0, {}))
print("after_titan_initialize", os.path.exists(path), flush=True)
time.sleep(600)  # killed with -9 here
"""


def test_initialize_releases_the_shm_file_even_for_a_killed_process():
    port = free_port()
    path = os.path.join(SHM_DIR, f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_0")
    env = dict(clean_env(), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, path], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        seen = {}
        deadline = time.time() + 600
        while len(seen) < 2 and time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            key, _, val = line.strip().partition(" ")
            if key in ("created_by_deepspeed", "after_titan_initialize"):
                seen[key] = val
        assert seen == {"created_by_deepspeed": "True", "after_titan_initialize": "False"}, seen
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not os.path.exists(path)


def test_clean_shm_removes_only_unused_leaked_files(capsys):
    base = f"deepspeed_allreduce_buffer_{os.getuid()}_test.invalid_{os.getpid()}"
    leaked, held = os.path.join(SHM_DIR, base + "_0"), os.path.join(SHM_DIR, base + "_1")
    for p in (leaked, held):
        with open(p, "wb") as f:
            f.write(b"\0" * 4096)
    fd = os.open(held, os.O_RDONLY)  # a live job still uses this one
    try:
        stale = stale_deepspeed_shm()
        assert leaked in stale and held not in stale
        assert cli.main(["clean-shm", "--dry-run"]) == 0
        assert "would remove" in capsys.readouterr().out and os.path.exists(leaked)
        assert cli.main(["clean-shm"]) == 0
        out = capsys.readouterr().out
        assert "removed" in out and leaked in out
        assert not os.path.exists(leaked) and os.path.exists(held)
    finally:
        os.close(fd)
        for p in (leaked, held):
            if os.path.exists(p):
                os.unlink(p)
