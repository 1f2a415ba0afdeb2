"""HGE, Holographic Gradient Encoding: coordinates bound to pseudo-random complex phases and superposed.

Each coordinate ``i`` is bound, in each of ``rows`` holograms, to a unit phase ``exp(j theta_r(i))`` and added
into complex slot ``h_r(i)`` of a length-``m`` complex vector (``m`` a power-of-two-free size chosen by the
byte budget; a complex slot costs two fp32 on the wire):

    ``H[r, h_r(i)] += x_i * exp(j theta_r(i))``

Binding and superposition are linear, so ranks all-reduce ``H`` itself. Decoding is correlation with the
conjugate key, ``x_hat_r(i) = Re(conj(exp(j theta_r(i))) H[r, h_r(i)])``, averaged over holograms: a colliding
coordinate ``x_k`` contributes ``x_k cos(theta_k - theta_i)``, half the variance of a +-1 sign, at the price of
half as many slots per byte as ``tgss``. Keys (slots and phases) are TGSS's hash family
(``tgss.hash_bins``: multiply-shift functions of the coordinate keyed by splitmix64 of (hologram, seed)):
identical on all ranks, new every step.

Why slots are hashed rather than the chunks being bound by circular convolution (an FFT layout): with
FFT binding every other chunk's energy spreads over every coordinate, so no coordinate is ever decoded
exactly and the exact sparse case (a gradient with fewer non-zeros than the budget) is lost; with hashed
slots a zero coordinate is non-zero in a hologram only when it collides there. Recovery (top-k of the
decoded magnitudes among coordinates whose slot is non-zero in every hologram, then the exact values in a
second all-reduce) and error feedback are shared with ``tgss`` in ``base.SketchCompressor``.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .base import EXPERIMENTAL_NOTE, SketchCompressor
from .tgss import hash_index

__all__ = ["Hologram", "HGECompressor", "CHUNK"]

CHUNK = 1 << 16  # coordinates whose keys are materialized at once (rows x CHUNK int64 + 2 fp32, ~4 MiB at 3 rows)


class Hologram:
    """``rows`` complex holograms of ``slots`` slots each, keyed by ``seed``; stored as (rows, slots, 2) reals.

    Keys (slots and phases) are recomputed per block of ``chunk`` coordinates in :meth:`encode` and
    :meth:`estimate` and never held for the whole gradient: the only full-size tensors are the ones the
    estimate returns (``n`` fp32 and ``n`` bool). The sums are accumulated in coordinate order, as an unchunked
    ``scatter_add_`` does, so the result does not depend on ``chunk`` (bit-identical on CPU, tested).
    """

    def __init__(self, rows: int, slots: int, seed: int, chunk: int = CHUNK):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.rows, self.slots, self.seed, self.chunk = rows, slots, seed, chunk

    def keys(self, n: int, device: Any = None, start: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots (rows, n) int64, cos, sin (rows, n) fp32) of coordinates ``start .. start + n - 1``."""
        idx = torch.arange(start, start + n, dtype=torch.int64, device=device)
        bins, bits = hash_index(idx, self.rows, self.slots, self.seed ^ 0x5A5A5A)
        assert bits is not None
        theta = bits.float()
        del bits
        theta.mul_(2 * math.pi / float(1 << 23))
        return bins, torch.cos(theta), theta.sin_()

    def _blocks(self, n: int):
        return ((lo, min(n, lo + self.chunk)) for lo in range(0, n, self.chunk))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``H[r, h_r(i)] += x_i exp(j theta_r(i))`` for every coordinate of the flat ``x``; (rows, slots, 2) fp32."""
        flat = x.reshape(-1)
        re = torch.zeros(self.rows, self.slots, dtype=torch.float32, device=x.device)
        im = torch.zeros_like(re)
        for lo, hi in self._blocks(flat.numel()):
            bins, c, s = self.keys(hi - lo, x.device, lo)
            xf = flat[lo:hi].float().unsqueeze(0)
            re.scatter_add_(1, bins, c.mul_(xf))
            im.scatter_add_(1, bins, s.mul_(xf))
        return torch.stack([re, im], dim=-1)

    def estimate(self, holo: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(decoded values averaged over holograms (n,), slot non-zero in every hologram (n,) bool).

        Per hologram ``x_hat_r(i) = Re(conj(exp(j theta_r(i))) H[r, h_r(i)]) = cos * Re H + sin * Im H``."""
        est = torch.empty(n, dtype=torch.float32, device=holo.device)
        cand = torch.empty(n, dtype=torch.bool, device=holo.device)
        hre, him = holo[..., 0], holo[..., 1]
        for lo, hi in self._blocks(n):
            bins, c, s = self.keys(hi - lo, holo.device, lo)
            re = torch.gather(hre, 1, bins)
            im = torch.gather(him, 1, bins)
            est[lo:hi] = c.mul_(re).add_(s.mul_(im)).mean(dim=0)
            cand[lo:hi] = ((re != 0) | (im != 0)).all(dim=0)
        return est, cand

    def decode(self, holo: torch.Tensor, n: int) -> torch.Tensor:
        return self.estimate(holo, n)[0]


class HGECompressor(SketchCompressor):
    """``hge``: holograms of ``rows x k`` complex slots (same bytes as tgss's ``rows x 2k`` table), then exact values.

    Its "keys" are the :class:`Hologram` itself: slots and phases are recomputed per block in encode and
    estimate (hashing twice costs less than holding ``rows x n`` int64 slots and fp32 cos/sin for the call:
    on a 1M-element gradient the call's peak extra RSS fell from 116 to 41 MiB, ``docs/compress.md``).
    """

    name = "hge"
    # said at initialize (CompressionPillar.apply): measured far behind the recommended section, which is why no
    # shipped profile uses it (results/compress_heldout/hge.md)
    experimental = EXPERIMENTAL_NOTE.format(method="HGE")

    def keys(self, n, cols, seed, device):
        return Hologram(self.rows, max(1, cols // 2), seed)

    def encode(self, acc, keys, cols, seed):
        return keys.encode(acc)

    def estimate(self, sketch, keys, n, cols, seed):
        return keys.estimate(sketch, n)
