"""ASDT's sparse strategy: the top-k step (``density < 1``) of the sign and the adaptive update, on Growth units
(with their momentum) and BSPS's Elastic units (``c = g``, then the pull toward their anchors), chunk by chunk
over :mod:`~titan_ds.optim.core`'s slices.

Every element's state update is its own (the momentum and the second moment move on every element of a unit,
selected or not); only the weight step needs the unit's threshold ``tau``, its k-th largest score. So a
*segment* (the whole units of one core slice, or the slices of one unit larger than a chunk) is stepped in two
passes:

1. chunk by chunk: decode the state, compute the direction ``c`` (:func:`core.direction`), store the new state,
   and keep ``c`` in one fp32 buffer of the segment (4 bytes per element of it; a slice of whole units needs none
   beyond the chunk's own temporaries);
2. each unit's ``tau``: ``torch.topk`` over a slice of whole units (as the flat path, per unit, or batched over
   units of one length), and over a unit cut into chunks an exact radix select on the scores' bit patterns
   (:func:`kth_largest_chunked`: two histograms of 16 bits, each over the chunks' scores in turn; the scores
   are non-negative, so their int32 patterns order as their values);
3. chunk by chunk: the mask ``(s >= tau) & (s > 0)``, the weight step from the kept ``c``, the Elastic pull,
   the write (stochastically rounded when the weights are bf16: one draw per element, chunk after chunk).

The scores are recomputed per chunk when needed (``|c|`` from the kept buffer, ``|g w|`` from the gradient and
the weights, the sketch's estimates from the TGSS table; :mod:`~titan_ds.optim.sketch`). The arithmetic is the
flat path's (:func:`~titan_ds.optim.asdt_math.asdt_update`) op for op in fp32, so the two agree bit for bit
(``tests/optim/test_sparse.py``); the flat path stays for units split across ranks, whose threshold is a
collective (:func:`~titan_ds.optim.layout.kth_largest`). Nothing is read back to the host.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from . import core
from .asdt_math import _k, device_list, round_to
from .core import Slice, StateBuffer

__all__ = ["PARTS", "CHUNK", "sparse_step", "segments", "kth_largest_chunked"]

Scores = Callable[[Slice], torch.Tensor]  # a slice's scores (importance="sketch")
# Chunks per tensor (core.plan's ``parts``): twice the dense core's, as a unit cut into chunks also holds its kept
# direction (4 bytes an element). Measured (one density-0.1 step of 2^22 elements, 8-bit momentum, 1 thread,
# peak RSS above the state): adaptive with a 4-bit second moment 5.8 B/element at 32 parts, 4.7 at 64; sign 5.2, 4.5.
PARTS = 2 * core.PARTS
# The smallest chunk of a tensor (core.plan's ``least``): the dense core's minimum as it was measured above (its
# own, core.CHUNK, was raised for speed; a sparse chunk's temporaries are larger). A test that lowers core.CHUNK
# lowers this one too (the plan takes the smaller of the two).
CHUNK = 1 << 16
_HALF = 1 << 16  # a radix pass resolves 16 bits of the int32 pattern


def segments(slices: list[Slice]) -> list[list[Slice]]:
    """The slices grouped by threshold: a slice of whole units alone, the consecutive slices of one unit
    (``core.plan`` cuts a unit larger than a chunk into slices at ``offset`` 0, chunk, 2 chunk, ...) together."""
    out: list[list[Slice]] = []
    for s in slices:
        if s.offset > 0 and out and out[-1][-1].lo == s.lo:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def _histogram(keys: torch.Tensor, bins: int) -> torch.Tensor:
    """Counts of each value of ``keys`` in ``[0, bins)`` (fixed size: also on the ``meta`` device)."""
    hist = torch.zeros(bins, dtype=torch.int64, device=keys.device)
    return hist.index_add_(0, keys.view(-1), torch.ones(1, dtype=torch.int64, device=keys.device).expand(keys.numel()))


def _pick(hist: torch.Tensor, k: Union[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest bin ``b`` with at least ``k`` counts at or above it, and the count strictly above it."""
    cum = hist.flip(0).cumsum(0)
    i = torch.searchsorted(cum, k).view(1)  # k: an int, or a device tensor (nothing is copied from the host)
    b = hist.numel() - 1 - i
    return b, cum.gather(0, i) - hist.gather(0, b)


def kth_largest_chunked(seg: list[Slice], score_of: Scores, k: int) -> torch.Tensor:
    """The k-th largest of the (non-negative) scores of the slices ``seg`` of one unit, as ``torch.topk(all,
    k).values[-1:]`` gives it, without holding them at once: a radix select over their int32 bit patterns
    (the top 16 bits, then the low 16 of the chosen top), each pass one histogram over the chunks."""
    hist = None
    for s in seg:
        top = score_of(s).contiguous().view(torch.int32) >> 16
        h = _histogram(top, _HALF)
        hist = h if hist is None else hist.add_(h)
    top_bits, above = _pick(hist, k)
    hist = None
    for s in seg:
        bits = score_of(s).contiguous().view(torch.int32)
        low = torch.where((bits >> 16) == top_bits, bits & (_HALF - 1), _HALF)  # others: an extra bin
        h = _histogram(low, _HALF + 1)[:_HALF]
        hist = h if hist is None else hist.add_(h)
    low_bits, _ = _pick(hist, k - above)
    return ((top_bits << 16) | low_bits).to(torch.int32).view(torch.float32)


