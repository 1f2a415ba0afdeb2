"""ASDT on bf16 weights with no fp32 master (titan.optimizer.weight_dtype="bf16"): stochastic rounding, the flat
path against the reference loop with the same draws, resume of the draws, and the config's checks."""
import copy

import pytest
import torch

from titan_ds.config import TitanConfig, TitanConfigError
from titan_ds.optim.asdt import ASDT, reference_step
from titan_ds.optim.asdt_math import stochastic_round

from tests.optim.test_asdt import SHAPES, _grads, _row_units


def _neighbours(x):
    """The bf16 values just below and just above each fp32 ``x`` (equal when bf16 holds ``x``)."""
    down = (x.view(torch.int32) & -65536).view(torch.float32)  # towards zero
    up = ((x.view(torch.int32) & -65536) + 65536).view(torch.float32)
    exact = down == x
    return torch.where(exact, x, down), torch.where(exact, x, up)


def test_stochastic_round_is_unbiased_and_lands_on_a_neighbour():
    x = torch.randn(2000) * 3
    g = torch.Generator().manual_seed(0)
    lo, hi = _neighbours(x)
    draws = torch.stack([stochastic_round(x, g).float() for _ in range(400)])
    assert bool(((draws == lo) | (draws == hi)).all())
    # unbiased: the mean of 400 draws is within a few standard errors of x (a bf16 step is ~x/128)
    step = (hi - lo).abs().clamp_min(1e-30)
    err = ((draws.mean(0) - x).abs() / step)
    assert float(err.mean()) < 0.03 and float(err.max()) < 0.25
    nearest = x.to(torch.bfloat16).float()
    assert float((draws.mean(0) - x).abs().mean()) < float((nearest - x).abs().mean()) / 4


def test_stochastic_round_keeps_exact_values_and_specials():
    g = torch.Generator().manual_seed(1)
    x = torch.tensor([0.0, -0.0, 1.0, -2.5, 2.0 ** 127, float("inf"), float("-inf"), 0.0078125])
    assert torch.equal(stochastic_round(x, g).float(), x)
    assert torch.isnan(stochastic_round(torch.tensor([float("nan")]), g)).all()
    with pytest.raises(TypeError, match="fp32"):
        stochastic_round(x.bfloat16(), g)


def test_small_updates_survive_only_with_stochastic_rounding():
    """An update of a tenth of a bf16 step: rounding to nearest never moves the weight; stochastic rounding moves it
    on average by the update."""
    ends = {}
    for rounding in ("stochastic", "nearest"):
        w = torch.ones(4096, dtype=torch.bfloat16, requires_grad=True)
        opt = ASDT([("w", w)], lr=1e-3 * 0.78125, density=1.0, update="sign", rounding=rounding)  # 1/10 of 2^-7
        for _ in range(50):
            w.grad = torch.ones(4096, dtype=torch.bfloat16)
            opt.step()
        ends[rounding] = float(w.detach().float().mean())
    assert ends["nearest"] == 1.0
    assert abs((1.0 - ends["stochastic"]) - 50 * 1e-3 * 0.78125) < 0.004


@pytest.mark.parametrize("update,kw", [("adaptive", dict(second_moment="coordinate", second_dtype="4bit",
                                                         state_dtype="4bit")),
                                       ("adaptive", dict(state_dtype="bf16")),
                                       ("sign", dict(state_dtype="bf16", density=0.3))])
def test_bf16_weights_flat_path_matches_reference_bit_exactly(update, kw):
    """The same draws in the same order: the flat path (runs of units) and the reference (unit by unit)."""
    torch.manual_seed(0)
    a = [torch.randn(s).bfloat16().requires_grad_() for s in SHAPES]
    b = [p.detach().clone() for p in a]
    hp = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, density=kw.pop("density", 1.0), importance="momentum")
    opt = ASDT([(f"p{i}", p) for i, p in enumerate(a)], update=update, granularity="row", rounding_seed=7,
               **hp, **kw)
    gen = torch.Generator().manual_seed(7)
    states = {}
    ref_kw = {}
    if kw.get("second_moment") == "coordinate":
        ref_kw = dict(second_moment="coordinate", second_dtype=torch.float32)
    for t in range(5):
        for p, g in zip(a, _grads(a, t)):
            p.grad = g.bfloat16()
        opt.step()
        units = [(p.data.view(-1)[s:s + n], g.bfloat16().float().view(-1)[s:s + n], states.setdefault((i, s), {}))
                 for i, (p, g) in enumerate(zip(b, _grads(b, t))) for s, n in _row_units(p)]
        if kw.get("state_dtype") == "4bit":  # the reference keeps fp32 state: compare the weights of step 1 only
            if t == 0:
                reference_step(units, state_dtype=torch.float32, update=update, generator=gen, **ref_kw, **hp)
                for pa, pb in zip(a, b):
                    assert torch.equal(pa.data, pb)
            continue
        reference_step(units, state_dtype=torch.bfloat16, update=update, generator=gen, **ref_kw, **hp)
        for pa, pb in zip(a, b):
            assert pa.dtype == torch.bfloat16 and torch.equal(pa.data, pb), f"step {t}"


