"""titan.hms.master_from_partitions: with fp32 partitions, each sub-group's fp32 master is kept as the parameter
partitions ZeRO-3 writes from it (the same bytes) instead of a second file ``opt/<id>/fp32``. Bit-exact with the
master written as its own file; 4 bytes/param less written per step; a sub-group whose partitions were not all
written from its master (a gap, another dtype) writes its master as before. Engine runs go through
tests/hms/zero3_harness.py (own process)."""
from types import SimpleNamespace

import pytest
import torch

from tests.hms.test_pipeline import _Opt
from tests.hms.test_swapper import assert_same, run
from titan_ds.hms.store import TensorStore, Tier
from titan_ds.hms.optimizer_swapper import HMSOptimizerSwapper
from titan_ds.hms.param_swapper import HMSParamSwapper, PartitionedParamStatus


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("hms_master_parts")


def test_master_kept_as_partitions_is_bit_exact_and_written_once(tmp):
    steps = 6
    own, = run(tmp, "own_file", "--mode", "hms", "--no-master-from-parts", "--steps", steps)
    parts, = run(tmp, "as_parts", "--mode", "hms", "--steps", steps)
    assert_same(own, parts)  # losses of every step, parameters, every sub-group's master and state, lr
    # every sub-group's master is its own file when off; when on, a sub-group's master is a file only where its
    # last step found a partition ZeRO-3 held in memory (updated by a copy, not written: the model's first
    # parameters, which ZeRO-3 fetches ahead for the next forward), so the fallback ran too
    assert own["master_files"] == own["subgroups"] > 1 and parts["master_files"] < own["master_files"]
    saved = own["store_bytes_written"] - parts["store_bytes_written"]
    assert saved >= 4 * parts["numel"] and saved % 4 == 0  # fp32 masters not written (>= one of every parameter)
    # with DeepSpeed's CPU Adam, the write-behind of the partitions (harness default) and delayed writes too
    cpu_own, = run(tmp, "ca_own", "--mode", "hms", "--cpu-adam", "--no-master-from-parts", "--slow-writes", 0.02)
    cpu_parts, = run(tmp, "ca_parts", "--mode", "hms", "--cpu-adam", "--slow-writes", 0.02)
    assert_same(cpu_own, cpu_parts)
    assert cpu_parts["master_files"] < cpu_own["master_files"]


# ---------------------------------------------------------------------------------------------- unit level
def _part(ds_id, n, dtype=torch.float32):
    t = torch.empty(0, dtype=dtype)
    t.ds_numel, t.status = n, PartitionedParamStatus.NOT_AVAILABLE
    return SimpleNamespace(ds_id=ds_id, dtype=dtype, ds_tensor=t)


def _setup(tmp_path, sizes=(1000, 3000, 24), dtype=torch.float32):
    store = TensorStore([Tier(str(tmp_path / "s"))], durable=False)
    pswap = HMSParamSwapper(store)
    opt = _Opt()
    osw = HMSOptimizerSwapper(None, None, str(tmp_path / "base"), opt, sum(sizes), "cpu", torch.float32, None,
                              store=store)
    master = torch.nn.Parameter(torch.arange(sum(sizes), dtype=torch.float32))
    master.ds_id = "0_2"
    osw.initialize_parameters([master], [master.data.clone()])
    parts = [_part(i, n, dtype) for i, n in enumerate(sizes)]
    return store, pswap, osw, opt, master, parts


def _step(pswap, osw, opt, master, parts, value, skip=()):
    """ZeRO-3's order: swap the master in, step it, write the partitions from it, swap the state out."""
    osw.swap_in_optimizer_state(master)
    master.data.add_(value)
    opt.state[master] = {"exp_avg": master.data * 2}
    views, off = [], 0
    for p in parts:
        views.append(master.data.narrow(0, off, p.ds_tensor.ds_numel))
        off += p.ds_tensor.ds_numel
    keep = [i for i in range(len(parts)) if i not in skip]
    pswap.swap_out_partitioned_params([parts[i] for i in keep], [views[i] for i in keep])
    want = master.data.clone()
    osw.swap_out_optimizer_state(master)
    osw.log_timers()
    return want


