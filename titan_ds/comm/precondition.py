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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RMSOptions", "rms_normalize_"]

_CHUNK = 1 << 20  # elements per chunk of rms_normalize_ (elementwise: the result does not depend on it)


@dataclass(frozen=True)
class RMSOptions:
    """``beta2`` and ``eps`` of the local second moment (Adam's meanings and defaults)."""

    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if not 0.0 < self.beta2 < 1.0:
            raise ValueError(f"precondition beta2 must be in (0, 1), got {self.beta2}")
        if not self.eps > 0:
            raise ValueError(f"precondition eps must be > 0, got {self.eps}")


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
