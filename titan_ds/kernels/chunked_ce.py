"""Cross-entropy fused with the output projection, in chunks: the (tokens x vocab) logits never exist at once.

``chunked_linear_cross_entropy(hidden, weight, targets, bias)`` equals
``F.cross_entropy(hidden @ weight.T + bias, targets, ignore_index=..., reduction=...)`` for hidden (..., d),
weight (V, d), targets (...). With row chunks r of ``chunk`` tokens and vocabulary chunks c of ``vocab_chunk``
classes (all of V when None):

Forward (fp32 accumulation, no graph kept):
1. for each r, for each c: Z = h_r W_c^T + b_c;  online log-sum-exp over c (running max m, running sum s);
   the target's logit is picked from the chunk that holds it.
2. loss_i = lse_i - z_{i, t_i} for rows whose target is not ``ignore_index``, else 0;
   mean = sum / (number of counted rows) (NaN when there are none, as PyTorch), sum, or none (per row).
3. save h, W, b, targets and lse (N floats): O(N) beyond the inputs, never O(N * V).

Backward, with g_i = upstream gradient / count (mean), g (sum) or g_i (none), zero for ignored rows:
4. for each r, c: recompute Z, P = exp(Z - lse);  P[i, t_i] -= 1;  G = g * P;
   dh_r += G W_c;  dW_c += G^T h_r;  db_c += colsum G.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

__all__ = ["chunked_linear_cross_entropy", "ChunkedLMLoss", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum", "none")


def _logits(h: Tensor, w: Tensor, b: Optional[Tensor], c0: int, c1: int) -> Tensor:
    z = h.float() @ w[c0:c1].float().t()
    return z if b is None else z + b[c0:c1].float()


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor, b: Optional[Tensor], t: Tensor, ignore_index: int, reduction: str,
                chunk: int, vchunk: int, out_dtype: torch.dtype) -> Tensor:
        n, vocab = h.shape[0], w.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        picked = torch.zeros(n, dtype=torch.float32, device=h.device)
        valid = t != ignore_index
        for r0 in range(0, n, chunk):
            r1 = min(r0 + chunk, n)
            m = torch.full((r1 - r0,), -math.inf, device=h.device)
            s = torch.zeros(r1 - r0, device=h.device)
            tr = t[r0:r1]
            for c0 in range(0, vocab, vchunk):
                c1 = min(c0 + vchunk, vocab)
                z = _logits(h[r0:r1], w, b, c0, c1)
                m_new = torch.maximum(m, z.amax(1))
                s = s * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(1)
                m = m_new
                inside = (tr >= c0) & (tr < c1)
                idx = (tr - c0).clamp(0, c1 - c0 - 1)
                picked[r0:r1] += torch.where(inside, z.gather(1, idx[:, None])[:, 0], torch.zeros_like(m))
            lse[r0:r1] = m + torch.log(s)
        per_row = torch.where(valid, lse - picked, torch.zeros_like(lse))
        count = valid.sum()
        if reduction == "mean":
            loss = per_row.sum() / count
        elif reduction == "sum":
            loss = per_row.sum()
        else:
            loss = per_row
        ctx.save_for_backward(h, w, b, t, lse, count)
        ctx.ignore_index, ctx.reduction, ctx.chunk, ctx.vchunk = ignore_index, reduction, chunk, vchunk
        return loss.to(out_dtype)

    @staticmethod
    def backward(ctx, g: Tensor):
        h, w, b, t, lse, count = ctx.saved_tensors
        n, vocab = h.shape[0], w.shape[0]
        valid = t != ctx.ignore_index
        if ctx.reduction == "mean":
            coef = (g.float() / count) * valid
        elif ctx.reduction == "sum":
            coef = g.float() * valid
        else:
            coef = g.float() * valid
        dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=h.device)
        db = torch.zeros(vocab, dtype=torch.float32, device=h.device) if b is not None else None
        for r0 in range(0, n, ctx.chunk):
            r1 = min(r0 + ctx.chunk, n)
            tr, cr, hr = t[r0:r1], coef[r0:r1, None], h[r0:r1].float()
            for c0 in range(0, vocab, ctx.vchunk):
                c1 = min(c0 + ctx.vchunk, vocab)
                p = torch.exp(_logits(h[r0:r1], w, b, c0, c1) - lse[r0:r1, None])
                inside = (tr >= c0) & (tr < c1)
                # P[i, t_i] -= 1 for the rows whose target is in this chunk, by a fixed-size scatter (nonzero()
                # would read the row count on the host); the other rows add -0.0, which changes no value
                idx = (tr - c0).clamp(0, c1 - c0 - 1)
                p.scatter_add_(1, idx[:, None], torch.where(inside, -1.0, -0.0)[:, None].to(p.dtype))
                p *= cr
                dh[r0:r1] += p @ w[c0:c1].float()
                dw[c0:c1] += p.t() @ hr
                if db is not None:
                    db[c0:c1] += p.sum(0)
        return (dh.to(h.dtype), dw.to(w.dtype), None if db is None else db.to(b.dtype),
                None, None, None, None, None, None)


def chunked_linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor] = None,
                                 *, ignore_index: int = -100, reduction: str = "mean", chunk: int = 4096,
                                 vocab_chunk: Optional[int] = None, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, targets)`` without materialising all logits (module docstring).

    ``chunk``: tokens per row chunk; ``vocab_chunk``: classes per vocabulary chunk (None: the whole vocabulary).
    ``out_dtype``: the loss's dtype (None: ``hidden``'s, as ``F.cross_entropy`` of logits in it; the sum is fp32
    either way, so ``torch.float32`` returns it unrounded for bf16 activations).
    Returns a scalar for mean/sum and a tensor of ``targets.shape`` for none.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; choose one of {list(REDUCTIONS)}")
    if chunk < 1 or (vocab_chunk is not None and vocab_chunk < 1):
        raise ValueError(f"chunk and vocab_chunk must be >= 1, got {chunk} and {vocab_chunk}")
    if hidden.shape[:-1] != targets.shape or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets "
                         f"{tuple(targets.shape)}: want hidden (..., d), weight (V, d), targets (...)")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be integer class indices, got {targets.dtype}")
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= weight.shape[0]))
    if targets.device.type == "cpu" and bool(bad.any()):  # on a device this check would be a host sync every step
        raise ValueError(f"targets out of range [0, {weight.shape[0]}) (ignore_index={ignore_index}): "
                         f"{targets[bad][:5].tolist()}")
    vchunk = weight.shape[0] if vocab_chunk is None else vocab_chunk
    loss = _ChunkedCE.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1).long(),
                            ignore_index, reduction, chunk, vchunk, out_dtype or hidden.dtype)
    return loss.reshape(targets.shape) if reduction == "none" else loss


class ChunkedLMLoss(nn.Module):
    """``forward(hidden, head, targets) -> loss``: the LM head projection and cross-entropy fused and chunked."""

    def __init__(self, chunk: int = 4096, vocab_chunk: Optional[int] = None, ignore_index: int = -100,
                 reduction: str = "mean"):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"unknown reduction {reduction!r}; choose one of {list(REDUCTIONS)}")
        if chunk < 1 or (vocab_chunk is not None and vocab_chunk < 1):
            raise ValueError(f"chunk and vocab_chunk must be >= 1, got {chunk} and {vocab_chunk}")
        self.chunk, self.vocab_chunk, self.ignore_index, self.reduction = chunk, vocab_chunk, ignore_index, reduction

    def forward(self, hidden: Tensor, head: nn.Module, targets: Tensor) -> Tensor:
        if not isinstance(head, nn.Linear):
            raise TypeError(f"ChunkedLMLoss needs the head as nn.Linear (weight (V, d)), got {type(head).__name__}")
        # fp32, as the reference GPT's LMLoss (and HF's loss) returns it from logits of any dtype
        return chunked_linear_cross_entropy(hidden, head.weight, targets, head.bias, ignore_index=self.ignore_index,
                                            reduction=self.reduction, chunk=self.chunk, vocab_chunk=self.vocab_chunk,
                                            out_dtype=torch.float32)

    def extra_repr(self) -> str:
        return (f"chunk={self.chunk}, vocab_chunk={self.vocab_chunk}, ignore_index={self.ignore_index}, "
                f"reduction={self.reduction}")
