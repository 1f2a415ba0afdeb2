"""The fast core of ASDT's dense updates: the adaptive (Adam-like) step with a per-coordinate or per-unit second
moment, and the sign step, at density 1, stepped chunk by chunk.

What the shipped quality profiles run (``titan_balanced``, ``titan_memory``, ``hf_*``: ``update="adaptive"``,
``second_moment="coordinate"``, ``density=1``) is a quantized AdamW: every element's update depends on its own
gradient, momentum and second moment only. So a tensor is stepped in *chunks* (a 32nd of it, 64K to 1M
elements, :func:`plan`): decode the chunk's momentum and second moment (qstate's 8-/4-bit codes, or bf16/fp32), update them,
compute the step, write the weights (stochastically rounded when bf16) and encode the state back, before the next
chunk. The temporaries are a few fp32 copies of one chunk (a fixed few MiB), whatever the tensor's size, and
nothing reads a value back to the host.

The arithmetic is :func:`~titan_ds.optim.asdt_math.reference_step`'s, op for op in fp32 (so the two agree bit for
bit; ``tests/optim/test_core.py``), with the bias corrections ``1 - beta^t`` computed per unit in fp64 and used
as ``v * (1 / bc2)`` and ``* bc1`` in fp32::

    m = m * b1 + g * (1 - b1);   v = v * b2 + (g * g) * (1 - b2)
    c = m / ((sqrt(v * (1 / bc2)) + eps) * bc1)          [clamped to +-update_clip]
    w = w - (c + weight_decay * w) * lr                  where the score (|c|, or |g w|) is > 0

and for the sign update ``c = m * b1 + g * (1 - b1)``, ``w = w - (sign(c) + weight_decay * w) * lr``,
``m = m * b2 + g * (1 - b2)``.

Chunks never cross a unit's boundary in a way that changes its quantization: a chunk is either consecutive whole
units (their blocks restart at each unit, as qstate stores them) or a piece of one unit that starts at a
multiple of the block size (256 values: both the 8-bit and the 4-bit block divide it). Stochastic rounding draws
one number per element, chunk after chunk: on the CPU generator the same draws as one call over the tensor.

The per-unit second moment (``second_moment="unit"``, the HF profiles' rows) takes one more pass over the
gradient first (each unit's mean square). Strategies that need a whole unit or every unit at once (a top-k at
density < 1, the TGSS sketch, BSPS modes, a unit split across ranks) stay in :mod:`~titan_ds.optim.asdt_math`;
ASDT routes to this core when none is on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from .asdt_math import device_list, round_to
from .layout import Piece

__all__ = ["CHUNK", "Slice", "StateBuffer", "plan", "dense_step"]

# Elements per chunk: a 32nd of the tensor, at least CHUNK and at most MAX_CHUNK, a multiple of every quantized
# block size (qstate.KINDS: 256, 128). A chunk's temporaries are ~40 bytes an element, so ~1.25 bytes an element of
# a large tensor; larger chunks cost less Python per element (measured: 64K-element chunks step a 16M tensor ~30%
# slower than 256K-1M ones on this CPU).
CHUNK, MAX_CHUNK, PARTS = 1 << 16, 1 << 20, 32


@dataclass(frozen=True)
class Slice:
    """One chunk: ``n`` elements at ``flat`` in the stepped tensor and ``buf`` in the state buffers, made of the
    whole units ``[lo, hi)`` (their ``lengths``), or of a piece of unit ``lo`` (``hi = lo + 1``) that starts
    ``offset`` elements into it."""
    flat: int
    buf: int
    lo: int
    hi: int
    lengths: tuple[int, ...]
    offset: int

    @property
    def n(self) -> int:
        return sum(self.lengths)


def plan(pieces: list[Piece], chunk: Optional[int] = None) -> list[Slice]:
    """The chunks of a tensor's units, held as ``pieces`` (state buffers hold them end to end, in this order), of
    at most ``chunk`` elements each (default: a :data:`PARTS`-th of them, within [:data:`CHUNK`,
    :data:`MAX_CHUNK`], rounded up to 256)."""
    if chunk is None:
        chunk = min(max(CHUNK, -(-sum(pc.length for pc in pieces) // PARTS // 256) * 256), max(CHUNK, MAX_CHUNK))
    if chunk % 256:
        raise ValueError(f"core.plan: chunk={chunk} must be a multiple of 256 (the quantized state's block sizes)")
    out: list[Slice] = []
    buf, group = 0, []  # group: consecutive pieces (contiguous in the tensor) of at most ``chunk`` elements

    def close():
        nonlocal group
        if group:
            out.append(Slice(group[0][0].start, group[0][1], group[0][2], group[-1][2] + 1,
                             tuple(pc.length for pc, _, _ in group), 0))
            group = []

    for i, pc in enumerate(pieces):
        if pc.length > chunk:  # a large unit: pieces of it, each starting at a multiple of the chunk
            close()
            for o in range(0, pc.length, chunk):
                out.append(Slice(pc.start + o, buf + o, i, i + 1, (min(chunk, pc.length - o),), o))
        else:
            if group and (sum(pc_.length for pc_, _, _ in group) + pc.length > chunk
                          or group[-1][0].start + group[-1][0].length != pc.start):
                close()
            group.append((pc, buf, i))
        buf += pc.length
    close()
    return out


@dataclass
class StateBuffer:
    """A state buffer of a tensor's units: plain (fp32/bf16) or quantized (``kind``: qstate's codes + block scales,
    ``block0[i]``: the first block scale of unit ``i``)."""
    data: torch.Tensor
    absmax: Optional[torch.Tensor] = None
    kind: Optional[str] = None
    signed: bool = True
    block0: Optional[list[int]] = None

    @classmethod
    def of(cls, st: dict, key: str, kind: Optional[str], signed: bool, lengths: list[int]) -> "StateBuffer":
        if kind is None or f"{key}_absmax" not in st:
            return cls(st[key])
        from . import qstate
        block0, at = [], 0
        for n in lengths:
            block0.append(at)
            at += qstate.blocks([n], kind)
        return cls(st[key], st[f"{key}_absmax"], kind, signed, block0)

    def _where(self, s: Slice) -> tuple[int, int]:
        from . import qstate
        return s.buf, self.block0[s.lo] + s.offset // qstate.KINDS[self.kind][0]

    def read(self, s: Slice) -> torch.Tensor:
        if self.kind is None:  # a copy: the step works on it in place
            return self.data[s.buf:s.buf + s.n].to(torch.float32, copy=True)
        from . import qstate
        start, b0 = self._where(s)
        return qstate.read(self.data, self.absmax, start, b0, list(s.lengths), self.kind, self.signed)

    def write(self, s: Slice, x: torch.Tensor) -> None:
        if self.kind is None:
            self.data[s.buf:s.buf + s.n].copy_(x)
            return
        from . import qstate
        start, b0 = self._where(s)
        qstate.write(self.data, self.absmax, start, b0, x, list(s.lengths), self.kind, self.signed)


def _per_element(values: torch.Tensor, s: Slice) -> torch.Tensor:
    """Unit values ``values[lo:hi]`` as one per element of the chunk (a broadcast for a single unit)."""
    if s.hi - s.lo == 1:
        return values[s.lo:s.lo + 1]
    lens = device_list(list(s.lengths), torch.int64, values.device)
    return values[s.lo:s.hi].repeat_interleave(lens, output_size=s.n)


def _unit_second_moment(g_flat: torch.Tensor, slices: list[Slice], seconds: torch.Tensor, unit_numels: list[int],
                        betas: tuple[float, float], eps: float) -> torch.Tensor:
    """The per-unit second moment (``second_moment="unit"``): a first pass sums each unit's squared gradient (fp64,
    chunk by chunk), then ``v``, ``t`` and each unit's denominator ``(sqrt(v / bc2) + eps) * bc1``, as fp32 (the
    arithmetic of asdt_math's flat path, per unit)."""
    b1, b2 = betas
    dev = seconds.device
    sq = torch.zeros(seconds.shape[0], dtype=torch.float64, device=dev)
    for s in slices:
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


