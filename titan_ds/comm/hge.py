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

import torch

from .base import SketchCompressor
from .tgss import hash_bins

__all__ = ["Hologram", "HGECompressor"]


class Hologram:
    """``rows`` complex holograms of ``slots`` slots each, keyed by ``seed``; stored as (rows, slots, 2) reals."""

    def __init__(self, rows: int, slots: int, seed: int):
        self.rows, self.slots, self.seed = rows, slots, seed

    def keys(self, n: int, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bins, bits = hash_bins(n, self.rows, self.slots, self.seed ^ 0x5A5A5A, device)
        theta = bits.float() * (2 * math.pi / float(1 << 23))
        return bins, torch.cos(theta), torch.sin(theta)

    def encode(self, x: torch.Tensor, keys=None) -> torch.Tensor:
        bins, c, s = keys if keys is not None else self.keys(x.numel(), x.device)
        xf = x.float().unsqueeze(0)
        re = torch.zeros(self.rows, self.slots, dtype=torch.float32, device=x.device)
        im = torch.zeros_like(re)
        re.scatter_add_(1, bins, c * xf)
        im.scatter_add_(1, bins, s * xf)
        return torch.stack([re, im], dim=-1)

    def correlate(self, holo: torch.Tensor, n: int, keys=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-hologram decoded values (rows, n), slot non-zero (rows, n))."""
        bins, c, s = keys if keys is not None else self.keys(n, holo.device)
        re = torch.gather(holo[..., 0], 1, bins)
        im = torch.gather(holo[..., 1], 1, bins)
        return c * re + s * im, (re != 0) | (im != 0)

    def decode(self, holo: torch.Tensor, n: int) -> torch.Tensor:
        return self.correlate(holo, n)[0].mean(dim=0)


class HGECompressor(SketchCompressor):
    """``hge``: holograms of ``rows x k`` complex slots (same bytes as tgss's ``rows x 2k`` table), then exact values."""

    name = "hge"

    def keys(self, n, cols, seed, device):
        return Hologram(self.rows, max(1, cols // 2), seed).keys(n, device)

    def encode(self, acc, keys, cols, seed):
        return Hologram(self.rows, max(1, cols // 2), seed).encode(acc, keys)

    def estimate(self, sketch, keys, n, cols, seed):
        vals, nz = Hologram(self.rows, max(1, cols // 2), seed).correlate(sketch, n, keys)
        return vals.mean(dim=0), nz.all(dim=0)
