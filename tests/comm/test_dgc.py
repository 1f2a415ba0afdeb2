"""DGC on ``topk`` (``titan_ds/comm/dgc.py`` + ``GradientReducer``): a reference loop written from the paper as
oracle on 1-4 simulated ranks, for every switch; the sparsity warm-up's bytes in the whole-run ratio; local
clipping's units; momentum state through checkpoints and skipped steps."""
from __future__ import annotations

import math

import pytest
import torch

from tests.comm.test_precondition import round_trip
from tests.helpers.collectives import run_ranks
from titan_ds.comm import GradientReducer, Segment
from titan_ds.comm.base import LocalCollective
from titan_ds.comm.dgc import DGCOptions, ratio_at

SIZES = {"a": 700, "b": 300, "c": 1000}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def layout_of(sizes: dict[str, int]) -> list[Segment]:
    segs, off = [], 0
    for k, n in sizes.items():
        segs.append(Segment(k, 0, off, n, n, (n,)))
        off += n
    return segs


# ------------------------------------------------------------------ the reference loop (plain tensors only)
def reference_dgc(grads, sizes, *, ratio, momentum, masking, clip, warmup, ramp, start):
    """Lin et al. 2018, Algorithm 1 with momentum correction, factor masking and local clipping, per rank w and
    step t: g <- clip(g) per tensor; u <- m u + g; v <- v + u; send the top-k of |v| (k = n / (2 ratio_t): int32
    index + fp32 value against 4 dense bytes); v <- 0 and (masking) u <- 0 where a value was sent. The warm-up:
    ``warmup`` dense steps, then ratio_t = start (ratio / start)^((t - warmup) / ramp) for ``ramp`` steps."""
    W, T = len(grads), len(grads[0])
    n = sum(sizes.values())
    u = [torch.zeros(n) for _ in range(W)]
    v = [torch.zeros(n) for _ in range(W)]
    out = []
    for t in range(T):
        if t < warmup:
            total = grads[0][t].clone()
            for w in range(1, W):
                total = total + grads[w][t]
            out.append((total, [x.clone() for x in u], [x.clone() for x in v], 4 * n))
            continue
        s = t - warmup
        ratio_t = start * (ratio / start) ** (s / ramp) if s < ramp else ratio
        k = max(1, min(n, int(n / (2.0 * ratio_t))))
        total = torch.zeros(n)
        for w in range(W):
            g = grads[w][t].clone()
            if clip is not None:
                off = 0
                for size in sizes.values():
                    norm = float(g[off:off + size].norm())
                    if norm > clip:
                        g[off:off + size] *= clip / norm
                    off += size
            u[w] = momentum * u[w] + g if momentum else g
            v[w] = v[w] + u[w]
            idx = torch.topk(v[w].abs(), k).indices
            send = torch.zeros(n)
            send[idx] = v[w][idx]
            total[idx] += send[idx]
            v[w][idx] = 0.0
            if momentum and masking:
                u[w][send != 0] = 0.0
        out.append((total, [x.clone() for x in u], [x.clone() for x in v], 8 * k))
    return out


