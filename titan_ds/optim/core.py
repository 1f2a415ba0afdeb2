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

**On a CPU** the adaptive chunks step on a C++ kernel (:mod:`~titan_ds.optim.core_cpu`, ``csrc/core_cpu.cpp``):
the same arithmetic in two passes over the chunk, each element's work done while it is in cache, the square root
the correctly rounded one (:func:`~titan_ds.optim.asdt_math.ieee_sqrt`, as everywhere in the update); it stores what the eager loop stores, bit for bit (``tests/optim/test_core_cpu.py``),
at ~5x its elements/s. ``TITAN_CORE_CPU=0`` (or a machine where it does not build) steps eagerly.

**On a GPU** (Triton importable; and on ``meta``, where the op's fake implementation stands in) the adaptive update
of a whole tensor is one fused op, ``titan::asdt_adaptive_step`` (:mod:`~titan_ds.optim.core_triton`: a Triton
kernel, one program per 256 values of a unit), the same arithmetic: bit for bit the eager loop with the
per-coordinate second moment (``tests/optim/test_core_triton.py``, under the interpreter). ``TITAN_KERNELS=reference``
keeps the eager loop, which stays the oracle and the fallback.

**The compiled fused chunk** (:func:`_fused_chunk` under ``torch.compile``; on with ``TITAN_CORE_COMPILE=1``
(:data:`COMPILE`) or ``dense_step(compiled=True)``): the adaptive step with the per-coordinate second
moment runs each chunk of units of one length (a multiple of 256; 4-bit codes starting on a byte) as one graph:
decode, update, weight step and encode, which inductor fuses into a few loops (vectorized C++ on a CPU, Triton on
a GPU). It stores what the eager loop stores, bit for bit (both take the correctly rounded square root). 4-bit
codes are unpacked before the graph and packed after it, eagerly; stochastic rounding of bf16 weights stays eager
(``round_to``: the same draws). Other chunks (mixed or odd unit lengths, the sign update, the per-unit second
moment) take the eager loop, the oracle (``tests/optim/test_core_compiled.py``).
"""
from __future__ import annotations

import itertools
import os
import types
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Optional, Union

import torch

from .asdt_math import device_list, ieee_sqrt, round_to
from .layout import Piece
from .moments import bias_corrections, unit_second_moment as _unit_second_moment

__all__ = ["CHUNK", "Slice", "StateBuffer", "plan", "dense_step"]

# Elements per chunk: a 32nd of the tensor, at least CHUNK and at most MAX_CHUNK, a multiple of every quantized
# block size (qstate.KINDS: 256, 128). A chunk's temporaries are ~40 bytes an element, so ~1.25 bytes an element of
# a large tensor (and at most ~10 MiB for a tensor under 32 x CHUNK); larger chunks cost less per element, each
# chunk paying ~1 ms of fixed costs on this CPU (measured: 64K-element chunks step a 16M tensor ~30% slower than
# 256K-1M ones; SmolLM2-135M's hf_asdt_8bit step, 1833 chunks at a CHUNK of 64K, 5.6-6.0 s -> 3.2-3.6 s at 256K,
# the same bits; launch/bench/hf_speed.py). The sparse strategy keeps its own smaller minimum (sparse.CHUNK).
CHUNK, MAX_CHUNK, PARTS = 1 << 18, 1 << 20, 32

# Whether dense_step runs the adaptive per-coordinate chunks on the compiled fused step (_fused_chunk) by default.
# Off by default (TITAN_CORE_COMPILE=1 turns it on). Measured (launch/bench/optim_step.py --what speed, 2^24 fp32,
# 1 thread, bit-for-bit equal): 2.0x / 2.3x the eager loop's elements/s for titan_balanced / titan_memory (51.0 /
# 49.6 M/s), 0.08x DeepSpeedCPUAdam; compiling costs ~5-20 s and ~37 MB of peak RSS per variant (state kinds, weight dtype,
# importance, clip) on the first step that meets it, which the step-temporaries contract (tests/optim/test_core.py,
# step 2 of a fresh process) then counts: 9.1 B/element at 2^22 elements.
_env = os.environ.get("TITAN_CORE_COMPILE", "0")
if _env not in ("0", "1"):
    raise ValueError(f"TITAN_CORE_COMPILE={_env!r}: set 1 (the compiled fused step) or 0 (the eager loop, default)")
COMPILE = _env == "1"
# The lookup tables are indexed by codes and 16-bit patterns that are in range by construction; inductor's bounds
# check of each indirect load cost ~30% of the 8-bit step (measured once, on a shared CPU).
OPTIONS = {"assert_indirect_indexing": False}


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

    @cached_property
    def uniform(self) -> int:
        """The units' common length, or 0 when they differ."""
        return self.lengths[0] if len(set(self.lengths)) == 1 else 0


def plan(pieces: list[Piece], chunk: Optional[int] = None, parts: int = PARTS,
         least: Optional[int] = None) -> list[Slice]:
    """The chunks of a tensor's units, held as ``pieces`` (state buffers hold them end to end, in this order), of
    at most ``chunk`` elements each (default: a ``parts``-th of them, within [``least`` (default :data:`CHUNK`),
    :data:`MAX_CHUNK`], rounded up to 256)."""
    if chunk is None:
        least = CHUNK if least is None else least
        chunk = min(max(least, -(-sum(pc.length for pc in pieces) // parts // 256) * 256), max(least, MAX_CHUNK))
    if chunk % 256:
        raise ValueError(f"core.plan: chunk={chunk} must be a multiple of 256 (the quantized state's block sizes)")
    out: list[Slice] = []
    buf, group, held = 0, [], 0  # group: consecutive pieces (contiguous in the tensor) of at most ``chunk``
    # elements, ``held`` of them (a running sum: re-summing the group per piece was quadratic in a chunk's units)

    def close():
        nonlocal group, held
        if group:
            out.append(Slice(group[0][0].start, group[0][1], group[0][2], group[-1][2] + 1,
                             tuple(pc.length for pc, _, _ in group), 0))
            group, held = [], 0

    for i, pc in enumerate(pieces):
        if pc.length > chunk:  # a large unit: pieces of it, each starting at a multiple of the chunk
            close()
            for o in range(0, pc.length, chunk):
                out.append(Slice(pc.start + o, buf + o, i, i + 1, (min(chunk, pc.length - o),), o))
        else:
            if group and (held + pc.length > chunk or group[-1][0].start + group[-1][0].length != pc.start):
                close()
            group.append((pc, buf, i))
            held += pc.length
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
    def of(cls, st: dict, key: str, kind: Optional[str], signed: bool, lengths: tuple[int, ...]) -> "StateBuffer":
        """The buffer ``st[key]`` (with ``st[key + "_absmax"]`` when quantized) of units of ``lengths`` (a tuple:
        each unit's first block is cached per lengths and kind, not recounted every step)."""
        if kind is None or f"{key}_absmax" not in st:
            return cls(st[key])
        return cls(st[key], st[f"{key}_absmax"], kind, signed, block_starts(tuple(lengths), kind))

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


@lru_cache(maxsize=64)
def block_starts(lengths: tuple[int, ...], kind: str) -> tuple[int, ...]:
    """The index of each unit's first block scale in a ``kind`` buffer of units of ``lengths``."""
    from . import qstate
    block = qstate.KINDS[kind][0]
    return tuple(itertools.accumulate((-(-n // block) for n in lengths[:-1]), initial=0)) if lengths else ()


def _per_element(values: torch.Tensor, s: Slice) -> torch.Tensor:
    """Unit values ``values[lo:hi]`` as one per element of the chunk (a broadcast for a single unit)."""
    if s.hi - s.lo == 1:
        return values[s.lo:s.lo + 1]
    lens = device_list(list(s.lengths), torch.int64, values.device)
    return values[s.lo:s.hi].repeat_interleave(lens, output_size=s.n)


# The compiled step sees a chunk as [1, rows, 2, 128] (every unit a whole number of FUSED_BLOCK = 256 values,
# so an 8-bit block is one row and a 4-bit block half of one): block scales then index by whole dimensions. A flat
# dynamic length made inductor compute ``i % (256 * (n // 256))`` at each load, and a flat 4-bit block index
# (``i // 128``) made it emit scalar loops or fail (an assertion in its CPU loop split at 256 rows).
FUSED_BLOCK, FUSED_ROW = 256, (2, 128)


def _fusable(s: Slice, *bufs: StateBuffer) -> bool:
    """Whether the compiled step takes chunk ``s``: units of one length, a multiple of :data:`FUSED_BLOCK` (so
    whole quantization blocks), starting on a byte of 4-bit codes. Any other chunk steps eagerly."""
    return s.uniform % FUSED_BLOCK == 0 and s.uniform > 0 and all(b.kind != "4bit" or s.buf % 2 == 0 for b in bufs)


def _state_in(buf: StateBuffer, s: Slice, shape: tuple[int, int]) -> tuple:
    """The raw slice of ``buf`` that chunk ``s`` (``shape``: its units and rows of :data:`FUSED_BLOCK`) reads
    and writes: ``(values,)`` of a plain buffer, ``(codes, absmax)`` of a quantized one (4-bit: the packed
    codes, flat, and two block scales a row)."""
    if buf.kind is None:
        return (buf.data[s.buf:s.buf + s.n].view(*shape, *FUSED_ROW),)
    from . import qstate
    block, bits = qstate.KINDS[buf.kind]
    b0 = buf.block0[s.lo] + s.offset // block
    absmax = buf.absmax[b0:b0 + s.n // block].view(*shape, FUSED_BLOCK // block)
    if bits == 4:  # unpacked before the step and packed after it, eagerly: in the graph, the step's arithmetic
        # was inlined into a scalar loop over the byte pairs (4-bit steps took 2.5x the time of 8-bit ones)
        return buf.data[s.buf // 2:(s.buf + s.n) // 2], absmax
    return buf.data[s.buf:s.buf + s.n].view(*shape, *FUSED_ROW), absmax


def _unpacked(raw: tuple, shape: tuple[int, int]) -> tuple:
    """:func:`_state_in`'s slices as the compiled step takes them: 4-bit codes one a byte."""
    if raw[0].dim() != 1:
        return raw
    from . import qstate
    return (qstate._unpack4(raw[0]).view(*shape, *FUSED_ROW),) + raw[1:]


def _decode(raw: tuple, tables: Optional[tuple], kind: Optional[str]) -> torch.Tensor:
    if kind is None:
        return raw[0].float()
    from . import qstate
    return qstate.decode_with(tables[0], raw[0], raw[1], qstate.KINDS[kind][0]).view(raw[0].shape)


def _encode(x: torch.Tensor, like: tuple, tables: Optional[tuple], kind: Optional[str]) -> tuple:
    """torchao's scale_tensor (each block over its absmax, clipped at 1e-12) and qstate's encoding, over the
    blocks of ``x`` ([1, rows, 2, 128]) as whole dimensions."""
    if kind is None:
        return (x.to(like[0].dtype),)
    from . import qstate
    dims = (-1,) if qstate.KINDS[kind][0] == FUSED_ROW[1] else (-2, -1)
    scale = x.abs().amax(dims, keepdim=True).clip(1e-12)
    return qstate.encode_with(x / scale, tables[1], tables[2]), scale.view(like[1].shape)


def _fused_chunk(w: torch.Tensor, g: torch.Tensor, m_raw: tuple, v_raw: tuple, bc1: torch.Tensor,
                 inv_bc2: torch.Tensor, hp: torch.Tensor, m_tables: Optional[tuple], v_tables: Optional[tuple],
                 m_kind: Optional[str], v_kind: Optional[str], importance: str, clip: bool, out_dtype: torch.dtype):
    """:func:`dense_step`'s adaptive per-coordinate chunk as one pure function (what ``torch.compile`` fuses):
    ``w``, ``g``: ``[1, rows, 2, 128]``; ``m_raw``, ``v_raw``: :func:`_unpacked` slices; ``bc1``,
    ``inv_bc2``: ``[1, rows, 1, 1]`` (each row's unit's); ``hp``: fp32 ``(b1, 1 - b1, b2, 1 - b2, eps, lr, weight_decay,
    update_clip)``. Returns the new weights (``out_dtype``), the new raw momentum and second moment, and the
    count of changed elements. The arithmetic is the eager loop's, op for op."""
    gf, wf = g.float(), w.float()
    m = _decode(m_raw, m_tables, m_kind) * hp[0] + gf * hp[1]
    v = _decode(v_raw, v_tables, v_kind) * hp[2] + (gf * gf) * hp[3]
    c = m / ((torch.sqrt(v * inv_bc2) + hp[4]) * bc1)  # inductor emits the IEEE sqrt (asdt_math.ieee_sqrt)
    if clip:
        c = c.clamp(-hp[7], hp[7])
    mask = (c.abs() if importance == "momentum" else (gf * wf).abs()) > 0
    new = torch.where(mask, wf - (c + hp[6] * wf) * hp[5], wf)
    return (new.to(out_dtype), _encode(m, m_raw, m_tables, m_kind), _encode(v, v_raw, v_tables, v_kind),
            mask.sum())


def _fused_step(w_flat: torch.Tensor, g_flat: torch.Tensor, s: Slice, momentum: StateBuffer,
                variance: StateBuffer, bc1: torch.Tensor, inv_bc2: torch.Tensor, hp: torch.Tensor, importance: str,
                clip: bool, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Chunk ``s`` on the compiled :func:`_fused_chunk`, its results stored in place; the count of changed
    elements. bf16 weights with stochastic rounding get the fp32 result rounded eagerly (round_to: the draws of the
    eager path, from the same generator)."""
    from . import qstate
    shape = (1, s.n // FUSED_BLOCK)  # units and their rows as one dimension: one graph for any count of units
    full = (*shape, *FUSED_ROW)
    per_row = [x[s.lo:s.hi].repeat_interleave(s.uniform // FUSED_BLOCK).view(*shape, 1, 1) for x in (bc1, inv_bc2)]
    w = w_flat[s.flat:s.flat + s.n]
    m_raw, v_raw = _state_in(momentum, s, shape), _state_in(variance, s, shape)
    m_in, v_in = (_unpacked(raw, shape) for raw in (m_raw, v_raw))
    tables = [None if b.kind is None else qstate._on(b.kind, b.signed, w.device) for b in (momentum, variance)]
    sr = generator is not None and w.dtype == torch.bfloat16
    out_dtype = torch.float32 if sr else w.dtype
    fn = _compiled(momentum.kind, variance.kind, importance, clip, out_dtype)
    new, m_new, v_new, count = fn(w.view(full), g_flat[s.flat:s.flat + s.n].view(full),
                                  m_in, v_in, *per_row,
                                  hp, *tables, momentum.kind, variance.kind, importance, clip, out_dtype)
    w.copy_(round_to(w.dtype, new.view(-1), generator) if sr else new.view(-1))
    for dst, src in zip(m_raw + v_raw, m_new + v_new):
        dst.copy_(qstate._pack4(src.view(-1)) if dst.shape != src.shape else src)  # 4-bit codes: packed
    return count


@lru_cache(maxsize=None)
def _compiled(*static):
    """:func:`_fused_chunk` under ``torch.compile`` (inductor: vectorized C++ on a CPU, Triton on a GPU), with
    dynamic shapes: one graph serves every chunk length and count of units (per state kinds, weight dtype,
    importance and clip; a chunk of one 256-value row compiles apart)."""
    # One copy of the function (its own code object, so its own dynamo cache and recompile limit) per ``static``
    # (kinds, importance, clip, weight dtype): otherwise the variants of one process (tests run many) pass
    # dynamo's limit of 8 graphs a code object, past which it silently runs the function eagerly.
    fn = types.FunctionType(_fused_chunk.__code__.replace(), _fused_chunk.__globals__, "_fused_chunk")
    return torch.compile(fn, dynamic=True, options=OPTIONS)


# The per-unit second moment's compiled chunk (:func:`_fused_unit_chunk`): whole units of one length ``L`` (the rows
# of a weight at ``granularity="row"``: 576 and 1536 for SmolLM2), seen as ``[rows, L]``, any ``L`` (quantization
# blocks restart at each unit and the last one is partial, as qstate stores them: padded to whole blocks in the
# graph). One graph per ``L`` (static: a symbolic ``L`` made inductor index blocks by a modulo per load) with the
# row count dynamic; units longer than UNIT_FUSED_MAX (pieces of a large 1-D unit) and past UNIT_FUSED_LENGTHS
# distinct lengths a process step eagerly.
UNIT_FUSED_MAX, UNIT_FUSED_LENGTHS = 16384, 16


def _rows_decode(raw: tuple, tables: Optional[tuple], kind: Optional[str]) -> torch.Tensor:
    """The fp32 values of a ``[rows, L]`` state slice: ``(values,)``, or ``(codes, absmax [rows, blocks])`` decoded
    as qstate's ``_values`` decodes them (codes padded to whole blocks with code 0, the pad dropped after)."""
    if kind is None:
        return raw[0].float()
    from . import qstate
    codes, absmax = raw
    rows, length = codes.shape
    nb, block = absmax.shape[1], qstate.KINDS[kind][0]
    if nb * block != length:
        codes = torch.nn.functional.pad(codes, (0, nb * block - length))
    return qstate.decode_with(tables[0], codes, absmax, block).view(rows, nb * block)[:, :length]


def _rows_encode(x: torch.Tensor, like: tuple, tables: Optional[tuple], kind: Optional[str]) -> tuple:
    """``x`` ([rows, L], fp32) stored as ``like`` is: cast, or qstate's ``_codes`` (zero-padded to whole blocks,
    each block over its absmax clipped at 1e-12, as torchao's scale_tensor; the pad's codes dropped)."""
    if kind is None:
        return (x.to(like[0].dtype),)
    from . import qstate
    rows, length = x.shape
    nb, block = like[1].shape[1], qstate.KINDS[kind][0]
    if nb * block != length:
        x = torch.nn.functional.pad(x, (0, nb * block - length))
    x = x.reshape(rows, nb, block)
    scale = x.abs().amax(-1, keepdim=True).clip(1e-12)
    codes = qstate.encode_with(x / scale, tables[1], tables[2]).view(rows, nb * block)[:, :length]
    return codes, scale.view(rows, nb)


def _fused_unit_chunk(w: torch.Tensor, g: torch.Tensor, m_raw: tuple, denom: torch.Tensor, hp: torch.Tensor,
                      m_tables: Optional[tuple], m_kind: Optional[str], importance: str, clip: bool,
                      out_dtype: torch.dtype):
    """:func:`dense_step`'s adaptive chunk with the per-unit second moment as one pure function (what
    ``torch.compile`` fuses): ``w``, ``g``: ``[rows, L]``; ``m_raw``: the momentum's slice as
    :func:`_rows_decode` takes it; ``denom``: ``[rows, 1]``, each unit's denominator; ``hp`` as
    :func:`_fused_chunk`'s. Returns the new weights (``out_dtype``), the new raw momentum and the count of changed
    elements; the arithmetic is the eager loop's, op for op."""
    gf, wf = g.float(), w.float()
    m = _rows_decode(m_raw, m_tables, m_kind) * hp[0] + gf * hp[1]
    c = m / denom
    if clip:
        c = c.clamp(-hp[7], hp[7])
    mask = (c.abs() if importance == "momentum" else (gf * wf).abs()) > 0
    new = torch.where(mask, wf - (c + hp[6] * wf) * hp[5], wf)
    return new.to(out_dtype), _rows_encode(m, m_raw, m_tables, m_kind), mask.sum()


def _unit_fusable(s: Slice, momentum: StateBuffer) -> bool:
    """Whether the compiled per-unit step takes chunk ``s``: whole units of one length (at most
    :data:`UNIT_FUSED_MAX`), 4-bit codes starting and ending on a byte."""
    return (s.uniform > 0 and s.offset == 0 and s.uniform <= UNIT_FUSED_MAX
            and (momentum.kind != "4bit" or (s.buf % 2 == 0 and s.n % 2 == 0))
            and (s.uniform in _unit_lengths or len(_unit_lengths) < UNIT_FUSED_LENGTHS))


_unit_lengths: set[int] = set()


def _fused_unit_step(w_flat: torch.Tensor, g_flat: torch.Tensor, s: Slice, momentum: StateBuffer,
                     unit_denom: torch.Tensor, hp: torch.Tensor, importance: str, clip: bool,
                     generator: Optional[torch.Generator]) -> torch.Tensor:
    """Chunk ``s`` on the compiled :func:`_fused_unit_chunk`, stored in place (as :func:`_fused_step`)."""
    from . import qstate
    rows, length = s.hi - s.lo, s.uniform
    _unit_lengths.add(length)
    w = w_flat[s.flat:s.flat + s.n]
    if momentum.kind is None:
        m_raw = (momentum.data[s.buf:s.buf + s.n].view(rows, length),)
        m_in, tables = m_raw, None
    else:
        block, bits = qstate.KINDS[momentum.kind]
        nb, b0 = -(-length // block), momentum.block0[s.lo]
        absmax = momentum.absmax[b0:b0 + rows * nb].view(rows, nb)
        if bits == 4:
            m_raw = (momentum.data[s.buf // 2:(s.buf + s.n) // 2], absmax)
            m_in = (qstate._unpack4(m_raw[0]).view(rows, length), absmax)
        else:
            m_raw = m_in = (momentum.data[s.buf:s.buf + s.n].view(rows, length), absmax)
        tables = qstate._on(momentum.kind, momentum.signed, w.device)
    sr = generator is not None and w.dtype == torch.bfloat16
    out_dtype = torch.float32 if sr else w.dtype
    fn = _compiled_unit(momentum.kind, importance, clip, out_dtype, length)
    new, m_new, count = fn(w.view(rows, length), g_flat[s.flat:s.flat + s.n].view(rows, length), m_in,
                           unit_denom[s.lo:s.hi].view(rows, 1), hp, tables, momentum.kind, importance, clip,
                           out_dtype)
    w.copy_(round_to(w.dtype, new.reshape(-1), generator) if sr else new.reshape(-1))
    for dst, src in zip(m_raw, m_new):
        dst.copy_(qstate._pack4(src.reshape(-1)) if dst.shape != src.shape else src)  # 4-bit codes: packed
    return count


@lru_cache(maxsize=None)
def _compiled_unit(*static):
    """:func:`_fused_unit_chunk` under ``torch.compile``, one copy per ``static`` (state kind, importance, clip,
    weight dtype, unit length: the length stays static, the row count turns dynamic on its second value)."""
    fn = types.FunctionType(_fused_unit_chunk.__code__.replace(), _fused_unit_chunk.__globals__,
                            "_fused_unit_chunk")
    return torch.compile(fn, dynamic=None, options=OPTIONS)


def direction(s: Slice, g: torch.Tensor, momentum: StateBuffer, betas: tuple[float, float], adaptive: bool, *,
              variance: Optional[StateBuffer] = None, unit_denom: Optional[torch.Tensor] = None,
              bc1: Optional[torch.Tensor] = None, inv_bc2: Optional[torch.Tensor] = None, eps: float = 1e-8,
              update_clip: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunk ``s``'s direction ``c`` (the score of ``importance="momentum"`` is ``|c|``), its step (``c``, or
    ``sign(c)`` for the sign update) and its new momentum (fp32, for the caller to store), from the fp32 gradient
    ``g`` and the stored momentum; the adaptive update's second moment per coordinate (``variance``, stored
    here) or per unit (``unit_denom``, each unit's denominator)."""
    b1, b2 = betas
    m_old = momentum.read(s)
    if not adaptive:
        c = m_old * b1 + g * (1 - b1)
        return c, torch.sign(c), m_old.mul_(b2).add_(g * (1 - b2))
    m = m_old.mul_(b1).add_(g * (1 - b1))
    if unit_denom is not None:
        c = m / _per_element(unit_denom, s)
    else:
        v = variance.read(s).mul_(b2).add_((g * g).mul_(1 - b2))
        variance.write(s, v)
        den = ieee_sqrt(v.mul_(_per_element(inv_bc2, s)), out=v).add_(eps).mul_(_per_element(bc1, s))
        c = torch.div(m, den, out=den)
    if update_clip is not None:
        c.clamp_(-update_clip, update_clip)
    return c, c, m


def _scale_folds(w_flat: torch.Tensor, g_flat: torch.Tensor, grad_scale: Union[float, torch.Tensor]) -> bool:
    """Whether :func:`dense_step` folds ``grad_scale`` chunk by chunk: CPU tensors and a host factor (a device
    tensor's value is not read on the host: no sync; the pass runs instead)."""
    if w_flat.device.type != "cpu" or g_flat.device.type != "cpu":
        return False
    return not torch.is_tensor(grad_scale) or (grad_scale.device.type == "cpu" and grad_scale.numel() == 1
                                               and grad_scale.dtype == torch.float32)


def dense_step(w_flat: torch.Tensor, g_flat: torch.Tensor, slices: list[Slice], momentum: StateBuffer, *,
               lr: float, betas: tuple[float, float], weight_decay: float, importance: str = "momentum",
               update: str = "adaptive", variance: Optional[StateBuffer] = None,
               seconds: Optional[torch.Tensor] = None, unit_numels: Optional[list[int]] = None, eps: float = 1e-8,
               update_clip: Optional[float] = None,
               generator: Optional[torch.Generator] = None,
               compiled: Optional[bool] = None, count: Optional[torch.Tensor] = None,
               grad_scale: Union[None, float, torch.Tensor] = None) -> Union[int, torch.Tensor]:
    """One step of every unit of ``slices`` (see the module docstring), in place: the weights ``w_flat`` (fp32 or
    bf16), ``momentum`` and (adaptive) ``variance``; ``seconds`` (adaptive): the ``[units, 2]`` (v, t) rows, whose
    t counts each unit's steps (incremented here). With ``unit_numels`` instead of ``variance``, the second moment
    is one per unit (``v``, of the mean square over the whole unit: every unit must be held whole, none split
    across ranks). Returns the elements changed (a device tensor, or 0); the fused op
    (:mod:`~titan_ds.optim.core_triton`) adds them to ``count`` (a 0-dim int64 tensor on the device) in place
    when it is given, and returns it.

    ``grad_scale`` (a Python float or a 0-dim fp32 CPU tensor: ZeRO-3's unscale and clip factor): the step is the
    one after ``g_flat.mul_(grad_scale)``, bit for bit, without that pass over the whole gradient. The CPU kernel
    multiplies as it reads (the gradient is not written); the eager and compiled chunks scale each chunk in place
    just before stepping it (while it is in cache); the fused device op and the per-unit second moment (which reads
    every chunk first) scale the whole gradient first, as the pass would. ``g_flat``'s values afterwards are
    unspecified (scaled or not): the caller must not read them again."""
    b1, b2 = betas
    adaptive = update == "adaptive"
    if grad_scale is not None and not torch.is_tensor(grad_scale) and float(grad_scale) == 1.0:
        grad_scale = None
    if grad_scale is not None and adaptive and (variance is None or not _scale_folds(w_flat, g_flat, grad_scale)):
        g_flat.mul_(grad_scale)  # per-unit second moment, the fused device op, a device tensor: the pass itself
        grad_scale = None
    unit_denom = bc1 = inv_bc2 = None
    if adaptive:
        if seconds is None or (variance is None) == (unit_numels is None):
            raise ValueError("dense_step: update='adaptive' needs the seconds rows and either the variance buffer "
                             "(a second moment per coordinate) or unit_numels (one per unit)")
        from . import core_triton
        if core_triton.runs(w_flat, g_flat, momentum, variance) and \
                core_triton.takes(slices, momentum, variance, w_flat.device):  # the tensor as one fused op
            return core_triton.step(
                w_flat, g_flat, slices, momentum, lr=lr, betas=betas, weight_decay=weight_decay,
                importance=importance, variance=variance, seconds=seconds, eps=eps, update_clip=update_clip,
                unit_numels=unit_numels, generator=generator, count=count)
        if variance is None:
            unit_denom = _unit_second_moment(g_flat, slices, seconds, unit_numels, betas, eps)
        else:
            bc1, inv_bc2 = bias_corrections(seconds, betas)
    elif update != "sign":
        raise ValueError(f"dense_step: unknown update {update!r}")
    selected: Union[int, torch.Tensor] = 0
    # the compiled graphs need a backend: on the meta device (a GPU's stand-in in the tests) the eager loop, the
    # same arithmetic, steps
    fused = adaptive and (COMPILE if compiled is None else compiled) and w_flat.device.type != "meta"
    if fused:
        hp = torch.tensor([b1, 1 - b1, b2, 1 - b2, eps, lr, weight_decay,
                           0.0 if update_clip is None else update_clip], dtype=torch.float32, device=w_flat.device)
    from . import core_cpu
    native = adaptive and not fused and core_cpu.runs(w_flat, g_flat, momentum, variance)
    if native and grad_scale is not None and g_flat.dtype != torch.float32:
        g_flat.mul_(grad_scale)  # (the kernel folds the factor into fp32 gradients only)
        grad_scale = None
    folded = 1.0 if grad_scale is None else float(grad_scale)  # (a CPU tensor: _scale_folds checked it)
    for s in slices:
        if native:
            selected = selected + core_cpu.step(
                w_flat, g_flat, s, momentum, variance, unit_denom=unit_denom, bc1=bc1, inv_bc2=inv_bc2, betas=betas,
                eps=eps, lr=lr, weight_decay=weight_decay, update_clip=update_clip, importance=importance,
                generator=generator, grad_scale=folded)
            continue
        if grad_scale is not None:  # this chunk, in cache, as the pass over the whole gradient would have it
            g_flat[s.flat:s.flat + s.n].mul_(grad_scale)
        if fused and variance is not None and _fusable(s, momentum, variance):
            selected = selected + _fused_step(w_flat, g_flat, s, momentum, variance, bc1, inv_bc2, hp,
                                              importance, update_clip is not None, generator)
            continue
        if fused and unit_denom is not None and _unit_fusable(s, momentum):
            selected = selected + _fused_unit_step(w_flat, g_flat, s, momentum, unit_denom, hp, importance,
                                                   update_clip is not None, generator)
            continue
        w = w_flat[s.flat:s.flat + s.n]
        g = g_flat[s.flat:s.flat + s.n].float()
        wf = w.float()
        c, step, m = direction(s, g, momentum, betas, adaptive, variance=variance, unit_denom=unit_denom,
                               bc1=bc1, inv_bc2=inv_bc2, eps=eps, update_clip=update_clip)
        score = c.abs() if importance == "momentum" else (g * wf).abs()
        mask = score > 0
        new = torch.where(mask, wf - (step + weight_decay * wf) * lr, wf)
        w.copy_(round_to(w.dtype, new, generator))
        momentum.write(s, m)
        selected = selected + mask.sum()
    return selected
