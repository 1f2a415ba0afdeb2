"""Checkpoints of titan engines: a kill at any point leaves `latest` on a complete checkpoint; corruption is
detected by checksum with an error naming the file; nothing corrupt is loaded."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import titan_ds
from titan_ds.checkpoint import MANIFEST, CheckpointCorruptError, CheckpointSaveError, complete_tags
from tests.helpers.equal_run import TINY, ds_config
from tests.helpers.launch import ROOT, clean_env, run as run_group
from titan_ds.models import GPT


def _engine():
    torch.manual_seed(0)
    model = GPT(TINY)
    engine, *_ = titan_ds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                     config=ds_config(2, {}))
    return engine


def _step(engine, i):
    x = torch.randint(0, 256, (4, TINY.block_size), generator=torch.Generator().manual_seed(i))
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()


@pytest.fixture
def saved(dist_env, tmp_path):
    e = _engine()
    _step(e, 0)
    e.save_checkpoint(str(tmp_path), tag="a")
    _step(e, 1)
    e.save_checkpoint(str(tmp_path), tag="b")
    return e, tmp_path


def test_manifest_and_atomic_latest(saved):
    e, d = saved
    assert (d / "latest").read_text() == "b"
    assert set(complete_tags(d)) == {"a", "b"}
    files = json.loads((d / "b" / MANIFEST).read_text())["files"]
    assert any(f.endswith("optim_states.pt") for f in files) and any("model_states" in f for f in files)
    fresh = _engine()  # its own initial weights, which the load must replace by those of 'b' (latest)
    assert not all(torch.equal(a, b) for a, b in zip(e.module.parameters(), fresh.module.parameters()))
    path, _ = fresh.load_checkpoint(str(d))
    assert path is not None and Path(path).parent.name == "b", path
    assert all(torch.equal(a, b) for a, b in zip(e.module.parameters(), fresh.module.parameters()))


def test_corrupted_shard_is_detected_and_named(saved):
    e, d = saved
    shard = next((d / "b").glob("*optim_states.pt"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = [p.detach().clone() for p in e.module.parameters()]
    with pytest.raises(CheckpointCorruptError, match=rf"{shard.name}.*SHA-256.*tag= one of \['a'\]"):
        e.load_checkpoint(str(d))
    assert all(torch.equal(a, b) for a, b in zip(before, e.module.parameters()))  # nothing was loaded


def test_truncated_shard_is_detected(saved):
    e, d = saved
    shard = next((d / "b").glob("*model_states.pt"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        e.load_checkpoint(str(d))


def test_incomplete_tag_is_refused(saved):
    e, d = saved
    (d / "b" / MANIFEST).unlink()  # what a kill between the shards and the manifest leaves
    with pytest.raises(CheckpointCorruptError, match="did not complete"):
        e.load_checkpoint(str(d), tag="b")
    assert e.load_checkpoint(str(d), tag="a")[0] is not None


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a 4 MiB tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])


def _fill(folder: Path, leave: int) -> Path:
    """Write a ballast file until only ``leave`` bytes are free on ``folder``'s filesystem."""
    ballast = folder / "ballast"
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    with open(ballast, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return ballast


def test_disk_full_during_save_is_a_clear_error_and_loses_nothing(dist_env, small_disk):
    e = _engine()
    _step(e, 0)
    e.save_checkpoint(str(small_disk), tag="a")
    _step(e, 1)
    before = [p.detach().clone() for p in e.module.parameters()]
    state = [{k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for s in e.basic_optimizer.state.values()]
    ballast = _fill(small_disk, leave=16 * 1024)  # room for a few kB: not for a checkpoint (~700 kB)
    with pytest.raises(CheckpointSaveError) as info:
        e.save_checkpoint(str(small_disk), tag="b")
    msg = str(info.value)
    assert "checkpoint 'b' could not be written" in msg and str(small_disk) in msg
    assert "filesystem is full" in msg and "`latest` still names 'a', which is intact" in msg
    assert "partial tag was removed" in msg and "free space there or pass another save folder" in msg
    assert (small_disk / "latest").read_text() == "a" and not (small_disk / "b").exists()
    assert complete_tags(small_disk) == ["a"]
    # the engine's state is untouched: same parameters and optimizer state, and training goes on
    assert all(torch.equal(a, b) for a, b in zip(before, e.module.parameters()))
    after = list(e.basic_optimizer.state.values())
    assert len(state) == len(after) and all(torch.equal(v, a[k]) for s, a in zip(state, after) for k, v in s.items())
    _step(e, 2)
    ballast.unlink()  # space freed: the next save works, and loads
    e.save_checkpoint(str(small_disk), tag="c")
    assert (small_disk / "latest").read_text() == "c"
    fresh = _engine()
    path, _ = fresh.load_checkpoint(str(small_disk))
    assert path is not None
    assert all(torch.equal(a, b) for a, b in zip(e.module.parameters(), fresh.module.parameters()))
    assert fresh.load_checkpoint(str(small_disk), tag="a")[0] is not None  # the earlier one is still good


TRAIN = [sys.executable, "launch/train.py", "--deepspeed_config", "tests/configs/demo.json", "--layers", "2",
         "--width", "64", "--heads", "4", "--context", "32", "--micro-batch", "4", "--val-batches", "1",
         "--no-progress"]


def _losses(p):
    return {json.loads(l)["step"]: json.loads(l)["loss"] for l in Path(p).read_text().splitlines() if l.strip()}


@pytest.mark.slow
@pytest.mark.heavy
def test_kill9_at_random_points_then_resume_bit_exact(tmp_path):
    """kill -9 while training and checkpointing every step (so also mid-save); resume continues exactly."""
    steps = 150  # long enough that the kill always lands mid-run
    ref = tmp_path / "ref.jsonl"
    run_group(TRAIN + ["--steps", str(steps), "--metrics-out", str(ref)], cwd=ROOT, env=clean_env(), check=True,
                   capture_output=True, timeout=600)
    full = _losses(ref)
    rng = random.Random(1)
    for trial in range(2):
        ck = tmp_path / f"ck{trial}"
        proc = subprocess.Popen(TRAIN + ["--steps", str(steps), "--save-dir", str(ck), "--save-every", "1"],
                                cwd=ROOT, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while not (ck / "latest").exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(rng.uniform(0.5, 3.0))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        latest = (ck / "latest").read_text()
        assert (ck / latest / MANIFEST).is_file(), "latest must point at a complete checkpoint"
        out = tmp_path / f"resumed{trial}.jsonl"
        run_group(TRAIN + ["--steps", str(steps), "--load-dir", str(ck), "--metrics-out", str(out)], cwd=ROOT, env=clean_env(),
                       check=True, capture_output=True, timeout=600)
        resumed = _losses(out)
        start = int(latest.removeprefix("step"))
        assert proc.returncode == -signal.SIGKILL and start < steps
        assert min(resumed) == start + 1
        assert all(resumed[s] == full[s] for s in resumed), "resumed run must continue bit-exactly"
