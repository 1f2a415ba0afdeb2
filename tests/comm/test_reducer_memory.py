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


def test_a_one_tensor_bucket_is_a_view_of_its_gradient_and_is_not_consumed():
    from torch._utils import _flatten_dense_tensors

    from titan_ds.comm.hooks import _owned
    g1, g2 = torch.randn(10), torch.randn(5)
    one = _flatten_dense_tensors([g1])  # DeepSpeed's engine.flatten: a view for a single tensor
    assert one.data_ptr() == g1.data_ptr() and not _owned(one, [g1])
    assert _owned(_flatten_dense_tensors([g1, g2]), [g1, g2])


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
