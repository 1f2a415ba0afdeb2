"""Exact attention computed in tiles with an online softmax (FlashAttention-2 style); never the full score matrix.

``tiled_attention(q, k, v, causal=..., key_padding_mask=..., tile=...)`` with q of shape (B, H, Tq, D) and k, v of
shape (B, H, Tk, D) returns ``softmax(q k^T * scale + mask) v`` of shape (B, H, Tq, D), like
``F.scaled_dot_product_attention`` (causal is SDPA's top-left alignment: query i sees keys j <= i).

Forward, per query tile Q_i (rows i0..i1) with running max m, running sum l and accumulator A (all fp32):

1. for every key tile (K_j, V_j) that the tile can see (with ``causal``: j0 <= i1 only)
   S = Q_i K_j^T * scale, masked entries -inf;  m' = max(m, rowmax S);  P = exp(S - m');
   l = l * exp(m - m') + rowsum P;  A = A * exp(m - m') + P V_j;  m = m'.
2. O_i = A / l;  LSE_i = m + log l  (rows with no visible key: O_i = 0, LSE_i = +inf so that P = 0 below).

Saved for backward: q, k, v, O, LSE (O(T * D) per head, not O(T^2)). Backward, with Delta = rowsum(dO * O):

3. for every visible tile pair (i, j): recompute S, P = exp(S - LSE_i);  dV_j += P^T dO_i;  dP = dO_i V_j^T;
   dS = P * (dP - Delta_i);  dQ_i += dS K_j * scale;  dK_j += dS^T Q_i * scale.

Three kernels behind :func:`tiled_attention`, chosen per call by :func:`attention_kernel` (``TITAN_KERNELS``, see
``_guard.py``):

* ``"triton"``: a Triton kernel (``_attention_triton.py``) with this contract, on CUDA; it supports ``causal`` and
  ``key_padding_mask`` but not a dense ``attn_mask``, which always runs on the reference;
* ``"torch_sdpa"``: on CPU tensors with no mask (``causal`` or not) and ``TITAN_KERNELS`` unset, PyTorch's CPU
  flash-attention kernel (``F.scaled_dot_product_attention`` restricted to ``SDPBackend.FLASH_ATTENTION``): the same
  algorithm (tiles, online softmax, O and the log-sum-exp saved, exact), in C++ -- it saves exactly the reference's
  bytes (q, k, v, O, LSE; measured in ``tests/kernels/test_attention.py``) at a fraction of the Python loop's time
  (results/mlme_speed.md). With masks the reference runs (it returns 0, not NaN, for a row with no visible key);
* ``"reference"``: this file's pure-PyTorch loop (any device; the test oracle; ``TITAN_KERNELS=reference``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ._guard import kernel_backend, requested_backend, triton_available

__all__ = ["tiled_attention", "tiled_attention_reference", "eager_attention", "TiledAttention", "attention_kernel",
           "kernels_by_device", "KERNELS", "MIN_HEAD_DIM", "MAX_HEAD_DIM"]

KERNELS = ("triton", "torch_sdpa", "reference")
_SDPA_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # the CPU flash kernel's dtypes

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # the contract is 32..128; the reference is exact for any D in this range


def _tile_mask(causal: bool, kpm: Optional[Tensor], dense: Optional[Tensor], i0: int, i1: int, j0: int,
               j1: int, device: torch.device) -> Optional[Tensor]:
    """Boolean "may attend" mask for the tile (rows i0:i1, cols j0:j1), broadcastable to (B, H, ti, tj)."""
    mask = None
    if causal and j1 - 1 > i0:  # some (i, j) in the tile has j > i
        rows = torch.arange(i0, i1, device=device)[:, None]
        cols = torch.arange(j0, j1, device=device)[None, :]
        mask = cols <= rows
    if kpm is not None:
        m = kpm[:, None, None, j0:j1]
        mask = m if mask is None else mask & m
    if dense is not None:
        m = dense[..., i0:i1, j0:j1]
        mask = m if mask is None else mask & m
    return mask


def _key_end(causal: bool, i1: int, tk: int) -> int:
    return min(tk, i1) if causal else tk


class _TiledAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, kpm: Optional[Tensor], dense: Optional[Tensor],
                causal: bool, scale: float, tile: int) -> Tensor:
        B, H, tq, D = q.shape
        tk = k.shape[2]
        out = torch.empty_like(q)
        lse = torch.empty(B, H, tq, dtype=torch.float32, device=q.device)
        for i0 in range(0, tq, tile):
            i1 = min(i0 + tile, tq)
            qi = q[:, :, i0:i1].float()
            m = torch.full((B, H, i1 - i0), -math.inf, device=q.device)
            l = torch.zeros_like(m)
            acc = torch.zeros(B, H, i1 - i0, v.shape[-1], device=q.device)
            for j0 in range(0, _key_end(causal, i1, tk), tile):
                j1 = min(j0 + tile, tk)
                s = torch.matmul(qi, k[:, :, j0:j1].float().transpose(-1, -2)).mul_(scale)
                mask = _tile_mask(causal, kpm, dense, i0, i1, j0, j1, q.device)
                if mask is not None:
                    s = s.masked_fill(~mask, -math.inf)
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # all masked so far
                p = torch.exp(s - m_safe[..., None])
                alpha = torch.exp(m - m_safe)
                l = l * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + torch.matmul(p, v[:, :, j0:j1].float())
                m = m_new
            empty = l == 0
            out[:, :, i0:i1] = (acc / torch.where(empty, torch.ones_like(l), l)[..., None]).to(q.dtype)
            lse[:, :, i0:i1] = torch.where(empty, torch.full_like(l, math.inf), m + torch.log(l))
        ctx.save_for_backward(q, k, v, out, lse, kpm, dense)
        ctx.causal, ctx.scale, ctx.tile = causal, scale, tile
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor):
        q, k, v, out, lse, kpm, dense = ctx.saved_tensors
        causal, scale, tile = ctx.causal, ctx.scale, ctx.tile
        tq, tk = q.shape[2], k.shape[2]
        d_out = d_out.float()
        delta = (d_out * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        for i0 in range(0, tq, tile):
            i1 = min(i0 + tile, tq)
            qi, doi = q[:, :, i0:i1].float(), d_out[:, :, i0:i1]
            lse_i, delta_i = lse[:, :, i0:i1, None], delta[:, :, i0:i1, None]
            for j0 in range(0, _key_end(causal, i1, tk), tile):
                j1 = min(j0 + tile, tk)
                kj, vj = k[:, :, j0:j1].float(), v[:, :, j0:j1].float()
                s = torch.matmul(qi, kj.transpose(-1, -2)).mul_(scale)
                mask = _tile_mask(causal, kpm, dense, i0, i1, j0, j1, q.device)
                if mask is not None:
                    s = s.masked_fill(~mask, -math.inf)
                p = torch.exp(s - lse_i)
                dv[:, :, j0:j1] += torch.matmul(p.transpose(-1, -2), doi)
                ds = p * (torch.matmul(doi, vj.transpose(-1, -2)) - delta_i)
                dq[:, :, i0:i1] += torch.matmul(ds, kj).mul_(scale)
                dk[:, :, j0:j1] += torch.matmul(ds.transpose(-1, -2), qi).mul_(scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _check(q: Tensor, k: Tensor, v: Tensor, kpm: Optional[Tensor], dense: Optional[Tensor], causal: bool,
           tile: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"tiled_attention wants q, k, v of shape (B, H, T, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape[:3] + k.shape[3:] or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not agree on B, H, D, Tk "
                         f"(repeat grouped k/v heads to H before calling)")
    if not MIN_HEAD_DIM <= q.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {q.shape[3]} outside [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    if causal and q.shape[2] > k.shape[2]:
        raise ValueError(f"causal attention with more queries ({q.shape[2]}) than keys ({k.shape[2]}) leaves rows "
                         f"with no key to attend to")
    if kpm is not None and (kpm.dtype != torch.bool or kpm.shape != (q.shape[0], k.shape[2])):
        raise ValueError(f"key_padding_mask must be a bool tensor of shape (B, Tk) = {(q.shape[0], k.shape[2])} "
                         f"with True for real tokens; got {kpm.dtype} {tuple(kpm.shape)}")
    if dense is not None and (dense.dtype != torch.bool or dense.dim() != 4):
        raise ValueError(f"attn_mask must be a 4-D bool tensor broadcastable to (B, H, Tq, Tk) with True where "
                         f"attention is allowed; got {dense.dtype} {tuple(dense.shape)}")


def tiled_attention_reference(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                              key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                              scale: Optional[float] = None, tile: int = 128) -> Tensor:
    """The pure-PyTorch tiled attention (see the module docstring); always available, any device and dtype."""
    _check(q, k, v, key_padding_mask, attn_mask, causal, tile)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _TiledAttentionFn.apply(q, k, v, key_padding_mask, attn_mask, causal, scale, tile)


def attention_kernel(q: Tensor, k: Tensor, v: Tensor, *, key_padding_mask: Optional[Tensor] = None,
                     attn_mask: Optional[Tensor] = None) -> str:
    """The kernel :func:`tiled_attention` runs for these tensors and masks: one of :data:`KERNELS` (module docstring)."""
    if attn_mask is None and kernel_backend(q, k, v, op="attention") == "triton":
        return "triton"
    if (key_padding_mask is None and attn_mask is None and requested_backend() == ""
            and all(t.device.type == "cpu" and t.dtype in _SDPA_DTYPES for t in (q, k, v))):
        return "torch_sdpa"
    return "reference"


def kernels_by_device() -> dict[str, str]:
    """What an unmasked ``mlme.attention="tiled"`` call runs on each device type here (for the MLME report)."""
    requested = requested_backend()
    cpu = "reference" if requested == "reference" else "triton (interpreter)" if requested == "triton" else \
        "torch_sdpa (CPU flash kernel)"
    cuda = "reference" if requested == "reference" or not (requested == "triton" or triton_available()) else "triton"
    return {"cpu": cpu, "cuda": cuda}


def tiled_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                    key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                    scale: Optional[float] = None, tile: int = 128) -> Tensor:
    """Exact attention in tiles on the kernel :func:`attention_kernel` picks (``TITAN_KERNELS``, device, masks).

    ``key_padding_mask``: (B, Tk) bool, True for real tokens. ``attn_mask``: 4-D bool broadcastable to
    (B, H, Tq, Tk), True where attention is allowed (reference backend only). A query row that can see no
    key returns 0 (SDPA returns NaN there). ``tile`` is the Triton kernel's and the reference's tile; PyTorch's
    CPU kernel picks its own.
    """
    kernel = attention_kernel(q, k, v, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
    if kernel == "reference":
        return tiled_attention_reference(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                                         attn_mask=attn_mask, scale=scale, tile=tile)
    _check(q, k, v, key_padding_mask, None, causal, tile)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if kernel == "torch_sdpa":
        # FLASH_ATTENTION only: were it unusable, SDPA raises rather than fall back to the math kernel, which would
        # save the (Tq, Tk) probabilities
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    from ._attention_triton import triton_attention  # imported only once Triton is known to be usable
    return triton_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, tile=tile)


def eager_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                    key_padding_mask: Optional[Tensor] = None, scale: Optional[float] = None) -> Tensor:
    """Plain math attention, ``softmax(q k^T * scale + mask) v`` with the full (Tq, Tk) score matrix: the
    memory baseline (what HF's "eager" attention does); rows with no visible key return NaN, as SDPA."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    allowed = None
    if causal:
        allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if key_padding_mask is not None:
        kp = key_padding_mask[:, None, None, :]
        allowed = kp if allowed is None else allowed & kp
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    return torch.matmul(torch.softmax(s, dim=-1), v)


class TiledAttention(nn.Module):
    """Drop-in attention core: ``forward(q, k, v) -> out`` on (B, H, T, D), causal by default, no parameters."""

    def __init__(self, causal: bool = True, tile: int = 128):
        super().__init__()
        if tile < 1:
            raise ValueError(f"tile must be >= 1, got {tile}")
        self.causal, self.tile = causal, tile

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return tiled_attention(q, k, v, causal=self.causal, tile=self.tile)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, tile={self.tile}"