def test_bf16_weights_resume_is_bit_exact():
    """The rounding's generator is saved with the state: a resumed run draws what the unbroken one drew."""
    hp = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, density=1.0, update="adaptive",
              second_moment="coordinate", state_dtype="8bit", second_dtype="4bit")
    torch.manual_seed(0)
    ps = [torch.randn(s).bfloat16().requires_grad_() for s in SHAPES]
    q = [p.detach().clone().requires_grad_() for p in ps]
    opt = ASDT([(f"p{i}", p) for i, p in enumerate(ps)], **hp)
    for t in range(6):
        for p, g in zip(ps, _grads(ps, t)):
            p.grad = g.bfloat16()
        opt.step()
        if t == 2:
            saved, qs = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in ps]
    assert "cpu" in saved["asdt"]["rounding_generators"]
    opt2 = ASDT([(f"p{i}", p) for i, p in enumerate(q)], **hp)
    for p, v in zip(q, qs):
        p.data.copy_(v)
    opt2.load_state_dict(saved)
    for t in range(3, 6):
        for p, g in zip(q, _grads(q, t)):
            p.grad = g.bfloat16()
        opt2.step()
    for x, y in zip(ps, q):
        assert torch.equal(x.data, y.data)
    # without the saved draws the steps differ (so the comparison above can fail)
    r = [v.clone().requires_grad_() for v in qs]
    opt3 = ASDT([(f"p{i}", p) for i, p in enumerate(r)], **hp)
    st = copy.deepcopy(saved)
    st["asdt"]["rounding_generators"] = {}
    opt3.load_state_dict(st)
    for t in range(3, 6):
        for p, g in zip(r, _grads(r, t)):
            p.grad = g.bfloat16()
        opt3.step()
    assert any(not torch.equal(x.data, y.data) for x, y in zip(ps, r))


def test_fp32_weights_ignore_the_rounding():
    torch.manual_seed(0)
    a = [torch.randn(s, requires_grad=True) for s in SHAPES]
    b = [p.detach().clone().requires_grad_() for p in a]
    opts = [ASDT([(f"p{i}", p) for i, p in enumerate(ps)], lr=1e-2, density=1.0, update="adaptive", rounding=r)
            for ps, r in ((a, "stochastic"), (b, "nearest"))]
    for t in range(3):
        for ps, opt in zip((a, b), opts):
            for p, g in zip(ps, _grads(ps, t)):
                p.grad = g
            opt.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert opts[0]._generators == {}


def test_weight_dtype_config_is_checked():
    with pytest.raises(ValueError, match="rounding"):
        ASDT([torch.zeros(3, requires_grad=True)], rounding="up")
    with pytest.raises(Exception, match="weight_dtype"):
        TitanConfig.from_ds_config({"titan": {"optimizer": {"weight_dtype": "fp16"}}})


def _initialize(ds, model):
    import titan_ds
    return titan_ds.initialize(model=model, config=ds)[0]


@pytest.mark.parametrize("extra,match", [({"zero_optimization": {"stage": 2}}, "ZeRO stage 0"),
                                         ({"bf16": {"enabled": True}}, "bf16.enabled")])
def test_weight_dtype_bf16_refuses_what_keeps_an_fp32_master(extra, match, dist_env):
    model = torch.nn.Linear(4, 4)
    ds = {"train_micro_batch_size_per_gpu": 1, "titan": {"optimizer": {"weight_dtype": "bf16"}}, **extra}
    with pytest.raises(TitanConfigError, match=match):
        _initialize(ds, model)
    assert model.weight.dtype == torch.float32  # nothing was changed


def test_weight_dtype_bf16_casts_the_model_and_trains(dist_env):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
          "titan": {"optimizer": {"weight_dtype": "bf16", "update": "adaptive", "density": 1.0, "lr": 1e-2,
                                  "second_moment": "coordinate", "state_dtype": "8bit", "second_dtype": "4bit"}}}
    engine = _initialize(ds, model)
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    assert type(engine.optimizer).__name__ == "ASDT"  # no DeepSpeed wrapper holding fp32 masters
    x = torch.randn(64, 8).bfloat16()
    y = x.float().sum(1, keepdim=True).bfloat16()
    losses = []
    for i in range(60):
        loss = torch.nn.functional.mse_loss(engine(x[i % 16 * 4:i % 16 * 4 + 4]).float(),
                                            y[i % 16 * 4:i % 16 * 4 + 4].float())
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
