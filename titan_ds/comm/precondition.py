"""Local RMS preconditioning: each rank compresses its own Adam-scaled update instead of its raw gradient.

Why (measured, ``results/compress_w2_*.md`` and docs/compress.md): with error feedback, a sparse compressor
sends a coordinate once every ``k`` steps carrying ~``k`` steps of gradient. An Adam-type optimizer *after* the
reduction normalizes by the RMS of what it receives, which for such a coordinate is ``sqrt(k)`` times the
RMS of one step's gradient, so the coordinate moves ``sqrt(k)`` learning rates per ``k`` steps instead of
``k``: at 100x (``k`` ~ 100) the run is ~10x slower where it is sparse, whatever the learning rate scale, since
Adam is scale-invariant. The normalizer has to come from the dense per-step gradients, and only the rank that
computed them has them.

So with ``precondition="rms"`` each rank keeps Adam's second moment of **its own** gradient and hands the
compressor its normalized gradient (the idea of Efficient-Adam, Chen et al. 2022: local Adam statistics, a
compressed update with error feedback); the reduced sum is then an update, applied by plain SGD at the
schedule's learning rate (SGD's ``weight_decay`` on an update is AdamW's decoupled decay). Per element of one
rank's gradient ``g`` (``prescale`` undone: ZeRO 1-3 hand over ``g / W``), at compressed step ``t >= 1``::

    v <- beta2 v + (1 - beta2) g^2
    u  = g / (sqrt(v / (1 - beta2^t)) + eps)        # handed to error feedback + the compressor (times prescale)

There is no first moment: error feedback already accumulates what was not sent (an Adam ``beta1`` on top of it
re-sends old gradients; measured worse). ``v`` is a journaled per-parameter store like DGC's momentum: rolled
back with the residuals when a step is skipped, saved in checkpoints. Cost: 4 bytes per element per rank, the
optimizer then holds none (SGD without momentum).

**``precondition="rms_mean"``: the RMS of the ranks' mean gradient, estimated on each rank** (for many
workers). Dense AdamW divides by the RMS of the *mean* of the ``W`` ranks' gradients, ``E[G^2] = mu^2 + s^2 / W``
(``mu`` the expected gradient, ``s^2`` one rank's noise variance); ``rms`` divides by the RMS of one rank's own,
``mu^2 + s^2``. Where noise dominates, ``rms`` therefore steps up to ``sqrt(W)`` times less than Adam, and measured
at W = 32 (uncompressed, 1000 steps) it is +0.26 nats behind dense AdamW whatever its lr. ``rms_mean`` estimates
``mu^2`` on each rank from its own first moment ``m`` (an EMA of its gradients, ``beta1``) and keeps::

    m <- beta1 m + (1 - beta1) g ;  m_hat = m / (1 - beta1^t)
    d <- beta2 d + (1 - beta2) ((1 - 1/W) m_hat^2 + g^2 / W)      # ~ mu^2 + s^2 / W, smoothed like Adam's v
    u  = g / (sqrt(d / (1 - beta2^t)) + eps)

(``W`` = the number of ranks the reduction sums over; with ``W = 1`` it is ``rms``). The sum of the ranks' ``u``
is then ``W`` times Adam's normalized gradient, and the optimizer becomes **SGD with momentum ``beta1``** (and
dampening ``beta1``: an EMA of the reduced updates, Adam's first moment taken after the reduction, where error
feedback's bursts are smoothed rather than re-sent). ``m`` shapes only the denominator; what is sent is ``g``
normalized. Cost: 8 bytes per element per rank (``m``, ``d``) plus the optimizer's momentum (4).
Measured (W = 32): close to dense uncompressed, far behind compressed; the momentum after the reduction is
what breaks it there (``results/rms_compressed_w32_300.md``: SGD momentum after error feedback's bursts costs
0.3-3 nats whatever the denominator).

**``precondition="rms_sketch"``: the mean gradient's RMS level per tensor, from an all-reduced sketch**.
Each rank keeps ``rms``'s ``v`` (the *shape* of its denominator) and, per tensor piece ``T`` of the bucket (a
:class:`~titan_ds.comm.base.Segment`), one number: the mean square of the ranks' **mean** gradient over ``T``,
estimated with a random sign projection that every rank draws alike from the call's seed. The projection is linear,
so its sum over ranks is an all-reduce of **one float per tensor piece** (``4 x segments`` bytes a bucket), and
``E[(r . G_mean)^2] = |G_mean|^2`` for signs ``r`` with ``E[r_a r_b] = 0`` (``a != b``)::

    p   = r . g                                    # this rank's projection of T (r: +-1, the call's seed)
    P   = all-reduce-sum(p) / W                    # the mean gradient's projection (the same on every rank)
    S  <- beta2 S + (1 - beta2) P^2 / |T|          # its mean square, EMA; S_hat bias-corrected by its own count
    v  <- beta2 v + (1 - beta2) g^2 ;  v_hat = v / (1 - beta2^t)
    q   = v_hat * S_hat / mean_T(v_hat)            # rms's shape, the mean gradient's level
    u   = g / (sqrt(clamp(q, v_hat / W, v_hat)) + eps)

The clamp is the range the mean gradient's second moment lies in: ``mu^2 + s^2 / W`` is between ``(mu^2 + s^2) /
W`` and ``mu^2 + s^2`` (``v_hat``: one rank's own). SGD without momentum applies the sum (as for ``rms``). Where
noise dominates, ``rms`` steps up to ``sqrt(W)`` times less than Adam on the mean gradient; this corrects it per
tensor with a shared, dense-per-step statistic (nothing the bursts of error feedback shape). Signs: per call, a row
``s1`` of :data:`SKETCH_TILE` and a column ``s2`` of one sign per tile of the flat bucket, ``r_f = s1[f mod L]
s2[f div L]`` (pairwise uncorrelated; ``L + n / L`` draws on the host, not ``n``). Cost: ``rms``'s 4 bytes per
element plus 8 bytes per tensor piece; one more all-reduce per bucket. Measured (W = 32, 100x fewer bytes received,
sharded, 1000 steps, 2 seeds, ``results/compress_sketch_w32_1000.md``): +0.106 / +0.196 nats from dense AdamW with
``gather_share`` 0.6, against ``rms``'s +0.269 (seed 0); the exact mean-gradient RMS does no better there
(``results/rms_compressed_w32_1000.md``), so the rest of the gap is the compression's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import Segment, to_device_async

__all__ = ["RMSOptions", "rms_normalize_", "rms_mean_normalize_", "rms_sketch_normalize_", "sketch_signs",
           "sketch_projections", "sketch_key", "PRECONDITIONS", "SKETCH_TILE"]

# the values of titan.compression.precondition besides "none"
PRECONDITIONS = ("rms", "rms_mean", "rms_sketch")
SKETCH_TILE = 4096  # rms_sketch: the length of the sign row s1 (module docstring)

_CHUNK = 1 << 20  # elements per chunk of rms_normalize_ (elementwise: the result does not depend on it)


@dataclass(frozen=True)
class RMSOptions:
    """``beta2`` and ``eps`` of the local second moment (Adam's meanings and defaults); ``kind`` is ``"rms"`` (this
    rank's own RMS) or ``"rms_mean"`` (the ranks' mean gradient's, estimated with a first moment of ``beta1``)."""

    beta2: float = 0.999
    eps: float = 1e-8
    kind: str = "rms"
    beta1: float = 0.9

    def __post_init__(self) -> None:
        if not 0.0 < self.beta2 < 1.0:
            raise ValueError(f"precondition beta2 must be in (0, 1), got {self.beta2}")
        if not self.eps > 0:
            raise ValueError(f"precondition eps must be > 0, got {self.eps}")
        if self.kind not in PRECONDITIONS:
            raise ValueError(f"precondition must be one of {PRECONDITIONS}, got {self.kind!r}")
        if not 0.0 < self.beta1 < 1.0:
            raise ValueError(f"precondition beta1 must be in (0, 1), got {self.beta1}")


def rms_normalize_(acc: torch.Tensor, second: torch.Tensor, t: int, opts: RMSOptions, prescale: float = 1.0) -> None:
    """In place: ``second`` (this rank's ``v``, fp32, flat like ``acc``) takes the step, ``acc`` becomes
    ``u * prescale``.

    ``acc`` is the rank's gradient times ``prescale``; ``t`` (>= 1) counts the compressed steps, for the bias
    correction."""
    if t < 1:
        raise ValueError(f"the preconditioner's step count starts at 1, got {t}")
    correction = 1.0 - opts.beta2 ** t
    for lo in range(0, acc.numel(), _CHUNK):  # temporaries of one chunk, not of the whole bucket
        a, v = acc[lo:lo + _CHUNK], second[lo:lo + _CHUNK]
        g = a / prescale if prescale != 1.0 else a
        v.mul_(opts.beta2).addcmul_(g, g, value=1.0 - opts.beta2)
        a.div_((v / correction).sqrt_().add_(opts.eps))


def rms_mean_normalize_(acc: torch.Tensor, first: torch.Tensor, second: torch.Tensor, t: int, opts: RMSOptions,
                        world: int, prescale: float = 1.0) -> None:
    """``precondition="rms_mean"``, in place: ``first`` (``m``) and ``second`` (``d``) take the step, ``acc`` becomes
    ``u * prescale`` (the module's formulas; ``world`` ranks are summed)."""
    if t < 1:
        raise ValueError(f"the preconditioner's step count starts at 1, got {t}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    b1, b2 = opts.beta1, opts.beta2
    c1, c2, keep = 1.0 - b1 ** t, 1.0 - b2 ** t, 1.0 - 1.0 / world
    for lo in range(0, acc.numel(), _CHUNK):
        a, m, d = acc[lo:lo + _CHUNK], first[lo:lo + _CHUNK], second[lo:lo + _CHUNK]
        g = a / prescale if prescale != 1.0 else a
        m.mul_(b1).add_(g, alpha=1.0 - b1)
        q = (m * m).mul_(keep / (c1 * c1)).addcmul_(g, g, value=1.0 / world)
        d.mul_(b2).add_(q, alpha=1.0 - b2)
        a.div_(torch.div(d, c2, out=q).sqrt_().add_(opts.eps))


def sketch_signs(n: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s1, s2)``: the call's signs (+-1, fp32) for an ``n``-element bucket, the same on every rank for the same
    ``seed``: ``s1`` of :data:`SKETCH_TILE`, ``s2`` one per tile. Drawn on the host (``L + n / L`` of them) and
    copied without the host waiting."""
    tiles = max(1, math.ceil(n / SKETCH_TILE))
    gen = torch.Generator().manual_seed((seed * 2_654_435_761 + 97) & 0x7FFFFFFF)
    signs = torch.randint(0, 2, (SKETCH_TILE + tiles,), generator=gen).float().mul_(2).sub_(1)
    signs = to_device_async(signs, device)
    return signs[:SKETCH_TILE], signs[SKETCH_TILE:]


def sketch_projections(acc: torch.Tensor, layout: list[Segment], s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """``p[i] = sum_f r_f acc[f]`` over segment ``i``'s flat range, ``r_f = s1[f mod L] s2[f div L]`` (fp32, one
    entry per segment in ``layout``'s order): per segment a matrix-vector product over its whole tiles plus its
    partial first and last tile."""
    L = SKETCH_TILE
    out = []
    for seg in layout:
        a, b = seg.flat_offset, seg.flat_offset + seg.numel
        total = acc.new_zeros((), dtype=torch.float32)
        t0, t1 = -(-a // L), b // L  # the whole tiles inside [a, b); t0 > t1: [a, b) inside one tile
        if t0 < t1:
            tiles = acc[t0 * L:t1 * L].float().view(t1 - t0, L)
            total = total + (tiles @ s1).dot(s2[t0:t1])
        pieces = [(a, b)] if t0 > t1 else [(a, t0 * L), (t1 * L, b)]
        for lo, hi in pieces:  # within one tile each (or empty)
            if hi > lo:
                t = lo // L
                total = total + acc[lo:hi].float().dot(s1[lo - t * L:hi - t * L]) * s2[t]
        out.append(total)
    return torch.stack(out) if out else acc.new_zeros(0, dtype=torch.float32)


def sketch_key(seg: Segment) -> str:
    """The key of a segment's mean-square statistic: one per tensor piece of a bucket."""
    return f"{seg.key}@{seg.param_offset}+{seg.numel}"


def rms_sketch_normalize_(acc: torch.Tensor, second: torch.Tensor, t: int, opts: RMSOptions, level: torch.Tensor,
                          world: int, prescale: float = 1.0) -> None:
    """``precondition="rms_sketch"``, in place on one segment: ``second`` (``v``) takes the step, ``acc`` becomes
    ``u * prescale`` (the module's formulas). ``level``: the 0-dim bias-corrected mean square ``S_hat`` of the
    ranks' mean gradient over this segment; ``world`` ranks are summed."""
    if t < 1:
        raise ValueError(f"the preconditioner's step count starts at 1, got {t}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    c2 = 1.0 - opts.beta2 ** t
    for lo in range(0, acc.numel(), _CHUNK):  # v's step first: the level's ratio needs the whole segment's mean
        a, v = acc[lo:lo + _CHUNK], second[lo:lo + _CHUNK]
        g = a / prescale if prescale != 1.0 else a
        v.mul_(opts.beta2).addcmul_(g, g, value=1.0 - opts.beta2)
    scale = level / (second.mean() / c2).clamp_min(torch.finfo(torch.float32).tiny)  # 0-dim: no host wait
    for lo in range(0, acc.numel(), _CHUNK):  # temporaries of one chunk, not of the whole segment
        a = acc[lo:lo + _CHUNK]
        vh = second[lo:lo + _CHUNK] / c2
        q = torch.maximum(vh * scale, vh / world)
        a.div_(torch.minimum(q, vh, out=q).sqrt_().add_(opts.eps))
