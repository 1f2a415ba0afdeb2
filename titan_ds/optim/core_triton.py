"""ASDT's adaptive update of one tensor as one fused Triton kernel, registered as the ``torch.library`` op
``titan::asdt_adaptive_step`` (:mod:`~titan_ds.optim._core_triton_kernels`).

:func:`titan_ds.optim.core.dense_step` hands a tensor's update here (:func:`runs`) when its tensors are on CUDA and
Triton imports, on ``meta`` (the op's fake implementation: how a GPU step's op count is measured without a GPU),
or on the CPU with ``TITAN_KERNELS=triton`` and ``TRITON_INTERPRET=1`` (the tests). ``TITAN_KERNELS=reference``
keeps the eager loop everywhere; on a CPU the C++ kernel (:mod:`~titan_ds.optim.core_cpu`) stays the default.

**One launch per tensor.** Every unit of the tensor is stepped by one launch, one program per tile of 256 values
of a unit (an 8-bit block, or two 4-bit ones: blocks restart at every unit, as qstate stores them). The tiles are
listed once per layout in a small device table (:func:`_table`: 6 int64 per tile, ~0.19 bytes a value), cached
per chunk plan as ``ASDT`` caches the plan itself.

**Bias corrections from a host counter.** The eager loop counts each unit's steps on the device (``seconds[:, 1]``)
and computes ``(1 - b1^t)`` and ``1 / (1 - b2^t)`` from it in fp64 (:func:`moments.bias_corrections`). The dense path
steps every unit of a tensor at every step, so their ``t`` is one number: it is read from the device once, when a
``seconds`` buffer is first seen (or after anything else wrote to it: its version counter moved), and counted on
the host after that; the corrections are computed on the host in fp64 and rounded to fp32 as the eager loop rounds
them, and the kernel writes the new ``t``. Python's ``pow`` (glibc) and ATen's CPU ``pow`` (Sleef) differ in the
last fp64 bit for ~0.1-5% of ``t``, which rounding to fp32 absorbed for every ``t`` up to 10^6 and the betas
0.9, 0.95, 0.98, 0.99, 0.999, 0.9999 (checked on this machine); a CUDA ``pow`` may differ likewise. Units whose
counts differ take the per-unit corrections of :func:`moments.bias_corrections` (a few device ops more).

**Stochastic rounding** (bf16 weights): the kernel draws Philox words (``tl.randint``), one per value (its index
in the buffer), keyed by the generator's seed and a number the generator advances on the host (:func:`_seed`: a
CUDA generator's Philox offset), so a checkpointed generator resumes the same words; no device read.
:data:`DRAWS_FROM_GENERATOR` instead draws the eager loop's words from the generator (``torch.randint``, the same
draws chunk after chunk) and passes them in: the tests compare the kernel with the eager loop bit for bit so.

**The per-unit second moment** (``second_moment="unit"``, the HF rows): the op makes two small launches before
the step: each tile's fp64 sum of squared gradients, then one program per unit adds its tiles' sums (block after
block of :data:`UNIT_BLOCK`), updates ``v`` and ``t`` and computes the denominator ``(sqrt(v / bc2) + eps) * bc1``
in fp64 (the arithmetic of :func:`moments.unit_second_moment`); the step divides each tile by its unit's. The fp64
sum is added in another order than the eager loop's (``segment_reduce`` / ATen's ``sum``, itself different on a
CPU and a GPU), so it may differ in its last bits; each term ``g^2`` is exact in fp64, so each sum is within
``n * 2^-53`` (relative) of the exact one and the fp32 mean within one ulp of the eager loop's; the tests bound
``v`` and the weights by what that ulp can do (and find them equal on their shapes). Units whose step counts
differ take the eager loop's denominators.

Layouts it does not take (they step on the eager loop): 4-bit state whose units start on an odd value (two units
would share a byte of codes across two programs), and empty units (no tile would count their step).
"""
from __future__ import annotations

