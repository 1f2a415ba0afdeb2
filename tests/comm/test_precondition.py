"""``precondition="rms"`` (``titan_ds/comm/precondition.py`` + ``GradientReducer`` + the optimizer hand-over in
``hooks.py``): a reference loop as oracle on 1-3 simulated ranks; ZeRO's pre-division undone; the second moment
through checkpoints and skipped steps; the config's refusals; Adam/AdamW turned into SGD (ds_config section and an
optimizer passed to initialize, whose scheduler keeps driving the lr)."""
from __future__ import annotations

import io
import pytest
import torch

from tests.helpers.collectives import run_ranks
from titan_ds.comm import GradientReducer, Segment
from titan_ds.comm.base import LocalCollective
from titan_ds.comm.precondition import RMSOptions, rms_normalize_
from titan_ds.config import TitanConfig, TitanConfigError
from titan_ds.engine import InitContext, prepare

SIZES = {"a": 700, "b": 300, "c": 1000}


def layout_of(sizes: dict[str, int]) -> list[Segment]:
    segs, off = [], 0
    for k, n in sizes.items():
        segs.append(Segment(k, 0, off, n, n, (n,)))
        off += n
    return segs


def reference(grads, *, ratio: float, beta2: float, eps: float):
    """Per rank w and step t (from 1): v <- b2 v + (1 - b2) g^2; u = g / (sqrt(v / (1 - b2^t)) + eps); e <- e + u;
    send the top-k of |e| (k = n / (2 ratio)); e <- 0 where sent; the sum over ranks of what was sent."""
    W, T = len(grads), len(grads[0])
    n = grads[0][0].numel()
    v = [torch.zeros(n) for _ in range(W)]
    e = [torch.zeros(n) for _ in range(W)]
    k = max(1, int(n / (2.0 * ratio)))
    out = []
    for t in range(T):
        total = torch.zeros(n)
        for w in range(W):
            g = grads[w][t]
            v[w] = v[w] * beta2 + (1 - beta2) * g * g
            e[w] = e[w] + g / ((v[w] / (1 - beta2 ** (t + 1))).sqrt() + eps)
            idx = torch.topk(e[w].abs(), k).indices
            total[idx] += e[w][idx]
            e[w][idx] = 0.0
        out.append((total, [x.clone() for x in v], [x.clone() for x in e]))
    return out


def round_trip(make, n: int, stores: set, xs: "list[torch.Tensor] | None" = None) -> dict:
    """Three steps of ``make()``'s reducer on ``xs`` (default: random), its state through ``torch.save``/``load``
    (holding exactly ``stores`` besides the residuals) into a fresh one, then two more steps on both: bit for bit
    the same. Returns the state."""
    layout = layout_of({"p": n})
    xs = xs if xs is not None else [torch.randn(n) for _ in range(6)]
    a = make()
    for t in range(3):
        a.reduce(xs[t], layout, LocalCollective(), t)
        a.end_step()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=False)
    assert set(state["stores"]) == stores
    b = make()
    b.load_state_dict(state)
    for t in (3, 4):
        assert torch.equal(a.reduce(xs[t], layout, LocalCollective(), t), b.reduce(xs[t], layout, LocalCollective(), t))
        a.end_step()
        b.end_step()
    return state


def prescaled_pair(opts: RMSOptions, n: int):
    """The same gradient reduced by two fresh reducers, as is and pre-divided by 4 (``prescale=0.25``, as ZeRO
    hands it over): ``(a, b, sum_a, sum_b)``; the output must be the first's times 0.25."""
    layout = layout_of({"p": n})
    g = torch.randn(n)
    a, b = GradientReducer("topk", 10.0, precondition=opts), GradientReducer("topk", 10.0, precondition=opts)
    sa = a.reduce(g, layout, LocalCollective(), 0)
    sb = b.reduce(g * 0.25, layout, LocalCollective(), 0, prescale=0.25)
    return a, b, sa, sb


def refuse_each_other(make, state: dict, other) -> None:
    """``state`` (of ``make()``'s kind) is refused by ``other()``, and ``other()``'s by ``make()``."""
    with pytest.raises(RuntimeError, match="compression state"):
        other().load_state_dict(state)
    red = other()
    red.reduce(torch.randn(state_numel(state)), layout_of({"p": state_numel(state)}), LocalCollective(), 0)
    red.end_step()
    with pytest.raises(RuntimeError, match="compression state"):
        make().load_state_dict(red.state_dict())


