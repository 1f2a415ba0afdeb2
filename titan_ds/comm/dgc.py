"""Deep Gradient Compression's accumulation (Lin et al., ICLR 2018): what the reducer hands ``topk``.

DGC is top-k sparsification plus four changes to what is accumulated and how fast the sparsity rises. Here
the selection and exchange are ``topk``'s (``topk.py``); this module holds the other pieces, and
``GradientReducer`` (``compressor.py``) runs them in this order, per bucket, on each rank (``g``: this rank's
gradient of one parameter, ``u``: its momentum, ``v``: its residual, the velocity not sent yet):

1. **Local gradient clipping** (``local_clip``): ``g <- g * min(1, local_clip / ||g||)``, per parameter (per
   piece of a parameter when DeepSpeed splits one across buckets), on the rank's own gradient, *before* it is
   accumulated. The paper scales the global clipping threshold by ``W^-1/2``; pass that value.
2. **Momentum correction** (``momentum = m``): ``u <- m u + g``, ``v <- v + u``. The residual accumulates
   velocity instead of raw gradient, so a coordinate sent after ``T`` quiet steps carries the momentum it
   would have had in dense momentum SGD. The optimizer receiving the sum must therefore **not** apply a
   momentum of its own (SGD without momentum, or Adam with ``beta1 = 0``).
3. **Top-k** of ``|v|`` at this step's ratio (:func:`ratio_at`); ``sent = v`` on the selected coordinates.
4. **Error feedback**: ``v <- v - sent`` (zero where sent).
5. **Momentum factor masking** (``momentum_masking``): ``u <- 0`` where a value was sent (``sent != 0``, the
   paper's ``|v| > threshold``: a selected exact zero sends nothing), so stale momentum does not push a
   coordinate again right after its accumulated update went out.
6. **Warm-up** (``ratio_warmup_steps``, ``ratio_warmup_start``): after the dense ``warmup_steps``, the ratio
   rises geometrically from ``ratio_warmup_start`` to ``ratio`` (the paper: sparsity 75%, 93.75%, 98.4375%,
   99.6%, 99.9% over the first epochs, i.e. density divided by 4 per stage; here continuously per step).
   The warm-up's larger messages are counted in the whole-run ratio like every other byte.

Without ``momentum`` (``m = 0``) steps 2 and 5 vanish and this is plain top-k with error feedback.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .base import Segment

__all__ = ["DGCOptions", "clip_segments_", "ratio_at"]


@dataclass(frozen=True)
class DGCOptions:
    """``momentum``: DGC's momentum-correction factor (0: off); ``momentum_masking``: zero the momentum where a
    value was sent; ``local_clip``: max norm of each parameter's local gradient (``None``: off)."""

    momentum: float = 0.0
    momentum_masking: bool = True
    local_clip: Optional[float] = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.local_clip is not None and not self.local_clip > 0:
            raise ValueError(f"local_clip must be > 0, got {self.local_clip}")


def clip_segments_(x: torch.Tensor, layout: list[Segment], max_norm: float) -> None:
    """Scale each segment of the flat fp32 ``x`` in place so that its L2 norm is at most ``max_norm``.

    A non-finite norm leaves the segment as it is (the reducer's non-finite path must still see it). The scale
    ``min(1, max_norm / norm)`` is computed on the device in fp64, as Python would (no host read of the norm),
    and a segment that is not clipped is multiplied by exactly 1."""
    for s in layout:
        seg = x[s.flat_offset:s.flat_offset + s.numel]
        norm = seg.norm().double()
        clip = torch.isfinite(norm) & (norm > max_norm)
        seg.mul_(torch.where(clip, torch.full_like(norm, max_norm) / norm, torch.ones_like(norm)).float())


def ratio_at(step: int, *, ratio: float, warmup_steps: int, ramp_steps: int, start: float) -> float:
    """The target ratio at optimizer step ``step``: ``start * (ratio / start) ** (t / ramp_steps)`` for
    ``t = step - warmup_steps`` in ``[0, ramp_steps)``, ``ratio`` from then on (and when ``ramp_steps`` is 0)."""
    t = step - warmup_steps
    if ramp_steps <= 0 or t >= ramp_steps:
        return ratio
    return start * (ratio / start) ** (max(t, 0) / ramp_steps)
