"""``titan.hms.param_tier: "dram"``: the parameter partitions stay in CPU memory (DeepSpeed's offload_param cpu)
and HMS keeps only the optimizer state on disk (ZeRO-Infinity's form). Bit-exact with no offload, with clipping
and accumulation, and across a resume in a fresh process; no parameter key ever enters the store. Engine runs go
through tests/hms/zero3_harness.py (own process)."""
import pytest

from tests.hms.test_swapper import assert_same, assert_state_same, run
from titan_ds.config import TitanConfigError
from titan_ds.hms.install import configure_ds_config

DRAM = ("--param-tier", "dram")


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("hms_dram")


def test_dram_tier_trains_like_no_offload_and_reads_no_parameter_from_disk(tmp):
    ref, = run(tmp, "none", "--mode", "none", "--clip", 0)
    hms, = run(tmp, "dram", "--mode", "hms", "--clip", 0, *DRAM)
    assert_same(ref, hms)
    m = hms["hms"]
    assert m.get("param_hits", 0) + m.get("param_misses", 0) == 0, m  # no parameter partition read from the store
    assert m["opt_hits"] + m["opt_misses"] > 0 and m["bytes_written"] > 0, m  # the optimizer state is on disk
    assert hms["master_files"] == 0  # every master's bits are in the partitions in RAM: no file (next test)
    # and the streamed tier on the same run writes the partitions too: more bytes
    nvme, = run(tmp, "nvme", "--mode", "hms", "--clip", 0)
    assert_same(ref, nvme)
    assert nvme["store_bytes_written"] > hms["store_bytes_written"]


def test_dram_tier_keeps_no_master_file_bit_exact_and_writes_4_bytes_per_param_less(tmp):
    """master_from_partitions with param_tier "dram": after each sub-group's step ZeRO-3 copied the fp32 master
    into the partitions it keeps in CPU memory; the master is neither written nor read back from disk."""
    steps = 5
    own, = run(tmp, "dram_own", "--mode", "hms", "--clip", 1.0, "--steps", steps, "--no-master-from-parts", *DRAM)
    ram, = run(tmp, "dram_ram", "--mode", "hms", "--clip", 1.0, "--steps", steps, *DRAM)
    assert_same(own, ram)  # losses, parameters, every sub-group's master and state, lr
    assert own["master_files"] == own["subgroups"] > 1 and ram["master_files"] == 0
    saved = own["store_bytes_written"] - ram["store_bytes_written"]
    # every step after the first writes no master (the first write of each was at initialize, in both runs)
    assert saved >= 4 * ram["numel"] * steps, (saved, ram["numel"])
    assert own["store_bytes_read"] - ram["store_bytes_read"] >= 4 * ram["numel"] * (steps - 1)


@pytest.mark.slow
def test_dram_tier_with_clipping_accumulation_and_resume(tmp):
    ref, = run(tmp, "cpu_g2", "--mode", "cpu", "--clip", 1.0, "--gas", 2)
    cont, = run(tmp, "dram_g2", "--mode", "hms", "--clip", 1.0, "--gas", 2, *DRAM)
    assert_same(ref, cont)
    saved, = run(tmp, "dram_save", "--mode", "hms", "--clip", 1.0, "--gas", 2, "--steps", 3, "--save-at", 3,
                 "--save-dir", tmp / "ck", *DRAM)
    loaded, = run(tmp, "dram_loaded", "--mode", "hms", "--clip", 1.0, "--gas", 2, "--steps", 3,
                  "--load-dir", tmp / "ck", *DRAM)
    assert_state_same(saved["state"], loaded["state"])
    resumed, = run(tmp, "dram_resumed", "--mode", "hms", "--clip", 1.0, "--gas", 2, "--load-dir", tmp / "ck", *DRAM)
    assert_same(cont, resumed, steps=[3, 4, 5])


def test_dram_tier_sets_cpu_parameter_offload_and_refuses_a_conflict():
    ds = {"zero_optimization": {"stage": 3}}
    changed = configure_ds_config(ds, "/x", "dram")
    z = ds["zero_optimization"]
    assert z["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert z["offload_optimizer"]["device"] == "nvme" and "zero_optimization.offload_param.device=cpu" in changed
    with pytest.raises(TitanConfigError, match="param_tier \"dram\".*offload_param.device must be \"cpu\""):
        configure_ds_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "/x", "dram")
    # the streamed tier names the setting that keeps parameters in CPU memory
    with pytest.raises(TitanConfigError, match="set titan.hms.param_tier to \"dram\""):
        configure_ds_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "/x")