CASES = {  # (world, momentum, masking, clip, warmup, ramp)
    "plain-topk": (2, 0.0, True, None, 0, 0),
    "momentum": (2, 0.9, False, None, 0, 0),
    "momentum+masking": (3, 0.9, True, None, 0, 0),
    "clip": (2, 0.0, True, 2.0, 0, 0),
    "all+ramp": (4, 0.9, True, 2.0, 2, 5),
    "one-rank": (1, 0.9, True, 2.0, 1, 4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_reference_loop(case):
    world, momentum, masking, clip, warmup, ramp = CASES[case]
    T, ratio, start = 10, 40.0, 2.0
    n, layout = sum(SIZES.values()), layout_of(SIZES)
    gen = torch.Generator().manual_seed(7)
    # each tensor at its own scale, so that clipping at 2.0 clips two of them (norms ~ 1.3, 17, 95)
    scale = torch.cat([torch.full((s,), f) for s, f in zip(SIZES.values(), (0.05, 1.0, 3.0))])
    grads = [[torch.randn(n, generator=gen) * scale for _ in range(T)] for _ in range(world)]
    ref = reference_dgc(grads, SIZES, ratio=ratio, momentum=momentum, masking=masking, clip=clip, warmup=warmup,
                        ramp=ramp, start=start)

    def fn(w, comm):
        red = GradientReducer("topk", ratio, warmup_steps=warmup, ratio_warmup_steps=ramp, ratio_warmup_start=start,
                              dgc=DGCOptions(momentum=momentum, momentum_masking=masking, local_clip=clip))
        steps = []
        for t in range(T):
            s = red.reduce(grads[w][t], layout, comm, t)
            red.end_step()
            res = torch.cat([red.residuals.residuals.get(k, torch.zeros(m)) for k, m in SIZES.items()])
            mom = torch.cat([red.momentum.residuals.get(k, torch.zeros(m)) for k, m in SIZES.items()]) \
                if red.momentum is not None else None
            steps.append((s, res, mom, red.take_metrics()["wire_bytes"]))
        return steps

    outs = run_ranks(world, fn) if world > 1 else [fn(0, LocalCollective())]
    for t in range(T):
        total, u, v, nbytes = ref[t]
        for w in range(world):
            s, res, mom, wire = outs[w][t]
            # the same float32 operations in the same order: bit for bit
            assert torch.equal(s, total), f"{case} step {t} rank {w}: max err {(s - total).abs().max()}"
            assert torch.equal(res, v[w]), f"{case} step {t} rank {w}: residual"
            if momentum:
                assert torch.equal(mom, u[w]), f"{case} step {t} rank {w}: momentum"
            else:
                assert mom is None
            assert wire == nbytes, (case, t, wire, nbytes)


def test_sparsity_warm_up_bytes_count_in_the_whole_run_ratio():
    """2 dense steps, a 10-step ramp 2x -> 200x, then 200x: each step's bytes follow the schedule, and the
    whole-run ratio is the dense bytes of every step over all bytes sent, warm-up included (far below 200x)."""
    n, T, warm, ramp = 40_000, 30, 2, 10
    red = GradientReducer("topk", 200.0, warmup_steps=warm, ratio_warmup_steps=ramp, ratio_warmup_start=2.0,
                          dgc=DGCOptions(momentum=0.9))
    layout = layout_of({"p": n})
    sent = 0
    for t in range(T):
        red.reduce(torch.randn(n), layout, LocalCollective(), t)
        red.end_step()
        m = red.take_metrics()
        want = 4 * n if t < warm else 8 * max(1, int(n / (2 * ratio_at(t, ratio=200.0, warmup_steps=warm,
                                                                         ramp_steps=ramp, start=2.0))))
        assert m["wire_bytes"] == want, (t, m["wire_bytes"], want)
        sent += want
    assert ratio_at(warm, ratio=200.0, warmup_steps=warm, ramp_steps=ramp, start=2.0) == 2.0
    assert ratio_at(warm + ramp // 2, ratio=200.0, warmup_steps=warm, ramp_steps=ramp, start=2.0) == pytest.approx(20.0)
    assert m["wire_compression_ratio"] == pytest.approx(200.0, rel=0.01)
    assert m["wire_bytes_run"] == sent and m["wire_compression_ratio_run"] == pytest.approx(T * 4 * n / sent)
    assert m["wire_compression_ratio_run"] < 15


def test_local_clip_bounds_the_ranks_own_gradient_at_any_prescale():
    """ZeRO 1-3 hand the reducer grad / W (prescale 1/W): the clip threshold still applies to the rank's own
    gradient, so the same gradient gives the same sum up to that factor."""
    n = 500
    layout = layout_of({"p": n})
    g = torch.randn(n) * 10  # norm ~ 224 > 5
    outs = {}
    for pre in (1.0, 0.25):
        red = GradientReducer("topk", 1.0, dgc=DGCOptions(local_clip=5.0))
        outs[pre] = red.reduce(g * pre, layout, LocalCollective(), 0, prescale=pre)
        total = outs[pre] + red.residuals.residuals["p"]
        assert float(total.norm()) == pytest.approx(5.0 * pre, rel=1e-5)
    torch.testing.assert_close(outs[0.25], outs[1.0] * 0.25)


def test_momentum_state_round_trip_and_refusal():
    n = 2000
    layout = layout_of({"p": n})
    xs = [torch.randn(n) for _ in range(6)]
    opts = DGCOptions(momentum=0.9)
    state = round_trip(lambda: GradientReducer("topk", 20.0, dgc=opts), n, {"momentum"}, xs)
    # the momentum is what the round trip keeps: the same residuals with a zero momentum give another step
    c = GradientReducer("topk", 20.0, dgc=opts)
    c.load_state_dict({**state, "stores": {"momentum": {}}})
    d = GradientReducer("topk", 20.0, dgc=opts)
    d.load_state_dict(state)
    assert not torch.equal(c.reduce(xs[3], layout, LocalCollective(), 3), d.reduce(xs[3], layout, LocalCollective(), 3))
    with pytest.raises(RuntimeError, match="momentum is there only with momentum > 0"):
        GradientReducer("topk", 20.0).load_state_dict(state)


def test_nonfinite_rolls_back_the_momentum():
    n = 1024
    a, b = layout_of({"a": n}), layout_of({"b": n})

    def fn(r, comm):
        red = GradientReducer("topk", 8.0, dgc=DGCOptions(momentum=0.9, local_clip=3.0))
        gen = torch.Generator().manual_seed(r)
        red.reduce(torch.randn(n, generator=gen), a, comm, 0)
        red.reduce(torch.randn(n, generator=gen), b, comm, 0)
        red.end_step()
        before = {k: v.clone() for k, v in red.momentum.residuals.items()}
        red.reduce(torch.randn(n, generator=gen), a, comm, 1)
        g = torch.randn(n, generator=gen)
        if r == 1:
            g[3] = float("nan")
        s = red.reduce(g, b, comm, 1)
        red.end_step()
        return before, {k: v.clone() for k, v in red.momentum.residuals.items()}, bool(torch.isfinite(s).all())

    for before, after, finite in run_ranks(2, fn):
        assert not finite and before.keys() == after.keys() == {"a", "b"}
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_options_are_checked():
    with pytest.raises(ValueError, match="momentum must be in"):
        DGCOptions(momentum=1.0)
    with pytest.raises(ValueError, match="local_clip must be > 0"):
        DGCOptions(local_clip=0.0)
    with pytest.raises(ValueError, match="ratio_warmup_start must be in"):
        GradientReducer("topk", 10.0, ratio_warmup_steps=5, ratio_warmup_start=10.0)
    assert math.isclose(ratio_at(100, ratio=500.0, warmup_steps=0, ramp_steps=0, start=2.0), 500.0)
