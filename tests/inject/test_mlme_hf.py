"""MLME policies on tiny random-initialised HuggingFace GPT-2 and Llama models: parity with the unmodified model."""
import copy

import pytest
import torch

from tests.helpers.deps import require

transformers = require("transformers")

from titan_ds.config import MLMEConfig  # noqa: E402
from titan_ds.inject.mlme import apply_mlme  # noqa: E402
from titan_ds.kernels.stripe_ffn import StripeFFN  # noqa: E402

ATOL, RTOL = 3e-5, 3e-5


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=97, n_positions=64,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=96, vocab_size=97, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _loss_and_grads(model, ids, mask=None):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("padded", [False, True])
def test_hf_parity(build, padded):
    model = build()
    eager = copy.deepcopy(model)
    report = apply_mlme(model, MLMEConfig(tile=16, stripe_ffn=7, chunked_loss=False))
    kinds = {e.policy for e in report.entries}
    assert kinds == {"mlme.attention", "mlme.stripe_ffn"} and len(report.entries) == 4, report.table()
    assert list(model.state_dict()) == list(eager.state_dict())  # names and order unchanged
    ids = torch.randint(0, 97, (2, 37))
    mask = None
    if padded:  # right padding, ragged lengths 37 and 20
        mask = torch.ones(2, 37, dtype=torch.long)
        mask[1, 20:] = 0
    logits0, grads0 = _loss_and_grads(eager, ids, mask)
    logits1, grads1 = _loss_and_grads(model, ids, mask)
    keep = mask.bool() if padded else torch.ones(2, 37, dtype=torch.bool)
    torch.testing.assert_close(logits1[keep], logits0[keep], atol=ATOL, rtol=RTOL)
    assert grads0.keys() == grads1.keys()
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], atol=ATOL, rtol=RTOL, msg=lambda m: f"grad {n}: {m}")


def test_hf_modules_really_swapped():
    model = _llama()
    apply_mlme(model, MLMEConfig(tile=16, stripe_ffn=8, chunked_loss=False))
    layer = model.model.layers[0]
    assert isinstance(layer.mlp, StripeFFN) and layer.mlp.kind == "gated"
    assert layer.self_attn.config._attn_implementation == "titan_tiled"
    assert model.config._attn_implementation != "titan_tiled"  # only the attention modules' own copies
    from titan_ds.inject.mlme import mlme_policies
    from titan_ds.inject.policy import apply_policies
    assert apply_policies(model, mlme_policies(MLMEConfig(tile=16, stripe_ffn=8))).entries == []  # idempotent


def test_right_padding_mask_takes_the_kernel_path():
    """HF's 4-D mask for right padding is recognised as causal + key padding (the Triton-capable path)."""
    from titan_ds.inject.mlme import _split_hf_mask
    kpm = torch.arange(10)[None] < torch.tensor([[10], [4]])
    mask = torch.ones(10, 10, dtype=torch.bool).tril()[None, None] & kpm[:, None, None, :]
    causal, got_kpm, dense = _split_hf_mask(mask, True, 10, 10)
    assert causal and dense is None and torch.equal(got_kpm, kpm)
    odd = mask.clone()
    odd[0, 0, 5, 2] = False
    assert _split_hf_mask(odd, True, 10, 10)[2] is not None  # anything else: the dense reference path


def test_hf_attention_dropout_raises():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=32, attn_pdrop=0.1)
    with pytest.raises(ValueError, match="attn_pdrop=0"):
        apply_mlme(transformers.GPT2LMHeadModel(cfg), MLMEConfig(stripe_ffn=None, chunked_loss=False))