def state_numel(state: dict) -> int:
    return int(state["residuals"]["p"].numel())


def rollback_on_two_ranks(make, n: int, snapshot) -> None:
    """A non-finite gradient on rank 1 at the second step: on both ranks the sum is non-finite and every tensor
    ``snapshot(reducer)`` lists is back at the step's start."""
    layout = layout_of({"p": n})

    def fn(r, comm):
        red = make()
        gen = torch.Generator().manual_seed(r)
        red.reduce(torch.randn(n, generator=gen), layout, comm, 0)
        red.end_step()
        before = [x.clone() for x in snapshot(red)]
        g = torch.randn(n, generator=gen)
        if r == 1:
            g[5] = float("nan")
        s = red.reduce(g, layout, comm, 1)
        red.end_step()
        return before, snapshot(red), bool(torch.isfinite(s).all())

    for before, after, finite in run_ranks(2, fn):
        assert not finite and all(torch.equal(x, y) for x, y in zip(before, after))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_matches_the_reference_loop(world):
    T, ratio, opts = 8, 25.0, RMSOptions(beta2=0.99, eps=1e-6)
    n, layout = sum(SIZES.values()), layout_of(SIZES)
    gen = torch.Generator().manual_seed(11)
    scale = torch.cat([torch.full((s,), f) for s, f in zip(SIZES.values(), (0.01, 1.0, 30.0))])
    grads = [[torch.randn(n, generator=gen) * scale for _ in range(T)] for _ in range(world)]
    ref = reference(grads, ratio=ratio, beta2=opts.beta2, eps=opts.eps)

    def fn(w, comm):
        red = GradientReducer("topk", ratio, precondition=opts)
        steps = []
        for t in range(T):
            s = red.reduce(grads[w][t], layout, comm, t)
            red.end_step()
            sec = torch.cat([red.second.residuals[k] for k in SIZES])
            res = torch.cat([red.residuals.residuals[k] for k in SIZES])
            steps.append((s, sec, res))
        return steps

    outs = run_ranks(world, fn) if world > 1 else [fn(0, LocalCollective())]
    for t in range(T):
        total, v, e = ref[t]
        for w in range(world):
            s, sec, res = outs[w][t]
            torch.testing.assert_close(sec, v[w], rtol=1e-6, atol=0)
            torch.testing.assert_close(res, e[w], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s, total, rtol=1e-5, atol=1e-6)
    # scale-free: the three tensors' gradients differ by 3000x, their normalized sums do not
    s = outs[0][-1][0]
    mags = [float(s[o.flat_offset:o.flat_offset + o.numel].abs().max()) for o in layout]
    assert max(mags) / min(mags) < 10, mags


def test_prescale_is_undone_for_the_moment_and_kept_on_the_output(monkeypatch):
    """ZeRO 1-3 hand over g / W: the second moment is the rank's own g^2, the output u / W (what the seams expect)."""
    n = 3000
    layout = layout_of({"p": n})
    g = torch.randn(n)
    a, b = GradientReducer("topk", 10.0, precondition=RMSOptions()), GradientReducer("topk", 10.0,
                                                                                       precondition=RMSOptions())
    sa = a.reduce(g, layout, LocalCollective(), 0)
    sb = b.reduce(g * 0.25, layout, LocalCollective(), 0, prescale=0.25)
    assert torch.equal(a.second.residuals["p"], b.second.residuals["p"])
    assert torch.equal(sb, sa * 0.25)
    # elementwise: chunks of 7 elements give the same bits
    import titan_ds.comm.precondition as pc
    monkeypatch.setattr(pc, "_CHUNK", 7)
    c = GradientReducer("topk", 10.0, precondition=RMSOptions())
    assert torch.equal(c.reduce(g * 0.25, layout, LocalCollective(), 0, prescale=0.25), sb)


