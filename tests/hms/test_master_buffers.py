"""The optimizer swapper's master buffers (HMSOptimizerSwapper._master_buffer): once attached, each sub-group's
fp32 master is read from its partitions into one of the step's two buffers, taken in turn, instead of a fresh
tensor (fresh pages under HMS's 1 MiB mmap threshold). The partitions are written behind as views of the master,
so a buffer is reused only after the writes that read from it landed: checked here with the writes held in flight
(without the wait, the third sub-group's master would overwrite the first's before its partitions were written).
The engine-level runs (tests/hms/test_master_from_partitions.py, test_param_write_behind.py, test_pipeline.py)
check the whole step bit for bit against the master written as its own file and against synchronous writes."""
import threading

import torch

from tests.hms.test_master_from_partitions import _part
from tests.hms.test_pipeline import _Opt
from tests.hms.test_store import _slow_writer
from titan_ds.hms.store import TensorStore, Tier
from titan_ds.hms.optimizer_swapper import HMSOptimizerSwapper
from titan_ds.hms.param_swapper import HMSParamSwapper

SIZES = (1000, 2000)  # each sub-group's two partitions


def _setup(tmp_path, groups=3):
    store = TensorStore([Tier(str(tmp_path / "s"))], durable=False)
    pswap = HMSParamSwapper(store, write_behind_depth=2)
    opt = _Opt()
    osw = HMSOptimizerSwapper(None, None, str(tmp_path / "base"), opt, sum(SIZES), "cpu", torch.float32, None,
                              store=store)
    masters, parts = [], []
    for g in range(groups):
        m = torch.nn.Parameter(torch.arange(sum(SIZES), dtype=torch.float32) + 1000 * g)
        m.ds_id = f"0_{g}"
        masters.append(m)
        parts.append([_part(10 * g + i, n) for i, n in enumerate(SIZES)])
        for p in parts[-1]:
            store.put(f"param/{p.ds_id}", torch.zeros(p.ds_tensor.ds_numel))
    osw.initialize_parameters(masters, [m.data.clone() for m in masters])
    return store, pswap, osw, opt, masters, parts


def _step(pswap, osw, opt, masters, parts, value):
    """ZeRO-3's order per sub-group: swap the master in, step it, write the partitions from it, swap the state
    out; the step's flush at the end. Returns each sub-group's new master and the buffer it was stepped in."""
    want, ptrs = [], []
    for g, (m, ps) in enumerate(zip(masters, parts)):
        osw.swap_in_optimizer_state(m)
        ptrs.append(m.data.untyped_storage().data_ptr())
        m.data.add_(value + g)
        opt.state[m] = {"exp_avg": m.data * 2}
        pswap.swap_out_partitioned_params(ps, [m.data[:SIZES[0]], m.data[SIZES[0]:]])
        want.append(m.data.clone())
        osw.swap_out_optimizer_state(m)
    osw.log_timers()
    pswap.flush()
    return want, ptrs


def test_masters_alternate_between_two_buffers_and_wait_for_the_writes_reading_them(tmp_path):
    store, pswap, osw, opt, masters, parts = _setup(tmp_path)
    osw.reuse_master_buffers(pswap)
    _step(pswap, osw, opt, masters, parts, 1.0)  # the masters come from their own files; the partitions written
    assert all(f"0_{g}" in osw._master_parts for g in range(3))  # from now on each is read from its partitions
    gate = threading.Event()
    _slow_writer(store, gate)  # every partition write of the next step stays in flight until the gate opens
    threading.Timer(0.5, gate.set).start()
    want, ptrs = _step(pswap, osw, opt, masters, parts, 10.0)
    assert ptrs[0] == ptrs[2] != ptrs[1]  # two buffers, in turn
    for g, ps in enumerate(parts):  # each partition file holds its own sub-group's master, not a later one's
        assert torch.equal(store.get(f"param/{ps[0].ds_id}"), want[g][:SIZES[0]]), g
        assert torch.equal(store.get(f"param/{ps[1].ds_id}"), want[g][SIZES[0]:]), g
    assert osw._masters == [None, None]  # not held past the step
    for g, m in enumerate(masters):
        osw.swap_in_optimizer_state(m)
        assert torch.equal(m.data, want[g]) and torch.equal(opt.state[m]["exp_avg"], want[g] * 2)
        osw.swap_out_optimizer_state(m)
    store.close()


def test_before_attach_every_master_is_a_fresh_tensor(tmp_path):
    store, pswap, osw, opt, masters, parts = _setup(tmp_path)
    _step(pswap, osw, opt, masters, parts, 1.0)
    _, ptrs = _step(pswap, osw, opt, masters, parts, 2.0)
    assert osw._masters == [None, None] and not osw._master_reuse
    store.close()


def test_masters_are_prefetched_into_their_buffer_and_an_untaken_prefetch_is_let_go(tmp_path):
    """Once attached, a sub-group's master is prefetched straight into the master buffer its swap-in takes (the
    partitions' reads land there: no fresh tensor, no copy). A step that ends without taking it (ZeRO-3's overflow
    return, which flushes) lets those reads go: the next forward's parameter fetch must get its own tensor, never a
    view of a master buffer that a later sub-group will overwrite."""
    store, pswap, osw, opt, masters, parts = _setup(tmp_path)
    osw.reuse_master_buffers(pswap)
    _step(pswap, osw, opt, masters, parts, 1.0)  # from now on each master is read from its partitions
    want, _ = _step(pswap, osw, opt, masters, parts, 2.0)
    osw.post_backward()  # the first sub-group's master prefetched into a master buffer
    buf, reads = osw._master_pending["0_0"]
    assert [k for k, *_ in reads] == [f"param/{p.ds_id}" for p in parts[0]]
    osw.log_timers()  # the step returned early (overflow): nothing took it
    assert osw._master_pending == {}
    got = store.get(f"param/{parts[0][0].ds_id}")
    assert got.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    assert torch.equal(got, want[0][:SIZES[0]])
    osw.post_backward()
    buf, _ = osw._master_pending["0_0"]
    osw.swap_in_optimizer_state(masters[0], masters[1])
    assert masters[0].data.data_ptr() == buf.data_ptr() and torch.equal(masters[0].data, want[0])
    assert "0_1" in osw._master_pending  # the next one's read started into the other buffer
    assert osw._master_pending["0_1"][0].data_ptr() != buf.data_ptr()
    osw.swap_out_optimizer_state(masters[0])
    osw.log_timers()
    pswap.flush()
    store.close()
