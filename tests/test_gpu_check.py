"""`titan-ds gpu-check` on the CPU with tiny settings: the report's fields, the plain statement that no GPU was
used, and a broken run (the reference trained on other data) failing its tolerance with exit status 1."""
import json

import pytest
import torch

from titan_ds import cli, gpu_check

TINY = ["--steps", "2", "--micro-batch", "2", "--time-numel", "4096", "--time-steps", "1"]


def test_profiles_load_with_their_auto_values_filled():
    for name in gpu_check.PROFILES:
        cfg = gpu_check.load_profile(name, gpu_check.CONFIG_DIR, 2)
        assert cfg["train_micro_batch_size_per_gpu"] == 2 and "auto" not in json.dumps(cfg), name
    assert gpu_check.weight_dtype(gpu_check.load_profile("titan_memory", gpu_check.CONFIG_DIR, 2)) == "bf16"
    assert gpu_check.weight_dtype(gpu_check.load_profile("titan_balanced", gpu_check.CONFIG_DIR, 2)) == "fp32"
    assert gpu_check.rel_diff([1.0, 2.0], [1.0, 2.002]) == pytest.approx(0.002 / 2.002)
    assert gpu_check.rel_diff([1.0, float("nan")], [1.0, 2.0]) == float("inf")
    assert gpu_check.rel_diff([1.0], [1.0, 2.0]) == float("inf")


def test_bad_requests_are_refused_by_name(tmp_path, capsys):
    assert cli.main(["gpu-check", "--profiles", "titan_nope", "--out", str(tmp_path / "x.json")]) == 2
    assert "titan_nope" in capsys.readouterr().err
    assert cli.main(["gpu-check", "--profiles", "titan_exact", "--configs", str(tmp_path),
                     "--out", str(tmp_path / "x.json")]) == 2
    assert "--configs" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only report")
def test_gpu_check_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    rc = cli.main(["gpu-check", "--profiles", "titan_balanced,titan_memory", *TINY, "--out", str(out)])
    screen = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rc == 0, screen
    assert rep["gpu"] is False and "NO GPU WAS USED" in rep["note"] and "NO GPU WAS USED" in screen
    assert rep["ok"] is True and rep["tolerance"]["fp32"] == gpu_check.TOLERANCE["fp32"]
    assert rep["versions"]["deepspeed"] == "0.19.8" and rep["settings"]["steps"] == 2
    rows = {r["profile"]: r for r in rep["profiles"]}
    assert set(rows) == {"titan_balanced", "titan_memory"}
    for name, r in rows.items():
        assert len(r["losses_device"]) == len(r["losses_reference"]) == 2, name
        assert r["ok"] and r["max_rel_diff"] <= r["tolerance"] and r["peak_memory_bytes"] > 0, name
        assert r["device_run_on"] == "cpu" and "RSS" in r["peak_memory_kind"], name
    assert rows["titan_memory"]["weights"] == "bf16" and "fp32 only" in rows["titan_memory"]["kernels"]
    assert "interpreter" in rows["titan_balanced"]["kernels"]
    timed = {r["optimizer"]: r for r in rep["optimizer_step"]["rows"]}
    assert {"titan_balanced", "titan_memory", "torch AdamW fused"} <= set(timed)
    assert all(r["ms"] > 0 for r in timed.values()), timed
    assert timed["torch AdamW fused"]["x_adamw_fused"] == 1.0


def test_a_broken_profile_fails(tmp_path, monkeypatch, capsys):
    """The reference side trains on other batches (what a wrong kernel on the device looks like from here): the
    losses leave the tolerance and gpu-check exits 1, saying so."""
    monkeypatch.setattr(gpu_check, "_reference_spec", lambda spec: dict(spec, data_seed=spec["data_seed"] + 1))
    out = tmp_path / "gpu_check.json"
    rc = cli.main(["gpu-check", "--profiles", "titan_balanced", *TINY, "--out", str(out)])
    screen = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rc == 1 and rep["ok"] is False and "FAILED" in screen
    row = rep["profiles"][0]
    assert not row["ok"] and row["max_rel_diff"] > row["tolerance"] and "errors" not in row
