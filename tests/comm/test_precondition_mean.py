"""``precondition="rms_mean"`` (``titan_ds/comm/precondition.py``): each rank's estimate of the RMS of the ranks'
*mean* gradient. A reference loop as oracle on 1-3 simulated ranks (with one rank it is ``rms``); the two moments
through checkpoints (a ``rms`` checkpoint is refused) and skipped steps; the config's refusals; Adam/AdamW turned
into SGD with momentum and dampening ``beta1``."""
from __future__ import annotations


import pytest
import torch

from tests.comm.test_precondition import (SIZES, _ctx, _sgd_for_precondition, layout_of, prescaled_pair, refuse_each_other,
                                          rollback_on_two_ranks, round_trip)
from tests.helpers.collectives import run_ranks
from titan_ds.comm import GradientReducer
from titan_ds.comm.base import LocalCollective
from titan_ds.comm.precondition import RMSOptions, rms_mean_normalize_, rms_normalize_
from titan_ds.config import TitanConfig, TitanConfigError

MEAN = {"method": "topk", "ratio": 50, "precondition": "rms_mean"}


def reference(grads, *, ratio: float, beta1: float, beta2: float, eps: float):
    """Per rank w and step t (from 1), W ranks: m <- b1 m + (1 - b1) g; mh = m / (1 - b1^t);
    d <- b2 d + (1 - b2) ((1 - 1/W) mh^2 + g^2 / W); u = g / (sqrt(d / (1 - b2^t)) + eps); e <- e + u; send the top-k
    of |e|; e <- 0 where sent; the sum over ranks of what was sent."""
    W, T = len(grads), len(grads[0])
    n = grads[0][0].numel()
    m = [torch.zeros(n) for _ in range(W)]
    d = [torch.zeros(n) for _ in range(W)]
    e = [torch.zeros(n) for _ in range(W)]
    k = max(1, int(n / (2.0 * ratio)))
    out = []
    for t in range(1, T + 1):
        total = torch.zeros(n)
        for w in range(W):
            g = grads[w][t - 1]
            m[w] = beta1 * m[w] + (1 - beta1) * g
            mh = m[w] / (1 - beta1 ** t)
            d[w] = beta2 * d[w] + (1 - beta2) * ((1 - 1 / W) * mh * mh + g * g / W)
            e[w] = e[w] + g / ((d[w] / (1 - beta2 ** t)).sqrt() + eps)
            idx = torch.topk(e[w].abs(), k).indices
            total[idx] += e[w][idx]
            e[w][idx] = 0.0
        out.append((total, [x.clone() for x in m], [x.clone() for x in d], [x.clone() for x in e]))
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_matches_the_reference_loop(world):
    T, ratio, opts = 8, 25.0, RMSOptions(beta2=0.99, eps=1e-3, kind="rms_mean", beta1=0.8)  # eps: no ties at t = 1
    n, layout = sum(SIZES.values()), layout_of(SIZES)
    gen = torch.Generator().manual_seed(5)
    scale = torch.cat([torch.full((s,), f) for s, f in zip(SIZES.values(), (0.01, 1.0, 30.0))])
    mean = torch.randn(n, generator=gen) * scale  # a shared expected gradient plus each rank's noise
    grads = [[mean + torch.randn(n, generator=gen) * scale for _ in range(T)] for _ in range(world)]
    ref = reference(grads, ratio=ratio, beta1=opts.beta1, beta2=opts.beta2, eps=opts.eps)

    def fn(w, comm):
        red = GradientReducer("topk", ratio, precondition=opts)
        steps = []
        for t in range(T):
            s = red.reduce(grads[w][t], layout, comm, t)
            red.end_step()
            cat = lambda store: torch.cat([store.residuals[k] for k in SIZES])  # noqa: E731
            steps.append((s, cat(red.first), cat(red.second), cat(red.residuals)))
        return steps

    outs = run_ranks(world, fn) if world > 1 else [fn(0, LocalCollective())]
    for t in range(T):
        total, m, d, e = ref[t]
        for w in range(world):
            s, fm, dm, res = outs[w][t]
            torch.testing.assert_close(fm, m[w], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(dm, d[w], rtol=1e-5, atol=0)
            torch.testing.assert_close(res, e[w], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s, total, rtol=1e-5, atol=1e-6)


def test_one_rank_is_rms_and_more_ranks_step_larger_where_noise_dominates():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(4000, generator=gen)
    a, v = g.clone(), torch.zeros_like(g)
    rms_normalize_(a, v, 1, RMSOptions())
    b, m, d = g.clone(), torch.zeros_like(g), torch.zeros_like(g)
    rms_mean_normalize_(b, m, d, 1, RMSOptions(kind="rms_mean"), world=1)
    torch.testing.assert_close(b, a, rtol=1e-6, atol=0)
    torch.testing.assert_close(d, v, rtol=1e-6, atol=0)
    # pure noise (zero mean) over many steps: rms's u has RMS ~1, rms_mean's (the mean-gradient estimate) larger,
    # about 1 / sqrt((1 - b1) / (1 + b1) + 1 / W) (its first moment's own noise bounds it)
    sizes = {}
    for world in (1, 32):
        m, d = torch.zeros(4000), torch.zeros(4000)
        for t in range(1, 400):
            u = torch.randn(4000, generator=gen)
            rms_mean_normalize_(u, m, d, t, RMSOptions(kind="rms_mean"), world=world)
        sizes[world] = float(u.pow(2).mean().sqrt())
    assert 0.9 < sizes[1] < 1.1
    expect = (0.1 / 1.9 + 1 / 32) ** -0.5
    assert 0.8 * expect < sizes[32] < 1.2 * expect, sizes
    with pytest.raises(ValueError, match="starts at 1"):
        rms_mean_normalize_(g.clone(), m, d, 0, RMSOptions(kind="rms_mean"), world=2)
    with pytest.raises(ValueError, match="world must be"):
        rms_mean_normalize_(g.clone(), m, d, 1, RMSOptions(kind="rms_mean"), world=0)
    with pytest.raises(ValueError, match="beta1 must be in"):
        RMSOptions(kind="rms_mean", beta1=1.0)
    with pytest.raises(ValueError, match="precondition must be one of"):
        RMSOptions(kind="adam")


def test_prescale_is_undone_for_the_moments():
    a, b, sa, sb = prescaled_pair(RMSOptions(kind="rms_mean"), 3000)
    torch.testing.assert_close(a.first.residuals["p"], b.first.residuals["p"], rtol=1e-6, atol=0)
    torch.testing.assert_close(a.second.residuals["p"], b.second.residuals["p"], rtol=1e-6, atol=0)
    torch.testing.assert_close(sb, sa * 0.25, rtol=1e-6, atol=0)


def test_moments_round_trip_rollback_and_refuse_an_rms_checkpoint():
    opts = RMSOptions(kind="rms_mean")
    state = round_trip(lambda: GradientReducer("topk", 20.0, precondition=opts), 2000,
                       {"first_moment", "mean_second_moment"})
    refuse_each_other(lambda: GradientReducer("topk", 20.0, precondition=opts), state,
                      lambda: GradientReducer("topk", 20.0, precondition=RMSOptions()))
    # a non-finite step on one rank: both moments go back to the step's start on every rank
    rollback_on_two_ranks(lambda: GradientReducer("topk", 8.0, precondition=opts), 2000,
                          lambda red: [red.first.residuals["p"], red.second.residuals["p"]])


def test_config_refusals():
    ok = TitanConfig(compression={**MEAN, "precondition_beta1": 0.8})
    assert ok.compression.precondition == "rms_mean" and ok.compression.precondition_beta1 == 0.8
    for bad, msg in [({"method": "topk", "precondition": "rms", "precondition_beta1": 0.8}, "only 'rms_mean'"),
                     ({**MEAN, "momentum": 0.9}, "remove momentum"),
                     ({**MEAN, "warmup_steps": 5}, "ratio_warmup_steps instead"),
                     ({**MEAN, "sync_every": 10}, "remove precondition")]:
        with pytest.raises(TitanConfigError, match=msg):
            TitanConfig(compression=bad)


def test_adamw_becomes_sgd_with_momentum_beta1():
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                                                    "weight_decay": 0.1}}}
    opts = _sgd_for_precondition(_ctx(ds, compression=MEAN))
    assert ds["optimizer"] == {"type": "SGD", "params": {"lr": 3e-4, "weight_decay": 0.1, "momentum": 0.8,
                                                         "dampening": 0.8}}
    assert opts == RMSOptions(beta2=0.95, eps=1e-6, kind="rms_mean", beta1=0.8)
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}
    opts = _sgd_for_precondition(_ctx(ds, compression={**MEAN, "precondition_beta1": 0.7}))
    assert ds["optimizer"]["params"]["momentum"] == 0.7 and opts.beta1 == 0.7  # the section's own value wins
    model = torch.nn.Linear(4, 3)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.85, 0.98))
    ctx = _ctx({}, optimizer=adamw, compression=MEAN)
    opts = _sgd_for_precondition(ctx)
    sgd = ctx.optimizer
    assert isinstance(sgd, torch.optim.SGD) and opts.beta1 == 0.85 and opts.beta2 == 0.98
    assert sgd.param_groups[0]["momentum"] == 0.85 and sgd.param_groups[0]["dampening"] == 0.85
    # momentum with dampening b1 is an EMA of the reduced updates: buf_1 = u_1, then buf <- b1 buf + (1 - b1) u
    # (u: the reduced update plus the group's decay wd p, as SGD adds it)
    wd = sgd.param_groups[0]["weight_decay"]
    w0 = model.weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    sgd.step()
    w1 = model.weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    sgd.step()
    buf = 0.85 * (1.0 + wd * w0) + 0.15 * (3.0 + wd * w1)
    torch.testing.assert_close(sgd.state[model.weight]["momentum_buffer"], buf, rtol=1e-6, atol=1e-7)


def test_refusals_name_the_fix():
    cases = [({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, None, "replace the SGD section by AdamW"),
             ({}, torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), "initialize\\(\\) was given an SGD"),
             ({"gradient_clipping": 1.0}, None, "set gradient_clipping to 0")]
    for ds, opt, msg in cases:
        with pytest.raises(TitanConfigError, match=msg):
            _sgd_for_precondition(_ctx(ds, optimizer=opt, compression=MEAN))
