"""TRD: TensorRingLinear (shapes, gradcheck, parity with the dense reference, init), the policy, the config.

DeepSpeed training (ZeRO 0-3) and checkpoint resume are in test_trd_deepspeed.py.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from titan_ds.config import TitanConfig, TitanConfigError, TRDConfig
from titan_ds.engine import InitContext, prepare
from titan_ds.inject.trd import TensorRingLinear, TRDPolicy, apply_trd, factorize, path_flops


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------- structure
@pytest.mark.parametrize("n,size,expect", [(256, 4, [4, 4, 4, 4]), (768, 4, [3, 4, 4, 4, 4]), (1024, 4, [4] * 5),
                                           (1000, 4, [2, 4, 5, 5, 5]), (97, 4, [97]), (1, 4, [1]), (256, 16, [16, 16]), (64, 16, [8, 8])])
def test_factorize(n, size, expect):
    assert factorize(n, size) == expect and math.prod(expect) == n


@pytest.mark.parametrize("fin,fout,rank,modes", [(12, 10, 3, None), (16, 48, [2, 3, 4, 5, 2], None),
                                                 (6, 35, 2, ([6], [5, 7])), (64, 64, 1, None)])
def test_shapes_and_param_count(fin, fout, rank, modes):
    m = TensorRingLinear(fin, fout, rank, modes)
    d = len(m.modes)
    r = [rank] * d if isinstance(rank, int) else rank
    assert [tuple(g.shape) for g in m.cores] == [(r[k], n, r[(k + 1) % d]) for k, n in enumerate(m.modes)]
    assert sum(p.numel() for p in m.parameters()) == sum(r[k] * n * r[(k + 1) % d] for k, n in enumerate(m.modes)) + fout
    assert m(torch.randn(fin)).shape == (fout,)
    assert m(torch.randn(2, 3, fin)).shape == (2, 3, fout)
    assert m.reference_weight().shape == (fout, fin)
    assert [n for n, _ in m.named_parameters()] == [f"core_{k}" for k in range(d)] + ["bias"]


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="rank has 2 entries but this layer has 4 cores"):
        TensorRingLinear(16, 16, [2, 2])
    with pytest.raises(ValueError, match=">= 1"):
        TensorRingLinear(16, 16, 0)
    with pytest.raises(ValueError, match="do not multiply"):
        TensorRingLinear(16, 16, 2, modes=([4, 2], [4, 4]))
    with pytest.raises(ValueError, match="unknown path 'fast'"):
        TensorRingLinear(16, 16, 2, path="fast")
    with pytest.raises(ValueError, match="needs dense_weight"):
        TensorRingLinear(16, 16, 2, init="tr_svd")
    with pytest.raises(ValueError, match="dense_bias= given but bias=False"):
        TensorRingLinear(16, 16, 2, bias=False, dense_bias=torch.zeros(16))


# ---------------------------------------------------------------- gradients and parity
@pytest.mark.parametrize("path", ["factored", "dense"])
def test_gradcheck_float64(path):
    m = TensorRingLinear(6, 8, [2, 3, 2, 2], path=path, dtype=torch.float64)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    params = tuple(m.parameters())

    def f(x, *ps):
        return torch.func.functional_call(m, {n: p for (n, _), p in zip(m.named_parameters(), ps)}, (x,))

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-6)


def _grads(m, x, path_fn):
    m.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    y = path_fn(x)
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.dtype)).sum().backward()
    return [y.detach(), x.grad] + [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("fin,fout,rank", [(12, 20, 3), (48, 15, [2, 3, 2, 4, 3])])
def test_parity_factored_dense_reference(fin, fout, rank):
    """Both associations against the reference (whole ring contracted, F.linear), outputs and every gradient.

    Tolerance: each fp32 path's error against the fp64 reference is at most 8x the fp32 reference's own error
    (plus 1e-6 relative slack for an fp32 reference that happens to be near-exact).
    """
    m = TensorRingLinear(fin, fout, rank)
    x = torch.randn(7, 3, fin)[:, 1]            # non-contiguous input
    assert not x.is_contiguous()
    m64 = TensorRingLinear(fin, fout, rank, dtype=torch.float64)
    m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    ref64 = _grads(m64, x.double(), m64.reference_forward)
    ref32 = _grads(m, x, m.reference_forward)
    for path in ("factored", "dense"):
        m.path = path
        got = _grads(m, x, m)
        for g, r32, r64 in zip(got, ref32, ref64):
            scale = r64.abs().max().item()
            base = (r32.double() - r64).abs().max().item()
            assert (g.double() - r64).abs().max().item() <= 8 * base + 1e-6 * scale, path


def test_cheapest_path_follows_flop_rule():
    m = TensorRingLinear(256, 256, 16)  # R = 256
    f = path_flops(2048, 256, 256, 256)
    assert f["dense"] < f["factored"] and m.choose_path(2048) == "dense"
    assert m.choose_path(16) == "factored"
    small = TensorRingLinear(256, 256, 4)  # R = 16: factored for any number of tokens
    assert small.choose_path(1) == small.choose_path(10 ** 6) == "factored"
    # the rule is 1/in + 1/out <= 1/R + 1/B
    for tokens in (1, 100, 2048):
        for r in (4, 11, 12, 16):
            mm = TensorRingLinear(256, 256, r)
            want = 1 / 256 + 1 / 256 <= 1 / (r * r) + 1 / tokens
            assert (mm.choose_path(tokens) == "factored") == want
    m.path = "factored"
    assert m.choose_path(10 ** 6) == "factored"


# ---------------------------------------------------------------- init
def test_random_init_variance_matches_nn_linear():
    """E[W_ij^2] = 1/(3 in) (nn.Linear's kaiming_uniform(a=sqrt(5))), averaged over 40 draws; 4 standard errors."""
    for fin, fout, r in [(64, 48, 4), (256, 256, 8)]:
        vals = []
        for s in range(40):
            torch.manual_seed(s)
            with torch.no_grad():
                vals.append(TensorRingLinear(fin, fout, r).reference_weight().pow(2).mean().item() * 3 * fin)
        t = torch.tensor(vals)
        assert abs(t.mean().item() - 1.0) <= 4 * t.std().item() / math.sqrt(len(vals)) + 0.02
    m = TensorRingLinear(64, 48, 4)
    assert m.bias.abs().max() <= 1 / math.sqrt(64)


def test_tr_svd_loses_nothing_when_ranks_suffice():
    """A 16x16 matrix, modes 4x4|4x4, rank 16: every TR-SVD unfolding keeps full rank -> exact (lossless case)."""
    w = torch.randn(16, 16)
    # ranks [2, 2, 8, 8] are exactly what TR-SVD needs here: no padding, fp32 round-off only
    exact = TensorRingLinear(16, 16, [2, 2, 8, 8], init="tr_svd", dense_weight=w)
    assert exact.init_error < 1e-6
    torch.testing.assert_close(exact.reference_weight(), w, rtol=0, atol=2e-6)
    # rank 16 everywhere: the slices TR-SVD cannot fill get TR_SVD_PAD noise, which costs < 1e-5 relative
    padded = TensorRingLinear(16, 16, 16, init="tr_svd", dense_weight=w)
    assert padded.init_error < 1e-5


def test_tr_svd_error_decreases_with_rank():
    """The error reported by the tensorly init falls strictly with rank (structured weight with decaying spectrum)."""
    u, _ = torch.linalg.qr(torch.randn(64, 64))
    v, _ = torch.linalg.qr(torch.randn(64, 64))
    w = u @ torch.diag(0.8 ** torch.arange(64.0)) @ v.t()
    errs = [TensorRingLinear(64, 64, r, init="tr_svd", dense_weight=w).init_error for r in (1, 2, 4, 8, 16)]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[0] > 0.9 and errs[-1] < 0.4, errs  # measured: 0.987 -> 0.362


def test_tr_svd_error_is_the_whole_ring_oracle_error_and_fits_in_memory_at_large_rank():
    """init_error and to_linear use the two half-rings (Am @ Cm); the value equals the whole-ring oracle's. At rank 128
    on a 576x576 layer (SmolLM2's q_proj) the oracle would hold 128^2 * 576^2 values (43 GB in float64): the init
    must not build it (it was OOM-killed before)."""
    w = torch.randn(48, 40, dtype=torch.float64)
    tr = TensorRingLinear(40, 48, 3, init="tr_svd", dense_weight=w.float())
    oracle = float((tr.reference_weight().detach().double() - w).norm() / w.norm())
    assert tr.init_error == pytest.approx(oracle, rel=1e-5)
    torch.testing.assert_close(tr.to_linear().weight, tr.reference_weight(), rtol=1e-5, atol=1e-6)
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, hard))  # the old path asked for 21.7 GB at once
    try:
        big = TensorRingLinear(576, 576, 128, init="tr_svd", dense_weight=torch.randn(576, 576))
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert 0 < big.init_error < 1


