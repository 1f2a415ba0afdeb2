"""titan.mlme.recompute_ffn "in_backward": a recomputed block's replay skips StripeFFN's forward; the gradients are
the same bits as a full replay, the MLP's forward runs once fewer, and a block that reads the MLP's output in more
than its residual sum is detected on the replay's graph and replayed in full."""
import copy
import importlib
import logging

import pytest
import torch
from torch import nn

from titan_ds.config import MLMEConfig, TitanConfig
from titan_ds.inject import recompute
from titan_ds.inject.mlme import apply_mlme
from titan_ds.kernels.saved import SavedTensorMeter
from titan_ds.models import GPT, GPTConfig

from .test_recompute import _loss_grads

sf = importlib.import_module("titan_ds.kernels.stripe_ffn")  # the package exports a function of that name
CFG = GPTConfig(n_layer=3, n_embd=64, n_head=4, block_size=64)


def _pair(saves="input", **kw):
    torch.manual_seed(0)
    base = GPT(CFG)
    out = []
    for mode in ("replay", "in_backward"):
        m = copy.deepcopy(base)
        apply_mlme(m, MLMEConfig(recompute_blocks=True, recompute_ffn=mode, stripe_ffn=32, stripe_ffn_saves=saves, **kw))
        out.append(m)
    return out


class _Count:
    """Counts StripeFFN's forward computations (_StripeFn.forward) and skipped ones (_StripeLazyFn.forward)."""

    def __init__(self, monkeypatch):
        self.full = self.lazy = 0
        full, lazy = sf._StripeFn.forward, sf._StripeLazyFn.forward

        def f(ctx, *a):
            self.full += 1
            return full(ctx, *a)

        def g(ctx, *a):
            self.lazy += 1
            return lazy(ctx, *a)
        monkeypatch.setattr(sf._StripeFn, "forward", staticmethod(f))
        monkeypatch.setattr(sf._StripeLazyFn, "forward", staticmethod(g))


@pytest.mark.parametrize("saves", ["input", "pre_activation"])
def test_same_bits_and_one_forward_fewer(saves, monkeypatch):
    replay, lazy = _pair(saves)
    x = torch.randint(0, 256, (2, CFG.block_size))
    count = _Count(monkeypatch)
    l0, g0 = _loss_grads(replay, x)
    full_replay = count.full
    count.full = 0
    l1, g1 = _loss_grads(lazy, x)
    assert torch.equal(l0, l1)
    if saves == "input":  # the same arithmetic in backward: bit for bit
        for n in g0:
            assert torch.equal(g0[n], g1[n]), n
    else:  # pre_activation's backward recomputes no matmul; the lazy replay's computes fc once: float rounding only
        for n in g0:
            assert torch.allclose(g0[n], g1[n], atol=1e-6, rtol=1e-5), n
    if saves == "input":
        assert full_replay == 2 * CFG.n_layer  # the first forward and the replay
    assert (count.full, count.lazy) == (CFG.n_layer, CFG.n_layer)  # the replay computed none
    assert type(lazy.blocks[0]).__mro__[1] not in recompute._VALUES_READ


def test_saves_no_more_than_input():
    replay, lazy = _pair("input")
    x = torch.randint(0, 256, (2, CFG.block_size))
    peaks = []
    for m in (replay, lazy):
        with SavedTensorMeter() as meter:
            m(x, x).backward()
        peaks.append(meter.peak)
    assert peaks[1] <= peaks[0], peaks


def test_pre_activation_changes_nothing_under_the_lazy_replay():
    """stripe_ffn_saves only matters where StripeFFN's forward runs with grad: with recompute_blocks and the lazy
    replay (titan_exact's section) it never does, so "pre_activation" and "input" save the same bytes and give the
    same bits (why ds_configs/titan_exact.json does not set it)."""
    x = torch.randint(0, 256, (2, CFG.block_size))
    peaks, grads = [], []
    for saves in ("input", "pre_activation"):
        torch.manual_seed(0)
        m = GPT(CFG)
        report = apply_mlme(m, MLMEConfig(recompute_blocks=True, stripe_ffn=32, stripe_ffn_saves=saves))
        assert {e.detail["saves"] for e in report.entries if e.policy == "mlme.stripe_ffn"} == {saves}
        with SavedTensorMeter() as meter:
            m(x, x).backward()
        peaks.append(meter.peak)
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert peaks[0] == peaks[1], peaks
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


