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


# ---------------------------------------------------------------------------------------------- a training step
def _second_step_on_meta(step):
    """Run ``step`` once (a first step may set things up, e.g. copy constant tables once), then again under
    :class:`NoHostCopies`: the second step must read nothing on the host and copy nothing from it."""
    step()
    with NoHostCopies():
        step()


@pytest.mark.parametrize("stripe", [4, "budget"])
@pytest.mark.parametrize("saves", ["input", "pre_activation"])
@pytest.mark.parametrize("kind", ["plain", "gpt2_dropout", "gated"])
def test_stripe_ffn_training_steps_on_meta(kind, saves, stripe):
    """StripeFFN's forward and backward with its parameters and input on meta, gradients accumulating over steps."""
    if kind == "gated":
        ffn = StripeFFN.gated(nn.Linear(16, 64, bias=False), nn.Linear(16, 64, bias=False),
                              nn.Linear(64, 16, bias=False), nn.SiLU(), stripe=stripe, saves=saves)
    else:
        drop = ("dropout", nn.Dropout(0.1)) if kind == "gpt2_dropout" else None
        ffn = StripeFFN.plain(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), stripe=stripe, dropout=drop,
                              saves=saves)
    ffn = ffn.to(META).train()
    x = _leaf(2, 7, 16)
    _second_step_on_meta(lambda: ffn(x).sum().backward())
    assert x.grad.device == META and all(p.grad.device == META for p in ffn.parameters())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_lm_loss_training_steps_on_meta(reduction, bias):
    head = nn.Linear(16, 50, bias=bias, device=META)
    h = _leaf(3, 5, 16)
    t = torch.randint(0, 50, (3, 5), device=META)
    loss_fn = ChunkedLMLoss(chunk=4, vocab_chunk=16, reduction=reduction)
    _second_step_on_meta(lambda: loss_fn(h, head, t).backward())
    assert h.grad.device == META and all(p.grad.device == META for p in head.parameters())


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("saves", ["input", "pre_activation"])
def test_reference_gpt_with_mlme_training_steps_on_meta(saves, recompute):
    """The reference GPT with every MLME part (StripeFFN, chunked loss, tiled attention, block recompute), moved
    whole to meta: a forward and backward after the first reads nothing on the host and copies nothing from it."""
    from titan_ds.config import MLMEConfig
    from titan_ds.inject.mlme import apply_mlme
    from titan_ds.models.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=64, vocab_size=97))
    apply_mlme(model, MLMEConfig(tile=16, stripe_ffn=8, stripe_ffn_saves=saves, recompute_blocks=recompute))
    model = model.to(META)
    x, y = (torch.randint(0, 97, (2, 33), device=META) for _ in range(2))
    _second_step_on_meta(lambda: model(x, y).backward())
    assert all(p.grad is not None and p.grad.device == META for p in model.parameters())
