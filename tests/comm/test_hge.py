"""HGE (titan_ds/comm/hge.py): the hologram encoding itself. What HGE shares with every compressor (exact sparse
case, error-feedback invariant, bytes on the wire, state round trip, non-finite steps) is parametrized over
the methods in test_compressor.py; the 2-rank DeepSpeed runs are in test_hooks.py."""
from __future__ import annotations

import pytest
import torch

from titan_ds.comm import build_compressor
from titan_ds.comm.base import CountingCollective, LocalCollective, sketch_budget
from titan_ds.comm.hge import HGECompressor, Hologram
from titan_ds.comm.tgss import hash_bins


def test_holograms_are_linear():
    n = 5000
    x, y = torch.randn(n), torch.randn(n)
    hg = Hologram(3, 64, 9)
    torch.testing.assert_close(hg.encode(x) + hg.encode(y), hg.encode(x + y), rtol=1e-5, atol=1e-4)


def test_single_heavy_coordinate_decodes_exactly():
    """HGE averages holograms, so a zero coordinate colliding in one of them decodes to a fraction of x_i; the
    heavy one itself comes back exactly (|exp(j theta)|^2 = 1)."""
    n = 5000
    x = torch.zeros(n)
    x[1234] = 3.5
    hg = Hologram(3, 64, 1)
    assert abs(float(hg.decode(hg.encode(x), n)[1234]) - 3.5) < 1e-6


def test_slots_are_tgss_hashes_and_new_each_seed():
    """One hash family (TGSS's): a hologram's slots and phases are hash_bins of (rows, slots, a seed derived
    from the hologram's), so HGE and TGSS never share a collision pattern at the same seed."""
    n, rows, slots = 3000, 3, 97
    bins, bits = hash_bins(n, rows, slots, 5 ^ 0x5A5A5A)
    slot, cos, _ = Hologram(rows, slots, 5).keys(n)
    assert torch.equal(slot, bins)
    torch.testing.assert_close(cos, torch.cos(bits.float() * (2 * torch.pi / float(1 << 23))))
    assert not torch.equal(hash_bins(n, rows, slots, 5)[0], slot)
    assert not torch.equal(Hologram(rows, slots, 6).keys(n)[0], slot)


def test_one_sparse_vector_decodes_to_its_collisions_everywhere():
    """x = v e_k decodes, at every coordinate i, to ``v * mean_r [h_r(i) = h_r(k)] cos(theta_r(k) - theta_r(i))``
    (the correlation of i's key with k's), computed here from TGSS's hashes: exactly v at k, exactly 0 where i
    never shares k's slot."""
    n, rows, slots, seed, k, v = 3001, 3, 53, 11, 1234, -2.75
    x = torch.zeros(n)
    x[k] = v
    hg = Hologram(rows, slots, seed)
    got = hg.decode(hg.encode(x), n)
    bins, bits = hash_bins(n, rows, slots, seed ^ 0x5A5A5A)
    theta = bits.double() * (2 * torch.pi / float(1 << 23))
    want = v * ((bins == bins[:, k:k + 1]) * torch.cos(theta[:, k:k + 1] - theta)).mean(dim=0)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    assert float(got[k]) == pytest.approx(v, abs=1e-6)
    alone = ~(bins == bins[:, k:k + 1]).any(dim=0)
    assert int(alone.sum()) > n // 2 and bool((got[alone] == 0).all())