def test_first_step_is_sign_like_and_step_count_must_start_at_one():
    x = torch.tensor([3.0, -0.002, 0.0])
    v = torch.zeros(3)
    rms_normalize_(x, v, 1, RMSOptions(eps=1e-8))
    # bias-corrected first step: g / (|g| + eps)
    torch.testing.assert_close(x, torch.tensor([1.0, -1.0, 0.0]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="starts at 1"):
        rms_normalize_(x, v, 0, RMSOptions())
    with pytest.raises(ValueError, match="beta2 must be in"):
        RMSOptions(beta2=1.0)


def test_second_moment_round_trip_and_nonfinite_rollback():
    state = round_trip(lambda: GradientReducer("topk", 20.0, precondition=RMSOptions()), 2000, {"second_moment"})
    with pytest.raises(RuntimeError, match="compression state"):
        GradientReducer("topk", 20.0).load_state_dict(state)
    # a NaN on one rank: every rank skips, and the second moment (with the residuals) goes back to the step start
    rollback_on_two_ranks(lambda: GradientReducer("topk", 8.0, precondition=RMSOptions()), 2000,
                          lambda red: [red.second.residuals["p"]])


def test_config_refusals():
    from titan_ds.comm import REGISTRY
    for name in set(REGISTRY) - {"none"}:  # before any codec: every compressing method takes it
        ok = TitanConfig(compression={"method": name, "precondition": "rms", "precondition_eps": 1e-6})
        assert ok.compression.precondition == "rms" and ok.compression.precondition_eps == 1e-6
    for bad, msg in [({"method": "topk", "precondition": "rms", "momentum": 0.9}, "remove momentum"),
                     ({"method": "topk", "precondition": "rms", "warmup_steps": 5}, "ratio_warmup_steps instead"),
                     ({"method": "topk", "precondition_beta2": 0.99}, "precondition is 'none'"),
                     ({"method": "none", "precondition": "rms"}, "precondition, which method='none' does not use"),
                     ({"method": "topk", "precondition": "adam"}, "precondition")]:
        with pytest.raises(TitanConfigError, match=msg):
            TitanConfig(compression=bad)
    with pytest.raises(ValueError, match="neither DGC's momentum"):
        GradientReducer("topk", 10.0, warmup_steps=2, precondition=RMSOptions())


# ------------------------------------------------------------------ the optimizer hand-over (no DeepSpeed engine)
def _ctx(ds: dict, optimizer=None, compression=None):
    titan = TitanConfig(compression=compression or {"method": "topk", "ratio": 50, "precondition": "rms"})
    return InitContext(titan=titan, ds_config=ds, model=None, optimizer=optimizer, world_size=2)


def _sgd_for_precondition(ctx) -> RMSOptions:
    """What initialize does before DeepSpeed (every rule validated, the compression pillar applied); the options
    the reducer got."""
    return prepare(ctx)[-1].reducer.precondition


def test_ds_config_adamw_becomes_sgd_and_lends_its_beta2():
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                                                    "weight_decay": 0.1}}, "gradient_clipping": 0.0}
    opts = _sgd_for_precondition(_ctx(ds))
    assert ds["optimizer"] == {"type": "SGD", "params": {"lr": 3e-4, "weight_decay": 0.1}}
    assert opts == RMSOptions(beta2=0.95, eps=1e-6)
    assert "zero_allow_untested_optimizer" not in ds  # ZeRO-0: DeepSpeed takes any optimizer
    ds2 = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
    dense_gather = {"method": "topk", "ratio": 50, "precondition": "rms", "allow_dense_parameter_gather": True}
    _sgd_for_precondition(_ctx(ds2, compression=dense_gather))
    assert ds2["zero_allow_untested_optimizer"] is True  # SGD is not in DeepSpeed's ZeRO list
    with pytest.raises(TitanConfigError, match="zero_allow_untested_optimizer=False"):
        _sgd_for_precondition(_ctx({"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": False},
                                   compression=dense_gather))
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}}}
    opts = _sgd_for_precondition(_ctx(ds, compression={"method": "topk", "precondition": "rms",
                                                         "precondition_beta2": 0.99}))
    assert opts.beta2 == 0.99  # the section's own value wins


