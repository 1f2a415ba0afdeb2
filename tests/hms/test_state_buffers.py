"""Swapped optimizer state read into reused buffers (HMSOptimizerSwapper._state_buffer, io.BufferPool) instead of
fresh tensors, and ``TensorStore.prefetch(key, out=...)``, which reads straight into the caller's buffer so that the
``get`` that takes it copies nothing. A buffer goes back to the pool only once the write that reads it landed:
checked with the writes held in flight (without that rule the next sub-group's prefetch would read into the
buffer still being written, and the file would hold the next sub-group's values). The engine-level runs
(tests/hms/test_swapper.py, test_pipeline.py) check the whole ZeRO-3 step bit for bit against no offload."""
import threading

import pytest
import torch

from tests.hms.test_pipeline import _step, _swapper
from tests.hms.test_store import _slow_writer
from titan_ds.hms.store import TensorStore, Tier


def test_prefetch_into_the_callers_buffer_is_what_get_returns(tmp_path):
    store = TensorStore([Tier(str(tmp_path))], durable=False, checksum=False)
    x = torch.randn(70_000)
    store.put("k", x)
    buf = torch.empty(70_000)
    store.prefetch("k", out=buf)
    assert store.get("k", out=buf) is buf and torch.equal(buf, x)  # the read landed in buf: no second copy
    other = torch.empty(70_000)
    store.prefetch("k", out=buf)
    assert store.get("k", out=other) is other and torch.equal(other, x)  # another buffer: copied, still right
    with pytest.raises(ValueError, match="speculative"):
        store.prefetch("k", speculative=True, out=buf)
    store.close()


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_state_is_read_into_pooled_buffers_bit_exact(tmp_path, depth):
    store = TensorStore([Tier(str(tmp_path / "s"))], durable=False, checksum=False)
    sw, opt, ps = _swapper(tmp_path, store, depth=depth)
    ref = {}
    for step in range(4):
        _step(sw, opt, ps, float(step))
    made = sw._pool.allocated
    for step in range(4, 8):
        _step(sw, opt, ps, float(step))
    # one step's buffers at most: the sub-group stepping, the next one's prefetch and the writes in flight
    assert sw._pool.allocated - made <= 4 * (depth + 2)
    for i, p in enumerate(ps):
        sw.swap_in_optimizer_state(p)
        ref[i] = opt.state[p]["exp_avg"]
        lent = sw._lent[p.ds_id]["exp_avg"][0]
        assert ref[i].untyped_storage().data_ptr() == lent.untyped_storage().data_ptr()  # read into the pool's
        # written at steps 0..7, +1 each step after the first: 0 + 7
        assert torch.equal(ref[i], torch.full((3000,), 7.0)), i
        sw.swap_out_optimizer_state(p)
    sw.log_timers()
    store.close()


def test_a_buffer_is_reused_only_after_its_write_landed(tmp_path):
    store = TensorStore([Tier(str(tmp_path / "s"))], durable=False, checksum=False)
    sw, opt, ps = _swapper(tmp_path, store, depth=2, groups=4)
    _step(sw, opt, ps, 0.0)
    _step(sw, opt, ps, 1.0)  # sizes known: from here on the state comes into pooled buffers
    gate = threading.Event()
    _slow_writer(store, gate)  # the writes of the next step stay in flight until the gate opens
    threading.Timer(0.5, gate.set).start()
    ptrs = []
    for i, p in enumerate(ps):
        sw.swap_in_optimizer_state(p, ps[i + 1] if i + 1 < len(ps) else None)
        ptrs.append(opt.state[p]["exp_avg"].untyped_storage().data_ptr())
        p.data.fill_(10.0 + i)
        opt.state[p]["exp_avg"].add_(float(10 * (i + 1)))
        sw.swap_out_optimizer_state(p)
    sw.log_timers()
    assert len(set(ptrs[:3])) == 3  # sub-groups 0-2: their writes in flight, each in a buffer of its own
    for i, p in enumerate(ps):  # each file holds its own sub-group's state: 0 + 1 + 10 (i + 1)
        sw.swap_in_optimizer_state(p)
        assert torch.equal(opt.state[p]["exp_avg"], torch.full((3000,), 1.0 + 10 * (i + 1))), i
        sw.swap_out_optimizer_state(p)
    sw.log_timers()
    store.close()


def test_the_pool_keeps_only_what_the_expected_reads_can_reuse():
    from titan_ds.hms.io import BufferPool

    pool = BufferPool()
    a, b = pool.take(4096), pool.take(4096)
    pool.give(a)
    pool.give(b)
    assert pool.free_bytes == 2 * 4096  # no expectation: everything kept (until clear)
    pool.expect([4096, 8192])  # one more take of each size to come: the second free 4096 buffer is let go
    assert pool.free_bytes == 4096 and pool.wanted(4096) == 0 and pool.wanted(8192) == 1
    assert pool.take(4096).data_ptr() in (a.data_ptr(), b.data_ptr())  # reused
    pool.give(pool.take(8192))  # the last 8192 take is done: giving it back keeps nothing
    assert pool.free_bytes == 0 and pool.dropped == 1 and pool.wanted(4096) == 0
    pool.clear()  # and without an expectation again, kept
    pool.give(a)
    assert pool.free_bytes == 4096


def test_a_step_whose_sizes_never_repeat_holds_no_more_than_fresh_tensors(tmp_path):
    """Sub-groups of different sizes (as plan's 8x768 config has): no read can reuse a buffer, so none may be held
    past what the write needs. Before ``expect`` the pool kept every one until the step's end (that config's peak
    was 1.413 GiB with it against 1.276 with fresh tensors)."""
    store = TensorStore([Tier(str(tmp_path / "s"))], durable=False, checksum=False)
    opt_ps = _swapper(tmp_path, store, depth=1, groups=1)
    sw, opt, _ = opt_ps
    ps = []
    for i, n in enumerate((3000, 4000, 5000, 6000)):
        p = torch.nn.Parameter(torch.full((n,), float(i)))
        p.ds_id = 10 + i
        ps.append(p)
    sw.initialize_parameters(ps, [p.data.clone() for p in ps])
    sw._numel = {p.ds_id: p.numel() for p in ps}
    for step in range(3):
        sw.post_backward()
        for i, p in enumerate(ps):
            sw.swap_in_optimizer_state(p, ps[i + 1] if i + 1 < len(ps) else None)
            st = opt.state.setdefault(p, {})
            if "exp_avg" in st and st["exp_avg"].numel():
                st["exp_avg"].add_(1.0)
            else:
                st["exp_avg"] = torch.full((p.numel(),), 0.0)
            sw.swap_out_optimizer_state(p)
            assert sw._pool.free_bytes == 0 and not sw._returning, (step, i)  # nothing held for a reuse
        sw.log_timers()
    assert sw._pool.allocated == 8  # steps 1 and 2: one buffer per sub-group, none reused
    for i, p in enumerate(ps):
        sw.swap_in_optimizer_state(p)
        assert torch.equal(opt.state[p]["exp_avg"], torch.full((p.numel(),), 2.0)), i
        sw.swap_out_optimizer_state(p)
    sw.log_timers()
    store.close()
