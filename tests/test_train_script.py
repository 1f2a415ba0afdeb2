"""launch/train.py end to end: 1 rank, checkpoint resume is bit-exact; 2 ranks run (slow)."""
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import ROOT, clean_env, run_deepspeed, run as run_group

TINY = ["--layers", "2", "--width", "64", "--heads", "4", "--context", "32", "--micro-batch", "4",
        "--val-batches", "2", "--no-progress"]


# Validation loss drops from step 0 (measured, seed 0: 5.5711 untrained; 1 rank -0.039 after 6 steps; 2 ranks
# -0.149 after 12); each bound is about half the measured drop, and an untrained model (5.57 < 5.6) meets neither.
DROP_6_STEPS, DROP_12_STEPS = 0.02, 0.07


def _train(tmp, *extra, cfg="tests/configs/demo.json"):
    cmd = [sys.executable, "launch/train.py", "--deepspeed_config", cfg, *TINY, *extra]
    # clean_env() runs it on one intra-op thread: the resume test compares runs bit for bit
    r = run_group(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def _losses(path):
    return [json.loads(l)["loss"] for l in Path(path).read_text().splitlines()]


def test_resume_is_bit_exact(tmp_path):
    _train(tmp_path, "--steps", "6", "--val-every", "100", "--metrics-out", str(tmp_path / "full.jsonl"),
           "--summary-out", str(tmp_path / "new" / "full.json"),  # folders created
           "--plot", str(tmp_path / "new" / "p.png"))
    _train(tmp_path, "--steps", "3", "--save-dir", str(tmp_path / "ck"), "--metrics-out", str(tmp_path / "a.jsonl"))
    _train(tmp_path, "--steps", "6", "--load-dir", str(tmp_path / "ck"), "--metrics-out", str(tmp_path / "b.jsonl"),
           "--summary-out", str(tmp_path / "resumed.json"))
    full = _losses(tmp_path / "full.jsonl")
    assert _losses(tmp_path / "a.jsonl") == full[:3]
    assert _losses(tmp_path / "b.jsonl") == full[3:]  # exact float equality, not approx
    a, b = json.loads((tmp_path / "new" / "full.json").read_text()), json.loads((tmp_path / "resumed.json").read_text())
    assert a["val_loss"] == b["val_loss"]  # the step-0 validation of the full run changed nothing
    (s0, v0), (s6, v6) = a["val_history"]
    assert (s0, s6) == (0, 6) and v6 == a["val_loss"]
    assert v6 < v0 - DROP_6_STEPS, (v0, v6)
    assert (tmp_path / "new" / "p.png").stat().st_size > 10_000
    monitor = ROOT / "results" / "tmp" / "monitor" / "demo" / "Train_loss.csv"  # tests/configs/demo.json's csv_monitor
    assert monitor.is_file() and len(monitor.read_text().splitlines()) >= 3
    mem = a["memory"]
    for k in ("parameters", "gradients", "optimizer_state", "activations", "peak_rss"):
        assert mem[k] > 0, k


@pytest.mark.slow
def test_two_ranks_zero2(tmp_path):
    r = run_deepspeed("launch/train.py", "--deepspeed_config", "tests/configs/demo.json", *TINY, "--steps", "12",
                      "--val-every", "100", "--summary-out", str(tmp_path / "s.json"), num_ranks=2)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    s = json.loads((tmp_path / "s.json").read_text())
    (s0, v0), (s12, v12) = s["val_history"]
    assert s["world_size"] == 2 and (s0, s12) == (0, 12) and v12 == s["val_loss"]
    assert v12 < v0 - DROP_12_STEPS, (v0, v12)


def test_gradient_accumulation_steps_take_the_same_sequences(tmp_path):
    """gradient_accumulation_steps=2 with half the micro-batch: each step splits the same sequences in two, so the
    losses and the final validation (on the same batches) are those of one micro-batch of all of them, to
    rounding, with the saved activations of half the sequences. (Without TRD: a recomputed block saves its
    reconstructed TRD weights again in backward, a per-step term that does not halve with the sequences.)"""
    cfg = json.loads((ROOT / "tests" / "configs" / "demo.json").read_text())
    cfg.pop("csv_monitor", None)
    cfg["titan"].pop("trd")
    runs = {}
    for gas, mb in ((1, 4), (2, 2)):
        path = tmp_path / f"gas{gas}.json"
        path.write_text(json.dumps({**cfg, "gradient_accumulation_steps": gas}))
        _train(tmp_path, "--steps", "4", "--micro-batch", str(mb), "--metrics-out", str(tmp_path / f"{gas}.jsonl"),
               "--summary-out", str(tmp_path / f"{gas}.json"), cfg=str(path))
        runs[gas] = (_losses(tmp_path / f"{gas}.jsonl"), json.loads((tmp_path / f"{gas}.json").read_text()))
    (l1, s1), (l2, s2) = runs[1], runs[2]
    assert len(l1) == len(l2) == 4
    assert l1 == pytest.approx(l2, rel=1e-4)  # from step 2 on: the same updates were applied, once a step
    assert s1["val_loss"] == pytest.approx(s2["val_loss"], rel=1e-4)
    assert s2["memory"]["activations"] < 0.6 * s1["memory"]["activations"]


def test_titan_memory_resume_is_bit_exact(tmp_path):
    """ds_configs/titan_memory.json (bf16 weights with stochastic rounding, 4-bit ASDT state, 4 micro-batches a
    step): 3 steps, a checkpoint, 3 more give the losses of 6 unbroken steps bit for bit (the rounding's
    generator is in the checkpoint)."""
    cfg = "ds_configs/titan_memory.json"
    mb = ["--micro-batch", "1"]
    _train(tmp_path, *mb, "--steps", "6", "--metrics-out", str(tmp_path / "full.jsonl"), cfg=cfg)
    _train(tmp_path, *mb, "--steps", "3", "--save-dir", str(tmp_path / "ck"), "--metrics-out",
           str(tmp_path / "a.jsonl"), cfg=cfg)
    _train(tmp_path, *mb, "--steps", "6", "--load-dir", str(tmp_path / "ck"), "--metrics-out",
           str(tmp_path / "b.jsonl"), "--summary-out", str(tmp_path / "b.json"), cfg=cfg)
    full = _losses(tmp_path / "full.jsonl")
    assert _losses(tmp_path / "a.jsonl") == full[:3]
    assert _losses(tmp_path / "b.jsonl") == full[3:]
    mem = json.loads((tmp_path / "b.json").read_text())["memory"]
    assert mem["parameters"] == mem["gradients"]  # bf16 weights and bf16 gradients, no fp32 copy of either


def _train_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("titan_train_script", ROOT / "launch" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_metrics_are_read_once_per_logging_window(tmp_path, dist_env, monkeypatch):
    """Every step gets its record, but its loss and titan's per-step metrics (device tensors) are read to the host
    only on the logging steps: every --log-every steps and the last, in whole windows (one wait for the device per
    window on a GPU, none in the steps between)."""
    train = _train_module()
    windows, counts, real = [], {}, train.log_records

    def spy(records, *a):
        windows.append([r["step"] for r in records])
        assert all(isinstance(r["loss"], torch.Tensor) for r in records)  # not read before the logging step
        counts.update({r["step"]: r["titan"]["asdt_changed_elements"] for r in records})
        return real(records, *a)

    monkeypatch.setattr(train, "log_records", spy)
    out = tmp_path / "m.jsonl"
    summary = train.main(["--deepspeed_config", "tests/configs/demo.json", *TINY, "--steps", "5", "--log-every", "2",
                          "--metrics-out", str(out)])
    assert windows == [[1, 2], [3, 4], [5]]
    # ASDT's count of changed elements: a device tensor until logged (under ZeRO it lags one step, and BSPS's
    # first step is a probe that changes nothing: the int 0 it starts from, for steps 1 and 2)
    assert all(isinstance(counts[s], torch.Tensor) for s in (3, 4, 5)), counts
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5]
    assert all(isinstance(r["loss"], float) and isinstance(r["asdt_changed_elements"], int) for r in lines)
    assert summary["titan_metrics"]["asdt_changed_elements"] == lines[-1]["asdt_changed_elements"] > 0


def test_log_every_must_be_positive():
    with pytest.raises(SystemExit, match="--log-every must be >= 1"):
        _train_module().main(["--deepspeed_config", "tests/configs/demo.json", "--log-every", "0"])