def dense_step(w_flat: torch.Tensor, g_flat: torch.Tensor, slices: list[Slice], momentum: StateBuffer, *,
               lr: float, betas: tuple[float, float], weight_decay: float, importance: str = "momentum",
               update: str = "adaptive", variance: Optional[StateBuffer] = None,
               seconds: Optional[torch.Tensor] = None, unit_numels: Optional[list[int]] = None, eps: float = 1e-8,
               update_clip: Optional[float] = None,
               generator: Optional[torch.Generator] = None) -> Union[int, torch.Tensor]:
    """One step of every unit of ``slices`` (see the module docstring), in place: the weights ``w_flat`` (fp32 or
    bf16), ``momentum`` and (adaptive) ``variance``; ``seconds`` (adaptive): the ``[units, 2]`` (v, t) rows, whose
    t counts each unit's steps (incremented here). With ``unit_numels`` instead of ``variance``, the second moment
    is one per unit (``v``, of the mean square over the whole unit: every unit must be held whole, none split
    across ranks). Returns the elements changed (a device tensor, or 0)."""
    b1, b2 = betas
    adaptive = update == "adaptive"
    unit_denom = None
    if adaptive:
        if seconds is None or (variance is None) == (unit_numels is None):
            raise ValueError("dense_step: update='adaptive' needs the seconds rows and either the variance buffer "
                             "(a second moment per coordinate) or unit_numels (one per unit)")
        if variance is None:
            unit_denom = _unit_second_moment(g_flat, slices, seconds, unit_numels, betas, eps)
        else:
            t = seconds[:, 1]
            t.add_(1)
            bc1 = (1 - b1 ** t.double()).float()
            inv_bc2 = (1 / (1 - b2 ** t.double())).float()
    elif update != "sign":
        raise ValueError(f"dense_step: unknown update {update!r}")
    selected: Union[int, torch.Tensor] = 0
    for s in slices:
        w = w_flat[s.flat:s.flat + s.n]
        g = g_flat[s.flat:s.flat + s.n].float()
        wf = w.float()
        m_old = momentum.read(s)
        if adaptive:
            m = m_old.mul_(b1).add_(g * (1 - b1))
            if unit_denom is not None:
                c = m / _per_element(unit_denom, s)
            else:
                v = variance.read(s).mul_(b2).add_((g * g).mul_(1 - b2))
                variance.write(s, v)
                den = v.mul_(_per_element(inv_bc2, s)).sqrt_().add_(eps).mul_(_per_element(bc1, s))
                c = torch.div(m, den, out=den)
            if update_clip is not None:
                c.clamp_(-update_clip, update_clip)
            step = c
        else:
            c = m_old * b1 + g * (1 - b1)
            step = torch.sign(c)
            m = m_old.mul_(b2).add_(g * (1 - b2))
        score = c.abs() if importance == "momentum" else (g * wf).abs()
        mask = score > 0
        new = torch.where(mask, wf - (step + weight_decay * wf) * lr, wf)
        w.copy_(round_to(w.dtype, new, generator))
        momentum.write(s, m)
        selected = selected + mask.sum()
    return selected
