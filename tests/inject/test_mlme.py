"""MLME injection on the reference GPT: parity of the whole model (loss and every gradient) with the eager model,
stable state-dict names, the report, the pillar hook and the shipped configs."""
import copy
import json
from pathlib import Path

import pytest
import torch

from tests.helpers.configs import all_configs
from titan_ds.config import MLMEConfig, TitanConfig, TitanConfigError
from titan_ds.inject.mlme import SDPAttention, apply_mlme, mlme_policies
from titan_ds.inject.policy import apply_policies
from titan_ds.kernels.attention import TiledAttention
from titan_ds.kernels.chunked_ce import ChunkedLMLoss
from titan_ds.kernels.stripe_ffn import StripeFFN
from titan_ds.models.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[2]
ATOL, RTOL = 3e-5, 3e-5
TINY = GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=64, vocab_size=97)


def _loss_and_grads(model, x, y):
    model.zero_grad()
    loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("T", [45, 64])
def test_whole_model_parity(T):
    eager = GPT(TINY)
    model = copy.deepcopy(eager)
    report = apply_mlme(model, MLMEConfig(tile=16, stripe_ffn=7, loss_chunk=10, loss_vocab_chunk=32))
    assert sorted({e.policy for e in report.entries}) == ["mlme.attention", "mlme.chunked_loss", "mlme.stripe_ffn"]
    assert report.names == ["blocks.0.attn.core", "blocks.0.mlp", "blocks.1.attn.core", "blocks.1.mlp", "lm_loss"]
    assert report.model_params_before == report.model_params_after  # MLME adds and removes no parameter
    x, y = torch.randint(0, 97, (3, T)), torch.randint(0, 97, (3, T))
    y[0, :5] = -100  # ignored targets, as LMLoss's ignore_index
    l0, g0 = _loss_and_grads(eager, x, y)
    l1, g1 = _loss_and_grads(model, x, y)
    torch.testing.assert_close(l1, l0, atol=ATOL, rtol=RTOL)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=ATOL, rtol=RTOL, msg=lambda m: f"grad {n}: {m}")
    torch.testing.assert_close(model(x), eager(x), atol=ATOL, rtol=RTOL)  # logits path (no targets)


def test_state_dict_names_stable_and_interchangeable():
    eager = GPT(TINY)
    model = copy.deepcopy(eager)
    apply_mlme(model, MLMEConfig())
    assert list(model.state_dict()) == list(eager.state_dict())
    fresh = GPT(TINY)
    apply_mlme(fresh, MLMEConfig())
    fresh.load_state_dict(eager.state_dict())  # strict: an eager checkpoint loads into the MLME model
    x = torch.randint(0, 97, (1, 10))
    torch.testing.assert_close(fresh(x), eager(x), atol=ATOL, rtol=RTOL)


def test_modes_and_switches():
    m = GPT(TINY)
    apply_mlme(m, MLMEConfig(attention="sdpa", stripe_ffn=None, chunked_loss=False))
    assert isinstance(m.blocks[0].attn.core, SDPAttention) and not isinstance(m.blocks[0].mlp, StripeFFN)
    assert not isinstance(m.lm_loss, ChunkedLMLoss)
    m = GPT(TINY)
    apply_mlme(m, MLMEConfig(attention="off", tile=32, stripe_ffn=16, chunked_loss=True, loss_chunk=8))
    assert type(m.blocks[0].attn.core).__name__ == "AttentionCore"
    assert isinstance(m.blocks[1].mlp, StripeFFN) and m.blocks[1].mlp.stripe == 16
    assert isinstance(m.lm_loss, ChunkedLMLoss) and m.lm_loss.chunk == 8
    m = GPT(TINY)
    apply_mlme(m, MLMEConfig(tile=32, stripe_ffn=None, chunked_loss=False))
    assert isinstance(m.blocks[0].attn.core, TiledAttention) and m.blocks[0].attn.core.tile == 32


def test_idempotent():
    m = GPT(TINY)
    apply_mlme(m, MLMEConfig())
    assert apply_policies(m, mlme_policies(MLMEConfig())).entries == []


def test_nothing_matched_raises():
    with pytest.raises(ValueError, match="matched no module of Sequential"):
        apply_mlme(torch.nn.Sequential(torch.nn.Linear(4, 4)), MLMEConfig())


