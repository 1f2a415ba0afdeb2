"""The reducer's memory savings are exact: a SparseSent acts as its dense tensor bit for bit, and the residual
store adopts whole-parameter segments without a copy (and still rolls them back)."""
import torch

from titan_ds.comm.base import ResidualStore, Segment, SparseSent, subtract_sent_, zero_where_sent_


def _specials(n=64):
    x = torch.randn(n)
    x[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40])
    return x


def test_sparse_sent_is_its_dense_tensor_bit_for_bit():
    acc = _specials()
    idx = torch.tensor([1, 2, 5, 9, 33, 63])
    val = acc[idx].clone()
    val[3] = 0.0  # a selected coordinate whose value is zero: never masked
    sparse = SparseSent(idx, val, acc.numel())
    dense = sparse.dense()
    assert torch.equal(dense[idx], val) and dense.count_nonzero() <= idx.numel()
    a, b = acc.clone(), acc.clone()
    subtract_sent_(a, sparse)
    subtract_sent_(b, dense)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))  # same bits: -0.0 and NaN payloads included
    u = _specials()
    w = u.clone()
    zero_where_sent_(u, sparse)
    zero_where_sent_(w, dense)
    assert torch.equal(u.view(torch.int32), w.view(torch.int32))


def test_whole_parameter_segments_are_adopted_partial_ones_copied_and_both_roll_back():
    store = ResidualStore()
    layout = [Segment("a", 0, 0, 8, 8), Segment("b", 2, 8, 4, 10)]  # all of a; elements 2..5 of b
    first = torch.arange(12.0)
    store.write(first, layout)
    store.commit()
    a0, b0 = store.residuals["a"], store.residuals["b"].clone()
    new = -torch.arange(12.0)
    store.write(new, layout)
    assert store.residuals["a"].data_ptr() == new.data_ptr()  # a view of new: no copy
    assert store.residuals["b"].data_ptr() != new.data_ptr() and torch.equal(store.residuals["b"][2:6], new[8:12])
    store.rollback()
    assert store.residuals["a"] is a0 and torch.equal(store.residuals["a"], torch.arange(8.0))
    assert torch.equal(store.residuals["b"], b0)
    fresh = ResidualStore()  # created in a skipped step: gone after the rollback
    fresh.write(torch.ones(8), layout[:1])
    fresh.rollback()
    assert "a" not in fresh.residuals


