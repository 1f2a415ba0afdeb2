"""TGSS as a gradient compressor: a count sketch of the error-compensated gradient, all-reduced directly.

The count sketch (Charikar et al. 2002; FetchSGD, Rothchild et al. 2020) hashes coordinate ``i`` to bin
``h_r(i)`` with sign ``s_r(i)`` in each of ``rows`` rows: ``S[r, h_r(i)] += s_r(i) x_i``. It is linear, so
the sum of the ranks' sketches is the sketch of the summed gradient and a plain all-reduce merges them.
The estimate of ``x_i`` is the median over rows of ``s_r(i) S[r, h_r(i)]``.

Hashes are multiply-shift functions of the coordinate keyed by splitmix64(row, seed), computed on the fly (no tables kept): the same on
every rank, new each step (the seed includes the step; see ``GradientReducer``), so a collision pattern
does not persist. The two-round recovery and error feedback live in ``compressor.SketchCompressor``.

This is a minimal sketch kept inside titan_ds/comm; ``titan_ds.optim.sketch`` (ASDT importance) is a
separate, accumulating sketch.
"""
from __future__ import annotations

import torch

from .compressor import SketchCompressor

__all__ = ["splitmix64", "hash_bins", "median_rows", "CountSketch", "TGSSCompressor"]

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64 constants as signed int64 (torch wraps on overflow)
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLD = 0x9E3779B97F4A7C15 - (1 << 64)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser on int64 tensors: a bijective, well-mixed hash of each element."""
    x = x * _GOLD
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def _mix_int(x: int) -> int:
    """splitmix64 on a Python int (scalar keys for the per-row hash functions)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= (1 << 63) else x


def hash_bins(n: int, rows: int, cols: int, seed: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bins, bits)``: per row and coordinate a bin in ``[0, cols)`` and 23 further hash bits (signs, phases).

    Multiply-shift hashing (Dietzfelbinger et al. 1997): the top 32 bits of ``(a i + b) mod 2^64`` with odd
    ``a`` and ``b`` drawn per row from splitmix64 of the seed, scaled to ``[0, cols)``; a second, independent
    function gives the 23 ``bits``. In-place int64 ops: 0.55 s for 3 x 4.8M coordinates on one loaded core
    (a splitmix64 per coordinate took 1.2 s, the same formula out of place 1.8 s).
    """
    i = torch.arange(n, dtype=torch.int64, device=device).unsqueeze(0)
    consts = [[_signed(_mix_int(seed * 1_000_003 + r * 4 + j) | (1 if j % 2 == 0 else 0)) for j in range(4)]
              for r in range(rows)]
    a1, b1, a2, b2 = (torch.tensor([row[j] for row in consts], dtype=torch.int64, device=device).unsqueeze(1)
                      for j in range(4))
    bins = torch.empty(rows, n, dtype=torch.int64, device=device)
    torch.mul(i, a1, out=bins).add_(b1)
    bins.bitwise_right_shift_(32).bitwise_and_(0xFFFFFFFF).mul_(cols).bitwise_right_shift_(32)  # no modulo bias
    bits = torch.empty_like(bins)
    torch.mul(i, a2, out=bits).add_(b2)
    bits.bitwise_right_shift_(41).bitwise_and_(0x7FFFFF)  # top 23 bits
    return bins, bits


class CountSketch:
    """``rows x cols`` count sketch with hashes derived from ``seed``; ``encode`` and ``estimate`` are linear."""

    def __init__(self, rows: int, cols: int, seed: int):
        self.rows, self.cols, self.seed = rows, cols, seed

    def hashes(self, n: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        bins, bits = hash_bins(n, self.rows, self.cols, self.seed, device)
        signs = bits.bitwise_right_shift_(22).to(torch.float32).mul_(2).sub_(1)  # the top hash bit
        return bins, signs

    def encode(self, x: torch.Tensor, keys=None) -> torch.Tensor:
        bins, signs = keys if keys is not None else self.hashes(x.numel(), x.device)
        table = torch.zeros(self.rows, self.cols, dtype=torch.float32, device=x.device)
        table.scatter_add_(1, bins, signs * x.float().unsqueeze(0))
        return table

    def row_values(self, table: torch.Tensor, n: int, keys=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-row signed estimates (rows, n), per-row bin contents (rows, n))."""
        bins, signs = keys if keys is not None else self.hashes(n, table.device)
        content = torch.gather(table, 1, bins)
        return signs * content, content

    def estimate(self, table: torch.Tensor, n: int, keys=None) -> torch.Tensor:
        return median_rows(self.row_values(table, n, keys)[0])


def median_rows(est: torch.Tensor) -> torch.Tensor:
    """Median over dim 0 (lower median for an even count); closed form for 1-3 rows (4x faster than torch)."""
    if est.shape[0] == 1:
        return est[0]
    if est.shape[0] == 2:
        return torch.minimum(est[0], est[1])  # torch.median's lower median
    if est.shape[0] == 3:
        a, b, c = est[0], est[1], est[2]
        return torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))
    return est.median(dim=0).values


class TGSSCompressor(SketchCompressor):
    """``tgss``: count-sketch round 1 (``rows x 2k`` fp32), exact values of the recovered top-k in round 2."""

    name = "tgss"

    def keys(self, n, cols, seed, device):
        return CountSketch(self.rows, cols, seed).hashes(n, device)

    def encode(self, acc, keys, cols, seed):
        return CountSketch(self.rows, cols, seed).encode(acc, keys)

    def estimate(self, sketch, keys, n, cols, seed):
        est, content = CountSketch(self.rows, cols, seed).row_values(sketch, n, keys)
        return median_rows(est), (content != 0).all(dim=0)
