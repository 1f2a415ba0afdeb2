"""``precondition="rms_sketch"`` (``titan_ds/comm/precondition.py``): rms's per-rank shape at the level of the ranks'
mean gradient, per tensor piece, from one all-reduced sign projection. A reference loop as oracle on 1-3 simulated
ranks (signs written out element by element); the projection against a dense dot; the signs' pairwise
decorrelation (what makes the estimate unbiased); the clamp; bytes; checkpoints and skipped steps; the config and
the optimizer hand-over (SGD without momentum)."""
from __future__ import annotations

import pytest
import torch

from tests.comm.test_precondition import (_ctx, _sgd_for_precondition, layout_of, prescaled_pair, refuse_each_other,
                                          rollback_on_two_ranks, round_trip)
from tests.helpers.collectives import run_ranks
from titan_ds.comm import GradientReducer, Segment
from titan_ds.comm.base import CountingCollective, LocalCollective
from titan_ds.comm.precondition import (SKETCH_TILE, RMSOptions, rms_sketch_normalize_, sketch_projections,
                                        sketch_signs)
from titan_ds.config import TitanConfig, TitanConfigError

SKETCH = {"method": "topk", "ratio": 50, "precondition": "rms_sketch"}
# a segment that ends inside the first tile, one spanning whole tiles, one that starts and ends mid-tile
SIZES = {"a": 700, "b": 9000, "c": 5000}


