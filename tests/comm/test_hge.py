"""HGE (titan_ds/comm/hge.py): the hologram encoding itself. What HGE shares with every compressor (exact sparse
case, error-feedback invariant, bytes on the wire, state round trip, non-finite steps) is parametrized over
the methods in test_compressor.py; the 2-rank DeepSpeed runs are in test_hooks.py."""
from __future__ import annotations

import pytest
import torch

from titan_ds.comm import build_compressor
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


def test_registry_builds_hge():
    assert isinstance(build_compressor("hge", 10.0, 3), HGECompressor)


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
    assert isinstance(keys, Hologram)
    assert not any(isinstance(v, torch.Tensor) for v in vars(keys).values())
