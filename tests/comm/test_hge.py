"""HGE (titan_ds/comm/hge.py): the hologram encoding itself. What HGE shares with every compressor (exact sparse
case, error-feedback invariant, bytes on the wire, state round trip, non-finite steps) is parametrized over
the methods in test_compressor.py; the 2-rank DeepSpeed runs are in test_hooks.py."""
from __future__ import annotations

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
