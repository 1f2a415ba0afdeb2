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

Kernels behind :func:`tiled_attention`, chosen per call by :func:`attention_kernel` (the pure decision is
:func:`choose_kernel` on an :class:`AttentionCall`; ``TITAN_KERNELS``, see ``_guard.py``):

* ``"sdpa_flash"`` / ``"sdpa_efficient"``: on CUDA tensors (default), ``F.scaled_dot_product_attention`` restricted
  to its FlashAttention-2 and memory-efficient kernels (``sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION])``, so
  never the math kernel that saves the (Tq, Tk) probabilities): flash for fp16/bf16 without a mask, memory-efficient
  for fp32 or with a key padding / dense mask (passed as a boolean ``attn_mask``, causality folded into it). Both are
  exact and save O(T * D) per head. A call neither takes (fp64, odd head dims, old GPUs) runs the reference, with a
  warning once; which kernel a kind of call runs is logged once (``titan_ds.kernels``). Attention dropout is not
  supported (the reference, the oracle, has none), on any kernel;
* ``"torch_sdpa"``: on CPU tensors with no mask (``causal`` or not) and ``TITAN_KERNELS`` unset, PyTorch's CPU
  flash-attention kernel (SDPA restricted to ``SDPBackend.FLASH_ATTENTION``): the same algorithm (tiles, online
  softmax, O and the log-sum-exp saved, exact), in C++ -- it saves exactly the reference's bytes (q, k, v, O, LSE;
  measured in ``tests/kernels/test_attention.py``) at a fraction of the Python loop's time (results/mlme_speed.md).
  With masks the reference runs (it returns 0, not NaN, for a row with no visible key);
* ``"triton"``: titan's Triton kernel (``_attention_triton.py``), only with ``TITAN_KERNELS=triton`` (CUDA, or CPU
  under ``TRITON_INTERPRET=1``): it has never been measured on a GPU against SDPA, so it is not a default; it
  supports ``causal`` and ``key_padding_mask`` but not a dense ``attn_mask``, which runs on the reference;
* ``"reference"``: this file's pure-PyTorch loop (any device, ``meta`` included; the test oracle;
  ``TITAN_KERNELS=reference``).
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ._guard import KernelBackendError, kernel_backend, requested_backend

__all__ = ["tiled_attention", "tiled_attention_reference", "eager_attention", "TiledAttention", "attention_kernel",
           "AttentionCall", "choose_kernel", "sdpa_mask_args", "kernels_by_device", "KERNELS", "SDPA_KERNELS",
           "MIN_HEAD_DIM", "MAX_HEAD_DIM"]

log = logging.getLogger("titan_ds.kernels")

SDPA_KERNELS = ("sdpa_flash", "sdpa_efficient")  # CUDA: SDPA restricted to these two backends
KERNELS = SDPA_KERNELS + ("torch_sdpa", "triton", "reference")
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


# ---------------------------------------------------------------------------------------------- dispatch
@dataclass(frozen=True)
class AttentionCall:
    """What the dispatcher knows about one call, without tensor data: the device type, dtype, lengths, head dim,
    causality, the mask's kind (``"none"``, ``"padding"``: a (B, Tk) key padding mask, ``"dense"``: a 4-D mask)
    and, on CUDA, the compute capability (None: unknown, taken as 8.0 or newer). Built by :meth:`of` from
    tensors, or written out in a test to describe a CUDA call on a machine without one."""

    device: str
    dtype: torch.dtype
    tq: int
    tk: int
    head_dim: int
    causal: bool = False
    mask: str = "none"
    capability: Optional[tuple[int, int]] = None

    @classmethod
    def of(cls, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, key_padding_mask: Optional[Tensor] = None,
           attn_mask: Optional[Tensor] = None) -> "AttentionCall":
        types = {t.device.type for t in (q, k, v)}
        device = types.pop() if len(types) == 1 else "mixed"
        cap = _capability(q.device.index) if device == "cuda" else None
        mask = "dense" if attn_mask is not None else "padding" if key_padding_mask is not None else "none"
        return cls(device, q.dtype, q.shape[-2], k.shape[-2], q.shape[-1], bool(causal), mask, cap)


