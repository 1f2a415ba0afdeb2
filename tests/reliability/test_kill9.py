"""kill -9 in the middle of an HMS swap write (1 rank, ZeRO-3 + titan HMS) and of a checkpoint shard on one of
2 ranks (ZeRO-2 + ASDT + HGE compression), and of a whole 2-rank job at a random moment: the next launch resumes
from the last complete checkpoint and continues bit-exactly as the uninterrupted run did. A half-written file
is never used; the killed processes leave no shared memory behind."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.launch import ROOT, clean_env, run as run_group
from titan_ds.checkpoint import MANIFEST
from titan_ds.utils import SHM_DIR, free_port

SMALL = ["--layers", "2", "--width", "64", "--heads", "4", "--context", "32", "--micro-batch", "4",
         "--val-batches", "1", "--no-progress"]
KILL = str(ROOT / "tests" / "helpers" / "kill_during.py")
DS = str(Path(sys.executable).with_name("deepspeed"))


def _losses(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows}


def _one_rank_env(port: int) -> dict:
    return dict(clean_env(), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port))


def _no_shm_left(port: int) -> bool:
    if not os.path.isdir(SHM_DIR):
        return True
    return not any(n.startswith(f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_") for n in os.listdir(SHM_DIR))


def _assert_resumes_exactly(ck: Path, ref: dict[int, float], resumed: dict[int, float], steps: int) -> int:
    latest = (ck / "latest").read_text()
    assert (ck / latest / MANIFEST).is_file(), "latest must name a complete checkpoint"
    start = int(latest.removeprefix("step"))
    assert min(resumed) == start + 1 and max(resumed) == steps
    diff = {s: (ref[s], resumed[s]) for s in resumed if ref[s] != resumed[s]}
    assert not diff, f"resumed run must continue bit-exactly: {diff}"
    return start


@pytest.mark.slow
@pytest.mark.parametrize("grads", ["mapped", "store"])
def test_kill9_during_hms_write_then_resume_bit_exact(tmp_path, grads):
    cfg = json.loads((ROOT / "ds_configs" / "hms.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 4
    cfg["titan"]["hms"].update(nvme_path=str(tmp_path / "nvme"), dram_cache_mb=1)  # every step goes to disk
    # "store": titan.hms.gradient_store, killed in the middle of a gradient piece's write (the 100th), which
    # lands in backward between two checkpoints
    kill_at = ["--nth", "300"]
    if grads == "store":
        cfg["titan"]["hms"].update(gradient_buffer="disk", gradient_store=True)
        kill_at = ["--nth", "100", "--name-contains", "%2Fgrad%2F"]
    (tmp_path / "hms.json").write_text(json.dumps(cfg))
    steps = 12
    train = ["launch/train.py", "--deepspeed_config", str(tmp_path / "hms.json"), *SMALL, "--steps", str(steps)]
    run_group([sys.executable, *train, "--metrics-out", str(tmp_path / "ref.jsonl")], cwd=ROOT,
              env=_one_rank_env(free_port()), check=True, capture_output=True, timeout=900)
    ck, swap = tmp_path / "ck", tmp_path / "nvme" / "titan_hms" / "rank0"
    # tens of swap-file writes a step here (about 40 since the gradients are read in place, 100 before): the 300th
    # lands after a checkpoint and before the last step
    port = free_port()
    killed = run_group([sys.executable, KILL, "--at", "hms_write", *kill_at, "--", *train,
                        "--save-dir", str(ck), "--save-every", "2"], cwd=ROOT, env=_one_rank_env(port),
                       capture_output=True, text=True, timeout=900)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    torn = killed.stderr.split("KILL_DURING hms_write ")[1].split()[0]
    # HMS rewrites a swap file of the same size in place (TensorStore overwrite_in_place), else writes a new one
    # under a temporary name: either way a torn file is left in the swap folder, which a new run discards
    assert os.path.getsize(torn) > 0 and Path(torn).parent == swap, "the kill must leave a half-written swap file"
    assert _no_shm_left(port)
    out = tmp_path / "resumed.jsonl"
    run_group([sys.executable, *train, "--load-dir", str(ck), "--metrics-out", str(out)], cwd=ROOT,
              env=_one_rank_env(free_port()), check=True, capture_output=True, timeout=900)
    start = _assert_resumes_exactly(ck, _losses(tmp_path / "ref.jsonl"), _losses(out), steps)
    assert start % 2 == 0 and 2 <= start < steps  # the last complete checkpoint before the kill
    assert not any(".tmp." in n for n in os.listdir(swap)), "the torn swap file must be gone, never read"


@pytest.mark.slow
@pytest.mark.heavy
def test_kill9_on_two_ranks_mid_checkpoint_and_at_random_then_resume_bit_exact(tmp_path):
    steps = 20  # compression warms up for 10 steps: the checkpoints after step 10 carry HGE residuals
    train = ["launch/train.py", "--deepspeed_config", "tests/configs/titan_2rank.json", *SMALL, "--steps", str(steps)]
    ref = tmp_path / "ref.jsonl"
    r = run_group([DS, "--num_gpus", "2", "--master_port", str(free_port()), *train, "--metrics-out", str(ref)],
                  cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    full = _losses(ref)

    # a) rank 1 dies halfway through its 5th checkpoint file (the save of step 15); the launcher ends rank 0
    ck, port = tmp_path / "ck_a", free_port()
    k = run_group([DS, "--num_gpus", "2", "--master_port", str(port), KILL, "--at", "checkpoint_file", "--nth", "5",
                   "--rank", "1", "--", *train, "--save-dir", str(ck), "--save-every", "3"],
                  cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert k.returncode != 0 and "KILL_DURING checkpoint_file" in k.stderr + k.stdout, k.stderr[-3000:]
    assert "exits with return code = -9" in k.stdout + k.stderr
    assert (ck / "step15").is_dir() and not (ck / "step15" / MANIFEST).exists()  # the torn save is incomplete
    assert _no_shm_left(port)
    out = tmp_path / "resumed_a.jsonl"
    r = run_group([DS, "--num_gpus", "2", "--master_port", str(free_port()), *train, "--load-dir", str(ck),
                   "--metrics-out", str(out)], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _assert_resumes_exactly(ck, full, _losses(out), steps) == 12

    # b) the whole job (launcher and both ranks) is killed at a random moment while saving every step
    ck, port = tmp_path / "ck_b", free_port()
    proc = subprocess.Popen([DS, "--num_gpus", "2", "--master_port", str(port), *train, "--save-dir", str(ck),
                             "--save-every", "1"], cwd=ROOT, env=clean_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 600
        while not (ck / "latest").exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(random.Random(3).uniform(0.5, 2.5))
        assert proc.poll() is None, "the job ended before the kill; make it longer"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert _no_shm_left(port)
    out = tmp_path / "resumed_b.jsonl"
    r = run_group([DS, "--num_gpus", "2", "--master_port", str(free_port()), *train, "--load-dir", str(ck),
                   "--metrics-out", str(out)], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _assert_resumes_exactly(ck, full, _losses(out), steps) < steps
