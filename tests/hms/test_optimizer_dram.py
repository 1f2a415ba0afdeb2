"""titan.hms.optimizer_dram_mb: optimizer sub-groups admitted to a DRAM budget at their first swap-out keep their
state (and master) in memory between steps instead of on disk. Bit-exact with everything on disk, with a budget
that admits part of the sub-groups and one that admits all; fewer bytes read and written; snapshots hold the
resident values (resume in a fresh process, with and without the budget); a purge writes resident masters back.
Engine runs go through tests/hms/zero3_harness.py (own process)."""
import pytest
import torch

from tests.hms.test_pipeline import _step, _swapper
from tests.hms.test_swapper import assert_same, assert_state_same, run
from titan_ds.hms.store import TensorStore, Tier


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("hms_opt_dram")


def test_resident_subgroups_train_bit_exact_and_skip_their_io(tmp):
    # the harness's model has two sub-groups: ~270K elements (AdamW: 3.2 MB of master and moments) and ~14K
    off, = run(tmp, "off", "--mode", "hms", "--clip", 1.0)
    part, = run(tmp, "part", "--mode", "hms", "--clip", 1.0, "--opt-dram-mb", 1)
    full, = run(tmp, "full", "--mode", "hms", "--clip", 1.0, "--opt-dram-mb", 100)
    assert_same(off, part)
    assert_same(off, full)
    assert off["resident"] == [] and len(part["resident"]) == 1 and len(full["resident"]) == off["subgroups"] == 2
    assert off["opt_state_files"] > 0 and full["opt_state_files"] == 0
    assert off["store_bytes_written"] > part["store_bytes_written"] > full["store_bytes_written"]
    # (the small sub-group's reads were DRAM-cache hits already, --dram-mb 1: residency saves its writes only)
    assert min(off["store_bytes_read"], part["store_bytes_read"]) > full["store_bytes_read"]
    assert full["hms"]["optimizer_dram_bytes"] > part["hms"]["optimizer_dram_bytes"] > 0
    # partition writes still in flight when the next step reads a resident master (it waits for them)
    slow, = run(tmp, "full_slow", "--mode", "hms", "--clip", 1.0, "--opt-dram-mb", 100, "--slow-writes", 0.02)
    assert_same(off, slow)
    # the parameters in RAM too: with every sub-group resident nothing but initialize's masters is written
    ram, = run(tmp, "ram_full", "--mode", "hms", "--clip", 1.0, "--opt-dram-mb", 100, "--param-tier", "dram")
    assert_same(off, ram)
    assert ram["store_bytes_written"] <= 4 * ram["numel"] + 2 * 4096 * ram["subgroups"]
    assert ram["master_files"] == 0


@pytest.mark.slow
def test_resident_state_is_checkpointed_and_resumes_either_way(tmp):
    cont, = run(tmp, "ck_cont", "--mode", "hms", "--clip", 1.0, "--gas", 2, "--opt-dram-mb", 100)
    saved, = run(tmp, "ck_save", "--mode", "hms", "--clip", 1.0, "--gas", 2, "--steps", 3, "--save-at", 3,
                 "--save-dir", tmp / "ck", "--opt-dram-mb", 100)
    assert len(saved["resident"]) == 2
    for name, budget in (("ck_resumed", 100), ("ck_resumed_off", 0), ("ck_resumed_part", 1)):
        resumed, = run(tmp, name, "--mode", "hms", "--clip", 1.0, "--gas", 2, "--load-dir", tmp / "ck",
                       "--opt-dram-mb", budget)
        assert_same(cont, resumed, steps=[3, 4, 5])
    loaded, = run(tmp, "ck_loaded", "--mode", "hms", "--clip", 1.0, "--gas", 2, "--steps", 3,
                  "--load-dir", tmp / "ck", "--opt-dram-mb", 100)
    assert_state_same(saved["state"], loaded["state"])


# ---------------------------------------------------------------------------------------------- unit level
def _resident_swapper(tmp_path, budget):
    store = TensorStore([Tier(str(tmp_path / "s"))], durable=False)
    sw, opt, ps = _swapper(tmp_path, store, depth=1)
    sw.resident_budget = budget
    return store, sw, opt, ps


def test_budget_admits_in_step_order_and_values_match_the_disk_run(tmp_path):
    ref_store, ref, ref_opt, ref_ps = _resident_swapper(tmp_path / "ref", 0)
    # each sub-group: 3000 fp32 master + 3000 fp32 exp_avg = 24000 bytes; room for two of the three
    store, sw, opt, ps = _resident_swapper(tmp_path / "res", 50_000)
    for step in range(4):
        _step(ref, ref_opt, ref_ps, 10.0 * step)
        _step(sw, opt, ps, 10.0 * step)
    assert sorted(sw._resident) == [0, 1] and sw.resident_bytes == 48_000
    assert not any(k.startswith(("opt/0/", "opt/1/")) for k in store.keys())  # stale files deleted
    for i in range(3):
        ref.swap_in_optimizer_state(ref_ps[i])
        sw.swap_in_optimizer_state(ps[i])
        assert torch.equal(ref_ps[i].data, ps[i].data)
        assert torch.equal(ref_opt.state[ref_ps[i]]["exp_avg"], opt.state[ps[i]]["exp_avg"])
        ref.swap_out_optimizer_state(ref_ps[i])
        sw.swap_out_optimizer_state(ps[i])
    sw.log_timers()
    ref.log_timers()
    # a purge (before loading a non-NVMe checkpoint) forgets the state but writes the resident masters back
    sw.purge_state()
    assert sw._resident == {} and sw.resident_bytes == 0
    for i in range(3):
        sw.swap_in_optimizer_state(ps[i])
        assert torch.equal(ps[i].data, torch.full((3000,), 30.0 + i))
        sw.swap_out_optimizer_state(ps[i])
    store.close()
    ref_store.close()