_HALF = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _capability(index: Optional[int]) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _cuda_kernel(call: AttentionCall) -> tuple[str, str]:
    """SDPA's flash kernel, else its memory-efficient one, else the reference; with the reason (PyTorch's
    ``sdp_utils.cpp`` gates: flash takes fp16/bf16, no mask, head dim <= 256, causal only for Tq == Tk (FA-2
    aligns a non-square causal mask bottom-right, SDPA top-left), sm80+; memory-efficient takes fp32 too and any
    mask, head dim a multiple of 8 (fp16/bf16) or 4 (fp32), sm50+; bf16 needs sm80+ in both)."""
    cap = call.capability or (8, 0)
    dt = str(call.dtype).replace("torch.", "")
    if call.dtype not in _HALF + (torch.float32,):
        return "reference", f"SDPA's flash and memory-efficient kernels take float16/bfloat16/float32, not {dt}"
    if call.dtype == torch.bfloat16 and cap < (8, 0):
        return "reference", f"SDPA's fused kernels need compute capability 8.0+ for bfloat16, this GPU is {cap}"
    no_flash = (dt if call.dtype not in _HALF else "an attention mask" if call.mask != "none" else
                f"head dim {call.head_dim} > 256" if call.head_dim > 256 else
                f"causal with {call.tq} queries != {call.tk} keys" if call.causal and call.tq != call.tk else
                f"compute capability {cap} < 8.0" if cap < (8, 0) else "")
    if not no_flash:
        return "sdpa_flash", "fp16/bf16 without a mask"
    align = 8 if call.dtype in _HALF else 4
    if call.head_dim % align == 0 and cap >= (5, 0):
        return "sdpa_efficient", f"flash refuses {no_flash}"
    return "reference", (f"flash refuses {no_flash}, and memory-efficient needs a head dim that is a multiple of "
                         f"{align} (got {call.head_dim}) and compute capability 5.0+ (got {cap})")


def choose_kernel(call: AttentionCall, requested: str = "") -> tuple[str, str]:
    """``(kernel, reason)`` for a described call: one of :data:`KERNELS` (module docstring). Pure: no tensors, no
    environment (``requested`` is ``TITAN_KERNELS``: ``""``, ``"reference"`` or ``"triton"``)."""
    if requested == "reference":
        return "reference", "TITAN_KERNELS=reference"
    if requested == "triton":
        if call.mask == "dense":
            return "reference", "the Triton kernel takes no dense attn_mask"
        return "triton", "TITAN_KERNELS=triton"
    if requested:
        raise ValueError(f"unknown kernel request {requested!r}; choose '', 'reference' or 'triton'")
    if call.device == "cuda":
        return _cuda_kernel(call)
    if call.device == "cpu" and call.mask == "none" and call.dtype in _SDPA_DTYPES:
        return "torch_sdpa", "CPU flash kernel, no mask"
    if call.device == "cpu":
        return "reference", "a mask on the CPU (the reference returns 0, not NaN, for a row with no visible key)" \
            if call.mask != "none" else f"{call.dtype} on the CPU"
    return "reference", f"tensors on {call.device}"


def attention_kernel(q: Tensor, k: Tensor, v: Tensor, *, key_padding_mask: Optional[Tensor] = None,
                     attn_mask: Optional[Tensor] = None, causal: bool = False) -> str:
    """The kernel :func:`tiled_attention` runs for these tensors and masks: one of :data:`KERNELS` (module docstring).

    Raises :class:`~titan_ds.kernels._guard.KernelBackendError` when ``TITAN_KERNELS=triton`` cannot run here."""
    return _choose(q, k, v, causal, key_padding_mask, attn_mask)[0]


def _choose(q: Tensor, k: Tensor, v: Tensor, causal: bool, kpm: Optional[Tensor],
            dense: Optional[Tensor]) -> tuple[str, str, AttentionCall]:
    call = AttentionCall.of(q, k, v, causal=causal, key_padding_mask=kpm, attn_mask=dense)
    requested = requested_backend()
    kernel, why = choose_kernel(call, requested)
    if kernel == "triton":
        kernel_backend(q, k, v, op="attention")  # raises, saying what to install or set, where Triton cannot run
    return kernel, why, call


_LOGGED: set = set()


def _log_choice(call: AttentionCall, kernel: str, why: str) -> None:
    """One log line per distinct kind of call: which kernel runs it and why (a CUDA call on the reference warns)."""
    key = (call.device, call.dtype, call.mask, call.causal, call.tq == call.tk, kernel)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    level = logging.WARNING if kernel == "reference" and call.device == "cuda" else logging.INFO
    log.log(level, "titan attention: %s %s %s%s -> %s (%s)", call.device, str(call.dtype).replace("torch.", ""),
            "causal " if call.causal else "", f"mask {call.mask}", kernel, why)


