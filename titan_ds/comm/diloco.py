"""Local updates with a compressed outer step (DiLoCo; SparseLoCo's compressed outer gradient).

Each worker takes ``H = sync_every`` steps of its own (inner) optimizer on its own data with **no** gradient
all-reduce; then the workers exchange their parameter change and apply one outer step. Douillard et al.,
"DiLoCo: Distributed Low-Communication Training of Language Models" (2023): inner AdamW, outer Nesterov SGD
(lr 0.7, momentum 0.9); SparseLoCo (2025): the outer gradient top-k sparsified with error feedback.

One outer step on worker ``r`` (:meth:`OuterStep.sync`), over the flat fp32 vector of its parameters ``x_r``:

1. ``delta_r = anchor - x_r`` (the outer gradient; ``anchor`` is the parameters of the last sync, identical on
   every worker);
2. ``sum = reducer.reduce(delta_r)``: the package's :class:`~titan_ds.comm.compressor.GradientReducer` with
   ``titan.compression``'s ``method``/``ratio``/``error_feedback`` (``none``: a dense all-reduce; ``topk``:
   all-gathered (index, value) pairs; ``qtopk``: all-gathered chunked top-k with ``bits``-bit values and
   in-chunk indices; ``randk``/``tgss``/``hge``: all-reduced fixed-length messages, whose received bytes do not
   grow with W); residuals ``delta_r + old - sent`` stay on worker ``r``;
3. ``g = sum / W``; ``m = mu m + g``; ``u = g + mu m`` (Nesterov) or ``u = m``;
4. ``anchor = anchor - outer_lr u``; every worker's parameters become ``anchor``.

The inner optimizer's state (AdamW's moments) stays per worker and is never averaged, as in DiLoCo.

:func:`reference_round` is the plain-PyTorch oracle of steps 1-4 for ``none``, ``topk`` and ``qtopk`` (the
chunked, low-bit top-k of SparseLoCo, ``qtopk.py``: more coordinates at the same bytes; all workers in one
process, no collective object): the tests hold the DeepSpeed path and the simulator to it bit for bit.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from .base import Segment, all_finite
from .compressor import GradientReducer
from .qtopk import DEFAULT_BITS, DEFAULT_CHUNK, reference_qtopk

__all__ = ["OuterStep", "param_layout", "reference_round"]

log = logging.getLogger("titan_ds.comm")


def param_layout(named: Sequence[tuple[str, torch.Tensor]]) -> list[Segment]:
    """One segment per parameter, in order (residuals are keyed by the parameter's name)."""
    out, off = [], 0
    for name, p in named:
        out.append(Segment(name, 0, off, p.numel(), p.numel(), tuple(p.shape)))
        off += p.numel()
    return out


def _flat(params: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in params])