def dense_signs(n: int, seed: int) -> torch.Tensor:
    """Every element's sign written out: ``r_f = s1[f mod L] s2[f div L]`` (the module's definition)."""
    s1, s2 = sketch_signs(n, seed, torch.device("cpu"))
    return torch.tensor([float(s1[f % SKETCH_TILE] * s2[f // SKETCH_TILE]) for f in range(n)])


def call_seed(step: int, seed: int = 0) -> int:
    """``GradientReducer._call_seed`` for the first reduce call of ``step`` (identical on every rank)."""
    return (seed * 1_000_003 + step * 7_919 + 1) & 0x7FFFFFFF


def reference(grads, layout, *, ratio: float, beta2: float, eps: float):
    """Per rank w, step t (from 1), W ranks, segment T: p = sum_f r_f g_f over T; P = sum_w p_w / W;
    S_T <- b2 S_T + (1 - b2) P^2 / |T| (its own count c, S_hat = S / (1 - b2^c)); v <- b2 v + (1 - b2) g^2,
    vh = v / (1 - b2^t); q = clamp(vh S_hat / mean_T(vh), vh / W, vh); u = g / (sqrt(q) + eps); e <- e + u; send the
    top-k of |e|; e <- 0 where sent; the sum over ranks of what was sent."""
    W, T = len(grads), len(grads[0])
    n = grads[0][0].numel()
    v = [torch.zeros(n) for _ in range(W)]
    e = [torch.zeros(n) for _ in range(W)]
    S = {s.key: 0.0 for s in layout}
    k = max(1, int(n / (2.0 * ratio)))
    out = []
    for t in range(1, T + 1):
        r = dense_signs(n, call_seed(t - 1))
        level = {}
        for s in layout:
            lo, hi = s.flat_offset, s.flat_offset + s.numel
            P = sum(float((r[lo:hi].double() * grads[w][t - 1][lo:hi].double()).sum()) for w in range(W)) / W
            S[s.key] = beta2 * S[s.key] + (1 - beta2) * P * P / s.numel
            level[s.key] = S[s.key] / (1 - beta2 ** t)
        total = torch.zeros(n)
        for w in range(W):
            g = grads[w][t - 1]
            v[w] = beta2 * v[w] + (1 - beta2) * g * g
            vh = v[w] / (1 - beta2 ** t)
            u = torch.empty(n)
            for s in layout:
                lo, hi = s.flat_offset, s.flat_offset + s.numel
                q = vh[lo:hi] * (level[s.key] / float(vh[lo:hi].double().mean()))
                q = torch.minimum(torch.maximum(q, vh[lo:hi] / W), vh[lo:hi])
                u[lo:hi] = g[lo:hi] / (q.sqrt() + eps)
            e[w] = e[w] + u
            idx = torch.topk(e[w].abs(), k).indices
            total[idx] += e[w][idx]
            e[w][idx] = 0.0
        out.append((total, [x.clone() for x in v], [x.clone() for x in e], dict(S)))
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_matches_the_reference_loop(world):
    T, ratio, opts = 5, 25.0, RMSOptions(beta2=0.99, eps=1e-3, kind="rms_sketch")
    n, layout = sum(SIZES.values()), layout_of(SIZES)
    gen = torch.Generator().manual_seed(7)
    scale = torch.cat([torch.full((s,), f) for s, f in zip(SIZES.values(), (0.01, 1.0, 30.0))])
    mean = torch.randn(n, generator=gen) * scale * 0.3  # a shared expected gradient plus each rank's noise
    grads = [[mean + torch.randn(n, generator=gen) * scale for _ in range(T)] for _ in range(world)]
    ref = reference(grads, layout, ratio=ratio, beta2=opts.beta2, eps=opts.eps)

    def fn(w, comm):
        red = GradientReducer("topk", ratio, precondition=opts)
        steps = []
        for t in range(T):
            s = red.reduce(grads[w][t], layout, comm, t)
            red.end_step()
            cat = lambda store: torch.cat([store.residuals[k] for k in SIZES])  # noqa: E731
            ms = {seg.key: float(red.sketch.get(f"{seg.key}@0+{seg.numel}")[0]) for seg in layout}
            steps.append((s, cat(red.second), cat(red.residuals), ms))
        return steps

    outs = run_ranks(world, fn) if world > 1 else [fn(0, LocalCollective())]
    for t in range(T):
        total, v, e, S = ref[t]
        for w in range(world):
            s, sec, res, ms = outs[w][t]
            for key in SIZES:
                assert ms[key] == pytest.approx(S[key], rel=1e-4), (t, w, key)
            torch.testing.assert_close(sec, v[w], rtol=1e-6, atol=0)
            torch.testing.assert_close(res, e[w], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(s, total, rtol=1e-4, atol=1e-5)


def test_projection_is_the_dense_signed_dot():
    gen = torch.Generator().manual_seed(3)
    for sizes in ({"x": 10}, {"x": 4096}, {"x": 4095, "y": 2, "z": 4097}, {"x": 100, "y": 20000, "z": 33}):
        n = sum(sizes.values())
        layout, acc = layout_of(sizes), torch.randn(n, generator=gen)
        r = dense_signs(n, 12345)
        got = sketch_projections(acc, layout, *sketch_signs(n, 12345, acc.device))
        want = torch.stack([(r[s.flat_offset:s.flat_offset + s.numel].double()
                             * acc[s.flat_offset:s.flat_offset + s.numel].double()).sum().float() for s in layout])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # a split parameter's tail (param_offset > 0) is its own piece at its own flat offset
    seg = [Segment("w", 200, 0, 40, 240, (6, 40))]
    assert sketch_projections(torch.ones(40), seg, *sketch_signs(40, 1, torch.device("cpu"))).shape == (1,)


def test_signs_are_pairwise_uncorrelated_so_the_square_is_unbiased():
    """E[(r . x)^2] = |x|^2 needs E[r_a r_b] = 0 for a != b, within a tile and across tiles. A constant x over
    three tiles is the hard case: signs that repeat per tile (no s2) would give 9 |x|^2 / 3."""
    n = 3 * SKETCH_TILE
    x = torch.ones(n)
    layout = layout_of({"x": n})
    sq = torch.stack([sketch_projections(x, layout, *sketch_signs(n, seed, x.device))[0] ** 2
                      for seed in range(3000)])
    assert float(sq.mean()) == pytest.approx(n, rel=0.1)
    seeds = torch.stack([dense_signs(64, s)[:64] for s in range(400)])  # 64 elements: within one tile
    corr = (seeds.T @ seeds) / 400
    off = corr - torch.diag(torch.diag(corr))
    assert float(off.abs().max()) < 0.25 and torch.equal(torch.diag(corr), torch.ones(64))


def test_the_clamp_bounds_the_step_between_rms_and_sqrt_w_times_rms():
    g = torch.randn(1000)
    opts = RMSOptions(kind="rms_sketch")
    for level, expect in ((0.0, 4.0), (1e9, 1.0)):  # no mean signal: v / W (W = 16); a huge level: v
        a, v = g.clone(), torch.zeros(1000)
        rms_sketch_normalize_(a, v, 1, opts, torch.tensor(level), world=16)
        torch.testing.assert_close(a.abs(), torch.full((1000,), expect), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="starts at 1"):
        rms_sketch_normalize_(g.clone(), torch.zeros(1000), 0, opts, torch.tensor(1.0), world=2)
    with pytest.raises(ValueError, match="world must be"):
        rms_sketch_normalize_(g.clone(), torch.zeros(1000), 1, opts, torch.tensor(1.0), world=0)


def test_chunking_the_segment_changes_no_bit(monkeypatch):
    """The segment is stepped in chunks (one chunk's temporaries, not three of the whole segment); the level's ratio
    uses the whole segment's mean either way, so the chunk size changes nothing, prescale included."""
    from titan_ds.comm import precondition

    g, v0 = torch.randn(10_000), torch.rand(10_000)
    opts = RMSOptions(kind="rms_sketch")
    out = []
    for chunk in (1 << 20, 777):
        monkeypatch.setattr(precondition, "_CHUNK", chunk)
        a, v = g.clone() * 4.0, v0.clone()
        for t in (1, 2):
            rms_sketch_normalize_(a, v, t, opts, torch.tensor(0.3), world=8, prescale=4.0)
        out.append((a, v))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_one_more_all_reduce_of_one_float_per_segment_is_counted():
    layout = layout_of(SIZES)
    n = sum(SIZES.values())
    g = torch.randn(n)
    plain = GradientReducer("topk", 20.0, precondition=RMSOptions())
    sketch = GradientReducer("topk", 20.0, precondition=RMSOptions(kind="rms_sketch"))
    plain.reduce(g, layout, LocalCollective(), 0)
    sketch.reduce(g, layout, LocalCollective(), 0)
    assert sketch.wire_bytes - plain.wire_bytes == 4 * len(layout)
    comm = CountingCollective(LocalCollective())  # the collective sees one call more than rms's
    plain_comm = CountingCollective(LocalCollective())
    sketch.reduce(g, layout, comm, 1)
    plain.reduce(g, layout, plain_comm, 1)
    assert comm.calls == plain_comm.calls + 1


def test_prescale_is_undone_for_the_statistics():
    a, b, sa, sb = prescaled_pair(RMSOptions(kind="rms_sketch"), 6000)
    torch.testing.assert_close(a.sketch.get("p@0+6000"), b.sketch.get("p@0+6000"), rtol=1e-5, atol=0)
    torch.testing.assert_close(a.second.residuals["p"], b.second.residuals["p"], rtol=1e-6, atol=0)
    torch.testing.assert_close(sb, sa * 0.25, rtol=1e-5, atol=0)


def test_state_round_trip_rollback_and_refusals():
    opts = RMSOptions(kind="rms_sketch")
    state = round_trip(lambda: GradientReducer("topk", 20.0, precondition=opts), 5000,
                       {"second_moment", "mean_square_sketch"})
    assert float(state["stores"]["mean_square_sketch"]["p@0+5000"][1]) == 3.0  # the piece's update count
    refuse_each_other(lambda: GradientReducer("topk", 20.0, precondition=opts), state,  # rms's and this one's
                      lambda: GradientReducer("topk", 20.0, precondition=RMSOptions()))
    # a non-finite step on one rank: v and the statistic go back to the step's start on every rank
    rollback_on_two_ranks(lambda: GradientReducer("topk", 8.0, precondition=opts), 5000,
                          lambda red: [red.second.residuals["p"], red.sketch.get("p@0+5000")])


def test_config_and_the_optimizer_hand_over():
    assert TitanConfig(compression=SKETCH).compression.precondition == "rms_sketch"
    with pytest.raises(TitanConfigError, match="only 'rms_mean'"):
        TitanConfig(compression={**SKETCH, "precondition_beta1": 0.8})
    with pytest.raises(TitanConfigError, match="remove momentum"):
        TitanConfig(compression={**SKETCH, "momentum": 0.9})
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                                                    "weight_decay": 0.1}}}
    opts = _sgd_for_precondition(_ctx(ds, compression=SKETCH))
    assert ds["optimizer"] == {"type": "SGD", "params": {"lr": 3e-4, "weight_decay": 0.1}}  # no momentum
    assert opts == RMSOptions(beta2=0.95, eps=1e-6, kind="rms_sketch")
