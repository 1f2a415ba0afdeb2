"""TGSS, the one count sketch (titan_ds/comm/tgss.py): hashes, exact cases, unbiasedness, linearity, EMA
superposition, Count-Min bound, DCT round trip, state, and the tgss compressor using the same sketch."""
import pytest
import torch

from titan_ds.comm import build_compressor
from titan_ds.comm.tgss import CountMinSketch, CountSketch, dct_matrix, hash_bins, hash_index, median_rows


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


def test_unbiased_over_seeds():
    """E over hash seeds of the (one-row) estimate is the true value. x has a positive mean, so an estimate
    without the random signs would be off by about sum(x) / width = 31 per element."""
    n, width, seeds = 1000, 32, 400
    x = torch.randn(n) + 1.0
    ests = []
    for seed in range(seeds):
        s = CountSketch(width, 1, seed)
        s.update(x)
        ests.append(s.query_range(0, n))
    est = torch.stack(ests)
    one_sketch_err = (est - x).norm(dim=1).mean()
    # the average of 400 independent unbiased estimates: 1/20 of one sketch's error; 1/10 leaves room
    assert float((est.mean(dim=0) - x).norm()) < 0.1 * float(one_sketch_err)


def test_hashes_in_range_and_balanced():
    bins, bits = hash_bins(50_000, 3, 97, seed=5)
    assert int(bins.min()) >= 0 and int(bins.max()) < 97
    counts = torch.bincount(bins[0], minlength=97).float()
    assert counts.std() / counts.mean() < 0.1  # ~Poisson(515): 0.044 expected
    assert abs(float((bits >> 22).float().mean()) - 0.5) < 0.01
    b2, _ = hash_bins(50_000, 3, 97, seed=6)
    assert not torch.equal(bins, b2)
    assert not torch.equal(bins[0], bins[1])


def test_hashes_depend_only_on_the_global_index():
    """A slice of indices hashes like the same indices inside a longer range (global offsets), and Count-Min
    skips the sign bits."""
    bins, bits = hash_bins(3000, 3, 101, seed=4)
    b, t = hash_index(torch.arange(1000, 2000), 3, 101, seed=4)
    assert torch.equal(b, bins[:, 1000:2000]) and torch.equal(t, bits[:, 1000:2000])
    assert hash_index(torch.arange(10), 3, 101, seed=4, with_bits=False)[1] is None


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_median_rows_matches_torch(rows):
    e = torch.randn(rows, 1000)
    assert torch.equal(median_rows(e), e.median(dim=0).values)


def test_compressor_sketch_is_the_count_sketch():
    """One sketch: the tgss compressor's per-call table and estimate are CountSketch's for (cols, rows, seed)."""
    n, cols, seed = 3000, 256, 11
    x = torch.randn(n)
    comp = build_compressor("tgss", 4.0, 3)
    keys = comp.keys(n, cols, seed, None)
    table = comp.encode(x, keys, cols, seed)
    s = CountSketch(cols, 3, seed)
    s.update(x)
    assert torch.equal(table, s.table)
    assert torch.equal(comp.estimate(table, keys, n, cols, seed)[0], s.query_range(0, n))


def test_single_heavy_coordinate_decodes_exactly_through_the_compressor():
    n = 5000
    x = torch.zeros(n)
    x[1234] = 3.5
    comp = build_compressor("tgss", 4.0, 3)
    keys = comp.keys(n, 128, 1, None)
    torch.testing.assert_close(comp.estimate(comp.encode(x, keys, 128, 1), keys, n, 128, 1)[0], x)