def test_rank_that_compresses_nothing_warns_naming_a_layer():
    """A ring with as many weights as the dense matrix (or more) is allowed but warned about, once, naming a layer."""
    with pytest.warns(UserWarning, match=r"titan.trd.rank 16 gives 2 of 8 replaced layers as many weights .*'blocks.0.proj'"):
        apply_trd(Tiny(), TRDPolicy(rank=16))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_trd(Tiny(), TRDPolicy(rank=2))


def test_tr_svd_wrong_shape():
    with pytest.raises(ValueError, match=r"shape \(8, 16\), expected \(16, 8\)"):
        TensorRingLinear(8, 16, 2, init="tr_svd", dense_weight=torch.randn(8, 16))


def test_to_linear_round_trip_and_state_dict():
    m = TensorRingLinear(12, 20, 3)
    x = torch.randn(4, 12)
    torch.testing.assert_close(m.to_linear()(x), m(x), rtol=1e-5, atol=1e-6)
    m2 = TensorRingLinear(12, 20, 3)
    assert not torch.equal(m2(x), m(x))
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2(x), m(x))


# ---------------------------------------------------------------- policy
class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential()
        self.mlp.fc, self.mlp.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


class Tiny(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.emb = nn.Embedding(32, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.small = nn.Linear(d, 8)   # below min_features
        self.head = nn.Linear(d, 32)

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = h + b.proj(b.qkv(h)[..., : h.shape[-1]]) + b.mlp.out(torch.relu(b.mlp.fc(h)))
        return self.head(h)


def test_policy_report_counts_and_names():
    model = Tiny()
    total = sum(p.numel() for p in model.parameters())
    rep = apply_trd(model, TRDPolicy(rank=4, include=[r"\.(qkv|proj|fc|out)$"]))
    assert rep.names == [f"blocks.{i}.{n}" for i in range(2) for n in ("qkv", "proj", "mlp.fc", "mlp.out")]
    for e in rep.entries:
        mod = model.get_submodule(e.name)
        assert isinstance(mod, TensorRingLinear) and e.new_params == sum(p.numel() for p in mod.parameters())
        assert e.dense_params == mod.in_features * mod.out_features + mod.out_features
        assert e.detail["ranks"] == [4] * len(mod.modes)
    assert rep.model_params_before == total and rep.model_params_after == sum(p.numel() for p in model.parameters())
    assert rep.compression_ratio == pytest.approx(rep.dense_params / rep.new_params) and rep.compression_ratio > 5
    assert isinstance(model.head, nn.Linear) and isinstance(model.small, nn.Linear)
    assert model(torch.randint(0, 32, (2, 5))).shape == (2, 5, 32)
    # idempotent
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # already-replaced layers count as matched: no warning
        again = apply_trd(model, TRDPolicy(rank=4))
    assert again.entries == []


def test_policy_exclude_min_features_and_tr_svd_detail():
    model = Tiny()
    pol = TRDPolicy(rank=4, include=[r"blocks\.", r"small|head"], exclude=[r"\.mlp\."], init="tr_svd", min_features=16)
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    rep = apply_trd(model, pol)
    assert rep.names == ["blocks.0.qkv", "blocks.0.proj", "blocks.1.qkv", "blocks.1.proj", "head"]
    for e in rep.entries:  # the reported error is the replaced layer's own distance to the weight it replaced
        w = dense[e.name]
        err = ((model.get_submodule(e.name).reference_weight() - w).norm() / w.norm()).item()
        assert e.detail["init_error"] == pytest.approx(err, rel=1e-5) and 0 < err < 1, (e.name, err)


def test_regex_matching_nothing_warns_naming_it():
    with pytest.warns(UserWarning, match=r"include pattern 'attn\\\\.c_attn\$' matched no nn.Linear"):
        apply_trd(Tiny(), TRDPolicy(rank=2, include=[r"\.qkv$", r"attn\.c_attn$"]))


def test_config_bad_rank_and_regex():
    with pytest.raises(TitanConfigError, match=r"titan.trd.rank must be >= 1, got 0"):
        TitanConfig(trd={"rank": 0})
    with pytest.raises(TitanConfigError, match=r"titan.trd.include is not a valid regular expression"):
        TitanConfig(trd={"include": ["(unclosed"]})
    with pytest.raises(TitanConfigError, match=r"titan.trd.mode_size must be >= 2"):
        TitanConfig(trd={"mode_size": 1})
    with pytest.raises(TitanConfigError, match=r"titan.trd.path must be one of"):
        TitanConfig(trd={"path": "fast"})
    cfg = TitanConfig(trd={"rank": [2, 3, 2, 2, 2, 2, 2, 2], "mode_size": 16, "path": "factored"}).trd
    pol = TRDPolicy.from_config(cfg)
    assert (pol.mode_size, pol.path, pol.rank) == (16, "factored", [2, 3, 2, 2, 2, 2, 2, 2])


def test_per_core_rank_list_that_does_not_fit_names_layer():
    with pytest.raises(ValueError, match=r"titan.trd cannot replace 'blocks.0.qkv'.*rank has 3 entries"):
        apply_trd(Tiny(), TRDPolicy(rank=[2, 2, 2]))


def test_mode_size_and_path_change_the_layer():
    model = Tiny()
    apply_trd(model, TRDPolicy(rank=2, mode_size=16, path="dense"))
    fc = model.blocks[0].mlp.fc
    assert (fc.in_modes, fc.out_modes, fc.path) == ([8, 8], [16, 16], "dense")


# ---------------------------------------------------------------- pillar hook (no DeepSpeed engine needed)
def _Ctx(model, trd, optimizer=None, model_parameters=None, stage=0):
    return InitContext(titan=TitanConfig(trd=trd), ds_config={"zero_optimization": {"stage": stage}}, model=model,
                       optimizer=optimizer, model_parameters=model_parameters)


def test_apply_report_metrics_and_param_remap():
    model = Tiny()
    dense_ids = {id(p) for p in model.parameters()}
    given = list(model.parameters())
    ctx = _Ctx(model, {"rank": 4}, model_parameters=given)
    prepare(ctx)
    rep = ctx.reports["trd"]
    m = ctx.metric_sources[0]()
    assert m == {"trd_compression_ratio": rep.compression_ratio, "trd_model_compression_ratio": rep.model_compression_ratio}
    assert m["trd_compression_ratio"] > m["trd_model_compression_ratio"] > 1
    assert {id(p) for p in ctx.model_parameters} == {id(p) for p in model.parameters()} != dense_ids


def test_apply_remaps_optimizer_instance_keeping_groups():
    model = Tiny()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    ctx = _Ctx(model, {"rank": 4}, optimizer=opt, model_parameters=[{"params": decay}, {"params": no_decay}])
    prepare(ctx)
    fc = model.blocks[0].mlp.fc
    g0, g1 = ({id(p) for p in g["params"]} for g in opt.param_groups)
    assert {id(c) for c in fc.cores} <= g0 and id(fc.bias) in g1 and id(model.head.weight) in g0
    assert g0 | g1 == {id(p) for p in model.parameters()} and not g0 & g1
    assert [{id(p) for p in g["params"]} for g in ctx.model_parameters] == [g0, g1]
    loss = model(torch.randint(0, 32, (2, 3))).sum()
    loss.backward()
    opt.step()  # trains the TR cores


def test_apply_rejects_optimizer_that_has_stepped():
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randint(0, 32, (2, 3))).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="already has state for 16 of them"):
        prepare(_Ctx(model, {"rank": 4}, optimizer=opt))


