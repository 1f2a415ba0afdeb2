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
