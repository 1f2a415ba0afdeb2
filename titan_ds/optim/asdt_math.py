"""ASDT's arithmetic: :func:`asdt_update` (steps 1-5 of :mod:`titan_ds.optim.asdt`'s docstring, and the adaptive
steps 1' and 4', on lists of unit slices: tensors in, updated in place; no optimizer, BSPS or engine) and
:func:`reference_step`, an independent plain per-unit loop of the same steps, the oracle of both.
:class:`~titan_ds.optim.asdt.ASDT` does the bookkeeping around them."""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable, Optional, Sequence, Union

import torch

from ..comm.base import to_device_async
from .bsps import FROZEN, GROWTH, SLEEPING
from .layout import Piece

__all__ = ["asdt_update", "local_kth_largest", "reference_step", "KthLargest", "IMPORTANCE", "round_to",
           "stochastic_round", "device_list", "ieee_sqrt"]

IMPORTANCE = ("momentum", "grad_weight", "sketch")

# Host -> device copies of the small per-unit lists of an adaptive update (lengths, unit sizes, lr scales), kept
# per device: a blocking ``torch.tensor(list, device=...)`` waits for the device (a host sync), so each distinct
# list is copied once, asynchronously, and reused; in a run the plans repeat every step. Bounded: BSPS makes new
# lists as modes change (stale ones are dropped first).
_DEVICE_LISTS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_DEVICE_LISTS_MAX = 256


