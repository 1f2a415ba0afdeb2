"""Parameter write-behind (titan.hms.param_write_behind): the partitions ZeRO-3's optimizer step updates are
written on the store's "param" writer thread while the step goes on. Bit-exact with the synchronous write, resume
included; a read of a partition waits for its write; a failed write surfaces naming the key. Also HMS stepping
with DeepSpeed's DeepSpeedCPUAdam (the optimizer ZeRO-Infinity uses). Engine runs go through
tests/hms/zero3_harness.py (own process)."""
import threading
from types import SimpleNamespace

import pytest
import torch

from tests.hms.test_pipeline import SLOW  # every background write sleeps 50 ms first: still in flight later
from tests.hms.test_store import _slow_writer
from tests.hms.test_swapper import assert_same, assert_state_same, run
from titan_ds.hms.store import StoreFullError, TensorStore, Tier
from titan_ds.hms.param_swapper import HMSParamSwapper, PartitionedParamStatus


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):  # with SLOW the parameter writes are in flight when the next forward reads them
    return tmp_path_factory.mktemp("hms_param_behind")


def test_param_write_behind_is_bit_exact_with_the_synchronous_write(tmp):
    sync, = run(tmp, "sync", "--mode", "hms", "--no-param-behind")
    behind, = run(tmp, "behind", "--mode", "hms", *SLOW)
    assert_same(sync, behind)  # losses of every step, parameters, every sub-group's master and state, lr
    assert sync["hms"]["bytes_written"] == behind["hms"]["bytes_written"] > 0  # the same writes, only later
    # with the optimizer state written synchronously, the parameter writes are the only ones in flight
    alone, = run(tmp, "behind_nopipe", "--mode", "hms", "--no-pipeline", *SLOW)
    assert_same(sync, alone)


@pytest.mark.slow
def test_resume_with_param_write_behind_is_bit_exact(tmp):
    cont, = run(tmp, "pb_cont", "--mode", "hms", *SLOW)
    saved, = run(tmp, "pb_save", "--mode", "hms", "--steps", 3, "--save-at", 3, "--save-dir", tmp / "ck", *SLOW)
    loaded, = run(tmp, "pb_loaded", "--mode", "hms", "--steps", 3, "--load-dir", tmp / "ck", *SLOW)
    assert_state_same(saved["state"], loaded["state"])
    resumed, = run(tmp, "pb_resumed", "--mode", "hms", "--load-dir", tmp / "ck", *SLOW)
    assert_same(cont, resumed, steps=[3, 4, 5])
    # and against the synchronous write: the resumed run is the same run
    sync, = run(tmp, "pb_sync_cont", "--mode", "hms", "--no-param-behind")
    assert_same(sync, resumed, steps=[3, 4, 5])


def _close(a, b, rtol=1e-5, atol=1e-6):
    return torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol)


def test_hms_with_deepspeed_cpu_adam_matches_torch_adamw(tmp):
    ref, = run(tmp, "adamw", "--mode", "hms")
    ds, = run(tmp, "cpuadam", "--mode", "hms", "--cpu-adam")
    assert ref["optimizer"] == "AdamW" and ds["optimizer"] == "DeepSpeedCPUAdam"
    for k in ref["losses"]:
        assert ref["losses"][k] == pytest.approx(ds["losses"][k], rel=1e-5), k
    for n in ref["params"]:
        assert _close(ref["params"][n], ds["params"][n]), n
    for i in ref["state"]:
        assert int(ds["state"][i]["step"]) == int(ref["state"][i]["step"]) == 6
        for k, atol in (("fp32", 1e-6), ("exp_avg", 1e-8), ("exp_avg_sq", 1e-10)):  # measured: 3.6e-7, 1e-9, 2e-11
            assert _close(ref["state"][i][k], ds["state"][i][k], atol=atol), (i, k)
    assert ref["lr"] == pytest.approx(ds["lr"])


@pytest.mark.slow
def test_hms_with_deepspeed_cpu_adam_resumes_bit_exact(tmp):
    cont, = run(tmp, "ca_cont", "--mode", "hms", "--cpu-adam", *SLOW)
    run(tmp, "ca_save", "--mode", "hms", "--cpu-adam", "--steps", 3, "--save-at", 3, "--save-dir", tmp / "ck_ca",
        *SLOW)
    resumed, = run(tmp, "ca_resumed", "--mode", "hms", "--cpu-adam", "--load-dir", tmp / "ck_ca", *SLOW)
    assert resumed["optimizer"] == "DeepSpeedCPUAdam"
    assert_same(cont, resumed, steps=[3, 4, 5])