def test_wrong_mlp_layout_is_caught():
    class TanhMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

        def forward(self, x):
            return self.out(torch.tanh(self.fc(x)))

    model = torch.nn.Module()
    model.mlp = TanhMLP()
    with pytest.raises(RuntimeError, match="does not reproduce TanhMLP"):
        apply_mlme(model, MLMEConfig(attention="off", chunked_loss=False))


def test_apply_publishes_report(monkeypatch):
    monkeypatch.delenv("TITAN_KERNELS", raising=False)
    from titan_ds.engine import InitContext, prepare
    ctx = InitContext(model=GPT(TINY), titan=TitanConfig(mlme={"tile": 16}), ds_config={})
    prepare(ctx)
    assert len(ctx.reports["mlme"].entries) == 2 * TINY.n_layer + 1
    assert isinstance(ctx.model.blocks[0].attn.core, TiledAttention)
    by = {e.policy: e.detail for e in ctx.reports["mlme"].entries}
    assert by["mlme.attention"]["kernel"].startswith("cpu: torch_sdpa")  # the report says which kernel runs
    assert "cuda: sdpa_flash (fp16/bf16, no mask) or sdpa_efficient" in by["mlme.attention"]["kernel"]
    assert by["mlme.stripe_ffn"] == {"stripe": "budget", "tokens_per_stripe": 16 * 2**20 // (2 * 4 * 64 * 4),
                                     "dtype": "float32", "saves": "input"}


def test_config_validation():
    with pytest.raises(TitanConfigError, match="titan.mlme.tile must be a power of two"):
        TitanConfig(mlme={"tile": 48})
    with pytest.raises(TitanConfigError, match="titan.mlme.attention must be one of"):
        TitanConfig(mlme={"attention": "flash"})
    with pytest.raises(TitanConfigError, match="switches nothing on"):
        TitanConfig(mlme={"attention": "off", "stripe_ffn": None, "chunked_loss": False})
    with pytest.raises(TitanConfigError, match="titan.mlme.loss_vocab_chunk must be >= 1"):
        TitanConfig(mlme={"loss_vocab_chunk": 0})
    assert TitanConfig(mlme={}).mlme.stripe_ffn == "budget" == TitanConfig(mlme={"stripe_ffn": "budget"}).mlme.stripe_ffn
    with pytest.raises(TitanConfigError, match='titan.mlme.stripe_ffn must be a number of tokens >= 1, "budget" or null'):
        TitanConfig(mlme={"stripe_ffn": 0})


@pytest.mark.parametrize("path", all_configs("mlme*.json"), ids=lambda p: p.name)
def test_shipped_configs_load_and_apply(path):
    titan = TitanConfig.from_ds_config(json.loads(path.read_text()))
    assert titan.mlme is not None
    report = apply_mlme(GPT(TINY), titan.mlme)
    assert report.entries


def test_through_titan_initialize(dist_env):
    import titan_ds
    cfg = json.loads((ROOT / "tests" / "configs" / "mlme.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 2
    model = GPT(TINY)
    engine, *_ = titan_ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    assert engine.titan.reports["mlme"].names[-1] == "lm_loss"
    x = torch.randint(0, 97, (2, 33))
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)


def test_composes_with_trd():
    """TRD runs first (PILLARS order): StripeFFN then wraps tensor-ring fc/out and recomputes them; still exact."""
    from titan_ds.inject.trd import TRDPolicy, TensorRingLinear, apply_trd
    trd = GPT(TINY)
    apply_trd(trd, TRDPolicy(rank=4, min_features=32))
    both = copy.deepcopy(trd)
    apply_mlme(both, MLMEConfig(tile=16, stripe_ffn=5, loss_chunk=16))
    mlp = both.blocks[0].mlp
    assert isinstance(mlp, StripeFFN) and isinstance(mlp.fc, TensorRingLinear) and not mlp.out_is_linear
    x, y = torch.randint(0, 97, (2, 30)), torch.randint(0, 97, (2, 30))
    l0, g0 = _loss_and_grads(trd, x, y)
    l1, g1 = _loss_and_grads(both, x, y)
    torch.testing.assert_close(l1, l0, atol=ATOL, rtol=RTOL)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=ATOL, rtol=RTOL, msg=lambda m: f"grad {n}: {m}")
