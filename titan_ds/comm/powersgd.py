"""``powersgd``: rank-r PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019) with warm start and error feedback.

Each parameter's gradient is viewed as the matrix ``M = (shape[0], prod(shape[1:]))`` and replaced by a rank-``r``
approximation computed with one step of subspace (power) iteration, started from the previous step's ``Q``.
Both factors are linear in ``M``, so ranks all-reduce them. Per bucket, on each rank (``acc = grad + residual``,
the reducer's error feedback):

1. **Plan** (:func:`plan`, the same on every rank: it depends only on the layout). A parameter with one dimension
   (biases, norms), or whose matrix would not shrink by at least ``min_compression``
   (``(n + m) r * min_compression >= n m``, the rule of torch's ``powerSGD_hook``), is sent dense. So is the
   ragged head and tail of a parameter that DeepSpeed split across buckets at an offset that is not a row
   boundary; the whole rows in between form a matrix of their own (its own ``Q``). ``r = min(n, m, rank)``.
2. ``Q`` (m x r): the previous step's summed ``Q`` for this matrix (warm start; kept per parameter in the
   ``q`` store), or, the first time, ``randn`` from a generator seeded by (``seed``, parameter name), so every
   rank starts from the same ``Q``. It is orthonormalized first, as torch's hook does (only the span of ``Q``
   matters, and this keeps ``P`` well conditioned).
3. ``P = M Q`` (n x r) for every matrix; **all-reduce** ``[P of every matrix | dense parts]`` in one buffer.
   A non-finite sum (some rank's gradient holds NaN/Inf) is seen by every rank: all return a non-finite sum
   (``summed`` all NaN, ``sent`` 0); the verdict stays on the device, so round 2 runs anyway.
4. ``P_hat = orthonormal(P_sum)`` (identical on every rank); ``Q_r = M^T P_hat`` (m x r).
5. **All-reduce** ``[Q_r of every matrix]``: ``Q_sum = sum_r M_r^T P_hat``.
6. ``summed = P_hat Q_sum^T = P_hat P_hat^T sum_r M_r`` (the sum of every rank's projection);
   ``sent = P_hat Q_r^T`` (this rank's projection, so the residual is what lies outside the shared subspace,
   the paper's local error ``e_r = M_r - decompress(C(M_r))``); ``Q_sum`` is kept as next step's warm start.

torch's hook keeps ``e_r = M_r - mean_s(P_hat Q_s^T)`` instead (the averaged reconstruction). The aggregate
depends only on ``sum_r M_r``, and both choices leave the same total ``sum_r e_r = (I - P_hat P_hat^T) sum_r M_r``,
so the trained model is the same in exact arithmetic; this one fits the reducer's contract that ``sent`` is what
this rank transmitted (``summed = sum_r sent_r``).

Bytes per call: ``4 (sum (n + m) r + dense elements)``. ``orthonormal`` is a reduced QR with the signs of
``R``'s diagonal made positive, i.e. exactly Gram-Schmidt's basis (the reference loop in the tests uses
Gram-Schmidt), and it never divides by a zero norm (an all-zero gradient gives a zero sum, not NaN).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Optional

import torch

from .base import Collective, ResidualStore, Segment

__all__ = ["PowerSGDCompressor", "Block", "plan", "orthonormal", "initial_q"]


@dataclass(frozen=True)
class Block:
    """Rows ``[row0, row0 + n)`` of parameter ``param`` as an ``n x m`` matrix at ``flat_offset``, at rank ``r``."""

    key: str          # the Q store key: the parameter's name, plus its rows when it is only a piece
    flat_offset: int
    n: int
    m: int
    r: int


def plan(layout: list[Segment], rank: int, min_compression: float) -> tuple[list[Block], list[tuple[int, int]]]:
    """(matrices to compress, flat ``[lo, hi)`` ranges sent dense) for a bucket; depends only on ``layout``."""
    blocks: list[Block] = []
    dense: list[tuple[int, int]] = []
    for s in layout:
        if s.shape is None:
            raise ValueError(f"powersgd needs the shape of every parameter (Segment.shape) to view its gradient as "
                             f"a matrix; the bucket segment of {s.key!r} has none (the caller building the layout "
                             f"must pass shape=tuple(param.shape))")
        if math.prod(s.shape) != s.param_numel:
            raise ValueError(f"Segment {s.key!r}: shape {tuple(s.shape)} does not hold its {s.param_numel} elements")
        m = math.prod(s.shape[1:]) if len(s.shape) >= 2 else 1
        head = min(s.numel, (-s.param_offset) % m)  # elements before the first whole row of this piece
        n = (s.numel - head) // m
        body_lo = s.flat_offset + head
        body_hi = body_lo + n * m
        r = min(n, m, rank)
        if len(s.shape) < 2 or n == 0 or (n + m) * r * min_compression >= n * m:
            dense.append((s.flat_offset, s.flat_offset + s.numel))
            continue
        if head:
            dense.append((s.flat_offset, body_lo))
        whole = s.param_offset == 0 and s.numel == s.param_numel
        row0 = (s.param_offset + head) // m
        blocks.append(Block(s.key if whole else f"{s.key}[rows {row0}:{row0 + n}]", body_lo, n, m, r))
        if body_hi < s.flat_offset + s.numel:
            dense.append((body_hi, s.flat_offset + s.numel))
    return blocks, dense


def orthonormal(a: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``a``'s (n x r, r <= n): reduced QR, signed so that ``R``'s diagonal is >= 0.

    That is the basis Gram-Schmidt produces; unlike Gram-Schmidt it stays finite when a column is zero."""
    q, r = torch.linalg.qr(a, mode="reduced")
    sign = torch.sign(torch.diagonal(r))
    sign[sign == 0] = 1.0
    return q * sign