# ---------------------------------------------------------------------------------------------- unit level
def _param(ds_id, n):
    t = torch.empty(0)
    t.ds_numel, t.status = n, PartitionedParamStatus.NOT_AVAILABLE
    return SimpleNamespace(ds_id=ds_id, dtype=torch.float32, ds_tensor=t)


def _gate(store):
    """The store's background writes wait for the returned Event (they stay in flight until it is set)."""
    gate = threading.Event()
    _slow_writer(store, gate)
    return gate


def test_read_of_a_partition_waits_for_its_write_and_depth_bounds_the_writes(tmp_path):
    store = TensorStore([Tier(str(tmp_path))], durable=False)
    ps = [_param(i, 3000) for i in range(3)]
    for p in ps:
        store.put(f"param/{p.ds_id}", torch.zeros(3000))
    sw = HMSParamSwapper(store, write_behind_depth=1)
    gate = _gate(store)
    master = torch.arange(9000, dtype=torch.float32)  # one sub-group's fp32 master; the partitions are views
    sw.swap_out_partitioned_params(ps[:2], [master[:3000], master[3000:6000]])  # returns with its writes pending
    assert sorted(store.pending_writes()) == ["param/0", "param/1"]
    assert all(p.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE for p in ps[:2])
    threading.Timer(0.3, gate.set).start()
    buf = torch.empty(3000)
    sw.swap_into_buffer(ps[0], buf)  # a plain read (store.get) waits for the write in flight
    assert torch.equal(buf, master[:3000])
    sw.swap_out_partitioned_params(ps[2:], [master[6000:]])  # depth 1: waited for the first call's writes
    assert not {"param/0", "param/1"} & set(store.pending_writes())
    sw.swap_in(ps, async_op=False)  # prefetch + get: wait for the write still in flight
    for i, p in enumerate(ps):
        assert torch.equal(p.ds_tensor.data, master[3000 * i:3000 * (i + 1)])
    sw.flush()
    assert store.pending_writes() == [] and not sw._writing
    store.close()


def test_a_partition_the_next_forward_reads_first_is_served_from_dram_not_the_master(tmp_path):
    store = TensorStore([Tier(str(tmp_path))], durable=False)  # no DRAM cache: staging is the only way to hit
    p = _param(5, 3000)
    store.put("param/5", torch.zeros(3000))
    sw = HMSParamSwapper(store, predictor=SimpleNamespace(predict=lambda n: ["param/5"]), write_behind_depth=1)
    gate = _gate(store)
    master = torch.full((3000,), 3.0)
    sw.swap_out_partitioned_params([p], [master])
    threading.Timer(0.2, gate.set).start()
    reads = store.stats.reads
    got = store.get("param/5")  # waits for the write, then takes the staged copy
    assert torch.equal(got, master) and store.stats.reads == reads and store.stats.staged_writes == 1
    assert got.untyped_storage().data_ptr() != master.untyped_storage().data_ptr()  # a copy, not the master
    store.close()


def test_failed_param_write_surfaces_naming_the_key(tmp_path):
    # room for the first version (3000 fp32 + header) only: the second, larger, write cannot land
    store = TensorStore([Tier(str(tmp_path), capacity_bytes=16384)], durable=False)
    p = _param(7, 3000)
    store.put("param/7", torch.zeros(3000))
    sw = HMSParamSwapper(store, write_behind_depth=2)
    old = torch.zeros(3000)
    sw.swap_out_partitioned_params([p], [torch.ones(6000)])  # returns: the failure is on the writer thread
    store._writes["param/7"].exception()  # done (failed)
    with pytest.raises(StoreFullError, match=r"'param/7'"):
        sw.check()  # what titan's after-step hook calls
    with pytest.raises(StoreFullError, match=r"'param/7'"):
        store.get("param/7")  # the read that would have waited for it
    assert torch.equal(store.get("param/7"), old)  # the previous version is intact
    sw.swap_out_partitioned_params([p], [torch.ones(6000)])
    with pytest.raises(StoreFullError, match=r"'param/7'"):
        sw.flush()  # before a checkpoint
    with pytest.raises(StoreFullError, match=r"'param/7'"):
        store.close()
