"""The pipelined optimizer step (titan.hms.pipeline_optimizer): write-behind of each sub-group's state while the
next one steps. Bit-exact with the unpipelined step, resume included; the writes in flight are bounded; a failed
write surfaces at the flush, naming the key. Engine runs go through tests/hms/zero3_harness.py (own process)."""
import threading
from collections import defaultdict

import pytest
import torch

from tests.hms.test_swapper import assert_same, assert_state_same, run
from titan_ds.hms.store import StoreFullError, TensorStore, Tier
from titan_ds.hms.optimizer_swapper import HMSOptimizerSwapper


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("hms_pipeline")


# each background write sleeps 50 ms first: the writes of sub-group i are still in flight while i+1 steps and
# when the step ends (the flush then waits), so the test exercises the overlap, not a writer that always won
SLOW = ("--slow-writes", 0.05)


def test_pipelined_step_is_bit_exact_with_the_unpipelined_one(tmp):
    sync, = run(tmp, "nopipe", "--mode", "hms", "--no-pipeline")
    pipe, = run(tmp, "pipe", "--mode", "hms", *SLOW)
    assert_same(sync, pipe)  # losses of every step, parameters, every sub-group's master and state, lr
    deep, = run(tmp, "pipe_d2", "--mode", "hms", "--pipeline-depth", 2, *SLOW)
    assert_same(sync, deep)
    assert sync["hms"]["bytes_written"] == pipe["hms"]["bytes_written"] > 0  # the same writes, only later


@pytest.mark.slow
def test_resume_with_pipelining_is_bit_exact(tmp):
    cont, = run(tmp, "pipe_cont", "--mode", "hms", *SLOW)
    saved, = run(tmp, "pipe_save", "--mode", "hms", "--steps", 3, "--save-at", 3, "--save-dir", tmp / "ck", *SLOW)
    loaded, = run(tmp, "pipe_loaded", "--mode", "hms", "--steps", 3, "--load-dir", tmp / "ck", *SLOW)
    assert_state_same(saved["state"], loaded["state"])  # the snapshot waited for the last step's writes
    resumed, = run(tmp, "pipe_resumed", "--mode", "hms", "--load-dir", tmp / "ck", *SLOW)
    assert_same(cont, resumed, steps=[3, 4, 5])


class _Opt:
    def __init__(self):
        self.state, self.param_groups = defaultdict(dict), [{"params": []}]  # as torch.optim.Optimizer


def _swapper(tmp_path, store, depth=1, n=3000, groups=3):
    opt = _Opt()
    sw = HMSOptimizerSwapper(None, None, str(tmp_path / "base"), opt, n, "cpu", torch.float32, None, store=store,
                             pipeline_depth=depth)
    ps = []
    for i in range(groups):
        p = torch.nn.Parameter(torch.full((n,), float(i)))
        p.ds_id = i
        ps.append(p)
    sw.initialize_parameters(ps, [p.data.clone() for p in ps])
    return sw, opt, ps


def _step(sw, opt, ps, value):
    """ZeRO-3's loop: swap in, change the master and the state in place, swap out."""
    for i, p in enumerate(ps):
        sw.swap_in_optimizer_state(p, ps[i + 1] if i + 1 < len(ps) else None)
        p.data.fill_(value + i)
        st = opt.state.setdefault(p, {})
        if "exp_avg" in st and st["exp_avg"].numel():
            st["exp_avg"].add_(1.0)
        else:
            st["exp_avg"] = torch.full((p.numel(),), float(value))
        sw.swap_out_optimizer_state(p)
    sw.log_timers()  # ZeRO-3's _post_step: the flush


def test_writes_in_flight_are_bounded_by_the_depth_and_flushed_at_step_end(tmp_path):
    store = TensorStore([Tier(str(tmp_path / "s"))], durable=False)
    gate = threading.Event()
    put = store._put
    seen = []

    def slow(key, tensor, **kw):
        if threading.current_thread() is not threading.main_thread():
            gate.wait(30)
        return put(key, tensor, **kw)

    store._put = slow
    sw, opt, ps = _swapper(tmp_path, store, depth=1)
    sw.swap_in_optimizer_state(ps[0])
    opt.state[ps[0]] = {"exp_avg": torch.ones(3000)}
    sw.swap_out_optimizer_state(ps[0])  # returns with its writes pending
    seen.append(sorted(store.pending_writes()))
    assert seen[0] == ["opt/0/fp32", "opt/0/state/exp_avg"] and ps[0].numel() == 0
    threading.Timer(0.3, gate.set).start()
    sw.swap_in_optimizer_state(ps[1])
    sw.swap_out_optimizer_state(ps[1])  # depth 1: waited for sub-group 0's writes first
    assert not any(k.startswith("opt/0/") for k in store.pending_writes())
    sw.log_timers()
    assert store.pending_writes() == [] and not sw._writing
    sw.swap_in_optimizer_state(ps[0])
    assert torch.equal(ps[0].data, torch.zeros(3000)) and torch.equal(opt.state[ps[0]]["exp_avg"], torch.ones(3000))
    store.close()


def test_pipelined_swapper_values_equal_the_synchronous_ones(tmp_path):
    out = []
    for depth in (0, 1, 2):
        store = TensorStore([Tier(str(tmp_path / f"s{depth}"))], durable=False)
        sw, opt, ps = _swapper(tmp_path / f"b{depth}", store, depth=depth)
        for step in range(3):
            _step(sw, opt, ps, 10.0 * step)
        got = []
        for p in ps:
            sw.swap_in_optimizer_state(p)
            got.append((p.data.clone(), opt.state[p]["exp_avg"].clone()))
        out.append(got)
        store.close()
    for other in out[1:]:
        for (a, b), (c, d) in zip(out[0], other):
            assert torch.equal(a, c) and torch.equal(b, d)


def test_failed_background_write_surfaces_at_the_step_end_naming_the_key(tmp_path):
    # room for the initial masters (3 x 3000 fp32 + headers) but not for a state tensor as well
    store = TensorStore([Tier(str(tmp_path / "s"), capacity_bytes=3 * (12288 + 4096) + 8192)], durable=False)
    sw, opt, ps = _swapper(tmp_path, store, depth=1)
    sw.swap_in_optimizer_state(ps[0])
    opt.state[ps[0]] = {"exp_avg": torch.ones(3000)}
    sw.swap_out_optimizer_state(ps[0])  # returns: the failure is on the writer thread
    with pytest.raises(StoreFullError, match=r"'opt/0/state/exp_avg'"):
        sw.log_timers()
    store.close()