class OuterStep:
    """DiLoCo's outer optimizer over one worker's parameters (``named``: ``(name, parameter)`` pairs, the same
    order on every worker). State: ``anchor`` and ``momentum`` (identical on all workers) and the reducer's
    residuals (this worker's own)."""

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], reducer: GradientReducer, *, outer_lr: float,
                 outer_momentum: float, nesterov: bool = True):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        for n, p in named:
            if p.dtype != torch.float32:
                raise ValueError(f"titan local updates keep fp32 parameters; {n} is {p.dtype}")
        self.layout = param_layout(named)
        self.reducer = reducer
        self.outer_lr, self.mu, self.nesterov = float(outer_lr), float(outer_momentum), bool(nesterov)
        self.anchor = _flat(self.params)
        self.momentum: Optional[torch.Tensor] = None
        self.rounds = 0

    def __repr__(self) -> str:
        return (f"OuterStep(method={self.reducer.method!r}, ratio={self.reducer.ratio}, outer_lr={self.outer_lr}, "
                f"outer_momentum={self.mu}, nesterov={self.nesterov}, rounds={self.rounds})")

    @torch.no_grad()
    def sync(self, comm: Any) -> None:
        """One outer step (module docstring, steps 1-4) through ``comm`` (a ``Collective``)."""
        delta = torch.sub(self.anchor, _flat(self.params))
        summed = self.reducer.reduce(delta, self.layout, comm, self.rounds, consume=True)
        if not all_finite(summed):  # the same verdict on every worker: the sum is identical
            raise FloatingPointError(f"titan local updates: the outer gradient of round {self.rounds + 1} is not "
                                     f"finite on some worker (inner training diverged); lower the inner lr")
        self.reducer.end_step()
        g = summed.div_(comm.world_size)
        if self.mu > 0:
            if self.momentum is None:
                self.momentum = torch.zeros_like(g)
            self.momentum.mul_(self.mu).add_(g)
            update = g.add_(self.momentum, alpha=self.mu) if self.nesterov else self.momentum
        else:
            update = g
        self.anchor.sub_(update, alpha=self.outer_lr)
        for p, seg in zip(self.params, self.layout):
            p.copy_(self.anchor[seg.flat_offset:seg.flat_offset + seg.numel].view_as(p))
        self.rounds += 1

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": self.anchor.clone(), "momentum": None if self.momentum is None else self.momentum.clone(),
                "rounds": self.rounds, "names": list(self.names)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state["names"]) != self.names:
            raise RuntimeError("titan local updates: the checkpoint's outer state is for other parameters "
                               f"({len(state['names'])} names, this model has {len(self.names)}); resume the same model")
        self.anchor.copy_(state["anchor"])
        self.momentum = None if state["momentum"] is None else state["momentum"].clone()
        self.rounds = int(state["rounds"])


def reference_round(xs: list[torch.Tensor], anchor: torch.Tensor, momentum: Optional[torch.Tensor],
                    residuals: list[Optional[torch.Tensor]], *, method: str, ratio: float, outer_lr: float,
                    outer_momentum: float, nesterov: bool = True, error_feedback: bool = True,
                    bits: int = DEFAULT_BITS, chunk: int = DEFAULT_CHUNK, scale_dtype: str = "fp32"
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor], list]:
    """The oracle of one outer step for ``W = len(xs)`` workers' flat parameters: ``(new anchor, new momentum,
    new residuals)``. ``method``: ``none`` (mean of the deltas), ``topk`` (each worker's ``n / (2 ratio)``
    largest entries of ``delta + residual``, summed in worker order) or ``qtopk`` (each worker's
    :func:`~titan_ds.comm.qtopk.reference_qtopk` of ``delta + residual`` at ``bits``/``chunk``/``scale_dtype``, summed in worker
    order; the residual keeps the rest and the quantization error)."""
    world, summed = len(xs), torch.zeros_like(anchor)
    new_res: list = []
    for r, x in enumerate(xs):
        d = anchor - x
        if method == "none":
            summed = d.clone() if r == 0 else summed + d
            new_res.append(None)
        elif method == "topk":
            acc = d + residuals[r] if (error_feedback and residuals[r] is not None) else d
            k = max(1, min(acc.numel(), int(acc.numel() / (2.0 * ratio))))
            idx = torch.topk(acc.abs(), k, sorted=False).indices
            summed.index_add_(0, idx, acc[idx])
            res = acc.clone()
            res[idx] = 0.0
            new_res.append(res if error_feedback else None)
        elif method == "qtopk":
            acc = d + residuals[r] if (error_feedback and residuals[r] is not None) else d
            sent = reference_qtopk(acc, ratio, bits=bits, chunk=chunk, scale_dtype=scale_dtype)
            summed = summed + sent
            new_res.append(acc - sent if error_feedback else None)
        else:
            raise ValueError(f"the reference knows methods 'none', 'topk' and 'qtopk', not {method!r}")
    g = summed / world
    if outer_momentum > 0:
        # the same primitives as OuterStep (ATen's add with alpha may fuse the multiply): bitwise comparable
        m = g.clone() if momentum is None else momentum.mul(outer_momentum).add(g)
        u = g.add(m, alpha=outer_momentum) if nesterov else m
    else:
        m, u = momentum, g
    return anchor.sub(u, alpha=outer_lr), m, new_res