import struct
import weakref
from typing import Optional

import torch

from ..kernels import _guard

__all__ = ["runs", "step", "DRAWS_FROM_GENERATOR", "OP"]

# Draw the bf16 weights' rounding words from the optimizer's generator (torch.randint chunk by chunk, the eager
# loop's draws) instead of Philox in the kernel: bit for bit the eager loop's weights (the tests); a few device ops
# more a tensor.
DRAWS_FROM_GENERATOR = False
TILE = 256
UNIT_BLOCK = 256  # partial sums a unit's program adds at a time (the per-unit second moment)
_KIND = {None: 0, "8bit": 8, "4bit": 4}
_PLAIN = {torch.float32: 0, torch.bfloat16: 1}


def _state_kind(buf) -> int:
    if buf.kind is not None:
        return _KIND[buf.kind]
    return _PLAIN[buf.data.dtype]


def runs(w_flat: torch.Tensor, g_flat: torch.Tensor, momentum, variance) -> bool:
    """Whether :func:`step` takes this tensor's adaptive update (see the module docstring)."""
    requested = _guard.requested_backend()
    if requested == "reference":
        return False
    dev = w_flat.device.type
    if dev == "meta":
        ok = True
    elif dev == "cuda":
        ok = _guard.triton_available() or requested == "triton"
    elif dev == "cpu":
        ok = requested == "triton"
    else:
        return False
    if not ok or w_flat.dtype not in _PLAIN or g_flat.dtype not in _PLAIN:
        return False
    if requested == "triton" and dev != "meta":
        _guard.kernel_backend(w_flat, g_flat, op="ASDT adaptive step")  # raises with the fix where it cannot run
    return all(b is None or (b.kind in _KIND if b.kind is not None else b.data.dtype in _PLAIN)
               for b in (momentum, variance))


# ------------------------------------------------------------------------------------------------- tile table
_TABLES: dict[int, tuple] = {}
_TABLES_MAX = 4096


def _table(slices: list, device: torch.device) -> tuple[torch.Tensor, int, bool, bool]:
    """``(table, tiles, even, full)`` of a chunk plan (:func:`core.plan`'s slices): each tile's row (see the
    kernel), on ``device``, made once per plan (``slices`` is the list ASDT caches per layout); ``even``: every
    unit starts on an even value of the buffers (the 4-bit codes of two units never share a byte); ``full``: no
    unit is empty."""
    key = id(slices)
    hit = _TABLES.get(key)
    if hit is not None and hit[0] is slices and hit[1] == device:
        return hit[2]
    table, even, full = _build(slices)
    from ..comm.base import to_device_async
    out = (to_device_async(table, device) if device.type != "cpu" else table, table.shape[0], even, full)
    if len(_TABLES) >= _TABLES_MAX:
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[key] = (slices, device, out)
    return out


