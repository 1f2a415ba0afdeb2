"""``residuals_follow_lr`` (titan_ds/comm/compressor.py, ``GradientReducer.follow_lr``): with a precondition the
reduced sum is an update direction that SGD scales by the lr, and error feedback is kept in the update's units.

The oracle is EF-SGD written in parameter units (Karimireddy et al. 2019): ``p = lr_t u_t + e_t``, apply
``C(p)``, ``e_{t+1} = p - C(p)``; the reducer keeps ``e / lr`` and rescales it when the lr changes."""
import pytest
import torch

from titan_ds.comm import GradientReducer, Segment
from titan_ds.comm.base import LocalCollective, topk_budget
from titan_ds.comm.precondition import RMSOptions, rms_normalize_
from titan_ds.comm.topk import topk_indices
from titan_ds.comm.wire import SimCollective
from titan_ds.config import CompressionConfig

N, RATIO = 400, 10.0
LRS = [0.01, 0.02, 0.04, 0.04, 0.01, 0.005]  # a warm-up, a plateau, a decay


def _layout(n=N):
    return [Segment("w", 0, 0, n, n, (n,))]


def _grads(steps, n=N, world=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, generator=gen) for _ in range(world)] for _ in range(steps)]


def test_one_rank_applies_what_ef_sgd_in_parameter_units_applies():
    red = GradientReducer("topk", RATIO, precondition=RMSOptions())
    assert red.lr_follows
    v, e = torch.zeros(N), torch.zeros(N)
    k = topk_budget(N, RATIO)
    for t, (lr, (g,)) in enumerate(zip(LRS, _grads(len(LRS)))):
        applied = lr * red.reduce(g.clone(), _layout(), LocalCollective(), t, lr=lr)
        red.end_step()
        u = g.clone()
        rms_normalize_(u, v, t + 1, RMSOptions())  # the same preconditioner, outside the reducer
        p = lr * u + e
        idx = topk_indices(p.abs(), k)
        sent = torch.zeros(N)
        sent[idx] = p[idx]
        e = p - sent
        torch.testing.assert_close(applied, sent, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(lr * red.residuals.residuals["w"], e, rtol=1e-5, atol=1e-9)
    # in gradient units (the option off) the same run applies something else once the lr moves
    off = GradientReducer("topk", RATIO, precondition=RMSOptions(), residuals_follow_lr=False)
    assert not off.lr_follows
    outs = []
    for t, (lr, (g,)) in enumerate(zip(LRS, _grads(len(LRS)))):
        outs.append(off.reduce(g.clone(), _layout(), LocalCollective(), t, lr=lr))
        off.end_step()
    assert not torch.allclose(lr * outs[-1], applied)


@pytest.mark.parametrize("world", [1, 3])
def test_constant_lr_is_bit_for_bit_the_option_off_sharded_qtopk(world):
    """Under a constant lr nothing is rescaled: the same bits as residuals in gradient units (rms_sketch, the
    sharded 2-bit exchange of compress_rms_sketch.json, its shard residuals included)."""
    kw = dict(precondition=RMSOptions(kind="rms_sketch"), bits=2, chunk=16, exchange="sharded", gather_share=0.7)
    reds = {f: [GradientReducer("qtopk", 8.0, residuals_follow_lr=f, **kw) for _ in range(world)] for f in (True, False)}
    for t, gs in enumerate(_grads(4, world=world)):
        outs = {}
        for f, rs in reds.items():
            sim = SimCollective(world)
            outs[f] = sim.run(lambda w, comm: rs[w].reduce(gs[w].clone(), _layout(), comm, t, lr=3e-3))
            for r in rs:
                r.end_step()
        assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))