def initial_q(key: str, m: int, r: int, seed: int) -> torch.Tensor:
    """The first ``Q`` of a matrix: ``randn(m, r)`` from a CPU generator seeded by ``seed`` and the key's CRC-32,
    so every rank draws the same one without communicating."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) & 0x7FFF_FFFF_FFFF)
    return torch.randn(m, r, generator=gen)


class PowerSGDCompressor:
    """``powersgd``: rank-``rank`` PowerSGD with warm start (module docstring: the steps)."""

    name = "powersgd"
    config_keys: tuple[str, ...] = ("error_feedback", "rank", "min_compression", "seed")
    init_options: tuple[str, ...] = ("rank", "min_compression", "seed")

    def __init__(self, ratio: float = 1.0, rows: int = 1, *, rank: int = 1, min_compression: float = 2.0,
                 seed: int = 0):
        del ratio, rows  # the rank sets the bytes; CompressionConfig refuses ratio and sketch_rows for powersgd
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        if min_compression < 1:
            raise ValueError(f"min_compression must be >= 1, got {min_compression}")
        self.rank, self.min_compression, self.seed = rank, min_compression, seed
        self.q = ResidualStore()  # warm-start Q per matrix, journaled and checkpointed by the reducer
        self.stores = {"q": self.q}

    def _start_q(self, b: Block, device: torch.device) -> torch.Tensor:
        q = self.q.get(b.key)
        if q is None or tuple(q.shape) != (b.m, b.r):
            q = initial_q(b.key, b.m, b.r, self.seed)
        return orthonormal(q.to(device))

    def reduce(self, acc: torch.Tensor, comm: Collective, seed: int, *, layout: list[Segment],
               ratio: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
        del seed, ratio  # Q's seed is per parameter (initial_q); the rank, not a ratio, sets the bytes
        blocks, dense = plan(layout, self.rank, self.min_compression)
        mats = [acc[b.flat_offset:b.flat_offset + b.n * b.m].view(b.n, b.m) for b in blocks]
        ps = [mat @ self._start_q(b, acc.device) for b, mat in zip(blocks, mats)]  # step 3
        round1 = torch.cat([p.reshape(-1) for p in ps] + [acc[lo:hi] for lo, hi in dense])
        comm.all_reduce_sum(round1)
        # the same summed buffer, the same verdict, on every rank; kept on the device (no host read): a non-finite
        # round 1 makes the whole sum NaN and sent 0 at the end (the reducer rolls Q back with the residuals)
        bad = ~torch.isfinite(round1).all()
        summed = torch.empty_like(acc)
        sent = torch.empty_like(acc)
        off = sum(b.n * b.r for b in blocks)
        for lo, hi in dense:
            summed[lo:hi] = round1[off:off + hi - lo]
            sent[lo:hi] = acc[lo:hi]
            off += hi - lo
        if not blocks:
            return summed.masked_fill_(bad, float("nan")), sent.masked_fill_(bad, 0.0)
        p_hats, qs, off = [], [], 0
        for b, mat in zip(blocks, mats):
            p_hat = orthonormal(round1[off:off + b.n * b.r].view(b.n, b.r))  # step 4
            off += b.n * b.r
            p_hats.append(p_hat)
            qs.append(mat.t() @ p_hat)
        round2 = torch.cat([q.reshape(-1) for q in qs])
        comm.all_reduce_sum(round2)  # step 5
        bad |= ~torch.isfinite(round2).all()
        off = 0
        for b, p_hat, q in zip(blocks, p_hats, qs):  # step 6
            q_sum = round2[off:off + b.m * b.r].view(b.m, b.r)
            off += b.m * b.r
            lo, hi = b.flat_offset, b.flat_offset + b.n * b.m
            summed[lo:hi] = (p_hat @ q_sum.t()).reshape(-1)
            sent[lo:hi] = (p_hat @ q.t()).reshape(-1)
            self.q.put(b.key, q_sum)
        return summed.masked_fill_(bad, float("nan")), sent.masked_fill_(bad, 0.0)
