"""The Triton kernel of ASDT's adaptive update (:mod:`titan_ds.optim.core_triton` launches it): one program per
*tile*, 256 consecutive values of one unit (a unit's tiles start at its first value, so a tile is one 8-bit
quantization block or two 4-bit ones, as qstate stores them: blocks restart at every unit).

Imported lazily, once :mod:`~titan_ds.kernels._guard` has found Triton (``require_triton``). Under
``TRITON_INTERPRET=1`` (set before this import) the kernel runs on CPU tensors in Triton's interpreter, which is
how CPU CI checks it against the eager loop.

The arithmetic is the eager loop's (:func:`titan_ds.optim.core.direction` and :func:`~titan_ds.optim.core.dense_step`),
op for op in fp32; the launch passes ``enable_fp_fusion=False`` (no product is contracted into an FMA), the
division and the square root are the correctly rounded ones (``div_rn``, ``sqrt_rn``: Triton's ``/`` and ``sqrt``
on fp32 are approximate on a GPU), and bf16 values are rounded to nearest even by integer arithmetic (the
interpreter's conversion truncates), so the kernel stores what the eager loop stores, bit for bit.
"""
from __future__ import annotations

from titan_ds.kernels._guard import require_triton

triton, tl = require_triton()

__all__ = ["adaptive_kernel", "unit_sumsq_kernel", "unit_denom_kernel", "TILE", "COLUMNS"]

TILE = 256  # values a program steps: an 8-bit block (qstate.KINDS), two 4-bit ones
COLUMNS = 6  # the tile table's columns: flat start, buffer start, length, piece, first 4-bit scale, first-of-piece
# a state kind (M_KIND, V_KIND: constexpr) is 0 (fp32), 1 (bf16), 8 (qstate's 8-bit codes) or 4 (4-bit, packed)


@triton.jit
def _rne_bf16(x):
    """``x`` (fp32) rounded to the nearest bf16 (ties to even), as fp32 with the low 16 bits 0 (NaN kept)."""
    bits = x.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))


