"""TGSS sketches: exact cases, linearity, EMA superposition, Count-Min bound, DCT round trip, state."""
import pytest
import torch

from titan_ds.optim.sketch import CountMinSketch, CountSketch, dct_matrix


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_single_element_is_exact():
    s = CountSketch(64, 3, seed=1)
    v = torch.zeros(1000)
    v[123] = 2.5
    s.update(v)
    assert s.query(torch.tensor([123])).item() == 2.5


def test_sparse_input_without_collisions_is_recovered():
    # 8 nonzeros in a 2**16-wide table: a collision in all 5 rows at once is (8/65536)**5-unlikely.
    s = CountSketch(1 << 16, 5, seed=2)
    v = torch.zeros(5000)
    idx = torch.randperm(5000)[:8]
    v[idx] = torch.randn(8)
    s.update(v[:2000], 0)
    s.update(v[2000:], 2000)
    torch.testing.assert_close(s.query_range(0, 5000), v, rtol=0, atol=0)


def test_linear_and_mergeable():
    a, b = torch.randn(3000), torch.randn(3000)
    sa, sb, sab = CountSketch(256, 3, 7), CountSketch(256, 3, 7), CountSketch(256, 3, 7)
    sa.update(a)
    sb.update(b)
    sab.update(a + b)
    torch.testing.assert_close((sa + sb).table, sab.table, rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="different"):
        sa.merge_(CountSketch(256, 3, 8))


def test_decay_keeps_the_sketch_of_the_exact_ema():
    s, ref = CountSketch(512, 3, 0), CountSketch(512, 3, 0)
    ema = torch.zeros(4000)
    for _ in range(10):
        g = torch.randn(4000)
        s.decay_(0.9)
        s.update(0.1 * g)
        ema = 0.9 * ema + 0.1 * g
    ref.update(ema)
    torch.testing.assert_close(s.table, ref.table, rtol=1e-5, atol=1e-5)


def test_count_min_never_underestimates():
    s = CountMinSketch(128, 4, 3)
    x = torch.rand(10000) ** 4
    s.update(x)
    assert bool((s.query_range(0, 10000) >= x - 1e-6).all())
    with pytest.raises(ValueError, match="non-negative"):
        s.update(-x)


def test_dct_roundtrip_and_offsets():
    d = dct_matrix(16)
    torch.testing.assert_close(d @ d.T, torch.eye(16), atol=1e-6, rtol=0)
    v = torch.randn(200)
    s = CountSketch(1 << 18, 3, 0, dct_chunk=16)
    s.update(v[:77], 5)  # chunks straddle the split: coefficients of the same chunk add up
    s.update(v[77:], 82)
    torch.testing.assert_close(s.query_range(5, 200), v, atol=1e-5, rtol=0)


def test_error_shrinks_with_width():
    g = torch.randn(20000) * (torch.rand(20000) < 0.02) * 10 + 0.1 * torch.randn(20000)
    errs = []
    for w in (512, 2048, 8192):
        s = CountSketch(w, 5, 0)
        s.update(g)
        errs.append(((s.query_range(0, 20000) - g).norm() / g.norm()).item())
    assert errs[0] > errs[1] > errs[2]


def test_state_dict_round_trip():
    s = CountSketch(64, 2, 5, dct_chunk=8)
    s.update(torch.randn(100), 3)
    t = CountSketch(64, 2, 5, dct_chunk=8)
    t.load_state_dict(s.state_dict())
    assert torch.equal(s.table, t.table)
    with pytest.raises(ValueError, match="does not match"):
        CountSketch(64, 2, 6).load_state_dict(s.state_dict())
