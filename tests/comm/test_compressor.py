"""Unit tests for the gradient compressors (STYLE.md 4: exact case, error-feedback invariant, off-switch, state)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.collectives import run_ranks
from titan_ds.comm import REGISTRY, GradientReducer, Segment, build_compressor
from titan_ds.comm.base import LocalCollective, ResidualStore, check_layout, sketch_budget, topk_budget

LOSSY = ["topk", "tgss", "hge"]
# every compressor that keeps residuals; randk is not exact on sparse input (it does not choose), nor is cltk on more
# than one rank (only the leader chooses), so neither is in LOSSY;
# qtopk sends quantized values (so not in EF's exact invariant) and is added where a test does not need exact sums
# (its own oracle tests: test_diloco.py)
EF = [*LOSSY, "randk", "cltk"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def one(n: int, key: str = "p") -> list[Segment]:
    return [Segment(key, 0, 0, n, n)]


# ------------------------------------------------------------------ 1. exact case
def sparse(n: int, nnz: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.zeros(n)
    x[torch.randperm(n, generator=gen)[:nnz]] = torch.randn(nnz, generator=gen)
    return x


@pytest.mark.parametrize("method", LOSSY)
def test_exact_when_fewer_nonzeros_than_budget_one_rank(method):
    n, ratio = 4096, 4.0
    k = topk_budget(n, ratio) if method == "topk" else sketch_budget(n, ratio, 3)[0]
    gen = torch.Generator().manual_seed(1)
    for trial in range(5):
        x = sparse(n, k // 8, gen)
        red = GradientReducer(method, ratio)
        out = red.reduce(x, one(n), LocalCollective(), step=trial)
        assert torch.equal(out, x), f"{method} trial {trial}: max err {(out - x).abs().max()}"
        assert red.residuals.norm() == 0.0


@pytest.mark.parametrize("method", ["tgss", "hge"])
def test_sketch_exact_case_premise_is_the_candidate_count(method):
    """The guarantee behind the exact case: the support is always among the candidates, and when there are
    at most k candidates all of them are taken. Check both halves on the decoded sketch directly."""
    n, ratio, rows = 4096, 4.0, 3
    k, cols = sketch_budget(n, ratio, rows)
    x = sparse(n, k // 8, torch.Generator().manual_seed(2))
    comp = build_compressor(method, ratio, rows)
    keys = comp.keys(n, cols, 7, x.device)
    sk = comp.encode(x, keys, cols, 7)
    est, cand = comp.estimate(sk, keys, n, cols, 7)
    assert bool(cand[x != 0].all())
    assert int(cand.sum()) <= k


@pytest.mark.parametrize("method", LOSSY)
def test_exact_sum_two_ranks(method):
    n, ratio = 4096, 4.0
    k = topk_budget(n, ratio) if method == "topk" else sketch_budget(n, ratio, 3)[0]
    xs = [sparse(n, k // 16, torch.Generator().manual_seed(10 + r)) for r in range(2)]

    def fn(r, comm):
        return GradientReducer(method, ratio).reduce(xs[r], one(n), comm, step=3)

    outs = run_ranks(2, fn)
    assert torch.equal(outs[0], outs[1])  # every rank decodes the same sum
    torch.testing.assert_close(outs[0], xs[0] + xs[1], rtol=0, atol=1e-7)


# ------------------------------------------------------------------ 2. error-feedback invariant
@pytest.mark.parametrize("method", EF)
def test_error_feedback_invariant(method):
    """sent + new_residual == x + old_residual, exactly, over several steps; with one rank summed == sent."""
    n = 3000
    red = GradientReducer(method, 20.0)
    old = torch.zeros(n)
    for step in range(4):
        x = torch.randn(n)
        out = red.reduce(x, one(n), LocalCollective(), step)
        new = red.residuals.residuals["p"].clone()
        assert torch.equal(out + new, x + old), method
        assert (out != 0).sum() < n // 5  # it did compress
        old = new


def test_qtopk_residual_is_what_was_not_sent_quantization_error_included():
    """Per step, one rank: qtopk's sum is its oracle's message of ``x + old residual`` and the new residual is the
    rest, bit for bit; ``sent + residual`` is ``x + old`` up to one rounding (the quantized values are not acc's)."""
    from titan_ds.comm.qtopk import reference_qtopk
    n, ratio = 3000, 20.0
    red = GradientReducer("qtopk", ratio, bits=2, chunk=256)
    old = torch.zeros(n)
    for step in range(4):
        x = torch.randn(n)
        out = red.reduce(x, one(n), LocalCollective(), step)
        red.end_step()
        new = red.residuals.residuals["p"].clone()
        assert torch.equal(out, reference_qtopk(x + old, ratio, bits=2, chunk=256))
        assert torch.equal(new, (x + old) - out)
        torch.testing.assert_close(out + new, x + old, rtol=0, atol=1e-5)
        assert 0 < (out != 0).sum() < n // 5  # it did compress
        old = new


@pytest.mark.parametrize("method", EF)
def test_residuals_follow_parameters_not_buckets(method):
    """The same parameters arriving in differently composed buckets keep one residual each."""
    na, nb = 700, 500
    red = GradientReducer(method, 10.0)
    xa, xb = torch.randn(na), torch.randn(nb)
    # step 0: one bucket [b | a]
    red.reduce(torch.cat([xb, xa]), [Segment("b", 0, 0, nb, nb), Segment("a", 0, nb, na, na)], LocalCollective(), 0)
    ra, rb = red.residuals.residuals["a"].clone(), red.residuals.residuals["b"].clone()
    # step 1: a's second half alone, then a's first half with b
    ya, yb = torch.randn(na), torch.randn(nb)
    h = na // 2
    out1 = red.reduce(ya[h:].clone(), [Segment("a", h, 0, na - h, na)], LocalCollective(), 1)
    out2 = red.reduce(torch.cat([ya[:h], yb]), [Segment("a", 0, 0, h, na), Segment("b", 0, h, nb, nb)],
                      LocalCollective(), 1)
    sent_a = torch.cat([out2[:h], out1])
    sent_b = out2[h:]
    assert torch.equal(sent_a + red.residuals.residuals["a"], ya + ra)
    assert torch.equal(sent_b + red.residuals.residuals["b"], yb + rb)


def test_layout_must_tile_the_bucket():
    with pytest.raises(RuntimeError, match="gap or overlap"):
        check_layout([Segment("a", 0, 0, 5, 5), Segment("b", 0, 6, 4, 4)], 10)
    with pytest.raises(RuntimeError, match="covers"):
        check_layout([Segment("a", 0, 0, 5, 5)], 10)


# ------------------------------------------------------------------ 3. fails when switched off
@pytest.mark.parametrize("method", EF)
@pytest.mark.parametrize("ratio", [10.0, 100.0])
def test_bytes_on_the_wire_meet_the_ratio(method, ratio):
    """Would fail with compression off (method none sends 4n bytes: ratio 1)."""
    n = 200_000
    red = GradientReducer(method, ratio)
    red.reduce(torch.randn(n), one(n), LocalCollective(), 0)
    m = red.take_metrics()
    assert m["dense_grad_bytes"] == 4 * n
    assert ratio * 0.98 <= m["hge_compression_ratio"] <= ratio * 1.05, m
    off = GradientReducer("none", 1.0)
    off.reduce(torch.randn(n), one(n), LocalCollective(), 0)
    assert off.take_metrics()["hge_compression_ratio"] == 1.0


@pytest.mark.parametrize("method", [*EF, "qtopk"])
def test_error_feedback_off_loses_mass_on(method):
    """A constant gradient over T steps: with error feedback the delivered total is T g minus one bounded
    residual; without it, most of T g never arrives. (Fails if error_feedback is a no-op either way.)"""
    n, T = 400, 150  # T * k >= 5 n for every method at ratio 4 (tgss: k = 14)
    g = torch.randn(n)
    tot = {}
    for ef in (True, False):
        red = GradientReducer(method, 4.0, error_feedback=ef)
        s = torch.zeros(n)
        for t in range(T):
            s += red.reduce(g.clone(), one(n), LocalCollective(), t)
        tot[ef] = (s - T * g).norm() / (T * g).norm()
        if ef:
            torch.testing.assert_close(s + red.residuals.residuals["p"], T * g, rtol=1e-5, atol=1e-4)
        else:
            assert red.residuals.residuals == {}
    assert tot[True] < 0.5 * tot[False], tot


def test_warmup_steps_are_dense():
    n = 1000
    red = GradientReducer("topk", 50.0, warmup_steps=2)
    x = torch.randn(n)
    assert torch.equal(red.reduce(x, one(n), LocalCollective(), 0), x)
    assert red.take_metrics()["hge_compression_ratio"] == 1.0
    assert not torch.equal(red.reduce(x, one(n), LocalCollective(), 2), x)
    assert red.take_metrics()["hge_compression_ratio"] > 40


# ------------------------------------------------------------------ 4. state round trip
@pytest.mark.parametrize("method", [*EF, "qtopk"])
def test_state_round_trip_keeps_residuals(method):
    n = 1500
    a = GradientReducer(method, 15.0, seed=3)
    xs = [torch.randn(n) for _ in range(5)]
    for t in range(3):
        a.reduce(xs[t], one(n), LocalCollective(), t)
    state = a.state_dict()
    b = GradientReducer(method, 15.0, seed=3)
    b.load_state_dict(state)
    assert torch.equal(b.residuals.residuals["p"], a.residuals.residuals["p"])
    assert a.residuals.norm() > 0
    for t in (3, 4):
        assert torch.equal(a.reduce(xs[t], one(n), LocalCollective(), t), b.reduce(xs[t], one(n), LocalCollective(), t))
    fresh = GradientReducer(method, 15.0, seed=3)
    # without the residuals the next step differs: the round trip is what keeps them
    c = GradientReducer(method, 15.0, seed=3)
    c.load_state_dict(state)
    assert not torch.equal(fresh.reduce(xs[3], one(n), LocalCollective(), 3), c.reduce(xs[3], one(n), LocalCollective(), 3))


def test_state_of_another_method_is_refused():
    a = GradientReducer("topk", 10.0)
    a.reduce(torch.randn(100), one(100), LocalCollective(), 0)
    with pytest.raises(RuntimeError, match="same method"):
        GradientReducer("tgss", 10.0).load_state_dict(a.state_dict())


# ------------------------------------------------------------------ registry (the sketches: test_tgss.py, test_hge.py)
def test_registry_unknown_name_lists_choices():
    assert sorted(REGISTRY) == ["cltk", "hge", "none", "powersgd", "qtopk", "randk", "tgss", "topk"]
    with pytest.raises(ValueError, match=r"unknown compressor 'dgc'; choose one of "
                                         r"\['cltk', 'hge', 'none', 'powersgd', 'qtopk', 'randk', 'tgss', 'topk'\]"):
        build_compressor("dgc", 10.0)


# ------------------------------------------------------------------ non-finite steps
@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("method", ["none", *EF, "qtopk"])
def test_nonfinite_on_one_rank_is_seen_by_all_and_leaves_residuals_unchanged(method, bad):
    """Step 1's second bucket holds NaN/Inf on rank 0 only: every rank gets a non-finite sum (so DeepSpeed skips
    the step everywhere), and every rank's residuals, including those the first, finite bucket had already
    updated, are back to their values after step 0. Step 2 is finite and updates them again."""
    n = 2048
    poison = float(bad)

    def fn(r, comm):
        red = GradientReducer(method, 8.0, seed=3)
        gen = torch.Generator().manual_seed(10 + r)
        a, b = [Segment("a", 0, 0, n, n)], [Segment("b", 0, 0, n, n)]
        red.reduce(torch.randn(n, generator=gen), a, comm, step=0)
        red.reduce(torch.randn(n, generator=gen), b, comm, step=0)
        red.end_step()
        after0 = {k: v.clone() for k, v in red.residuals.residuals.items()}
        s1a = red.reduce(torch.randn(n, generator=gen), a, comm, step=1)  # finite: writes residual "a"
        g = torch.randn(n, generator=gen)
        if r == 0:
            g[5] = poison
        s1b = red.reduce(g, b, comm, step=1)
        red.end_step()
        after1 = {k: v.clone() for k, v in red.residuals.residuals.items()}
        s2 = red.reduce(torch.randn(n, generator=gen), a, comm, step=2)
        return (bool(torch.isfinite(s1a).all()), bool(torch.isfinite(s1b).all()), after0, after1,
                bool(torch.isfinite(s2).all()), red.residuals.residuals["a"].clone(), red.take_metrics())

    for r, (fin_a, fin_b, after0, after1, fin2, res2, m) in enumerate(run_ranks(2, fn)):
        assert fin_a and not fin_b, f"rank {r}: the poisoned bucket's sum must be non-finite on every rank"
        assert after0.keys() == after1.keys()
        for k in after0:
            assert torch.equal(after0[k], after1[k]), f"rank {r}: residual {k} changed by the skipped step"
        assert fin2 and torch.isfinite(res2).all()
        assert m["compression_nonfinite_steps"] == 1
        if method != "none":
            assert not torch.equal(res2, after0["a"]), "a finite step after the skip updates residuals again"


def test_residual_journal_is_released_after_the_step():
    red = GradientReducer("topk", 8.0)
    seg = one(1024)
    red.reduce(torch.randn(1024), seg, LocalCollective(), step=0)
    assert red.residuals.nbytes() == 1024 * 4  # created in this step: no earlier value to keep
    red.end_step()
    assert red.residuals.nbytes() == 1024 * 4
    red.reduce(torch.randn(1024), seg, LocalCollective(), step=1)
    assert red.residuals.nbytes() == 2 * 1024 * 4  # residual + its value at the step's start
    red.end_step()
    assert red.residuals.nbytes() == 1024 * 4


def test_whole_run_ratio_counts_warmup_and_survives_a_state_round_trip():
    """10 dense warm-up steps then 90 at 100x: the last step shows ~100x, the whole run 4n*100 / (4n*10 +
    4n*90/100) = 100/10.9 ~ 9.2x (the figure the seed's table used to hide). The totals are checkpointed."""
    n, steps, warm = 20_000, 100, 10
    red = GradientReducer("topk", 100.0, warmup_steps=warm)
    for s in range(steps):
        red.reduce(torch.randn(n), one(n), LocalCollective(), s)
        m = red.take_metrics()
        if s == warm - 1:
            assert m["wire_compression_ratio"] == 1.0 and m["wire_compression_ratio_run"] == 1.0
        if s == steps // 2 - 1:
            again = GradientReducer("topk", 100.0, warmup_steps=warm)
            again.load_state_dict(red.state_dict())
    sent = warm * 4 * n + (steps - warm) * m["wire_bytes"]
    assert m["wire_bytes_run"] == sent and m["dense_grad_bytes_run"] == steps * 4 * n
    assert m["wire_compression_ratio"] == pytest.approx(100.0, rel=0.05)
    assert m["wire_compression_ratio_run"] == pytest.approx(steps * 4 * n / sent) and m["wire_compression_ratio_run"] < 10
    for s in range(steps // 2, steps):
        again.reduce(torch.randn(n), one(n), LocalCollective(), s)
        m2 = again.take_metrics()
    assert m2["wire_bytes_run"] == m["wire_bytes_run"]  # the resumed reducer kept counting from the checkpoint


# ------------------------------------------------------------------ cltk: the reference
@pytest.mark.parametrize("world", [2, 3])
def test_cltk_sends_every_rank_values_at_the_leaders_top_k(world):
    """Each call, leader = seed % W: the sum is the sum over ranks of each rank's values at the leader's own
    top-k coordinates (k = n / (2 ratio)); each rank's sent is its values there; the leader changes with the seed."""
    from titan_ds.comm.topk import topk_indices
    n, ratio = 5000, 10.0
    k = topk_budget(n, ratio)
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    leaders = set()
    for seed in range(5, 5 + 2 * world):
        outs = run_ranks(world, lambda r, comm: build_compressor("cltk", ratio).reduce(xs[r], comm, seed, layout=one(n)))
        leader = seed % world
        leaders.add(leader)
        idx = topk_indices(xs[leader].abs(), k)
        want = torch.zeros(n)
        want[idx] = sum(x[idx] for x in xs)
        for r, (summed, sent) in enumerate(outs):
            assert torch.equal(summed, outs[0][0])
            torch.testing.assert_close(summed, want, rtol=0, atol=1e-6)
            assert torch.equal(sent.dense()[idx], xs[r][idx]) and int((sent.dense() != 0).sum()) == k
    assert leaders == set(range(world))


def test_cltk_received_bytes_do_not_grow_with_the_workers():
    """What a worker receives (ring all-reduces of the leader's k indices and of k + 1 values) is
    2 (W-1)/W x 8k bytes: the same at W = 8 as at W = 2 within (W-1)/W, where topk's all-gather grows ~W-fold."""
    from titan_ds.comm.wire import SimCollective, ring_allreduce_bytes
    n, ratio = 4096, 16.0
    k = topk_budget(n, ratio)
    recv = {}
    for method in ("cltk", "topk"):
        for world in (2, 8):
            sim = SimCollective(world)
            xs = [torch.randn(n) for _ in range(world)]
            sim.run(lambda w, comm: build_compressor(method, ratio).reduce(xs[w], comm, 7, layout=one(n)))
            recv[method, world] = sim.received[0]
    for world in (2, 8):
        assert recv["cltk", world] == ring_allreduce_bytes(4 * k, world) + ring_allreduce_bytes(4 * (k + 1), world)
    assert recv["cltk", 8] < 2 * recv["cltk", 2] and recv["topk", 8] > 5 * recv["topk", 2]


def test_cltk_needs_to_know_the_rank():
    class NoRank:
        world_size = 2

        def all_reduce_sum(self, t):
            pass

    with pytest.raises(TypeError, match="does not say which rank"):
        build_compressor("cltk", 10.0).reduce(torch.randn(100), NoRank(), 3, layout=one(100))


# ------------------------------------------------------------------ randk: the reference
def test_randk_matches_the_reference_and_its_indices_are_shared_distinct_and_uniform():
    """Two ranks: the sum is the sum over ranks of each rank's values at randk_indices(n, ratio, seed), the same
    coordinates on both (no index crosses the wire: 4 bytes per value); the indices are distinct, about n / ratio,
    change with the seed, and cover every coordinate about equally often."""
    from titan_ds.comm.randk import randk_indices
    n, ratio = 10_000, 20.0
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(2)]

    def fn(r, comm):
        return build_compressor("randk", ratio).reduce(xs[r], comm, 5, layout=one(n))

    (s0, sent0), (s1, _) = run_ranks(2, fn)
    idx = randk_indices(n, ratio, 5)
    want = torch.zeros(n)
    want[idx] = xs[0][idx] + xs[1][idx]
    assert torch.equal(s0, s1) and torch.equal(s0, want)  # (plus one fp32 non-finite flag on the wire)
    assert torch.equal(sent0[idx], xs[0][idx]) and int((sent0 != 0).sum()) == idx.numel()
    assert idx.unique().numel() == idx.numel() and abs(idx.numel() - n / ratio) <= 16
    assert not torch.equal(randk_indices(n, ratio, 6), idx)
    hits = torch.zeros(n)
    for seed in range(400):
        hits[randk_indices(n, ratio, seed)] += 1
    # Binomial(400, 1/20) per block of 16 (mean 20, sd 4.4), 625 blocks: every block chosen, none hugely often
    assert abs(float(hits.mean()) - 400 / ratio) < 0.05 * 400 / ratio
    assert 0.25 * 400 / ratio < float(hits.min()) and float(hits.max()) < 2.0 * 400 / ratio, (hits.min(), hits.max())


def test_journal_in_one_buffer_rolls_back_exactly_and_drops_what_the_step_created():
    """``ResidualStore.journal_``: the step's old values in one buffer (views), the same rollback as one clone a
    parameter; a key created in the step is journaled as absent; ``adopt`` keeps the tensor itself."""
    store = ResidualStore()
    layout = [Segment("a", 0, 0, 5, 5), Segment("b", 0, 5, 3, 3)]
    store.update_(torch.zeros(8), layout[:1], lambda v, x: v.add_(1.0))  # creates "a" (journaled as absent)
    store.commit()
    before = store.residuals["a"].clone()
    store.journal_(layout, torch.device("cpu"))
    assert store._journal["b"] is None  # one stored tensor to journal: slice_ clones it as before
    store.update_(torch.ones(8), layout, lambda v, x: v.mul_(3.0).add_(x))
    assert torch.equal(store.residuals["a"], before * 3 + 1)
    store.rollback()
    assert torch.equal(store.residuals["a"], before) and "b" not in store.residuals
    store.update_(torch.ones(8), layout, lambda v, x: v.add_(x))
    store.commit()
    store.journal_(layout, torch.device("cpu"))  # two stored tensors now: one buffer holds both old values
    assert store._journal["a"].untyped_storage().data_ptr() == store._journal["b"].untyped_storage().data_ptr()
    store.commit()
    t = torch.arange(4.0)
    store.adopt("c", t)
    assert store.residuals["c"] is t or store.residuals["c"].data_ptr() == t.data_ptr()
    store.rollback()
    assert "c" not in store.residuals
    with pytest.raises(TypeError, match="fp32"):
        store.adopt("d", torch.zeros(2, dtype=torch.float64))