def _slice_taus(s: Slice, scores: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """The k-th largest score of each whole unit of slice ``s`` (``torch.topk``, as the flat path)."""
    if s.hi - s.lo == 1:
        return torch.topk(scores, ks[0]).values[-1:]
    if s.uniform and len(set(ks)) == 1:  # one call over the units as rows: the same values
        return torch.topk(scores.view(-1, s.uniform), ks[0], dim=1).values[:, -1]
    return torch.stack([torch.topk(x, k).values[-1] for x, k in zip(scores.split(list(s.lengths)), ks)])


def _lr(lr: float, lr_scales: Optional[list[float]], per_unit: Optional[torch.Tensor],
        s: Slice) -> Union[float, torch.Tensor]:
    """The learning rate of each element of ``s``: ``lr * lr_scale`` of its unit, a float when it is one for the
    whole slice (``per_unit``: the fp32 ``lr * lr_scale`` of every unit; the float rounds to the same fp32)."""
    if lr_scales is None:
        return lr
    scales = lr_scales[s.lo:s.hi]
    if len(set(scales)) == 1:
        return lr * scales[0]
    return core._per_element(per_unit, s)


def sparse_step(w_flat: torch.Tensor, g_flat: torch.Tensor, slices: list[Slice], *, lr: float,
                betas: tuple[float, float], density: float, weight_decay: float, unit_numels: list[int],
                importance: str = "momentum", update: str = "sign", momentum: Optional[StateBuffer] = None,
                anchor: Optional[StateBuffer] = None, variance: Optional[StateBuffer] = None,
                seconds: Optional[torch.Tensor] = None, eps: float = 1e-8, update_clip: Optional[float] = None,
                lr_scales: Optional[list[float]] = None, elastic_pull: float = 0.0, scores: Optional[Scores] = None,
                generator: Optional[torch.Generator] = None) -> Union[int, torch.Tensor]:
    """One step of the units of ``slices`` (see the module docstring), in place; the units are whole (none split
    across ranks): ``unit_numels[i]`` is unit ``i``'s size, for its ``k``. Growth units: ``momentum`` (and, for
    ``update="adaptive"``, ``seconds`` and either ``variance`` or the per-unit second moment); Elastic ones:
    ``anchor``. ``scores``: a slice's importance (``"sketch"``); else ``|c|`` or ``|g w|``. Returns the elements
    changed (a device tensor, or 0)."""
    if (momentum is None) == (anchor is None):
        raise ValueError("sparse_step needs momentum (Growth) or anchor (Elastic), exactly one of them")
    if (importance == "sketch") != (scores is not None):
        raise ValueError(f"sparse_step takes scores with importance='sketch' only (got {importance!r})")
    adaptive = update == "adaptive" and momentum is not None
    unit_denom = bc1 = inv_bc2 = None
    if adaptive:
        if seconds is None:
            raise ValueError("sparse_step: update='adaptive' needs the seconds rows")
        if variance is None:
            unit_denom = core._unit_second_moment(g_flat, slices, seconds, unit_numels, betas, eps)
        else:
            bc1, inv_bc2 = core.bias_corrections(seconds, betas)
    elif update not in ("sign", "adaptive"):
        raise ValueError(f"sparse_step: unknown update {update!r}")
    dev = w_flat.device
    taus = torch.empty(len(unit_numels), dtype=torch.float32, device=dev)
    per_unit = None if lr_scales is None or len(set(lr_scales)) < 2 else \
        device_list([lr * x for x in lr_scales], torch.float32, dev)
    selected: Union[int, torch.Tensor] = 0
    for seg in segments(slices):
        kept = {}  # each slice's direction c (its slice of one fp32 buffer of the segment)
        buf = torch.empty(sum(s.n for s in seg), dtype=torch.float32, device=dev) if len(seg) > 1 else None
        at = 0
        for s in seg:  # pass 1: the direction and the new state
            g = g_flat[s.flat:s.flat + s.n].float()
            if momentum is None:
                c = g  # Elastic: c = g (a copy: g_flat is not float32 only when the weights are bf16)
            else:
                c, _, m = core.direction(s, g, momentum, betas, adaptive, variance=variance, unit_denom=unit_denom,
                                         bc1=bc1, inv_bc2=inv_bc2, eps=eps, update_clip=update_clip)
                momentum.write(s, m)
                del m  # (the chunk's temporaries: one at a time)
            if buf is not None:
                kept[s] = buf[at:at + s.n].copy_(c)
                at += s.n
            else:
                kept[s] = c

        def score_of(s: Slice) -> torch.Tensor:
            if importance == "momentum":
                return kept[s].abs()
            if importance == "grad_weight":
                return (g_flat[s.flat:s.flat + s.n].float() * w_flat[s.flat:s.flat + s.n].float()).abs()
            return scores(s)

        lo, hi = seg[0].lo, seg[0].hi
        ks = [_k(density, n) for n in unit_numels[lo:hi]]
        if len(seg) > 1:
            taus[lo:hi] = kth_largest_chunked(seg, score_of, ks[0])
        for s in seg:  # pass 3: the weights
            sc = score_of(s)
            if len(seg) == 1:
                taus[lo:hi] = _slice_taus(s, sc, ks)
            mask = sc >= core._per_element(taus, s)
            mask &= sc > 0
            del sc
            w = w_flat[s.flat:s.flat + s.n]
            wf = w.float()
            c = kept.pop(s)
            step = c if adaptive else torch.sign(c)
            new = wf - (step + weight_decay * wf) * _lr(lr, lr_scales, per_unit, s)
            if anchor is not None:
                new = new + (anchor.read(s) - new) * elastic_pull
            w.copy_(round_to(w.dtype, torch.where(mask, new, wf), generator))
            selected = selected + mask.sum()
    return selected