def test_consume_works_in_the_callers_buffer_with_the_same_result():
    from titan_ds.comm.base import LocalCollective
    from titan_ds.comm.compressor import GradientReducer
    from titan_ds.comm.precondition import RMSOptions
    layout = [Segment("a", 0, 0, 300, 300), Segment("b", 0, 300, 212, 212)]
    keep, work = (GradientReducer("topk", 20, precondition=RMSOptions()) for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    for t in range(4):
        g = torch.randn(512, generator=gen)
        flat = g.clone()
        want = keep.reduce(g, layout, LocalCollective(), t)
        assert torch.equal(g, flat)  # consume=False leaves the caller's tensor alone
        got = work.reduce(flat, layout, LocalCollective(), t, consume=True)
        assert torch.equal(want, got)
        assert not torch.equal(flat, g)  # it was the working buffer (now the residual)
        assert torch.equal(work.residuals.residuals["a"], keep.residuals.residuals["a"])


def test_the_hooks_flatten_into_a_fresh_buffer_with_deepspeeds_values():
    from torch._utils import _flatten_dense_tensors

    from titan_ds.comm.hooks import _flatten
    g1, g2 = torch.randn(10), torch.randn(5)
    one = _flatten([g1])  # DeepSpeed's engine.flatten returns a view of g1 here: the reducer must not consume it
    assert one.data_ptr() != g1.data_ptr() and torch.equal(one, _flatten_dense_tensors([g1]))
    g3 = torch.randn(5, 3).t()  # not contiguous
    two = _flatten([g1, g2, g3])
    assert torch.equal(two, _flatten_dense_tensors([g1, g2, g3]))
    half = _flatten([g1.bfloat16(), g2.bfloat16()])
    assert half.dtype == torch.bfloat16 and torch.equal(half, _flatten_dense_tensors([g1.bfloat16(), g2.bfloat16()]))


def _mapping_starts() -> set[int]:
    with open("/proc/self/maps") as f:
        return {int(line.split("-", 1)[0], 16) for line in f}


def test_a_large_host_workspace_is_a_mapping_of_its_own_and_a_small_one_plain_zeros():
    from titan_ds.comm.base import WORKSPACE_MMAP_BYTES, workspace_zeros
    n = WORKSPACE_MMAP_BYTES // 4 * 3
    big = workspace_zeros(n, "cpu")
    assert big.shape == (n,) and big.dtype == torch.float32 and not big.any()
    # its data starts a mapping (heap or allocator memory starts after a chunk header: never on a mapping's start)
    assert big.data_ptr() in _mapping_starts()
    big[-1] = 3.0
    assert float(big.sum()) == 3.0
    heap = torch.zeros(n)
    assert heap.data_ptr() not in _mapping_starts()
    small = workspace_zeros(16, "cpu", torch.bfloat16)
    assert small.dtype == torch.bfloat16 and small.shape == (16,) and not small.any()
    meta = workspace_zeros(n, "meta")  # an accelerator's buffer is torch.zeros on its device
    assert meta.device.type == "meta" and meta.shape == (n,)


def test_chunked_topk_selects_the_same_set_as_one_call():
    from titan_ds.comm.topk import topk_indices
    gen = torch.Generator().manual_seed(1)
    mag = torch.randn(10_000, generator=gen).abs()
    mag[[17, 5000, 9999]] = torch.tensor([float("nan"), float("inf"), 1e30])  # NaN and Inf first, as torch.topk
    for k, chunk in ((1, 1000), (37, 1000), (999, 1000), (2500, 1000), (300, 3333), (37, 20_000)):
        want = torch.topk(mag, k, sorted=False).indices
        got = topk_indices(mag, k, chunk=chunk)
        assert got.numel() == k and set(got.tolist()) == set(want.tolist()), (k, chunk)
        assert {17, 5000, 9999} <= set(got.tolist()) or k < 3


def _bits(t):
    return t.contiguous().view(torch.int32)


def test_a_pending_scale_reads_bit_for_bit_as_the_scaled_tensor_without_copying_it():
    """``ResidualStore.scale_`` keeps the factor pending (no second full-size copy beside the journal's): every
    read gives the bits of multiplying at once, chained scales round twice as two multiplications do, and a
    skipped step takes the factor back with the tensors."""
    gen = torch.Generator().manual_seed(3)
    a0, b0 = torch.randn(8, generator=gen) * 1e3, torch.randn(10, generator=gen) / 7
    store = ResidualStore()
    store.write(torch.cat([a0, b0[2:6]]), [Segment("a", 0, 0, 8, 8), Segment("b", 2, 8, 4, 10)])
    store.commit()
    want = {"a": store.residuals["a"].clone(), "b": store.residuals["b"].clone()}
    held = {k: v for k, v in store.residuals.items()}
    store.scale_(0.3)
    assert all(store.residuals[k] is held[k] for k in held)  # nothing materialized
    for k in want:
        assert torch.equal(_bits(store.get(k)), _bits(want[k] * 0.3))
    acc, ref = torch.randn(12, generator=gen), None
    ref = acc.clone()
    layout = [Segment("a", 0, 0, 8, 8), Segment("b", 2, 8, 4, 10)]
    store.add_into(acc, layout)
    ref[:8] += want["a"] * 0.3
    ref[8:] += (want["b"] * 0.3)[2:6]
    assert torch.equal(_bits(acc), _bits(ref))
    state = store.state_dict()
    assert torch.equal(_bits(state["b"]), _bits(want["b"] * 0.3))
    # a skipped step: the factor goes back with the tensors
    store.rollback()
    assert not store._factor and all(torch.equal(store.get(k), want[k]) for k in want)
    # a factor pending across a committed step, then a second one and a partial write: two roundings, as eager
    store.scale_(0.3)
    store.commit()
    store.scale_(1.7)
    assert torch.equal(_bits(store.get("a")), _bits(want["a"] * 0.3 * 1.7))
    store.write(torch.full((4,), 5.0), [Segment("b", 6, 0, 4, 10)])  # partial: applies the factor, then writes
    eager_b = want["b"] * 0.3 * 1.7
    eager_b[6:10] = 5.0
    assert torch.equal(_bits(store.get("b")), _bits(eager_b)) and "b" not in store._factor
    store.rollback()
    assert torch.equal(_bits(store.get("b")), _bits(want["b"] * 0.3)) and store._factor == {"a": 0.3, "b": 0.3}
    # a whole-parameter write replaces the tensor: no factor on the new one
    store.write(torch.ones(8), [Segment("a", 0, 0, 8, 8)])
    assert "a" not in store._factor and torch.equal(store.get("a"), torch.ones(8))
    store.rollback()
    fresh = ResidualStore()
    fresh.load_state_dict(store.state_dict())
    assert not fresh._factor and all(torch.equal(_bits(fresh.get(k)), _bits(store.get(k))) for k in want)