def sdpa_mask_args(causal: bool, kpm: Optional[Tensor], dense: Optional[Tensor], tq: int, tk: int,
                   device: torch.device) -> tuple[Optional[Tensor], bool]:
    """``(attn_mask, is_causal)`` for ``F.scaled_dot_product_attention`` meaning what ``causal``, the (B, Tk) key
    padding mask and the 4-D dense mask mean to :func:`tiled_attention` (True = may attend). SDPA takes
    ``is_causal`` only without a mask, so causal with a mask becomes part of the mask. A padding mask alone stays
    (B, 1, 1, Tk), broadcast, O(B Tk); with ``causal`` it is (B, 1, Tq, Tk) booleans."""
    mask = None if kpm is None else kpm[:, None, None, :]
    if dense is not None:
        mask = dense if mask is None else mask & dense
    if mask is None:
        return None, causal
    if causal:
        mask = mask & torch.ones(tq, tk, dtype=torch.bool, device=device).tril()
    return mask, False


_NO_KERNEL = ("No available kernel", "No viable backend")  # SDPA's messages on CUDA and on the CPU


def _fused_sdpa(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, kpm: Optional[Tensor], dense: Optional[Tensor],
                scale: float, tile: int) -> Tensor:
    """SDPA restricted to its flash and memory-efficient kernels (never the math kernel, which saves the (Tq, Tk)
    probabilities); where SDPA refuses both, the reference, with a warning once."""
    mask, is_causal = sdpa_mask_args(causal, kpm, dense, q.shape[2], k.shape[2], q.device)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    except RuntimeError as e:
        if not any(m in str(e) for m in _NO_KERNEL):
            raise
        key = ("refused", q.device.type, q.dtype, mask is None, causal, q.shape[-1])
        if key not in _LOGGED:
            _LOGGED.add(key)
            log.warning("titan attention: SDPA refused both its flash and memory-efficient kernels for %s %s, head "
                        "dim %d, %s (%s); running titan's reference tiled attention (exact, O(L) memory, slower)",
                        q.device.type, str(q.dtype).replace("torch.", ""), q.shape[-1],
                        "no mask" if mask is None else f"mask {tuple(mask.shape)}", str(e).splitlines()[0])
    return _TiledAttentionFn.apply(q, k, v, kpm, dense, causal, scale, tile)


def kernels_by_device() -> dict[str, str]:
    """What ``mlme.attention="tiled"`` runs on each device type here (for the MLME report)."""
    requested = requested_backend()
    if requested == "reference":
        return {"cpu": "reference", "cuda": "reference"}
    if requested == "triton":
        return {"cpu": "triton (interpreter)", "cuda": "triton (TITAN_KERNELS=triton)"}
    return {"cpu": "torch_sdpa (CPU flash kernel; reference with a mask)",
            "cuda": "sdpa_flash (fp16/bf16, no mask) or sdpa_efficient (fp32, or a mask)"}


def tiled_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                    key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                    scale: Optional[float] = None, tile: int = 128) -> Tensor:
    """Exact attention on the kernel :func:`attention_kernel` picks (``TITAN_KERNELS``, device, dtype, masks).

    ``key_padding_mask``: (B, Tk) bool, True for real tokens. ``attn_mask``: 4-D bool broadcastable to
    (B, H, Tq, Tk), True where attention is allowed. A query row that can see no key returns 0 on the reference
    and on PyTorch's CPU kernels (checked); on CUDA what SDPA returns there is not checked here. ``tile`` is the
    reference's and the Triton kernel's tile; PyTorch's kernels pick their own. Each distinct kind of call logs
    its kernel once (logger ``titan_ds.kernels``).
    """
    kernel, why, call = _choose(q, k, v, causal, key_padding_mask, attn_mask)
    _log_choice(call, kernel, why)
    if kernel == "reference":
        return tiled_attention_reference(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                                         attn_mask=attn_mask, scale=scale, tile=tile)
    _check(q, k, v, key_padding_mask, attn_mask, causal, tile)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if kernel == "torch_sdpa":
        # FLASH_ATTENTION only: were it unusable, SDPA raises rather than fall back to the math kernel, which would
        # save the (Tq, Tk) probabilities
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    if kernel in SDPA_KERNELS:
        return _fused_sdpa(q, k, v, causal=causal, kpm=key_padding_mask, dense=attn_mask, scale=scale, tile=tile)
    if not q.is_cuda and q.dtype != torch.float32:
        # Triton's interpreter gets this kernel's bf16/fp16 arithmetic wrong with no error (a relative error of
        # 1e9 on bf16 inputs, where fp32 agrees to 1e-7): refused rather than returned
        raise KernelBackendError(f"TITAN_KERNELS=triton runs titan's Triton attention in Triton's interpreter on "
                                 f"these CPU tensors, which computes only fp32 correctly; they are {q.dtype}: cast "
                                 f"them to fp32, or set TITAN_KERNELS=reference")
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