def test_the_shard_residuals_follow_too_and_a_skipped_step_takes_back_scale_and_lr():
    world = 2
    kw = dict(precondition=RMSOptions(kind="rms_sketch"), bits=2, chunk=16, exchange="sharded", gather_share=0.7)
    reds = [GradientReducer("qtopk", 8.0, **kw) for _ in range(world)]
    gs = _grads(3, world=world)

    def step(t, grads, lr):
        SimCollective(world).run(lambda w, comm: reds[w].reduce(grads[w].clone(), _layout(), comm, t, lr=lr))
        for r in reds:
            r.end_step()

    step(0, gs[0], 0.01)
    before = [{n: {k: v.clone() for k, v in r.stores[n].residuals.items()} for n in ("residuals", "shard_residuals")}
              for r in reds]
    assert any(before[w]["shard_residuals"] for w in range(world))
    # the next step doubles the lr and its gradient holds a NaN: DeepSpeed skips it, the scale goes back
    bad = [g.clone() for g in gs[1]]
    bad[0][5] = float("nan")
    step(1, bad, 0.02)
    for w, r in enumerate(reds):
        assert r.nonfinite_steps == 1 and r._lr_prev == 0.01
        for n in ("residuals", "shard_residuals"):
            assert set(r.stores[n].residuals) == set(before[w][n])
            assert all(torch.equal(r.stores[n].residuals[k], v) for k, v in before[w][n].items())
    # a step at 0.02 that stands rescales both stores by 0.01 / 0.02 before adding its gradients
    scaled = []
    for r in reds:
        r._call_seed(2)
        r.follow_lr(0.02)
        scaled.append({n: {k: r.stores[n].get(k).clone() for k in r.stores[n].residuals}
                       for n in ("residuals", "shard_residuals")})
        for st in r.stores.values():
            st.rollback()
    for w in range(world):
        for n in ("residuals", "shard_residuals"):
            for k, v in before[w][n].items():
                assert torch.equal(scaled[w][n][k], v * 0.5)


def test_checkpoint_keeps_the_lr_and_resume_is_bit_exact():
    gs = _grads(len(LRS))

    def run(resume_at=None):
        red = GradientReducer("topk", RATIO, precondition=RMSOptions())
        outs = []
        for t, (lr, (g,)) in enumerate(zip(LRS, gs)):
            if t == resume_at:
                state = red.state_dict()
                assert state["lr_prev"] == LRS[t - 1]
                red = GradientReducer("topk", RATIO, precondition=RMSOptions())
                red.load_state_dict(state)
            outs.append(red.reduce(g.clone(), _layout(), LocalCollective(), t, lr=lr))
            red.end_step()
        return outs

    whole, resumed = run(), run(resume_at=3)
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed))
    # a checkpoint written before the field loads (no lr yet: the first step after it does not rescale)
    red = GradientReducer("topk", RATIO, precondition=RMSOptions())
    red.reduce(gs[0][0].clone(), _layout(), LocalCollective(), 0, lr=0.01)
    red.end_step()
    old = red.state_dict()
    del old["lr_prev"]
    fresh = GradientReducer("topk", RATIO, precondition=RMSOptions())
    fresh.load_state_dict(old)
    assert fresh._lr_prev is None


def test_without_a_precondition_or_an_lr_nothing_follows_and_the_config_refuses_the_key_there():
    assert not GradientReducer("topk", RATIO).lr_follows  # AdamW applies the sum: its own scale
    assert not GradientReducer("topk", RATIO, precondition=RMSOptions(), error_feedback=False).lr_follows
    red = GradientReducer("topk", RATIO, precondition=RMSOptions())
    for t, (g,) in enumerate(_grads(2)):
        red.reduce(g.clone(), _layout(), LocalCollective(), t)  # no lr given: nothing to follow
        red.end_step()
    assert red._lr_prev is None
    assert CompressionConfig(method="topk", precondition="rms").residuals_follow_lr is True
    assert CompressionConfig(method="topk", precondition="rms", residuals_follow_lr=False).residuals_follow_lr is False
    with pytest.raises(ValueError, match="has residuals_follow_lr but precondition is 'none'"):
        CompressionConfig(method="topk", residuals_follow_lr=False)


# DeepSpeed's seams hand the reducer engine.get_lr() (2 real ranks under a warm-up, resumed bit for bit):
# tests/comm/test_hooks.py, method rms_sketch_warmup (compression needs >= 2 ranks)
