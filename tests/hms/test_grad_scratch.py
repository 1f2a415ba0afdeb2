"""The optimizer swapper's gradient scratch: every sub-group of a step reads its gradient into one reused buffer
(not a fresh tensor each, which under HMS's 1 MiB mmap threshold is fresh pages every time), with the same values
as before: a gradient whose pieces tile the sub-group, one that covers only part of it (the rest zero), a larger
sub-group after a smaller one; dropped at the step's end. The engine-level parity (HMS against DeepSpeed's own
offload, bit for bit) is tests/hms/test_swapper.py's."""
import torch

from tests.hms.test_pipeline import _swapper
from titan_ds.hms.store import TensorStore, Tier
from titan_ds.hms.optimizer_swapper import HMSOptimizerSwapper


def test_sub_groups_share_one_gradient_buffer_with_their_own_values(tmp_path):
    store = TensorStore([Tier(str(tmp_path / "s"))], durable=False)
    sw, opt, ps = _swapper(tmp_path, store, depth=0, n=3000, groups=3)
    ptrs = []
    for step in range(2):
        grads = [torch.randn(3000) for _ in ps]  # backward hands each sub-group's gradient over
        sw.swap_out_gradients(ps[0], [0, 1000], [grads[0][:1000], grads[0][1000:]])  # tiles the sub-group
        sw.swap_out_gradients(ps[1], [500], [grads[1][500:2000]])  # covers a part: the rest must read as zeros
        sw.swap_out_gradients(ps[2], [0], [grads[2]])
        want = [grads[0], torch.cat([torch.zeros(500), grads[1][500:2000], torch.zeros(1000)]), grads[2]]
        for i, p in enumerate(ps):
            sw.swap_in_optimizer_state(p)
            assert torch.equal(p.grad, want[i]), (step, i)
            ptrs.append(p.grad.untyped_storage().data_ptr())
            p.grad.fill_(float("nan"))  # what the step leaves in it must not reach the next sub-group
            sw.swap_out_optimizer_state(p)
            assert p.grad is None
        assert sw._grad_scratch is not None
        sw.log_timers()  # ZeRO-3's end of step
        assert sw._grad_scratch is None  # not held through forward and backward
    assert len(set(ptrs[:3])) == 1 and len(set(ptrs[3:])) == 1  # one buffer a step
    store.close()


def test_a_larger_sub_group_grows_the_scratch(tmp_path):
    store = TensorStore([Tier(str(tmp_path / "s"))], durable=False)
    sw, opt, ps = _swapper(tmp_path, store, depth=0, n=2000, groups=1)
    big = torch.nn.Parameter(torch.zeros(5000))
    big.ds_id = 9
    sw.initialize_parameters([big], [big.data.clone()])
    g_small, g_big = torch.randn(2000), torch.randn(5000)
    for p, g in ((ps[0], g_small), (big, g_big), (ps[0], g_small)):
        sw.swap_out_gradients(p, [0], [g])
        sw.swap_in_optimizer_state(p)
        assert torch.equal(p.grad, g)
        sw.swap_out_optimizer_state(p)
    assert sw._grad_scratch.numel() == 5000
    store.close()


def test_a_sub_group_laid_out_back_to_back_in_zero3s_buffer_steps_on_it_without_a_copy(tmp_path):
    """ZeRO-3 lays its fp32 gradient partitions out in the sub-groups' order (``grad_partitions_flat_buffer``): a
    sub-group whose pieces lie there back to back is handed that range itself, not a copy in the scratch; pieces
    that do not (out of place, a gap, or some in the store) are copied as before, with the same values."""
    store = TensorStore([Tier(str(tmp_path / "s"))], durable=False)
    sw, opt, ps = _swapper(tmp_path, store, depth=0, n=3000, groups=3)
    flat = torch.randn(10_000)
    sw.grad_buffer = flat  # as install's attach sets it ("dram"); the disk mapping is the same case
    sw.swap_out_gradients(ps[0], [1000, 0], [flat[1000:3000], flat[:1000]])  # back to back, handed out of order
    sw.swap_out_gradients(ps[1], [0, 1000], [flat[3000:4000], flat[4500:6500]])  # not back to back in the buffer
    sw.swap_out_gradients(ps[2], [0], [flat[7000:]])
    want = [flat[:3000].clone(), torch.cat([flat[3000:4000], flat[4500:6500]]), flat[7000:].clone()]
    for i, p in enumerate(ps):
        sw.swap_in_optimizer_state(p)
        assert torch.equal(p.grad, want[i]), i
        in_buffer = p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert in_buffer == (i != 1), i
        if in_buffer:
            assert p.grad.data_ptr() == flat[{0: 0, 2: 7000}[i]:].data_ptr()
        p.grad.mul_(0.5)  # ZeRO-3's clip scales it in place: the buffer's range is dead after the step anyway
        sw.swap_out_optimizer_state(p)
    assert sw.grads_in_place == 2 and torch.equal(flat[:3000], want[0] * 0.5)
    assert torch.equal(flat[3000:4000], want[1][:1000])  # the copied sub-group left the buffer alone
    store.close()


def test_the_next_subgroups_gradient_range_is_advised_page_aligned_and_only_in_the_file_mapping(monkeypatch, tmp_path):
    """_advise_gradient asks the kernel for the pages under a sub-group's gradient views in the file mapping
    (madvise WILLNEED from the page holding the first value to the end of the last), nothing for views of another
    buffer or a sub-group without views."""
    import ctypes
    import mmap
    import types

    from titan_ds.hms import optimizer_swapper as sw_mod

    calls = []

    def fake(addr, length, advice):
        calls.append((addr.value, length.value, advice))
        return 0
    monkeypatch.setattr(sw_mod, "_MADVISE", fake)
    path = tmp_path / "g.bin"
    path.write_bytes(b"\0" * (4 * 10000))
    mapped = torch.from_file(str(path), shared=True, size=10000, dtype=torch.float32)
    other = torch.zeros(10000)
    sw = types.SimpleNamespace(grad_file=types.SimpleNamespace(mapped=mapped), grads_advised=0,
                               _grad_views={"a": [(0, mapped[3000:3500]), (500, mapped[3500:5000])],
                                            "b": [(0, other[:100])], "c": []})
    for pid in ("a", "b", "c", "d"):
        HMSOptimizerSwapper._advise_gradient(sw, pid)
    base, page = mapped.data_ptr(), mmap.PAGESIZE
    start, end = base + 3000 * 4, base + 5000 * 4
    assert calls == [(start // page * page, end - start // page * page, mmap.MADV_WILLNEED)]
    assert sw.grads_advised == 1
    assert isinstance(sw_mod._libc_madvise(), (type(None), ctypes._CFuncPtr))