def test_the_master_is_read_back_from_its_partitions(tmp_path):
    store, pswap, osw, opt, master, parts = _setup(tmp_path)
    assert "opt/0_2/fp32" in store
    for step in range(3):
        want = _step(pswap, osw, opt, master, parts, 1.5 * (step + 1))
        assert "opt/0_2/fp32" not in store  # its bytes are the partitions' files
        assert torch.equal(osw._read_master("0_2"), want)
        assert torch.equal(store.get("param/1"), want[1000:4000])
    osw.swap_in_optimizer_state(master)
    assert torch.equal(master.data, want) and torch.equal(opt.state[master]["exp_avg"], want * 2)
    store.close()


def test_a_master_its_partitions_do_not_cover_is_written_as_its_file(tmp_path):
    store, pswap, osw, opt, master, parts = _setup(tmp_path)
    _step(pswap, osw, opt, master, parts, 1.0)
    assert "opt/0_2/fp32" not in store
    # ZeRO-3 kept partition 1 in memory this step (copied, not written): the files do not hold the new master
    want = _step(pswap, osw, opt, master, parts, 2.0, skip=(1,))
    assert "opt/0_2/fp32" in store and "0_2" not in osw._master_parts
    osw.swap_in_optimizer_state(master)
    assert torch.equal(master.data, want)
    store.close()


def test_partitions_of_another_dtype_keep_the_master_file(tmp_path):
    store, pswap, osw, opt, master, parts = _setup(tmp_path, dtype=torch.bfloat16)
    want = _step(pswap, osw, opt, master, parts, 0.25)
    assert "opt/0_2/fp32" in store and store.get("param/0").dtype == torch.bfloat16
    osw.swap_in_optimizer_state(master)
    assert torch.equal(master.data, want)  # the fp32 master, not the bf16 partitions
    store.close()


def test_off_writes_the_master_file(tmp_path):
    store, pswap, osw, opt, master, parts = _setup(tmp_path)
    osw.master_from_partitions = False
    want = _step(pswap, osw, opt, master, parts, 3.0)
    assert "opt/0_2/fp32" in store
    assert torch.equal(store.get("opt/0_2/fp32"), want)
    store.close()


def test_with_the_partitions_in_ram_the_master_is_the_partition_flat_itself(tmp_path):
    """param_tier "dram": once the partitions in CPU memory hold the master's bits, the swapped-in master is that
    flat (no copy): the optimizer steps it in place, ZeRO-3's copy of the master into it is a copy onto itself,
    and the write compares one pointer. A restored master (its own file) is a separate tensor again until written."""
    store = TensorStore([Tier(str(tmp_path / "s"))], durable=False)
    opt = _Opt()
    osw = HMSOptimizerSwapper(None, None, str(tmp_path / "base"), opt, 5000, "cpu", torch.float32, None,
                              store=store)
    master = torch.nn.Parameter(torch.arange(5000, dtype=torch.float32))
    master.ds_id = "0_0"
    osw.initialize_parameters([master], [master.data.clone()])
    flat = torch.zeros(5000)
    assert osw.use_partition_masters([(master, flat)]) == 1
    for step in range(3):
        osw.swap_in_optimizer_state(master)
        if step:
            assert master.data.data_ptr() == flat.data_ptr()  # the partitions' own bytes
        master.data.add_(1.0)
        flat.copy_(master.data)  # ZeRO-3's _reassign_or_swap_out_partitioned_parameters
        opt.state[master] = {"exp_avg": master.data * 2}
        osw.swap_out_optimizer_state(master)
        osw.log_timers()
        assert "opt/0_0/fp32" not in store and torch.equal(flat, torch.arange(5000.0) + step + 1)
    osw.swap_in_optimizer_state(master)
    assert torch.equal(opt.state[master]["exp_avg"], (torch.arange(5000.0) + 3) * 2)
    osw.swap_out_optimizer_state(master)
    store.close()