@triton.jit
def _decode(P, ABS, Q, buf, offs, mask, tile, q4, KIND: tl.constexpr):
    """The fp32 values of a tile of a state buffer (0 past the tile's length)."""
    if KIND == 8:
        code = tl.load(P + buf + offs, mask=mask, other=0).to(tl.int32)
        x = tl.load(Q + code) * tl.load(ABS + tile)
    elif KIND == 4:
        e = buf + offs
        byte = tl.load(P + e // 2, mask=mask, other=0).to(tl.int32)
        code = tl.where(e % 2 == 0, byte >> 4, byte & 15)
        x = tl.load(Q + code) * tl.load(ABS + q4 + offs // 128, mask=mask, other=0.0)
    else:
        x = tl.load(P + buf + offs, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, x, 0.0)


@triton.jit
def _codes(x, scale, CODES, NXT):
    """qstate.encode_with: the nearest code of ``x / scale`` by the top-16-bit tables."""
    s = tl.div_rn(x, scale)
    top = (s.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    return tl.load(CODES + top) + (s >= tl.load(NXT + top)).to(tl.int32)


@triton.jit
def _store_state(P, ABS, CODES, NXT, x, buf, offs, mask, n, tile, q4, KIND: tl.constexpr, TILE: tl.constexpr):
    """Store a tile's new values (0 past its length) as the buffer keeps them: plain fp32/bf16, or qstate's codes
    with each block's absmax (torchao's scale_tensor: clipped at 1e-12)."""
    if KIND == 8:
        scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-12)
        tl.store(P + buf + offs, _codes(x, scale, CODES, NXT).to(tl.uint8), mask=mask)
        tl.store(ABS + tile, scale)
    elif KIND == 4:
        a = tl.abs(x)
        first = offs < 128
        s0 = tl.maximum(tl.max(tl.where(first, a, 0.0), 0), 1e-12)
        s1 = tl.maximum(tl.max(tl.where(first, 0.0, a), 0), 1e-12)
        code = _codes(x, tl.where(first, s0, s1), CODES, NXT)
        hi, lo = tl.split(tl.reshape(code, (TILE // 2, 2)))
        j = tl.arange(0, TILE // 2)
        has_hi = 2 * j < n
        # buf is even (core_triton takes no other layout): byte j holds values 2j (high half) and 2j + 1; past
        # the tile's last value the byte keeps its low half (the pad of an odd buffer)
        old = tl.load(P + buf // 2 + j, mask=has_hi, other=0).to(tl.int32)
        byte = (hi << 4) | tl.where(2 * j + 1 < n, lo, old & 15)
        tl.store(P + buf // 2 + j, byte.to(tl.uint8), mask=has_hi)
        tl.store(ABS + q4, s0)
        tl.store(ABS + q4 + 1, s1, mask=n > 128)
    elif KIND == 1:
        tl.store(P + buf + offs, _rne_bf16(x), mask=mask)
    else:
        tl.store(P + buf + offs, x, mask=mask)


@triton.jit
def adaptive_kernel(W, G, TAB, M, MABS, MQ, MCODES, MNXT, V, VABS, VQ, VCODES, VNXT, SEC, BC1, IBC2, DEN, RAND,
                    COUNT, b1, omb1, b2, omb2, eps, lr, wd, clip, bc1_s, ibc2_s, t_new, seed,
                    M_KIND: tl.constexpr, V_KIND: tl.constexpr, W_BF16: tl.constexpr, ROUND: tl.constexpr,
                    CLIP: tl.constexpr, GRAD_WEIGHT: tl.constexpr, BC_MODE: tl.constexpr, WRITE_T: tl.constexpr,
                    TILE: tl.constexpr):
    """One tile's adaptive step (see :mod:`titan_ds.optim.core`'s docstring), in place.

    ``TAB[tile]``: flat start in ``W``/``G``, start in the state buffers, length (<= TILE), piece (its row of
    ``SEC``, ``BC1``/``IBC2``/``DEN``), the index of its first 4-bit block scale, 1 on a piece's first tile.
    ``BC_MODE``: 0 the bias corrections ``bc1_s``/``ibc2_s`` of every piece (the piece's step count ``t_new``
    written by its first tile when ``WRITE_T``), 1 each piece's ``BC1``/``IBC2``, 2 the per-unit second moment:
    each piece's denominator ``DEN`` (no ``V``). ``ROUND`` (bf16 weights): 0 to nearest, 1 stochastically with
    the 16-bit words ``RAND`` (one per buffer value), 2 stochastically with Philox words of ``seed`` and the
    value's buffer index. ``COUNT`` (int64) gets the number of changed values added.
    """
    tile = tl.program_id(0)
    row = TAB + tile * 6
    flat = tl.load(row)
    buf = tl.load(row + 1)
    n = tl.load(row + 2)
    piece = tl.load(row + 3)
    q4 = tl.load(row + 4)
    offs = tl.arange(0, TILE)
    mask = offs < n
    g = tl.load(G + flat + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + flat + offs, mask=mask, other=0.0).to(tl.float32)
    m = _decode(M, MABS, MQ, buf, offs, mask, tile, q4, M_KIND) * b1 + g * omb1
    _store_state(M, MABS, MCODES, MNXT, m, buf, offs, mask, n, tile, q4, M_KIND, TILE)
    if BC_MODE == 2:
        c = tl.div_rn(m, tl.load(DEN + piece))
    else:
        v = _decode(V, VABS, VQ, buf, offs, mask, tile, q4, V_KIND) * b2 + (g * g) * omb2
        _store_state(V, VABS, VCODES, VNXT, v, buf, offs, mask, n, tile, q4, V_KIND, TILE)
        if BC_MODE == 0:
            ib = ibc2_s
            bc = bc1_s
        else:
            ib = tl.load(IBC2 + piece)
            bc = tl.load(BC1 + piece)
        c = tl.div_rn(m, (tl.sqrt_rn(v * ib) + eps) * bc)
    if CLIP:
        c = tl.minimum(tl.maximum(c, -clip), clip)
    if GRAD_WEIGHT:
        sel = tl.abs(g * w) > 0
    else:
        sel = tl.abs(c) > 0
    sel = sel & mask
    new = tl.where(sel, w - (c + wd * w) * lr, w)
    if W_BF16:
        if ROUND == 0:
            new = _rne_bf16(new)
        else:
            if ROUND == 1:
                r = tl.load(RAND + buf + offs, mask=mask, other=0)
            else:
                r = (tl.randint(seed, (buf + offs).to(tl.uint32)) & 0xFFFF).to(tl.int32)
            bits = new.to(tl.int32, bitcast=True)
            finite = (bits & 0x7F800000) != 0x7F800000
            new = tl.where(finite, (bits + r) & -65536, bits).to(tl.float32, bitcast=True)
    tl.store(W + flat + offs, new, mask=mask)
    if WRITE_T:
        tl.store(SEC + piece * 2 + 1, t_new, mask=tl.load(row + 5) != 0)
    tl.atomic_add(COUNT, tl.sum(sel.to(tl.int64), 0))


@triton.jit
def unit_sumsq_kernel(G, TAB, PART, TILE: tl.constexpr):
    """Each tile's sum of squared gradients, in fp64 (the per-unit second moment's first pass)."""
    tile = tl.program_id(0)
    row = TAB + tile * 6
    flat = tl.load(row)
    offs = tl.arange(0, TILE)
    g = tl.load(G + flat + offs, mask=offs < tl.load(row + 2), other=0.0).to(tl.float64)
    tl.store(PART + tile, tl.sum(g * g, 0))


@triton.jit
def unit_denom_kernel(PART, UNITS, SEC, DEN, b2, omb2, bc1_bits, bc2_bits, eps_bits, t_new, BLOCK: tl.constexpr):
    """One piece's second moment and denominator (:func:`core._unit_second_moment`'s arithmetic): its tiles'
    partial sums added block after block (fp64), ``v = v * b2 + (1 - b2) * (sum / numel)`` (fp32), ``t = t_new``,
    the denominator ``(sqrt(v / bc2) + eps) * bc1`` in fp64, stored as fp32. ``UNITS[piece]``: its first tile, the
    tile after its last, the whole unit's size; ``bc1``, ``bc2``, ``eps``: fp64 bit patterns (Triton passes a
    Python float as fp32)."""
    p = tl.program_id(0)
    lo = tl.load(UNITS + p * 3)
    hi = tl.load(UNITS + p * 3 + 1)
    numel = tl.load(UNITS + p * 3 + 2).to(tl.float64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float64)
    for i in range(lo, hi, BLOCK):
        acc += tl.load(PART + i + offs, mask=i + offs < hi, other=0.0)
    mean = (tl.sum(acc, 0) / numel).to(tl.float32)  # fp64 division: correctly rounded on a GPU too
    v = tl.load(SEC + p * 2) * b2 + omb2 * mean
    tl.store(SEC + p * 2, v)
    tl.store(SEC + p * 2 + 1, t_new)
    bc1 = bc1_bits.to(tl.int64).to(tl.float64, bitcast=True)
    bc2 = bc2_bits.to(tl.int64).to(tl.float64, bitcast=True)
    eps = eps_bits.to(tl.int64).to(tl.float64, bitcast=True)
    den = (tl.sqrt(v.to(tl.float64) / bc2) + eps) * bc1  # fp64: sqrt.rn.f64 (no approximate one)
    tl.store(DEN + p, den.to(tl.float32))
