"""GPU readiness of the memory kernels' PyTorch paths, without a GPU: forward and backward on ``meta`` tensors.

The chunked loss, StripeFFN and tiled attention's reference path (the one a GPU runs when Triton is not used, and
always for a dense ``attn_mask``) run with every input and parameter on meta, where a CPU tensor next to a device
one or a host read raises; :class:`~tests.helpers.meta.NoHostCopies` also fails on blocking host-to-device copies
(tests/helpers/meta.py). The Triton kernels are compiled for CUDA targets without a device in
``test_triton_compile.py``.
"""
import pytest
import torch
import torch.nn as nn

from tests.helpers.meta import META, NoHostCopies
from titan_ds.kernels.attention import tiled_attention
from titan_ds.kernels.chunked_ce import ChunkedLMLoss, chunked_linear_cross_entropy
from titan_ds.kernels.stripe_ffn import StripeFFN


def _leaf(*shape, dtype=torch.float32):
    return torch.empty(*shape, device=META, dtype=dtype, requires_grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_chunked_loss_on_meta(reduction, dtype):
    h, w, b = _leaf(2, 7, 16, dtype=dtype), _leaf(50, 16, dtype=dtype), _leaf(50, dtype=dtype)
    t = torch.randint(0, 50, (2, 7), device=META)
    with NoHostCopies():
        loss = chunked_linear_cross_entropy(h, w, t, b, reduction=reduction, chunk=4, vocab_chunk=16)
        loss.sum().backward()
    assert h.grad.device == w.grad.device == b.grad.device == META


def test_chunked_lm_loss_module_on_meta():
    head = nn.Linear(16, 50, bias=False, device=META)
    h = _leaf(3, 5, 16)
    with NoHostCopies():
        ChunkedLMLoss(chunk=4)(h, head, torch.randint(0, 50, (3, 5), device=META)).backward()
    assert head.weight.grad.device == META


@pytest.mark.parametrize("saves", ["input", "pre_activation"])
@pytest.mark.parametrize("kind", ["plain", "gated"])
def test_stripe_ffn_on_meta(kind, saves):
    if kind == "plain":
        ffn = StripeFFN.plain(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), stripe=4, saves=saves)
    else:
        ffn = StripeFFN.gated(nn.Linear(16, 64, bias=False), nn.Linear(16, 64, bias=False),
                              nn.Linear(64, 16, bias=False), nn.SiLU(), stripe=4, saves=saves)
    assert ffn.saves_used == saves
    ffn = ffn.to(META)
    x = _leaf(2, 7, 16)
    with NoHostCopies():
        ffn(x).sum().backward()
    assert x.grad.device == META and all(p.grad.device == META for p in ffn.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masks", ["causal", "causal_padding", "dense"])
def test_tiled_attention_reference_on_meta(masks, dtype):
    q, k, v = (_leaf(2, 3, 9, 16, dtype=dtype) for _ in range(3))
    kw = {"causal": masks != "dense", "tile": 4}
    if masks == "causal_padding":
        kw["key_padding_mask"] = torch.empty(2, 9, dtype=torch.bool, device=META)
    if masks == "dense":
        kw["attn_mask"] = torch.empty(1, 1, 9, 9, dtype=torch.bool, device=META)
    with NoHostCopies():
        tiled_attention(q, k, v, **kw).sum().backward()
    assert q.grad.device == k.grad.device == v.grad.device == META


@pytest.mark.parametrize("kind", ["plain", "gated"])
def test_stripe_ffn_lazy_replay_on_meta(kind):
    """recompute_ffn "in_backward": the replay's zeros and the backward that computes the MLP, on meta."""
    from titan_ds.kernels.stripe_ffn import lazy_replay
    if kind == "plain":
        ffn = StripeFFN.plain(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), stripe=4)
    else:
        ffn = StripeFFN.gated(nn.Linear(16, 64, bias=False), nn.Linear(16, 64, bias=False),
                              nn.Linear(64, 16, bias=False), nn.SiLU(), stripe=4)
    ffn = ffn.to(META)
    x = _leaf(2, 7, 16)
    with NoHostCopies():
        with lazy_replay() as skipped:
            y = x + ffn(x)
        assert len(skipped) == 1 and y.device == META
        y.sum().backward()
    assert x.grad.device == META and all(p.grad.device == META for p in ffn.parameters())
