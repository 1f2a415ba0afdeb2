"""Triton kernels for :mod:`titan_ds.kernels.attention` (forward, dK/dV, dQ), same algorithm as the reference.

Imported lazily by ``attention.tiled_attention`` once ``_guard.kernel_backend`` chose Triton, so importing it
means Triton is usable. Under ``TRITON_INTERPRET=1`` (set before this import) the kernels run on CPU tensors in
Triton's interpreter (fp32 only), which is how CPU CI tests them.

Layout: q (B, H, Tq, D), k and v (B, H, Tk, D), any strides; one program per (query block, batch*head) in the
forward and the dQ kernel, per (key block, batch*head) in the dK/dV kernel (no atomics). Accumulation is in fp32;
fp32 inputs use IEEE products (not TF32) so that fp32 parity with the reference holds on GPUs too.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ._guard import require_triton

triton, tl = require_triton()

__all__ = ["triton_attention", "block_sizes"]


@triton.jit
def _scores(q, k, offs_m, cols, b, KPM, s_kpm, TK, sm_scale, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
            PREC: tl.constexpr):
    """Scaled scores of a (BLOCK_M, BLOCK_N) tile and its "may attend" mask; k is given as (D, BLOCK_N)."""
    s = tl.dot(q, k, input_precision=PREC) * sm_scale
    ok = cols[None, :] < TK
    if CAUSAL:
        ok = ok & (cols[None, :] <= offs_m[:, None])
    if HAS_KPM:
        kp = tl.load(KPM + b * s_kpm + cols, mask=cols < TK, other=0)
        ok = ok & (kp[None, :] != 0)
    return s, ok


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, KPM, sm_scale,
                s_qb, s_qh, s_qt, s_qd, s_kb, s_kh, s_kt, s_kd, s_vb, s_vh, s_vt, s_vd,
                s_ob, s_oh, s_ot, s_od, s_kpm, H, TQ, TK, D,
                CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, PREC: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok, d_ok = offs_m < TQ, offs_d < D
    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qt + offs_d[None, :] * s_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end_n = TK
    if CAUSAL:
        end_n = tl.minimum((pid_m + 1) * BLOCK_M, TK)
    for start_n in range(0, end_n, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < TK
        k = tl.load(K + b * s_kb + h * s_kh + cols[None, :] * s_kt + offs_d[:, None] * s_kd,
                    mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        s, ok = _scores(q, k, offs_m, cols, b, KPM, s_kpm, TK, sm_scale, CAUSAL, HAS_KPM, PREC)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key so far
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * s_vb + h * s_vh + cols[:, None] * s_vt + offs_d[None, :] * s_vd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(O + b * s_ob + h * s_oh + offs_m[:, None] * s_ot + offs_d[None, :] * s_od, out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + pid_bh * TQ + offs_m, lse, mask=row_ok)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, KPM, sm_scale,
                     s_qb, s_qh, s_qt, s_qd, s_kb, s_kh, s_kt, s_kd, s_vb, s_vh, s_vt, s_vd,
                     s_db, s_dh, s_dt, s_dd, s_ob, s_oh, s_ot, s_od, s_kpm, H, TQ, TK, D,
                     CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, PREC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok, d_ok = cols < TK, offs_d < D
    kt = tl.load(K + b * s_kb + h * s_kh + cols[None, :] * s_kt + offs_d[:, None] * s_kd,
                 mask=col_ok[None, :] & d_ok[:, None], other=0.0)  # (D, BLOCK_N)
    vt = tl.load(V + b * s_vb + h * s_vh + cols[None, :] * s_vt + offs_d[:, None] * s_vd,
                 mask=col_ok[None, :] & d_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    start_m = 0
    if CAUSAL:
        start_m = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M  # rows above the first key of the block see none of it
    for m0 in range(start_m, TQ, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < TQ
        io = offs_m[:, None] * s_dt + offs_d[None, :] * s_dd
        q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qt + offs_d[None, :] * s_qd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        do = tl.load(DO + b * s_db + h * s_dh + io, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        lse = tl.load(LSE + pid_bh * TQ + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA + pid_bh * TQ + offs_m, mask=row_ok, other=0.0)
        s, ok = _scores(q, kt, offs_m, cols, b, KPM, s_kpm, TK, sm_scale, CAUSAL, HAS_KPM, PREC)
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)
        dp = tl.dot(do, vt, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PREC)
    dk = dk * sm_scale
    out = b * s_ob + h * s_oh + cols[:, None] * s_ot + offs_d[None, :] * s_od  # DK, DV: contiguous, same shape
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, KPM, sm_scale,
                   s_qb, s_qh, s_qt, s_qd, s_kb, s_kh, s_kt, s_kd, s_vb, s_vh, s_vt, s_vd,
                   s_db, s_dh, s_dt, s_dd, s_ob, s_oh, s_ot, s_od, s_kpm, H, TQ, TK, D,
                   CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, PREC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok, d_ok = offs_m < TQ, offs_d < D
    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qt + offs_d[None, :] * s_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(DO + b * s_db + h * s_dh + offs_m[:, None] * s_dt + offs_d[None, :] * s_dd,
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lse = tl.load(LSE + pid_bh * TQ + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + pid_bh * TQ + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end_n = TK
    if CAUSAL:
        end_n = tl.minimum((pid_m + 1) * BLOCK_M, TK)
    for start_n in range(0, end_n, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < TK
        kt = tl.load(K + b * s_kb + h * s_kh + cols[None, :] * s_kt + offs_d[:, None] * s_kd,
                     mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        vt = tl.load(V + b * s_vb + h * s_vh + cols[None, :] * s_vt + offs_d[:, None] * s_vd,
                     mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        s, ok = _scores(q, kt, offs_m, cols, b, KPM, s_kpm, TK, sm_scale, CAUSAL, HAS_KPM, PREC)
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, vt, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PREC)
    dq = dq * sm_scale
    tl.store(DQ + b * s_ob + h * s_oh + offs_m[:, None] * s_ot + offs_d[None, :] * s_od, dq.to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def block_sizes(tile: int, head_dim: int, dtype: Optional[torch.dtype] = None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D): the tile rounded to a power of two in [16, 128] (64 for head dims > 64, and
    for fp32 inputs).

    tl.dot needs every block dimension >= 16; the caps keep a (BLOCK_M x BLOCK_N) fp32 score tile and the
    (BLOCK x D) accumulators in registers. Untuned: no GPU was available when this was written. The fp32 cap is
    shared memory, measured by compiling for sm_90 (tests/kernels/test_triton_compile.py): at 128 x 128 blocks
    and head dim 64 the fp32 dK/dV kernel needs 264192 bytes, over the 232448 a block may have (OutOfResources
    at launch), and the forward 229888, over sm_80's 166912; at 64 x 64, 115712 and 98304.
    """
    cap = 64 if head_dim > 64 or dtype == torch.float32 else 128
    block = max(16, min(triton.next_power_of_2(tile), cap))
    return block, block, max(16, triton.next_power_of_2(head_dim))