def device_list(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, copied to ``device`` once per distinct list (read it
    only: the tensor is shared)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    key = (str(device), dtype, tuple(values))
    hit = _DEVICE_LISTS.get(key)
    if hit is None:
        hit = _DEVICE_LISTS[key] = to_device_async(torch.tensor(values, dtype=dtype), device)
        while len(_DEVICE_LISTS) > _DEVICE_LISTS_MAX:
            _DEVICE_LISTS.popitem(last=False)
    else:
        _DEVICE_LISTS.move_to_end(key)
    return hit


def stochastic_round(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16 at random, up or down with the probabilities that make it unbiased
    (``E[round(x)] = x``): a uniform 16-bit integer is added to the low half of each fp32 bit pattern, which is
    then cut off. A value bf16 holds exactly comes back unchanged; infinities and NaNs stay what they are."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round takes fp32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, generator=generator, device=bits.device)
    out = torch.where(torch.isfinite(x), (bits + noise) & -65536, bits).view(torch.float32)
    return out.to(torch.bfloat16)  # exact: the low 16 bits are 0


def ieee_sqrt(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The correctly rounded square root (IEEE 754's), the one the adaptive update divides by everywhere: what
    ``torch.sqrt`` computes on CUDA, what inductor emits and what the C++ CPU kernel's ``vsqrtps`` computes. ATen's
    CPU kernel for fp32 is not correctly rounded (MKL's vml: the last bit differs for ~20% of values on this
    machine), so an fp32 CPU tensor goes through fp64 and back, which gives the correctly rounded fp32 root for
    every non-negative finite float (checked over all 2^31 of them against numpy's; tests/optim/test_ieee_sqrt.py
    checks a sample). ``out``: written in place (it may be ``x``)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        r = x.double().sqrt_()
        return r.float() if out is None else out.copy_(r)
    return torch.sqrt(x) if out is None else torch.sqrt(x, out=out)


def round_to(dtype: torch.dtype, x: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """``x`` (fp32) in ``dtype``: stochastically rounded when ``generator`` is given and ``dtype`` is bf16 (weights
    kept in bf16 with no fp32 master copy, where rounding to nearest drops every update under half a bf16 step),
    else ``x.to(dtype)``."""
    if generator is not None and dtype == torch.bfloat16:
        return stochastic_round(x.float(), generator)
    return x.to(dtype)


def _scores(importance: str, c: torch.Tensor, g: torch.Tensor, w: torch.Tensor,
            sketch_est: Optional[torch.Tensor]) -> torch.Tensor:
    if importance == "momentum":
        return c.abs()
    if importance == "grad_weight":
        return (g * w).abs()
    if importance == "sketch":
        return sketch_est
    raise ValueError(f"unknown importance {importance!r}; choose one of {list(IMPORTANCE)}")


def _k(density: float, numel: int) -> int:
    return max(1, min(numel, math.ceil(density * numel)))


def reference_step(units: list[tuple[torch.Tensor, torch.Tensor, dict]], *, lr: float, betas: tuple[float, float],
                   density: float, weight_decay: float, importance: str, state_dtype: torch.dtype,
                   modes: Optional[list[int]] = None, lr_scales: Optional[list[float]] = None,
                   elastic_pull: float = 0.0, sketch_est: Optional[list[torch.Tensor]] = None,
                   update: str = "sign", eps: float = 1e-8, update_clip: Optional[float] = None,
                   second_moment: str = "unit", second_dtype: torch.dtype = torch.float32,
                   generator: Optional[torch.Generator] = None) -> None:
    """The docstring's steps, one unit at a time: ``units`` is ``[(w_view, g, state)]`` (1-D views: fp32, or bf16
    weights; the new weights are computed in fp32, then written in the weights' dtype, with
    :func:`stochastic_round` when ``generator`` is given: one draw per element of the unit, unit by unit).

    ``state`` holds ``momentum`` (Growth) or ``anchor`` (Elastic), created here on first use, and with
    ``update="adaptive"`` a Growth unit's ``v`` and ``t`` (Python floats); with ``second_moment="coordinate"``
    ``v`` is a tensor of the unit's shape, stored in ``second_dtype`` (Adam's own second moment).
    """
    b1, b2 = betas
    for i, (w, g, st) in enumerate(units):
        mode = GROWTH if modes is None else modes[i]
        scale = 1.0 if lr_scales is None else lr_scales[i]
        if mode in (FROZEN, SLEEPING):
            continue
        if mode == GROWTH and update == "adaptive":
            f32 = torch.float32
            m = st.setdefault("momentum", torch.zeros_like(w, dtype=state_dtype)).float() * b1 + g * (1 - b1)
            st["t"] = st.get("t", 0) + 1
            bc1, bc2 = 1 - b1 ** st["t"], 1 - b2 ** st["t"]
            if second_moment == "coordinate":
                v = st.get("v", torch.zeros_like(w, dtype=second_dtype)).float() * b2 + (g * g) * (1 - b2)
                st["v"] = v.to(second_dtype)
                # fp32, as core.dense_step (the bias corrections in fp64, then as v * (1 / bc2) and * bc1)
                c = m / ((ieee_sqrt(v * (1 / bc2)) + eps) * bc1)
            else:
                mean = torch.tensor(float((g.double() ** 2).sum()) / g.numel(), dtype=f32)
                st["v"] = st.get("v", torch.zeros((), dtype=f32)) * b2 + (1 - b2) * mean
                c = m / torch.tensor((math.sqrt(float(st["v"]) / bc2) + eps) * bc1, dtype=f32)
            if update_clip is not None:
                c = c.clamp(-update_clip, update_clip)
            s = _scores(importance, c, g, w, None if sketch_est is None else sketch_est[i])
            tau = torch.topk(s, _k(density, s.numel())).values[-1]
            mask = (s >= tau) & (s > 0)
            wf = w.float()
            wf[mask] = wf[mask] - (c[mask] + weight_decay * wf[mask]) * (lr * scale)
            w.copy_(torch.where(mask, round_to(w.dtype, wf, generator), w))
            st["momentum"] = m.to(state_dtype)
            continue
        if mode == GROWTH:
            m = st.setdefault("momentum", torch.zeros_like(w, dtype=state_dtype)).float()
            c = m * b1 + g * (1 - b1)
        else:
            st.setdefault("anchor", w.detach().clone().to(state_dtype))
            c = g.clone()
        s = _scores(importance, c, g, w, None if sketch_est is None else sketch_est[i])
        tau = torch.topk(s, _k(density, s.numel())).values[-1]
        mask = (s >= tau) & (s > 0)
        wf = w.float()
        wf[mask] = wf[mask] - (torch.sign(c[mask]) + weight_decay * wf[mask]) * (lr * scale)
        if mode == GROWTH:
            st["momentum"] = (m * b2 + g * (1 - b2)).to(state_dtype)
        else:
            a = st["anchor"].float()
            wf[mask] = wf[mask] + (a[mask] - wf[mask]) * elastic_pull
        w.copy_(torch.where(mask, round_to(w.dtype, wf, generator), w))


KthLargest = Callable[[list[torch.Tensor], list[int]], list[torch.Tensor]]


def local_kth_largest(scores: list[torch.Tensor], ks: list[int]) -> list[torch.Tensor]:
    """The k-th largest value of each whole unit's scores (``torch.topk``)."""
    return [torch.topk(s, k).values[-1] for s, k in zip(scores, ks)]


def asdt_update(weights: list[torch.Tensor], grads: list[torch.Tensor], *, lr: float, betas: tuple[float, float],
                density: float, weight_decay: float, unit_numels: list[int], importance: str = "momentum",
                momenta: Optional[list[torch.Tensor]] = None, anchors: Optional[list[torch.Tensor]] = None,
                lr_scales: Optional[list[float]] = None, elastic_pull: float = 0.0,
                scores: Optional[list[torch.Tensor]] = None, kth_largest: KthLargest = local_kth_largest,
                seconds: Optional[torch.Tensor] = None, eps: float = 1e-8,
                unit_sums: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
                lengths: Optional[list[int]] = None, update_clip: Optional[float] = None,
                variances: Optional[list[torch.Tensor]] = None,
                generator: Optional[torch.Generator] = None) -> Union[int, torch.Tensor]:
    """Steps 1-5 of the module docstring on a list of 1-D unit slices, in place; returns the elements changed, as
    a 0-dim int64 tensor on the slices' device (0 when there are no slices): reading it is a host sync, so the
    step never does (ASDT reads it lazily, as ``last_selected``).

    ``weights[i]``/``grads[i]``: unit ``i``'s slice (all of it, or the part this rank holds of a unit split
    across ranks; ``unit_numels[i]`` is the whole unit's size, for ``k``). Give ``momenta`` (Growth: steps
    1-5, the momenta updated in place in their own dtype) or ``anchors`` (Elastic: ``c = g``, then the pull
    toward the anchors), not both. ``scores``: the ``importance="sketch"`` estimates (given with it only).
    ``kth_largest(scores, ks)`` gives each unit's threshold; a collective one (units split across ranks) must
    be called on every rank, so it is called even when there are no slices here.

    ``seconds`` (with ``momenta``): ``update="adaptive"``, a ``[len(weights), 2]`` fp32 tensor of each unit's
    ``(v, t)``, updated in place; ``unit_sums(partial)`` turns per-slice sums into whole-unit sums (a collective
    when units are split across ranks: it too is called even when there are no slices here). ``lengths``
    (adaptive only): the slices' lengths when ``weights``/``grads``/``momenta`` are each given as *runs* of
    consecutive slices (fewer, longer tensors: the same arithmetic without a loop over units). ``variances``
    (adaptive only): each element's own second moment (``second_moment="coordinate"``), slices like
    ``momenta``, updated in place; ``seconds`` then only counts each unit's steps (its ``v`` stays 0).
    ``generator``: bf16 weights are written with :func:`stochastic_round` (fp32 weights: no effect), one draw per
    element of each slice, slice after slice: the draws of :func:`reference_step` unit by unit.
    """
    if seconds is not None:
        if momenta is None:
            raise ValueError("asdt_update: seconds (update='adaptive') go with momenta (Growth units)")
        return _adaptive_update(weights, grads, momenta, seconds, lr=lr, betas=betas, density=density,
                                weight_decay=weight_decay, unit_numels=unit_numels, importance=importance, eps=eps,
                                lr_scales=lr_scales, scores=scores, kth_largest=kth_largest, unit_sums=unit_sums,
                                lengths=lengths, update_clip=update_clip, variances=variances,
                                generator=generator)
    if variances is not None:
        raise ValueError("asdt_update: variances (second_moment='coordinate') go with seconds (update='adaptive')")
    if (momenta is None) == (anchors is None):
        raise ValueError("asdt_update needs momenta (Growth) or anchors (Elastic), exactly one of them")
    if (importance == "sketch") != (scores is not None):
        raise ValueError(f"asdt_update takes scores with importance='sketch' only, got importance={importance!r} "
                         f"and scores={'given' if scores is not None else None}")
    b1, b2 = betas
    gs = [g.float() for g in grads]
    cs = [m.float() * b1 + g * (1 - b1) for m, g in zip(momenta, gs)] if momenta is not None else \
        [g.clone() for g in gs]
    est = scores if importance == "sketch" else [None] * len(gs)
    ss = [_scores(importance, c, g, w, e) for c, g, w, e in zip(cs, gs, weights, est)]
    # density 1: every unit's k is its size, its k-th largest score its minimum, so the mask is ``s > 0`` (the
    # same decision on every rank: density is a group setting, so no collective is skipped on one rank only)
    taus = kth_largest(ss, [_k(density, n) for n in unit_numels]) if density < 1.0 else None
    selected: Union[int, torch.Tensor] = 0
    for i, w in enumerate(weights):
        mask = (ss[i] >= taus[i]) & (ss[i] > 0) if taus is not None else ss[i] > 0
        selected = selected + mask.sum()
        wf = w.float()
        new = wf - (torch.sign(cs[i]) + weight_decay * wf) * (lr * (1.0 if lr_scales is None else lr_scales[i]))
        if anchors is not None:
            a = anchors[i].float()
            new = new + (a - new) * elastic_pull
        w.copy_(torch.where(mask, round_to(w.dtype, new, generator), w))
        if momenta is not None:
            m = momenta[i]
            m.copy_((m.float() * b2 + gs[i] * (1 - b2)).to(m.dtype))
    return selected


def _adaptive_update(weights: list[torch.Tensor], grads: list[torch.Tensor], momenta: list[torch.Tensor],
                     seconds: torch.Tensor, *, lr: float, betas: tuple[float, float], density: float,
                     weight_decay: float, unit_numels: list[int], importance: str, eps: float,
                     lr_scales: Optional[list[float]], scores: Optional[list[torch.Tensor]], kth_largest: KthLargest,
                     unit_sums: Callable[[torch.Tensor], torch.Tensor], lengths: Optional[list[int]] = None,
                     update_clip: Optional[float] = None, variances: Optional[list[torch.Tensor]] = None,
                     generator: Optional[torch.Generator] = None) -> Union[int, torch.Tensor]:
    """Steps 1' and 4' of the module docstring, vectorised over the slices (one concatenation, no per-unit loop
    except the top-k of ``density < 1`` and the write-back). Every tensor is made on the slices' device and
    nothing is read back to the host (the per-unit lists are copied once, :func:`device_list`)."""
    b1, b2 = betas
    n = len(unit_numels)
    dev = seconds.device
    if n == 0:  # the collectives still run (units split across ranks)
        if variances is None:
            unit_sums(torch.zeros(0, dtype=torch.float64, device=dev))
        if density < 1.0:
            kth_largest([], [])
        return 0
    lengths = list(lengths) if lengths is not None else [w.numel() for w in weights]
    lens, total = device_list(lengths, torch.int64, dev), sum(lengths)
    g = torch.cat([x.float() for x in grads])
    w = torch.cat([x.float() for x in weights])
    m = torch.cat([x.float() for x in momenta]) * b1 + g * (1 - b1)
    v, t = seconds[:, 0], seconds[:, 1]
    if variances is None:  # one second moment per unit (summed across ranks when the unit is split)
        # unsafe: the lengths are ours (non-negative, summing to the slices); the checks would read them on the host
        sq = unit_sums(torch.segment_reduce(g.double() ** 2, "sum", lengths=lens, unsafe=True))
        v.copy_(v * b2 + (1 - b2) * (sq / device_list(unit_numels, torch.float64, dev)).float())
        t.add_(1)
        bc1, bc2 = 1 - b1 ** t.double(), 1 - b2 ** t.double()
        denom = ((v.double() / bc2).sqrt() + eps) * bc1
        c = m / denom.float().repeat_interleave(lens, output_size=total)
    else:  # each coordinate's own (Adam's); no collective: nothing is summed over a unit
        t.add_(1)
        vc = torch.cat([x.float() for x in variances]) * b2 + (g * g) * (1 - b2)
        bc1 = (1 - b1 ** t.double()).float().repeat_interleave(lens, output_size=total)
        inv_bc2 = (1 / (1 - b2 ** t.double())).float().repeat_interleave(lens, output_size=total)
        for dst, part in zip(variances, torch.split(vc, [x.numel() for x in variances])):
            dst.copy_(part)
        c = m / ((ieee_sqrt(vc * inv_bc2) + eps) * bc1)  # fp32, as core.dense_step and reference_step
        del vc, bc1, inv_bc2
    if update_clip is not None:  # bound one coordinate's step when its gradient is far above its unit's RMS
        c = c.clamp(-update_clip, update_clip)
    if importance == "sketch":
        s = torch.cat(scores)
    else:
        s = _scores(importance, c, g, w, None)
    if density >= 1.0:  # every unit's k is its size: the k-th largest is its minimum (the same on every rank)
        mask = s > 0
    else:
        s_parts = list(torch.split(s, lengths))
        taus = kth_largest(s_parts, [_k(density, u) for u in unit_numels])
        mask = s >= torch.stack(taus).repeat_interleave(lens, output_size=total)
        mask &= s > 0
    scale = lr if lr_scales is None else \
        device_list([lr * x for x in lr_scales], torch.float32, dev).repeat_interleave(lens, output_size=total)
    new = torch.where(mask, w - (c + weight_decay * w) * scale, w)
    for dst, part in zip(weights, torch.split(new, [x.numel() for x in weights])):
        dst.copy_(round_to(dst.dtype, part, generator))  # unchanged elements: exact, so they stay as they were
    for dst, part in zip(momenta, torch.split(m, [x.numel() for x in momenta])):
        dst.copy_(part)
    return mask.sum()


def _chunk_plans(pieces: list[Piece], numels: list[int]) -> list[tuple]:
    """``[(lo, hi, offset, runs, lengths, numels)]``: all of ``pieces`` as one call (the flat path now steps only
    tensors with units split across ranks, whose collectives must match on every rank), ``offset`` 0 into the
    Growth buffers, ``runs`` the ``[start, stop)`` of consecutive pieces merged into single slices."""
    runs: list[list[int]] = []
    for pc in pieces:
        if runs and runs[-1][1] == pc.start:
            runs[-1][1] += pc.length
        else:
            runs.append([pc.start, pc.start + pc.length])
    return [(0, len(pieces), 0, runs, [pc.length for pc in pieces], numels)]