# seed 0-5 at (n, rows, slots) = (20000, 3, 500), (50000, 3, 1000), (8000, 5, 200), (30011, 3, 701): HGE's mean
# squared error is 0.92-1.02 of ||x||^2 / (2 rows slots); a +-1 sign sketch on the same slots 1.80-2.10 of it
@pytest.mark.parametrize("n,rows,slots,seed", [(20000, 3, 500, 0), (8000, 5, 200, 3)])
def test_decode_error_is_half_that_of_a_sign_sketch(n, rows, slots, seed):
    """The docstring's claim: a colliding x_k adds x_k cos(theta_k - theta_i), of mean square x_k^2 / 2, so on a
    dense x the decode error's mean square is ||x||^2 / (2 rows slots): half that of +-1 signs on the same slots."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    hg = Hologram(rows, slots, seed)
    err = hg.decode(hg.encode(x), n) - x
    predicted = float(x.square().sum()) / (2 * rows * slots)
    mse = float(err.square().mean())
    assert 0.8 * predicted < mse < 1.25 * predicted, mse / predicted
    bins, bits = hash_bins(n, rows, slots, seed ^ 0x5A5A5A)
    sign = (bits >> 22).float() * 2 - 1  # TGSS's +-1: the top hash bit
    table = torch.zeros(rows, slots).scatter_add_(1, bins, sign * x)
    sign_mse = float(((sign * torch.gather(table, 1, bins)).mean(dim=0) - x).square().mean())
    assert mse < 0.65 * sign_mse, (mse, sign_mse)


def test_registered_hge_finds_heavy_coordinates_in_dense_noise():
    """Through the registry and the two-round reduce: 20 coordinates of 100 in unit noise (the decode's noise
    is ~2.2 here) are all selected and come back with their exact values; the wire holds rows x cols + k fp32,
    within the 4 n / ratio bytes budget."""
    n, ratio, rows = 4096, 4.0, 3
    k, cols = sketch_budget(n, ratio, rows)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, generator=gen)
    heavy = torch.randperm(n, generator=gen)[:20]
    x[heavy] = 100.0
    comm = CountingCollective(LocalCollective())
    summed, sent = build_compressor("hge", ratio, rows).reduce(x, comm, 9, layout=[])
    assert torch.equal(summed[heavy], x[heavy]) and torch.equal(sent, summed)
    assert int((summed != 0).sum()) == k  # the k best candidates, exact values (x has no zero)
    assert torch.equal(summed[summed != 0], x[summed != 0])
    assert comm.bytes == 4 * (rows * cols + k) <= 4 * n / ratio


def _reference_holograms(x: torch.Tensor, rows: int, slots: int, seed: int):
    """The seed's unchunked HGE, written out: full (rows, n) slots and phases, then scatter/gather."""
    n = x.numel()
    bins, bits = hash_bins(n, rows, slots, seed ^ 0x5A5A5A)
    theta = bits.float() * (2 * torch.pi / float(1 << 23))
    c, s = torch.cos(theta), torch.sin(theta)
    re = torch.zeros(rows, slots).scatter_add_(1, bins, c * x.unsqueeze(0))
    im = torch.zeros(rows, slots).scatter_add_(1, bins, s * x.unsqueeze(0))
    holo = torch.stack([re, im], dim=-1)
    gre, gim = torch.gather(re, 1, bins), torch.gather(im, 1, bins)
    return holo, (c * gre + s * gim).mean(dim=0), ((gre != 0) | (gim != 0)).all(dim=0)


@pytest.mark.parametrize("chunk", [1, 257, 4096, 1 << 20])
def test_chunked_hologram_is_the_unchunked_one(chunk):
    """Keys are recomputed per block (no rows x n temporaries): encode and estimate must equal the unchunked
    formulas bit for bit on CPU, for any block size, including blocks that do not divide n."""
    n, rows, slots, seed = 5003, 3, 211, 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    holo, est, cand = _reference_holograms(x, rows, slots, seed)
    hg = Hologram(rows, slots, seed, chunk=chunk)
    assert torch.equal(hg.encode(x), holo)
    got_est, got_cand = hg.estimate(holo, n)
    assert torch.equal(got_est, est)
    assert torch.equal(got_cand, cand)


def test_compressor_keys_hold_no_full_size_tensor():
    """HGE's per-call keys are the hologram's parameters, not rows x n slots and phases (the seed's 16 bytes per
    coordinate and row): nothing the size of the gradient is kept between encode and estimate."""
    keys = HGECompressor(100.0, 3).keys(1 << 20, 4000, 1, None)
    assert (keys.rows, keys.slots) == (3, 2000)  # cols // 2 complex slots: rows x cols reals on the wire
    assert not any(isinstance(v, torch.Tensor) for v in vars(keys).values())


@pytest.mark.parametrize("method", ["hge", "tgss"])
def test_the_sketch_methods_warn_that_they_are_experimental_naming_the_measured_loss(method, caplog):
    """HGE and TGSS lost 0.7-2.2 nats to dense AdamW with the rms preconditioners (results/compress_heldout/hge.md):
    initialize says so once, naming the measured loss and the section to use; the recommended method does not."""
    import logging

    from tests.comm.test_precondition import _ctx
    from titan_ds.engine import prepare
    with caplog.at_level(logging.WARNING, logger="titan_ds.comm"):
        prepare(_ctx({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
                     compression={"method": method, "ratio": 50, "precondition": "rms_sketch"}))
    said = [r.getMessage() for r in caplog.records if "experimental" in r.getMessage()]
    assert len(said) == 1 and f"method={method!r}" in said[0]
    assert "0.7 to 2.2 nats" in said[0] and "compress_rms_sketch.json" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titan_ds.comm"):
        prepare(_ctx({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
                     compression={"method": "qtopk", "ratio": 50, "precondition": "rms_sketch"}))
    assert not [r for r in caplog.records if "experimental" in r.getMessage()]