def test_hf_chunked_loss_is_applied_not_skipped():
    """Was a warning ("HF computes all logits inside forward"); now a policy (tests/inject/test_chunked_loss_hf.py)."""
    model = _gpt2()
    report = apply_mlme(model, MLMEConfig(attention="off", stripe_ffn=None, chunked_loss=True))
    assert [(e.name, e.policy) for e in report.entries] == [("lm_head", "mlme.chunked_loss")]


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_hf_recompute_ffn_in_backward(build, monkeypatch):
    """recompute_ffn "in_backward" on HF decoder layers (GPT-2: Conv1D and a dropout module; Llama: gated): the
    replay's graph check passes (no fallback), the MLP's forward is skipped there, and the gradients are the bits of
    the full replay."""
    import importlib
    from titan_ds.inject import recompute
    sf = importlib.import_module("titan_ds.kernels.stripe_ffn")
    model = build()
    models = {}
    for mode in ("replay", "in_backward"):
        models[mode] = copy.deepcopy(model)
        apply_mlme(models[mode], MLMEConfig(tile=16, stripe_ffn=7, chunked_loss=False, recompute_blocks=True,
                                            recompute_ffn=mode))
        models[mode].train()
    skipped = []
    lazy_forward = sf._StripeLazyFn.forward
    monkeypatch.setattr(sf._StripeLazyFn, "forward", staticmethod(lambda ctx, *a: skipped.append(1) or lazy_forward(ctx, *a)))
    ids = torch.randint(0, 97, (2, 37))
    _, g_replay = _loss_and_grads(models["replay"], ids)
    assert skipped == []
    _, g_lazy = _loss_and_grads(models["in_backward"], ids)
    assert len(skipped) == 2  # one per layer, in the replay
    assert not {c for c in recompute._VALUES_READ if c.__module__.startswith("transformers")}
    assert g_replay.keys() == g_lazy.keys()
    for n in g_replay:
        assert torch.equal(g_replay[n], g_lazy[n]), n


@pytest.fixture
def cuda_path(monkeypatch):
    """The CUDA path on CPU tensors: every attention call described as an H100's, and HF's mask passed to SDPA as it
    is (off the CPU it is never read on the host). What runs is SDPA restricted to flash + memory-efficient (on the
    CPU: PyTorch's CPU flash kernel, which takes masks)."""
    from titan_ds.inject import mlme
    from titan_ds.kernels import attention
    of = attention.AttentionCall.of

    def cuda_of(*a, **kw):
        c = of(*a, **kw)
        return attention.AttentionCall("cuda", c.dtype, c.tq, c.tk, c.head_dim, c.causal, c.mask, (9, 0))

    monkeypatch.delenv("TITAN_KERNELS", raising=False)
    monkeypatch.setattr(attention.AttentionCall, "of", staticmethod(cuda_of))
    monkeypatch.setattr(mlme, "_MASK_READ_ON", ())
    used = []
    sdpa = attention._fused_sdpa
    monkeypatch.setattr(attention, "_fused_sdpa", lambda *a, **kw: used.append(kw.get("dense")) or sdpa(*a, **kw))
    return used


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_hf_parity_on_the_cuda_path_with_padding(build, cuda_path):
    """Right padding through the CUDA path: HF's 4-D mask handed to SDPA unread; logits of real tokens and every
    gradient equal the unmodified model's."""
    model = build()
    eager = copy.deepcopy(model)
    apply_mlme(model, MLMEConfig(tile=16, stripe_ffn=7, chunked_loss=False))
    ids = torch.randint(0, 97, (2, 37))
    mask = torch.ones(2, 37, dtype=torch.long)
    mask[1, 20:] = 0
    logits0, grads0 = _loss_and_grads(eager, ids, mask)
    logits1, grads1 = _loss_and_grads(model, ids, mask)
    assert len(cuda_path) == 2 and all(d is not None and d.shape == (2, 1, 37, 37) for d in cuda_path)
    keep = mask.bool()
    torch.testing.assert_close(logits1[keep], logits0[keep], atol=ATOL, rtol=RTOL)
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], atol=ATOL, rtol=RTOL, msg=lambda m: f"grad {n}: {m}")


def test_hf_mask_is_not_read_on_the_host_off_the_cpu():
    """On meta (a GPU stand-in) HF's mask is passed on, never read: no host read, no host copy."""
    from tests.helpers.meta import META, NoHostCopies
    from titan_ds.inject.mlme import hf_tiled_attention
    q, k, v = (torch.empty(2, 2, 9, 32, device=META, requires_grad=True) for _ in range(3))
    mask = torch.empty(2, 1, 9, 9, dtype=torch.bool, device=META)
    with NoHostCopies():
        out, _ = hf_tiled_attention(torch.nn.Module(), q, k, v, mask, scaling=0.2)
        out.sum().backward()
    assert out.shape == (2, 9, 2, 32) and q.grad.device == META
