"""Chunked linear cross-entropy vs F.cross_entropy(hidden @ W.T + b): loss and grads of hidden, W, b, fp32."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from titan_ds.kernels.chunked_ce import ChunkedLMLoss, chunked_linear_cross_entropy

ATOL, RTOL = 1e-5, 1e-5


def _both(h, w, b, t, g=None, **kw):
    eager_kw = {k: v for k, v in kw.items() if k in ("ignore_index", "reduction")}
    res = []
    for fn in (lambda h, w, b: F.cross_entropy(F.linear(h, w, b).reshape(-1, w.shape[0]), t.reshape(-1),
                                               **eager_kw).reshape(t.shape if kw.get("reduction") == "none" else ()),
               lambda h, w, b: chunked_linear_cross_entropy(h, w, t, b, **kw)):
        hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        bb = None if b is None else b.detach().clone().requires_grad_()
        loss = fn(hh, ww, bb)
        gg = torch.ones_like(loss) if g is None else g
        grads = torch.autograd.grad(loss, [x for x in (hh, ww, bb) if x is not None], gg)
        res.append((loss, grads))
    return res


def _assert(res):
    (l0, g0), (l1, g1) = res
    torch.testing.assert_close(l1, l0, atol=ATOL, rtol=RTOL)
    for a, b, n in zip(g1, g0, ("hidden", "weight", "bias")):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"grad {n}: {m}")


@pytest.mark.parametrize("chunk,vocab_chunk", [(1, None), (7, 13), (64, 64), (5, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_eager(chunk, vocab_chunk, bias):
    h, w, t = torch.randn(3, 11, 16) * 3, torch.randn(50, 16), torch.randint(0, 50, (3, 11))
    b = torch.randn(50) if bias else None
    _assert(_both(h, w, b, t, chunk=chunk, vocab_chunk=vocab_chunk))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ignore_index_and_reductions(reduction):
    h, w, t = torch.randn(4, 9, 16), torch.randn(30, 16), torch.randint(0, 30, (4, 9))
    t[0, :5] = -1
    t[2] = -1
    g = torch.randn(4, 9) if reduction == "none" else None
    _assert(_both(h, w, None, t, g=g, ignore_index=-1, reduction=reduction, chunk=6, vocab_chunk=8))


def test_all_ignored_mean_is_nan_like_pytorch():
    h, w, t = torch.randn(5, 8), torch.randn(10, 8), torch.full((5,), -100)
    assert torch.isnan(chunked_linear_cross_entropy(h, w, t)) and torch.isnan(F.cross_entropy(h @ w.t(), t))


def test_module_and_no_full_logits_saved():
    head, loss_mod = nn.Linear(16, 300, bias=False), ChunkedLMLoss(chunk=8)
    h, t = torch.randn(2, 20, 16, requires_grad=True), torch.randint(0, 300, (2, 20))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        loss = loss_mod(h, head, t)
    torch.testing.assert_close(loss, F.cross_entropy(head(h).reshape(-1, 300), t.reshape(-1)), atol=ATOL, rtol=RTOL)
    assert max(saved) < 40 * 300  # nothing of the size of the logits (tokens x vocab) is kept


def test_errors():
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="reduction"):
        chunked_linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long), reduction="avg")
    with pytest.raises(ValueError, match="out of range"):
        chunked_linear_cross_entropy(h, w, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="chunk"):
        ChunkedLMLoss(chunk=0)
    with pytest.raises(TypeError, match="nn.Linear"):
        ChunkedLMLoss()(h, nn.Identity(), torch.zeros(4, dtype=torch.long))


def test_lm_loss_module_returns_the_fp32_sum_for_bf16_activations():
    """ChunkedLMLoss stands in for the GPT's LMLoss, which returns an fp32 loss from bf16 logits: the loss is the
    fp32 sum unrounded (a bf16 loss would be a multiple of 2^-7 near 2), and the function keeps torch's dtype rule."""
    torch.manual_seed(0)
    head = nn.Linear(16, 40).bfloat16()
    h = torch.randn(3, 8, 16).bfloat16()
    t = torch.randint(0, 40, (3, 8))
    loss = ChunkedLMLoss(chunk=5)(h, head, t)
    logits = h.float() @ head.weight.float().t() + head.bias.float()  # the kernel's fp32 logits of bf16 inputs
    ref = nn.functional.cross_entropy(logits.reshape(-1, 40), t.reshape(-1))
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert chunked_linear_cross_entropy(h, head.weight, t, head.bias).dtype == torch.bfloat16