def _build(slices: list) -> tuple[torch.Tensor, bool, bool]:
    """:func:`_table`'s table, on the host, ``even`` and ``full``."""
    flat, buf, length, piece, offset = [], [], [], [], []
    for s in slices:
        f, b = s.flat, s.buf
        for i, n in enumerate(s.lengths):
            flat.append(f)
            buf.append(b)
            length.append(n)
            piece.append(s.lo + i)
            offset.append(s.offset)
            f, b = f + n, b + n
    lens = torch.tensor(length, dtype=torch.int64)
    tiles = (lens + TILE - 1) // TILE
    rep = lambda x: torch.tensor(x, dtype=torch.int64).repeat_interleave(tiles)  # noqa: E731
    start = torch.cumsum(tiles, 0) - tiles
    j = torch.arange(int(tiles.sum())) - start.repeat_interleave(tiles)  # the tile's index in its run of units
    into = rep(offset) + j * TILE  # the tile's first value, from its piece's first
    # each piece's first 4-bit block scale (block_starts of the pieces' whole lengths)
    whole: dict[int, int] = {}
    for p, o, n in zip(piece, offset, length):
        whole[p] = max(whole.get(p, 0), o + n)
    count4 = torch.tensor([-(-whole[p] // 128) for p in sorted(whole)], dtype=torch.int64)
    first4 = torch.cumsum(count4, 0) - count4
    table = torch.stack([rep(flat) + j * TILE, rep(buf) + j * TILE,
                         torch.minimum(rep(length) - j * TILE, torch.tensor(TILE)), rep(piece),
                         first4[rep(piece)] + into // 128, (into == 0).long()], 1)
    return table.contiguous(), all(b % 2 == 0 for b in buf), all(length)


_UNITS: dict[int, tuple] = {}


def _units(slices: list, numels: list[int], device: torch.device) -> torch.Tensor:
    """Each piece's first tile, the tile after its last, and its unit's size (``[pieces, 3]`` int64 on
    ``device``), for the per-unit second moment; made once per plan, as :func:`_table`."""
    key = id(slices)
    hit = _UNITS.get(key)
    if hit is not None and hit[0] is slices and hit[1] == device:
        return hit[2]
    table = _build(slices)[0]
    per = torch.bincount(table[:, 3], minlength=len(numels))
    end = torch.cumsum(per, 0)
    out = torch.stack([end - per, end, torch.tensor(numels, dtype=torch.int64)], 1).contiguous()
    from ..comm.base import to_device_async
    out = to_device_async(out, device) if device.type != "cpu" else out
    if len(_UNITS) >= _TABLES_MAX:
        _UNITS.pop(next(iter(_UNITS)))
    _UNITS[key] = (slices, device, out)
    return out


def _bits(x: float) -> int:
    """The fp64 bit pattern of ``x`` as an int (a Triton float argument is fp32)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def takes(slices: list, momentum, variance, device: torch.device) -> bool:
    """Whether the layout of ``slices`` fits the kernel: no empty unit (a tile writes its unit's step count) and,
    with 4-bit codes, every unit starting on a byte."""
    _, _, even, full = _table(slices, device)
    four = any(b is not None and b.kind == "4bit" for b in (momentum, variance))
    return full and (even or not four)


# ------------------------------------------------------------------------------------------- step counts
_STEPS: dict[int, tuple] = {}  # id(buffer) -> (weakref to it, its version after our last write, t)


def _base(seconds: torch.Tensor) -> torch.Tensor:
    """The buffer ``seconds`` views (ASDT hands a fresh ``view(-1, 2)`` of it every step; views share its version
    counter)."""
    return seconds if seconds._base is None else seconds._base


def _remember(seconds: torch.Tensor, t: int) -> None:
    base = _base(seconds)
    _STEPS[id(base)] = (weakref.ref(base), seconds._version, t)


def _read_t(seconds: torch.Tensor) -> Optional[int]:
    """The units' common step count, read from the device (a host sync), or None when they differ."""
    if seconds.device.type == "meta":  # no values: any count (the fake op computes nothing)
        return 0
    t_col = seconds[:, 1]
    lo, hi = torch.stack([t_col.min(), t_col.max()]).tolist()
    return int(lo) if lo == hi and lo == int(lo) else None


def _host_t(seconds: torch.Tensor) -> Optional[int]:
    """Every unit's step count of ``seconds`` (``[:, 1]``) when they are one number, else None: read from the device
    when this buffer is first seen or was written by someone else since, counted here after that."""
    base = _base(seconds)
    hit = _STEPS.get(id(base))
    if hit is not None and hit[0]() is base and hit[1] == seconds._version:
        return hit[2]
    t = _read_t(seconds)
    if t is not None:
        _remember(seconds, t)
    else:
        _STEPS.pop(id(base), None)
    return t


# ------------------------------------------------------------------------------------------- the op
OP = "titan::asdt_adaptive_step"


@torch.library.custom_op(OP, mutates_args=("w", "m", "m_absmax", "v", "v_absmax", "seconds", "count"))
def _op(w: torch.Tensor, g: torch.Tensor, table: torch.Tensor, tiles: int,
        m: torch.Tensor, m_absmax: Optional[torch.Tensor], m_kind: int, m_signed: bool,
        v: Optional[torch.Tensor], v_absmax: Optional[torch.Tensor], v_kind: int,
        seconds: torch.Tensor, bc1: Optional[torch.Tensor], inv_bc2: Optional[torch.Tensor],
        denom: Optional[torch.Tensor], words: Optional[torch.Tensor], count: torch.Tensor,
        hp: list[float], bc_mode: int, t_new: float, seed: int, rounding: int, clip: bool,
        grad_weight: bool, units: Optional[torch.Tensor], pieces: int, bits: list[int]) -> None:
    """The adaptive step of one tensor (see the module docstring): ``w``, ``m`` (+ ``m_absmax``), ``v``
    (+ ``v_absmax``) and ``seconds`` updated in place, the changed values added to ``count``. ``hp``: ``b1, 1 - b1,
    b2, 1 - b2, eps, lr, weight_decay, update_clip, bc1, 1 / bc2`` (the last two: ``bc_mode`` 0). ``bc_mode`` 3:
    the per-unit second moment computed here (``units``: each of the ``pieces``' first and last tile and size;
    ``bits``: the fp64 bit patterns of ``bc1``, ``bc2``, ``eps``), then the step as ``bc_mode`` 2."""
    from . import _core_triton_kernels as K, qstate
    dev = w.device
    empty = torch.empty(0, device=dev)

    def tables(kind: int, signed: bool) -> tuple:
        if kind in (0, 1):
            return empty, empty, empty
        return qstate._on("8bit" if kind == 8 else "4bit", signed, dev)

    mq, mc, mn = tables(m_kind, m_signed)
    vq, vc, vn = tables(v_kind, False) if v is not None else (empty, empty, empty)
    b1, omb1, b2, omb2, eps, lr, wd, uclip, bc1_s, ibc2_s = hp
    if bc_mode == 3:  # the per-unit denominators: two small launches before the step
        part = torch.empty(tiles, dtype=torch.float64, device=dev)
        denom = torch.empty(pieces, dtype=torch.float32, device=dev)
        K.unit_sumsq_kernel[(tiles,)](g, table, part, TILE=K.TILE, enable_fp_fusion=False)
        K.unit_denom_kernel[(pieces,)](part, units, seconds, denom, b2, omb2, *bits, t_new, BLOCK=UNIT_BLOCK,
                                       enable_fp_fusion=False)
        bc_mode = 2
    K.adaptive_kernel[(tiles,)](
        w, g, table, m, m_absmax if m_absmax is not None else empty, mq, mc, mn,
        v if v is not None else empty, v_absmax if v_absmax is not None else empty, vq, vc, vn,
        seconds, bc1 if bc1 is not None else empty, inv_bc2 if inv_bc2 is not None else empty,
        denom if denom is not None else empty, words if words is not None else empty, count,
        b1, omb1, b2, omb2, eps, lr, wd, uclip, bc1_s, ibc2_s, t_new, seed,
        M_KIND=m_kind, V_KIND=v_kind, W_BF16=w.dtype == torch.bfloat16, ROUND=rounding, CLIP=clip,
        GRAD_WEIGHT=grad_weight, BC_MODE=bc_mode, WRITE_T=bc_mode == 0, TILE=K.TILE,
        enable_fp_fusion=False)


@_op.register_fake
def _(w, g, table, tiles, m, m_absmax, m_kind, m_signed, v, v_absmax, v_kind, seconds, bc1, inv_bc2, denom, words,
      count, hp, bc_mode, t_new, seed, rounding, clip, grad_weight, units, pieces, bits) -> None:
    return None


def _seed(generator: torch.Generator, device: torch.device) -> int:
    """A Philox key for this call (64 bits, always above 2^32, so Triton passes it as an int64): the generator's
    seed in the low half and, in the high half, a number the generator itself advances, so that its saved state
    (ASDT checkpoints its generators) resumes the same words: a CUDA generator's Philox offset (a host value; moved
    on by 4, as torch's own draws move it), a CPU generator's next draw (a host op)."""
    if device.type == "meta":  # the fake op draws nothing
        return 1 << 32
    if generator.device.type == "cuda":
        offset = generator.get_offset()
        generator.set_offset(offset + 4)
        n = offset // 4
    else:
        n = int(torch.randint(0, 1 << 31, (1,), generator=generator))
    return ((n % 0x7FFFFFFF) + 1) << 32 | (generator.initial_seed() & 0xFFFFFFFF)


def step(w_flat: torch.Tensor, g_flat: torch.Tensor, slices: list, momentum, *, lr: float,
         betas: tuple[float, float], weight_decay: float, importance: str, variance, seconds: torch.Tensor,
         unit_numels: Optional[list[int]], eps: float, update_clip: Optional[float],
         generator: Optional[torch.Generator], count: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`core.dense_step`'s adaptive update of the whole tensor as one op; the count of changed values (an
    int64 device tensor: ``count``, added to in place, when given). ``unit_numels`` instead of ``variance``: the
    per-unit second moment (each piece a whole unit of that size)."""
    from . import moments
    b1, b2 = betas
    dev = w_flat.device
    table, tiles = _table(slices, dev)[:2]
    bc1 = inv_bc2 = unit_denom = units = None
    bc1_s = ibc2_s = t_new = 0.0
    bits: list[int] = []
    t = _host_t(seconds)
    if t is not None:
        t_new = float(t + 1)
    if variance is None and t is None:  # the eager loop's denominators, per unit
        bc_mode = 2
        unit_denom = moments.unit_second_moment(g_flat, slices, seconds, unit_numels, betas, eps)
    elif variance is None:
        bc_mode = 3
        units = _units(slices, unit_numels, dev)
        bits = [_bits(1 - b1 ** (t + 1)), _bits(1 - b2 ** (t + 1)), _bits(eps)]
    elif t is None:
        bc_mode = 1
        bc1, inv_bc2 = moments.bias_corrections(seconds, betas)
    else:
        bc_mode = 0
        bc1_s, ibc2_s = 1 - b1 ** (t + 1), 1 / (1 - b2 ** (t + 1))
    sr = generator is not None and w_flat.dtype == torch.bfloat16
    words, seed, rounding = None, 0, 0
    if sr and DRAWS_FROM_GENERATOR:  # chunk by chunk, as the eager loop draws (one call would differ on CUDA)
        words, rounding = torch.cat([torch.randint(0, 1 << 16, (s.n,), dtype=torch.int32, generator=generator,
                                                   device=dev) for s in slices]), 1
    elif sr:
        seed, rounding = _seed(generator, dev), 2
    if count is None:
        count = torch.zeros((), dtype=torch.int64, device=dev)
    hp = [b1, 1 - b1, b2, 1 - b2, eps, lr, weight_decay, 0.0 if update_clip is None else update_clip, bc1_s, ibc2_s]
    torch.ops.titan.asdt_adaptive_step(
        w_flat, g_flat, table, tiles, momentum.data, momentum.absmax, _state_kind(momentum), momentum.signed,
        None if variance is None else variance.data, None if variance is None else variance.absmax,
        0 if variance is None else _state_kind(variance), seconds, bc1, inv_bc2, unit_denom, words, count, hp,
        bc_mode, t_new, seed, rounding, update_clip is not None, importance == "grad_weight", units,
        len(unit_numels) if unit_numels is not None else 0, bits)
    if bc_mode in (0, 3):  # our own write: the count stays ours
        _remember(seconds, t + 1)
    return count