def test_trd_off_means_model_unchanged():
    """The feature-off test: without the trd section nothing is replaced (and with it, the model changes)."""
    assert TitanConfig().trd is None
    model = Tiny()
    ctx = _Ctx(model, {"rank": 4})
    prepare(ctx)
    assert any(isinstance(m, TensorRingLinear) for m in model.modules())
    assert not any(isinstance(m, TensorRingLinear) for m in Tiny().modules())


def test_trd_config_defaults_round_trip():
    cfg = TRDConfig()
    assert (cfg.rank, cfg.init, cfg.min_features, cfg.mode_size, cfg.path) == (16, "random", 64, 4, "cheapest")


# ---------------------------------------------------------------- core_lr_scale
def test_core_lr_scale_keeps_the_function_and_tr_svd_error():
    torch.manual_seed(3)
    plain = TensorRingLinear(32, 48, 4, dtype=torch.float64)
    torch.manual_seed(3)
    scaled = TensorRingLinear(32, 48, 4, core_lr_scale=3.0, dtype=torch.float64)
    assert torch.allclose(scaled.reference_weight(), plain.reference_weight(), rtol=1e-12, atol=1e-15)
    assert torch.allclose(scaled.core_0, plain.core_0 / 3.0)  # the stored parameter is G / c
    x = torch.randn(5, 32, dtype=torch.float64)
    for path in ("factored", "dense"):
        scaled.path = path
        assert torch.allclose(scaled(x), scaled.reference_forward(x), rtol=1e-10, atol=1e-12)
    w = torch.randn(48, 32, dtype=torch.float64)
    torch.manual_seed(4)  # the rank padding of init_from_dense is random
    a = TensorRingLinear(32, 48, 4, init="tr_svd", dense_weight=w, dtype=torch.float64)
    torch.manual_seed(4)
    b = TensorRingLinear(32, 48, 4, init="tr_svd", dense_weight=w, core_lr_scale=0.5, dtype=torch.float64)
    assert b.init_error == pytest.approx(a.init_error, rel=1e-9)
    assert "core_lr_scale=3" in repr(scaled) and "core_lr_scale" not in repr(plain)


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_core_lr_scale_is_a_core_learning_rate_multiplier_under_adam(opt_cls):
    """c * P_k stepped by Adam at lr moves the ring exactly as plain cores stepped at lr * c (bias at lr)."""
    c, lr, steps = 4.0, 1e-3, 3
    torch.manual_seed(1)
    plain = TensorRingLinear(16, 24, 3, dtype=torch.float64)
    torch.manual_seed(1)
    scaled = TensorRingLinear(16, 24, 3, core_lr_scale=c, dtype=torch.float64)
    kw = dict(eps=1e-30, weight_decay=0.0)
    o_plain = opt_cls([{"params": plain.cores, "lr": lr * c}, {"params": [plain.bias], "lr": lr}], **kw)
    o_scaled = opt_cls(scaled.parameters(), lr=lr, **kw)
    w0 = plain.reference_weight().detach().clone()
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x, t = torch.randn(8, 16, generator=g, dtype=torch.float64), torch.randn(8, 24, generator=g, dtype=torch.float64)
        for m, o in ((plain, o_plain), (scaled, o_scaled)):
            o.zero_grad()
            ((m(x) - t) ** 2).mean().backward()
            o.step()
    # the ring moved from its own initial weight (measured: max |dW| = 0.051 after the 3 steps, |W0| max 0.38)
    moved = (plain.reference_weight() - w0).abs().max().item()
    assert moved > 0.01, moved
    assert torch.allclose(scaled.reference_weight(), plain.reference_weight(), rtol=1e-9, atol=1e-12)
    assert torch.allclose(scaled.bias, plain.bias, rtol=1e-12, atol=1e-15)


def test_core_lr_scale_config_and_policy():
    cfg = TitanConfig.from_ds_config({"titan": {"trd": {"rank": 4, "core_lr_scale": 3}}})
    assert cfg.trd.core_lr_scale == 3.0
    m = nn.Sequential()
    m.add_module("block", nn.Sequential())
    m.block.add_module("fc", nn.Linear(64, 64))
    apply_trd(m, TRDPolicy.from_config(cfg.trd))
    assert isinstance(m.block.fc, TensorRingLinear) and m.block.fc.core_lr_scale == 3.0
    for bad in (0, -1, float("inf")):
        with pytest.raises(TitanConfigError, match="core_lr_scale"):
            TitanConfig.from_ds_config({"titan": {"trd": {"core_lr_scale": bad}}})
    with pytest.raises(ValueError, match="core_lr_scale"):
        TensorRingLinear(8, 8, 2, core_lr_scale=0.0)