def _strides(t: Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, kpm: Optional[Tensor], causal: bool, scale: float,
                tile: int) -> Tensor:
        B, H, TQ, D = q.shape
        TK = k.shape[2]
        bm, bn, bd = block_sizes(tile, D, q.dtype)
        o = torch.empty(B, H, TQ, D, dtype=q.dtype, device=q.device)
        lse = torch.empty(B * H * TQ, dtype=torch.float32, device=q.device)
        kpm_i8 = kpm.to(torch.int8).contiguous() if kpm is not None else lse  # dummy pointer when absent
        prec = "ieee" if q.dtype == torch.float32 else "tf32"  # "tf32" is ignored for 16-bit inputs
        _fwd_kernel[(triton.cdiv(TQ, bm), B * H)](
            q, k, v, o, lse, kpm_i8, scale, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
            kpm_i8.stride(0) if kpm is not None else 0, H, TQ, TK, D,
            CAUSAL=causal, HAS_KPM=kpm is not None, PREC=prec, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd)
        ctx.save_for_backward(q, k, v, o, lse, kpm_i8 if kpm is not None else None)
        ctx.causal, ctx.scale, ctx.blocks, ctx.prec = causal, scale, (bm, bn, bd), prec
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, o, lse, kpm = ctx.saved_tensors
        B, H, TQ, D = q.shape
        TK = k.shape[2]
        bm, bn, bd = ctx.blocks
        delta = (do.float() * o.float()).sum(-1).reshape(-1).contiguous()
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(k.shape, dtype=v.dtype, device=v.device)  # same strides as dk: one set passed
        kpm_arg = kpm if kpm is not None else lse
        common = dict(CAUSAL=ctx.causal, HAS_KPM=kpm is not None, PREC=ctx.prec, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd)
        s_kpm = kpm.stride(0) if kpm is not None else 0
        _bwd_dkdv_kernel[(triton.cdiv(TK, bn), B * H)](
            q, k, v, do, lse, delta, dk, dv, kpm_arg, ctx.scale, *_strides(q), *_strides(k), *_strides(v),
            *_strides(do), *_strides(dk), s_kpm, H, TQ, TK, D, **common)
        _bwd_dq_kernel[(triton.cdiv(TQ, bm), B * H)](
            q, k, v, do, lse, delta, dq, kpm_arg, ctx.scale, *_strides(q), *_strides(k), *_strides(v),
            *_strides(do), *_strides(dq), s_kpm, H, TQ, TK, D, **common)
        return dq, dk, dv, None, None, None, None


def triton_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, key_padding_mask: Optional[Tensor],
                     scale: float, tile: int) -> Tensor:
    """The Triton backend of :func:`titan_ds.kernels.attention.tiled_attention` (inputs already checked)."""
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return _TritonAttention.apply(q, k, v, key_padding_mask, causal, scale, tile)
