"""TRD on HF models: the default include matches the block linears of HF Llama / Qwen2 /
Mistral / GPT-2, HF ``Conv1D`` (weight stored (in, out)) is replaced with its function kept, and ``tr_svd``
reports the relative reconstruction error per layer. Tiny random configs built in code."""
import copy
import logging

import pytest
import torch

from tests.helpers.deps import require

transformers = require("transformers")

from titan_ds.config import TitanConfig  # noqa: E402
from titan_ds.inject.trd import TensorRingLinear, TRDPolicy, apply_trd, init_errors  # noqa: E402

V = 97
LLAMA_BLOCK = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"]
GPT2_BLOCK = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]


def _llama_like(cfg_cls, model_cls):
    return model_cls(cfg_cls(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                             intermediate_size=48, vocab_size=V, max_position_embeddings=32))


def _gpt2(n_layer=2):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=n_layer, n_embd=32, n_head=2, vocab_size=V, n_positions=32, attn_pdrop=0.0, resid_pdrop=0.0,
        embd_pdrop=0.0))


MODELS = {
    "llama": (lambda: _llama_like(transformers.LlamaConfig, transformers.LlamaForCausalLM), "model.layers", LLAMA_BLOCK),
    "qwen2": (lambda: _llama_like(transformers.Qwen2Config, transformers.Qwen2ForCausalLM), "model.layers", LLAMA_BLOCK),
    "mistral": (lambda: _llama_like(transformers.MistralConfig, transformers.MistralForCausalLM), "model.layers",
                LLAMA_BLOCK),
    "gpt2": (_gpt2, "transformer.h", GPT2_BLOCK),
}


@pytest.mark.parametrize("family", list(MODELS))
def test_default_include_matches_every_block_linear_and_nothing_else(family):
    build, prefix, block = MODELS[family]
    model = build()
    include = TitanConfig(trd={}).trd.include  # the default, as a user gets it
    report = apply_trd(model, TRDPolicy(rank=2, include=include, min_features=8))
    assert report.names == [f"{prefix}.{i}.{leaf}" for i in range(2) for leaf in block]
    assert all(isinstance(model.get_submodule(n), TensorRingLinear) for n in report.names)
    assert type(model.get_output_embeddings()) is torch.nn.Linear  # the LM head is never replaced


def test_conv1d_replacement_keeps_the_function_weight_transposed():
    """Conv1D computes x @ W + b with W (in, out). Exact TR-SVD (rank 64) must give the same outputs; c_proj and
    c_fc are square or wide, so a layer built from W instead of W^T would differ (c_proj) or fail (c_attn)."""
    torch.manual_seed(0)
    model = _gpt2()
    ref = copy.deepcopy(model)
    conv = ref.transformer.h[0].attn.c_proj
    layer = TensorRingLinear.from_linear(conv, 64, init="tr_svd")
    torch.testing.assert_close(layer.reference_weight(), conv.weight.t(), atol=1e-5, rtol=1e-5)
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(layer(x), conv(x), atol=1e-5, rtol=1e-5)
    report = apply_trd(model, TRDPolicy(rank=64, init="tr_svd", min_features=8))
    assert len(report.entries) == 8 and max(init_errors(report).values()) < 1e-4  # TR_SVD_PAD noise
    ids = torch.randint(0, V, (2, 11))
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)
    out = model(ids, labels=ids)
    out.loss.backward()
    core = model.transformer.h[0].attn.c_attn.core_0
    assert core.grad is not None and core.grad.abs().sum() > 0  # the cores train


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tr_svd_reports_the_relative_error_of_each_layer(family, caplog):
    """Pretrained-style init: the reported error is ||W - W_tr|| / ||W|| against the layer's own dense weight
    (as (out, in)), one per layer, logged, and smaller at a higher rank."""
    build, _, _ = MODELS[family]
    torch.manual_seed(0)
    model = build()
    dense = {n: (m.weight.t() if type(m).__name__ == "Conv1D" else m.weight).detach().clone()
             for n, m in model.named_modules() if hasattr(m, "weight") and m.weight is not None and m.weight.dim() == 2}
    pristine = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="titan_ds.trd"):
        report = apply_trd(model, TRDPolicy(rank=2, init="tr_svd", min_features=8))
    errors = init_errors(report)
    assert list(errors) == report.names and len(errors) == 2 * len(MODELS[family][2])
    for name, err in errors.items():
        w = dense[name].double()
        want = float((model.get_submodule(name).reference_weight().double() - w).norm() / w.norm())
        assert err == pytest.approx(want, rel=1e-6) and 0.05 < err < 1.0, (name, err)
        assert name in caplog.text
    higher = init_errors(apply_trd(pristine, TRDPolicy(rank=8, init="tr_svd", min_features=8)))
    assert all(higher[n] < errors[n] for n in errors)


def test_random_init_reports_no_error():
    report = apply_trd(_gpt2(1), TRDPolicy(rank=2, min_features=8))
    assert len(report.entries) == 4 and init_errors(report) == {}
