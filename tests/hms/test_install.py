"""titan.hms wiring: nvme_path validation, the ZeRO-3 / nvme ds_config it requires, shipped configs."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from titan_ds.config import HMSConfig, TitanConfig, TitanConfigError
from titan_ds.hms.install import configure_ds_config, validate_folder

ROOT = Path(__file__).resolve().parents[2]
BOUND_KEYS = ("zero_optimization.reduce_bucket_size=", "zero_optimization.stage3_", "zero_optimization.sub_group_size=")


def test_folder_created_and_writable(tmp_path):
    p = tmp_path / "a" / "b"
    assert validate_folder(str(p), "titan.hms.nvme_path") == str(p) and p.is_dir()


def test_folder_that_is_a_file_is_rejected_by_key(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(TitanConfigError, match=r"titan.hms.nvme_path=.*not a folder"):
        validate_folder(str(f), "titan.hms.nvme_path")


def test_uncreatable_folder_is_rejected_by_key():
    with pytest.raises(TitanConfigError, match=r"titan.hms.nvme_path=.*cannot be created"):
        validate_folder("/proc/titan_cannot_exist/x", "titan.hms.nvme_path")


def test_read_only_folder_is_rejected_by_key(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root); root ignores chmod")
    try:
        with pytest.raises(TitanConfigError, match=r"titan.hms.spill_tiers\[0\].path=.*not writable"):
            validate_folder(str(mnt), "titan.hms.spill_tiers[0].path")
    finally:
        subprocess.run(["umount", str(mnt)])


def test_ds_config_made_zero3_nvme_and_flags_set():
    ds = {"train_micro_batch_size_per_gpu": 2}
    changed = configure_ds_config(ds, "/x", client_optimizer=True)
    z = ds["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"]["device"] == "nvme" and z["offload_optimizer"]["device"] == "nvme"
    assert z["offload_param"]["max_in_cpu"] == 0 and z["offload_param"]["nvme_path"] == "/x"
    assert ds["zero_force_ds_cpu_optimizer"] is False and ds["zero_allow_untested_optimizer"] is True
    assert "zero_optimization.stage=3" in changed
    ds2 = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "max_in_cpu": 1000}}}
    configure_ds_config(ds2, "/x", client_optimizer=False)
    assert ds2["zero_optimization"]["offload_param"]["max_in_cpu"] == 1000  # the user's value is kept
    assert "zero_force_ds_cpu_optimizer" not in ds2


def test_zero3_working_buffers_bounded_unless_the_user_set_them():
    from titan_ds.hms.install import ZERO3_BOUNDS
    ds = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 12345, "sub_group_size": "auto"}}
    changed = configure_ds_config(ds, "/x", client_optimizer=False)
    z = ds["zero_optimization"]
    assert z["reduce_bucket_size"] == 12345  # the user's value is kept
    assert "zero_optimization.reduce_bucket_size=1e+04" not in changed
    for key in ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                "sub_group_size"):  # "auto" (HF) and missing both get the bound
        assert z[key] == ZERO3_BOUNDS[key] <= 5e7, key
        assert any(c.startswith(f"zero_optimization.{key}=") for c in changed), key


@pytest.mark.parametrize("zero,match", [
    ({"stage": 2}, r"zero_optimization.stage is 2: set it to 3"),
    ({"stage": 3, "offload_param": {"device": "cpu"}}, r"offload_param.device must be \"nvme\", got 'cpu'"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "fast_init": True}}, r"fast_init .*set it to false"),
])
def test_ds_config_conflicts_raise_naming_the_key(zero, match):
    with pytest.raises(TitanConfigError, match=match):
        configure_ds_config({"zero_optimization": zero}, "/x", client_optimizer=False)


def test_force_ds_cpu_optimizer_conflict():
    with pytest.raises(TitanConfigError, match="zero_force_ds_cpu_optimizer=True conflicts"):
        configure_ds_config({"zero_force_ds_cpu_optimizer": True}, "/x", client_optimizer=True)


def test_hms_config_fields_validated():
    with pytest.raises(TitanConfigError) as e:
        TitanConfig(hms={"nvme_path": " ", "prefetch": "belady", "io_threads": 0, "direct_io": "maybe"})
    msg = str(e.value)
    for key in ("titan.hms.nvme_path", "titan.hms.prefetch", "titan.hms.io_threads", "titan.hms.direct_io"):
        assert key in msg
    assert HMSConfig(nvme_path="/x").prefetch == "trace"


@pytest.mark.parametrize("name", ["hms.json", "titan_zero3_nvme.json"])
def test_shipped_hms_configs(name, tmp_path):
    cfg = json.loads((ROOT / "ds_configs" / name).read_text())
    t = TitanConfig.from_ds_config(cfg)
    assert t.hms is not None
    ds = {k: v for k, v in cfg.items() if k != "titan"}
    before = json.loads(json.dumps(ds))
    changed = configure_ds_config(ds, str(tmp_path), client_optimizer=True)  # consistent with what HMS requires
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