class _ScaledBlock(nn.Module):
    """A block that reads its MLP's output: LayerScale (gamma's gradient needs the value), or a norm after the sum."""

    def __init__(self, d, post_norm=False):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = sf.StripeFFN.plain(nn.Linear(d, 4 * d), torch.nn.functional.gelu, nn.Linear(4 * d, d), stripe=8)
        self.gamma = nn.Parameter(torch.full((d,), 0.5))
        self.post = nn.LayerNorm(d) if post_norm else None

    def forward(self, x):
        h = self.mlp(self.ln(x))
        if self.post is not None:
            return self.post(x + h)
        return x + self.gamma * h


class _Net(nn.Module):
    def __init__(self, d=32, post_norm=False):
        super().__init__()
        self.blocks = nn.ModuleList(_ScaledBlock(d, post_norm) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


@pytest.mark.parametrize("post_norm", [False, True])
def test_reading_block_is_replayed_in_full(post_norm, caplog):
    from titan_ds.inject.policy import apply_policies
    torch.manual_seed(1)
    ref = _Net(post_norm=post_norm)
    outs = []
    for mode in ("replay", "in_backward"):
        m = copy.deepcopy(ref)
        apply_policies(m, [recompute.BlockRecomputePolicy(mode)])
        outs.append(m)
    x = torch.randn(3, 10, 32).requires_grad_()  # reentrant checkpoint needs an input that requires grad
    recompute._VALUES_READ.clear()
    grads = []
    with caplog.at_level(logging.WARNING, logger="titan_ds.inject.recompute"):
        for m in outs + [ref]:
            m.zero_grad()
            torch.manual_seed(5)
            m(x).backward()
            grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() == grads[2].keys()
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n  # the fallback replays exactly what "replay" does
        assert torch.allclose(grads[0][n], grads[2][n], atol=1e-6), n
    assert _ScaledBlock in recompute._VALUES_READ
    assert sum("reads its MLP's output" in r.getMessage() for r in caplog.records) == 1  # once per class


def test_graph_check_accepts_sum_and_dropout():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    h = lin(x)
    node = h.grad_fn
    y = x + torch.nn.functional.dropout(h.view(2, 4), 0.1, training=True)
    assert recompute._values_unread(y, [node])
    assert recompute._values_unread((y, None), [node])
    assert not recompute._values_unread(y * y, [node])  # the product's backward reads y
    w = torch.randn(4, requires_grad=True)
    assert not recompute._values_unread(x + h * w, [node])  # LayerScale: w's gradient reads h
    z = x + h
    assert not recompute._values_unread((z, z.sum()), [node])  # a consumer outside the value-free list: refused
    assert not recompute._values_unread(x * 2, [node])  # not on the way to an output

def test_config():
    assert MLMEConfig(recompute_blocks=True).recompute_ffn == "in_backward"
    with pytest.raises(ValueError, match="recompute_ffn 'replay' is set but recompute_blocks is false"):
        MLMEConfig(recompute_ffn="replay")
    with pytest.raises(ValueError):
        MLMEConfig(recompute_blocks=True, recompute_ffn="lazy")
    cfg = TitanConfig.from_ds_config({"titan": {"mlme": {"recompute_blocks": True, "recompute_ffn": "replay"}}})
    assert cfg.mlme.recompute_ffn == "replay"


@pytest.mark.parametrize("stage", [0, 3])
def test_through_deepspeed_zero(dist_env, stage, monkeypatch):
    """Under DeepSpeed (ZeRO-0 and ZeRO-3, whose hooks gather the MLP's weights in backward): three steps with the
    lazy replay give the losses and weights of the full replay, bit for bit."""
    import titan_ds
    count = _Count(monkeypatch)
    out = {}
    for mode in ("replay", "in_backward"):
        torch.manual_seed(0)
        model = GPT(CFG)
        cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
               "zero_allow_untested_optimizer": True,
               "titan": {"mlme": {"stripe_ffn": 16, "recompute_blocks": True, "recompute_ffn": mode}}}
        engine, *_ = titan_ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         config=cfg)
        losses = []
        for step in range(3):
            x = torch.randint(0, 256, (2, CFG.block_size), generator=torch.Generator().manual_seed(step))
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().clone())
        out[mode] = losses
        engine.destroy()
    assert all(torch.equal(a, b) for a, b in zip(out["replay"], out["in_backward"])), out
    assert count.lazy == 3 * CFG.n_layer  # the in_backward run skipped every replay's MLP forward
