"""titan.hms wiring: nvme_path validation, the ZeRO-3 / nvme ds_config it requires, shipped configs."""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers.configs import config_path
from titan_ds.config import HMSConfig, TitanConfig, TitanConfigError
from titan_ds.hms.install import _make_folder, configure_ds_config, folder_problems

ROOT = Path(__file__).resolve().parents[2]
BOUND_KEYS = ("zero_optimization.reduce_bucket_size=", "zero_optimization.stage3_", "zero_optimization.sub_group_size=")


def test_folder_checked_without_writing_then_created_and_removed_on_rollback(tmp_path):
    from titan_ds.transaction import Transaction
    p = tmp_path / "a" / "b"
    assert folder_problems(str(p), "titan.hms.nvme_path") == [] and not (tmp_path / "a").exists()  # stat only
    txn = Transaction(torch.nn.Linear(1, 1))
    assert _make_folder(str(p), "titan.hms.nvme_path", txn) == str(p) and p.is_dir()
    txn.rollback()
    assert not (tmp_path / "a").exists()  # the topmost folder titan created is gone, tmp_path stays


def test_folder_that_is_a_file_is_rejected_by_key(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert "not a folder" in folder_problems(str(f), "titan.hms.nvme_path")[0]
    assert folder_problems(str(f / "below"), "titan.hms.nvme_path")[0].startswith("titan.hms.nvme_path=")


def test_uncreatable_folder_is_rejected_by_key():
    # procfs refuses mkdir even to root, which no stat/access check sees: caught when apply creates it
    with pytest.raises(TitanConfigError, match=r"titan.hms.nvme_path=.*cannot be created"):
        _make_folder("/proc/titan_cannot_exist/x", "titan.hms.nvme_path")


def test_read_only_folder_is_rejected_by_key(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root); root ignores chmod")
    try:
        msg = folder_problems(str(mnt), "titan.hms.spill_tiers[0].path")
        assert len(msg) == 1 and msg[0].startswith("titan.hms.spill_tiers[0].path=") and "not writable" in msg[0]
    finally:
        subprocess.run(["umount", str(mnt)])


def test_ds_config_made_zero3_nvme_and_flags_set():
    from titan_ds import rules
    from titan_ds.pillar import View
    ds = {"train_micro_batch_size_per_gpu": 2}
    changed = configure_ds_config(ds, "/x")
    z = ds["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"]["device"] == "nvme" and z["offload_optimizer"]["device"] == "nvme"
    assert z["offload_param"]["max_in_cpu"] == 0 and z["offload_param"]["nvme_path"] == "/x"
    assert "zero_optimization.stage=3" in changed
    titan = TitanConfig(hms={"nvme_path": "/x"})
    flags = {k: v for k, v, _ in rules.required_ds_flags(View.of(titan, {}, torch.nn.Linear(1, 1),
                                                                 optimizer=object()))}
    assert flags == {"zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True}
    assert rules.required_ds_flags(View.of(titan, {}, torch.nn.Linear(1, 1))) == []  # DeepSpeed's own optimizer
    ds2 = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "max_in_cpu": 1000}}}
    configure_ds_config(ds2, "/x")
    assert ds2["zero_optimization"]["offload_param"]["max_in_cpu"] == 1000  # the user's value is kept


def test_zero3_working_buffers_bounded_unless_the_user_set_them():
    from titan_ds.hms.install import ZERO3_BOUNDS
    ds = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 12345, "sub_group_size": "auto"}}
    changed = configure_ds_config(ds, "/x")
    z = ds["zero_optimization"]
    assert z["reduce_bucket_size"] == 12345  # the user's value is kept
    assert "zero_optimization.reduce_bucket_size=1e+04" not in changed
    for key in ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                "sub_group_size"):  # "auto" (HF) and missing both get the bound
        assert z[key] == ZERO3_BOUNDS[key] <= 5e7, key
        assert any(c.startswith(f"zero_optimization.{key}=") for c in changed), key


@pytest.mark.parametrize("zero,match", [
    ({"stage": 2}, r"zero_optimization.stage is 2: set it to 3"),
    ({"stage": 3, "offload_param": {"device": "cpu"}}, r"offload_param.device is \"cpu\" but titan.hms.param_tier"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, r"offload_optimizer.device must be \"nvme\", got 'cpu'"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "fast_init": True}}, r"fast_init .*set it to false"),
])
def test_ds_config_conflicts_raise_naming_the_key(zero, match):
    with pytest.raises(TitanConfigError, match=match):
        configure_ds_config({"zero_optimization": zero}, "/x")


def test_force_ds_cpu_optimizer_conflict():
    from titan_ds import rules
    from titan_ds.pillar import View
    v = View.of(TitanConfig(hms={"nvme_path": "/x"}), {"zero_force_ds_cpu_optimizer": True}, torch.nn.Linear(1, 1),
                optimizer=object())
    assert any("zero_force_ds_cpu_optimizer=True in the ds_config conflicts" in m for m in rules.problems(v))


def test_hms_config_fields_validated():
    with pytest.raises(TitanConfigError) as e:
        TitanConfig(hms={"nvme_path": " ", "prefetch": "belady", "io_threads": 0, "direct_io": "maybe"})
    msg = str(e.value)
    for key in ("titan.hms.nvme_path", "titan.hms.prefetch", "titan.hms.io_threads", "titan.hms.direct_io"):
        assert key in msg
    assert HMSConfig(nvme_path="/x").prefetch == "trace"


@pytest.mark.parametrize("name", ["hms.json", "titan_zero3_nvme.json"])
def test_shipped_hms_configs(name, tmp_path):
    cfg = json.loads(config_path(name).read_text())
    t = TitanConfig.from_ds_config(cfg)
    assert t.hms is not None
    ds = {k: v for k, v in cfg.items() if k != "titan"}
    before = json.loads(json.dumps(ds))
    from titan_ds import rules
    from titan_ds.pillar import View
    assert rules.problems(View.of(t, ds, torch.nn.Linear(1, 1), optimizer=object())) == []  # no flag conflicts
    changed = configure_ds_config(ds, str(tmp_path))  # consistent with what HMS requires
    # hms.json leaves the offload sections to HMS; titan_zero3_nvme.json spells them out in full
    want = {"hms.json": ["zero_optimization.offload_param.device=nvme", "zero_optimization.offload_param.max_in_cpu=0",
                         "zero_optimization.offload_optimizer.device=nvme"],
            "titan_zero3_nvme.json": []}[name]
    # ... and the ZeRO-3 working-buffer bounds the file leaves unset
    assert [c for c in changed if not c.startswith(BOUND_KEYS)] == want
    for sec in ("offload_param", "offload_optimizer"):
        assert ds["zero_optimization"][sec]["device"] == "nvme"
        assert ds["zero_optimization"][sec]["nvme_path"] == before["zero_optimization"].get(sec, {}).get(
            "nvme_path", str(tmp_path))  # a path the user gave is kept
    assert ds["zero_optimization"]["offload_param"]["max_in_cpu"] == 0