def test_passed_adamw_becomes_sgd_and_its_scheduler_still_drives_the_lr():
    model = torch.nn.Linear(4, 3)
    groups = [{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: min(1.0, (s + 1) / 4))  # linear warm-up
    ctx = _ctx({}, optimizer=adamw)
    opts = _sgd_for_precondition(ctx)
    sgd = ctx.optimizer
    assert isinstance(sgd, torch.optim.SGD) and opts.beta2 == 0.98
    assert [g["weight_decay"] for g in sgd.param_groups] == [0.1, 0.0]
    seen = []
    for _ in range(5):
        seen.append(sgd.param_groups[0]["lr"])
        sched.step()
    assert seen == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    # SGD's decay on a normalized update u is AdamW's decoupled decay: p <- p - lr (u + wd p)
    w0 = model.weight.detach().clone()
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.zeros_like(model.bias)
    lr = sgd.param_groups[0]["lr"]
    sgd.step()
    torch.testing.assert_close(model.weight.detach(), w0 - lr * (1.0 + 0.1 * w0))


def test_refusals_name_the_fix():
    cases = [({"fp16": {"enabled": True}}, None, "fp16.enabled"),
             ({"gradient_clipping": 1.0}, None, "set gradient_clipping to 0"),
             ({"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}}, None, "not 'Lion'"),
             ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}, None, "set momentum to 0"),
             ({}, torch.optim.RMSprop([torch.nn.Parameter(torch.zeros(2))]), "was given RMSprop")]
    for ds, opt, msg in cases:
        with pytest.raises(TitanConfigError, match=msg):
            _sgd_for_precondition(_ctx(ds, optimizer=opt))
    ctx = InitContext(titan=TitanConfig(compression={"method": "topk", "precondition": "rms"},
                                        optimizer={"name": "asdt"}), ds_config={}, model=None, world_size=2)
    with pytest.raises(TitanConfigError, match="cannot run with titan.optimizer"):
        _sgd_for_precondition(ctx)


@pytest.mark.parametrize("stage,bound", [(1, "2x"), (2, "2x"), (3, "1x")])
def test_compression_under_zero_1_to_3_is_refused_unless_allowed(stage, bound):
    """DeepSpeed's dense parameter all-gather caps what a compressed gradient exchange saves (rules.received_bound):
    initialize refuses before anything is changed, naming the bound and both fixes; the opt-in runs it."""
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
    with pytest.raises(TitanConfigError, match=f"at most {bound} fewer") as e:
        prepare(_ctx(dict(ds)))
    assert "zero_optimization.stage to 0" in str(e.value) and "allow_dense_parameter_gather" in str(e.value)
    assert ds["optimizer"]["type"] == "AdamW"  # validated before anything was touched
    prepare(_ctx(dict(ds), compression={"method": "topk", "ratio": 50, "precondition": "rms",
                                        "allow_dense_parameter_gather": True}))
    prepare(_ctx({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))  # ZeRO-0: no refusal


def test_an_optimizer_factory_is_accepted_and_becomes_sgd():
    """``initialize(optimizer=lambda params: AdamW(params, ...))`` is valid DeepSpeed: under precondition it is
    built (on the parameters DeepSpeed would give it), lends its betas and eps, and becomes SGD; a factory of an
    optimizer titan cannot turn into SGD is refused by name."""
    model = torch.nn.Linear(4, 3)
    ctx = InitContext(titan=TitanConfig(compression={"method": "topk", "ratio": 50, "precondition": "rms"}),
                      ds_config={}, model=model, world_size=2,
                      optimizer=lambda params: torch.optim.AdamW(params, lr=2e-3, betas=(0.8, 0.9), eps=1e-7))
    opts = prepare(ctx)[-1].reducer.precondition
    assert isinstance(ctx.optimizer, torch.optim.SGD) and ctx.optimizer.param_groups[0]["lr"] == 2e-3
    assert [p for g in ctx.optimizer.param_groups for p in g["params"]] == list(model.parameters())
    assert opts == RMSOptions(beta2=0.9, eps=1e-7, beta1=0.8)
    bad = InitContext(titan=TitanConfig(compression={"method": "topk", "ratio": 50, "precondition": "rms"}),
                      ds_config={}, model=model, world_size=2, optimizer=lambda params: torch.optim.Adagrad(params))
    with pytest.raises(TitanConfigError, match="was given Adagrad"):
        prepare(bad)
