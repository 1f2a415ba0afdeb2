"""The step counts and bias corrections of ASDT's adaptive update, and its per-unit second moment: one place for the
three paths that step it (the eager loop and the C++ kernel in :mod:`~titan_ds.optim.core`, the fused GPU op in
:mod:`~titan_ds.optim.core_triton`), so that neither step module imports the other."""
from __future__ import annotations

import torch

from .asdt_math import device_list

__all__ = ["bias_corrections", "unit_second_moment"]


def unit_second_moment(g_flat: torch.Tensor, slices: list, seconds: torch.Tensor, unit_numels: list[int],
                       betas: tuple[float, float], eps: float) -> torch.Tensor:
    """The per-unit second moment (``second_moment="unit"``): a first pass sums each unit's squared gradient (fp64,
    chunk by chunk), then ``v``, ``t`` and each unit's denominator ``(sqrt(v / bc2) + eps) * bc1``, as fp32 (the
    arithmetic of asdt_math's flat path, per unit)."""
    b1, b2 = betas
    dev = seconds.device
    sq = torch.zeros(seconds.shape[0], dtype=torch.float64, device=dev)
    from . import core_cpu
    native = core_cpu.runs(g_flat, g_flat)
    for s in slices:
        if native and s.hi - s.lo > 1:  # the C++ kernel's sum, segment_reduce's order (a single unit: ATen's sum)
            core_cpu.unit_sumsq(g_flat[s.flat:s.flat + s.n], list(s.lengths), sq[s.lo:s.hi])
            continue
        g = g_flat[s.flat:s.flat + s.n].double() ** 2
        if s.hi - s.lo == 1:
            sq[s.lo:s.lo + 1] += g.sum()
        else:
            lens = device_list(list(s.lengths), torch.int64, dev)
            sq[s.lo:s.hi] += torch.segment_reduce(g, "sum", lengths=lens, unsafe=True)
    v, t = seconds[:, 0], seconds[:, 1]
    v.copy_(v * b2 + (1 - b2) * (sq / device_list(unit_numels, torch.float64, dev)).float())
    t.add_(1)
    bc1, bc2 = 1 - b1 ** t.double(), 1 - b2 ** t.double()
    return (((v.double() / bc2).sqrt() + eps) * bc1).float()


def bias_corrections(seconds: torch.Tensor, betas: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Count one more step of each unit (``seconds[:, 1]``, in place) and return its ``1 - b1^t`` and
    ``1 / (1 - b2^t)``: computed in fp64, used in fp32 (the per-coordinate second moment's)."""
    b1, b2 = betas
    t = seconds[:, 1]
    t.add_(1)
    return (1 - b1 ** t.double()).float(), (1 / (1 - b2 ** t.double())).float()
