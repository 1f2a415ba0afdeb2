"""The W-worker simulation harness (launch/bench/compress_scale.py): its collective's sums and byte counts,
and one end-to-end run."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from tests.helpers.launch import ROOT
from titan_ds.comm import GradientReducer
from titan_ds.comm.base import Segment, sketch_budget, topk_budget
from titan_ds.data import Corpus

_spec = importlib.util.spec_from_file_location("compress_scale", ROOT / "launch" / "bench" / "compress_scale.py")
cs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cs)


def test_sim_sum_is_the_direct_sum_on_every_worker():
    W, n = 5, 1000
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(w)) for w in range(W)]
    sim = cs.SimCollective(W)

    def fn(w, comm):
        t = xs[w].clone()
        comm.all_reduce_sum(t)
        gathered = comm.all_gather(xs[w][:3].clone())
        return t, gathered

    outs = sim.run(fn)
    direct = xs[0].clone()
    for x in xs[1:]:
        direct += x
    for t, gathered in outs:
        assert torch.equal(t, direct)  # the same sum, in rank order, on every worker
        assert all(torch.equal(g, x[:3]) for g, x in zip(gathered, xs))
    torch.testing.assert_close(outs[0][0], torch.stack(xs).sum(0))


def test_ring_byte_formulas_by_hand_at_four_workers():
    """W = 4: an all-reduce of 1000 fp32 (4000 B) moves 2 * 3/4 * 4000 = 6000 B out of and into each worker;
    an all-gather of 10 int32 (40 B each) moves 3 * 40 = 120 B."""
    assert cs.ring_allreduce_bytes(4000, 4) == 6000
    assert cs.ring_allgather_bytes(40, 4) == 120
    assert cs.ring_allreduce_bytes(4000, 1) == 0 and cs.ring_allgather_bytes(40, 1) == 0
    sim = cs.SimCollective(4)

    def fn(w, comm):
        comm.all_reduce_sum(torch.zeros(1000))
        comm.all_gather(torch.zeros(10, dtype=torch.int32))

    sim.run(fn)
    assert sim.sent == [6120.0] * 4 and sim.received == [6120.0] * 4
    assert sim.calls == 2


@pytest.mark.parametrize("method", ["tgss", "hge", "topk"])
def test_both_rounds_and_the_gather_are_counted(method):
    """Sketch methods all-reduce the sketch (rows x 2k fp32) then the k exact values: two rounds, both counted.
    top-k all-gathers k int32 indices and k fp32 values, so what each worker receives grows with W."""
    W, n, ratio = 4, 20_000, 10.0
    sim = cs.SimCollective(W)
    layout = [Segment("p", 0, 0, n, n)]
    reds = [GradientReducer(method, ratio) for _ in range(W)]
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(w)) for w in range(W)]
    outs = sim.run(lambda w, comm: reds[w].reduce(xs[w], layout, comm, step=0))
    assert all(torch.equal(o, outs[0]) for o in outs)
    if method == "topk":
        k = topk_budget(n, ratio)
        want = 3 * 4 * k + 3 * 4 * k  # indices, then values: (W - 1) * b each
    else:
        k, cols = sketch_budget(n, ratio, 3)
        want = 1.5 * (3 * cols * 4) + 1.5 * (4 * k)  # 2 (W - 1) / W = 1.5
    assert sim.calls == 2
    assert sim.received == [want] * W and sim.sent == [want] * W


def test_disagreeing_workers_and_a_failing_worker_raise_instead_of_hanging():
    sim = cs.SimCollective(3)
    with pytest.raises(RuntimeError, match="disagree"):
        sim.run(lambda w, comm: comm.all_reduce_sum(torch.zeros(2 + (w == 1))))

    def boom(w, comm):
        if w == 1:
            raise ValueError("worker 1 broke")
        comm.all_reduce_sum(torch.zeros(2))

    with pytest.raises(ValueError, match="worker 1 broke"):
        cs.SimCollective(3).run(boom)


def test_harness_end_to_end_two_workers_two_steps():
    rng = np.random.default_rng(0)
    corpus = Corpus(train=rng.integers(0, 256, 50_000, dtype=np.uint8),
                    val=rng.integers(0, 256, 5_000, dtype=np.uint8), source="random")
    rows = {m: cs.train_row(m, 1.0 if m == "none" else 20.0, 2, 2, corpus=corpus, micro_batch=2, context=16,
                            val_batches_n=2) for m in ("none", "hge")}
    n = rows["none"]["params"]
    assert rows["none"]["recv_per_worker_step"] == 4 * n  # 2 (W - 1) / W = 1 at W = 2
    assert rows["none"]["wire_x_recv"] == 1.0
    assert 15 < rows["hge"]["wire_x_recv"] <= 21 and rows["hge"]["collectives_per_step"] == 2
    assert all(np.isfinite(r["val_loss"]) for r in rows.values())
    assert rows["hge"]["val_loss"] != rows["none"]["val_loss"]
    md = cs.render(list(rows.values()), [cs._key(r) for r in rows.values()] + [("topk", 20.0, 2) + (0,) * 8], "cmd")
    assert "PARTIAL: 1 of 3 rows missing" in md and "| hge | 20 | 2 | 2 |" in md


def test_curve_every_records_the_loss_by_step_without_changing_the_run(tmp_path):
    """``--curve-every``: the validation loss every N steps, the last entry the row's own; the run's final loss is
    the same bits as without it (the model has no dropout, validation draws nothing); ``plot_steps`` draws it."""
    rng = np.random.default_rng(1)
    corpus = Corpus(train=rng.integers(0, 256, 50_000, dtype=np.uint8),
                    val=rng.integers(0, 256, 5_000, dtype=np.uint8), source="random")
    small = dict(corpus=corpus, micro_batch=2, context=16, val_batches_n=2)
    plain = cs.train_row("rms_sketch_qtopk2c256_sharded_g0.7", 20.0, 2, 4, **small)
    curved = cs.train_row("rms_sketch_qtopk2c256_sharded_g0.7", 20.0, 2, 4, curve_every=2, **small)
    assert "curve" not in plain and curved["val_loss"] == plain["val_loss"]
    assert [c[0] for c in curved["curve"]] == [2, 4] and curved["curve"][-1][1] == curved["val_loss"]
    assert curved["curve"][0][1] != curved["curve"][1][1]
    path = tmp_path / "c.png"
    assert cs.plot_steps([plain, curved], path, "t") and path.stat().st_size > 0
    assert not cs.plot_steps([plain], tmp_path / "none.png", "t") and not (tmp_path / "none.png").exists()


def test_topk_at_ratio_times_w_over_2_receives_what_an_all_reduce_method_does():
    """The table's matched top-k rows: at ``ratio * W / 2`` each worker receives about the bytes tgss/hge
    receive at ``ratio`` (rounding of k aside), and at ``ratio`` itself ``W / 2`` times more."""
    W, n, ratio = 8, 40_000, 10.0
    assert cs._ratios("topk", [ratio], W, True) == [ratio, ratio * W / 2]
    assert cs._ratios("hge", [ratio], W, True) == [ratio] and cs._ratios("topk", [ratio], 2, True) == [ratio]
    x = [torch.randn(n, generator=torch.Generator().manual_seed(w)) for w in range(W)]
    layout = [Segment("p", 0, 0, n, n)]

    def recv(method, r):
        sim = cs.SimCollective(W)
        reds = [GradientReducer(method, r) for _ in range(W)]
        sim.run(lambda w, comm: reds[w].reduce(x[w], layout, comm, step=0))
        return sim.received[0]

    sketch = recv("hge", ratio)
    assert abs(recv("topk", ratio * W / 2) / sketch - 1) < 0.05
    assert abs(recv("topk", ratio) / sketch - W / 2) < 0.2


def test_dgc_and_powersgd_rows_end_to_end_and_old_rows_still_match():
    """The issue-14 peers in the harness: a dgc row (topk + momentum correction, AdamW beta1 0) and powersgd rows
    at two ranks (two all-reduces per step: P with the dense tensors, then Q); rows written before rank/dgc were
    part of the key still match their keys (rank and dgc None)."""
    rng = np.random.default_rng(1)
    corpus = Corpus(train=rng.integers(0, 256, 50_000, dtype=np.uint8),
                    val=rng.integers(0, 256, 5_000, dtype=np.uint8), source="random")
    small = dict(corpus=corpus, micro_batch=2, context=16, val_batches_n=2)
    dgc = dict(momentum=0.9, masking=True, clip=None, ramp_steps=2, ramp_start=2.0, beta1=0.0)
    d = cs.train_row("dgc", 50.0, 2, 3, dgc=dgc, **small)
    p1, p2 = (cs.train_row("powersgd", 0.0, 2, 2, rank=r, **small) for r in (1, 2))
    assert d["dgc"] == "m0.9+mask/clip-/ramp2@2/b1=0" and d["collectives_per_step"] == 2
    # the ramp's 2x and 2 * 25^(1/2) = 10x steps count, then 50x: 3 / (1/2 + 1/10 + 1/50) = 4.8x over the run
    assert d["handed_x"] == pytest.approx(3 / (1 / 2 + 1 / 10 + 1 / 50), rel=0.01)
    assert p1["rank"] == 1 and p1["collectives_per_step"] == 2
    assert p1["handed_x"] > p2["handed_x"] > 1.5 and p1["val_loss"] != p2["val_loss"]
    old = {k: v for k, v in p1.items() if k not in ("rank", "dgc")}
    assert cs._key(old) == cs._key({**p1, "method": "powersgd", "rank": None, "dgc": None})
    md = cs.render([d, p1, p2], [cs._key(r) for r in (d, p1, p2)], "cmd")
    assert "| powersgd r=2 | - | 2 | 2 |" in md and "| dgc (m0.9+mask/clip-/ramp2@2/b1=0) | 50 | 2 | 3 |" in md


def test_best_lr_summary_picks_each_methods_own_best_lr_and_prints_the_spread(tmp_path):
    """Synthetic rows: dense is best at lr 1e-3, rms at 3e-3; the delta is between the two best means, the spread
    the larger of their seed spreads, the verdict follows; an lr missing a seed is not a candidate; the plot is
    written."""
    base = dict(world=2, steps=10, micro_batch=4, context=64, n_layer=2, n_embd=64, warmup=0, rank=None, dgc=None,
                wire_x_recv=1.0, handed_x=1.0)
    vals = {("none", 1.0, 1e-3): (2.00, 2.02), ("none", 1.0, 3e-3): (2.10, 2.12),
            ("rms", 100.0, 1e-3): (2.30, 2.32), ("rms", 100.0, 3e-3): (1.90, 1.91)}
    rows = [dict(base, method=m, ratio=r, lr=lr, seed=s, val_loss=v[s]) for (m, r, lr), v in vals.items() for s in (0, 1)]
    rows.append(dict(base, method="rms", ratio=100.0, lr=1e-2, seed=0, val_loss=1.0))  # seed 1 missing: not a candidate
    wanted = [cs._key(r) for r in rows] + [cs._key(dict(rows[-1], seed=1))]
    best = {b["method"]: b for b in cs.best_rows(rows, wanted)}
    assert best["none"]["lr"] == 1e-3 and best["rms"]["lr"] == 3e-3
    assert best["rms"]["delta"] == pytest.approx(1.905 - 2.01) and best["rms"]["spread"] == pytest.approx(0.02)
    assert best["rms"]["verdict"] == "better" and best["none"]["verdict"] == "reference"
    md = "\n".join(cs.summarize(rows, wanted))
    assert "| rms | 100 | 2 | 10 | 0.003 | 1.9050 | -0.1050 | 0.0200 | better | 1.900/1.910 |" in md
    assert cs.plot(rows, wanted, tmp_path / "p.png", "t") and (tmp_path / "p.png").stat().st_size > 1000


def test_warmup_cosine_schedule_is_train_pys_and_a_separate_row_and_constant_rows_keep_their_identity():
    """``--schedule warmup_cosine``: launch/train.py's lr schedule (linear warm-up, cosine to 10%), every method
    alike; its rows are keyed apart from the constant-lr rows (which keep the store identity they had before ``schedule`` existed), and
    the table compares a cosine row with the cosine dense row."""
    assert cs.lr_factor(None, 5, 10) == 1.0
    assert cs.train.DEFAULT_WARMUP == 50
    assert cs.lr_factor("warmup_cosine", 0, 1000) == pytest.approx(1 / 50)
    assert cs.lr_factor("warmup_cosine", 49, 1000) == pytest.approx(1.0) == cs.lr_factor("warmup_cosine", 50, 1000)
    assert cs.lr_factor("warmup_cosine", 525, 1000) == pytest.approx(0.55)
    assert cs.lr_factor("warmup_cosine", 1000, 1000) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="unknown lr schedule"):
        cs.lr_factor("linear", 0, 10)
    rng = np.random.default_rng(2)
    corpus = Corpus(train=rng.integers(0, 256, 50_000, dtype=np.uint8),
                    val=rng.integers(0, 256, 5_000, dtype=np.uint8), source="random")
    small = dict(corpus=corpus, micro_batch=2, context=16, val_batches_n=2)
    const = cs.train_row("none", 1.0, 2, 3, **small)
    cos = cs.train_row("none", 1.0, 2, 3, schedule="warmup_cosine", **small)
    cos_c = cs.train_row("rms_sketch_qtopk2c256_sharded_g0.7", 20.0, 2, 3, schedule="warmup_cosine", **small)
    assert const["schedule"] is None and cos["schedule"] == "warmup_cosine"
    assert cos["val_loss"] != const["val_loss"] and cs._key(cos) != cs._key(const)
    assert "schedule" not in cs._identity(const)["settings"] and cs._identity(cos)["settings"]["schedule"] == "warmup_cosine"
    old = {k: v for k, v in const.items() if k != "schedule"}  # a row stored before the field existed
    assert cs._identity(old) == cs._identity(const) and cs._key(old) == cs._key(const)
    md = cs.render([const, cos, cos_c], [cs._key(r) for r in (const, cos, cos_c)], "cmd")
    delta = f"{cos_c['val_loss'] - cos['val_loss']:+.4f}"
    assert f"| {cos_c['val_loss']:.4f} | {delta} |" in md


def test_bf16_suffix_is_scale_dtype_and_the_reducer_gets_it():
    assert cs.qtopk_options("rms_sketch_qtopk2c256_sharded_g0.8_bf16") == {
        "bits": 2, "chunk": 256, "exchange": "sharded", "gather_share": 0.8, "scale_dtype": "bf16"}
    assert "scale_dtype" not in cs.qtopk_options("rms_sketch_qtopk2c256_sharded_g0.7")
    red = cs.make_reducer("rms_sketch_qtopk2c256_sharded_g0.8_bf16", 100.0, warmup=0, seed=0)
    assert red.compressor.scale_dtype == "bf16" and red.compressor.gather_share == 0.8


def test_rounds_are_counted_per_collective_and_cpu_seconds_leave_out_waits_and_the_networks_sums():
    """The time model's inputs: a ring all-reduce waits through 2 (W - 1) message rounds, an all-gather W - 1; a
    worker's CPU seconds are its own thread's (a sleeping worker costs none), less the collectives' arithmetic."""
    import time as _time
    assert [cs.ring_rounds(op, 4) for op in ("all_reduce", "all_gather", "all_to_all_single", "broadcast")] == [6, 3, 3, 2]
    assert cs.ring_rounds("all_reduce", 1) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        cs.ring_rounds("gossip", 4)
    sim = cs.SimCollective(4)
    a = torch.randn(256, 256)

    def fn(w, comm):
        if w == 0:
            t0 = _time.thread_time()
            while _time.thread_time() - t0 < 0.05:  # 50 ms of this worker's CPU
                a @ a
        if w == 1:
            _time.sleep(0.2)  # waiting costs no CPU
        comm.all_reduce_sum(torch.zeros(1000))
        comm.all_gather(torch.zeros(10, dtype=torch.int32))

    sim.run(fn)
    assert all(c.rounds == 9 for c in sim.wire)
    assert sim.cpu_seconds[0] >= 0.05 and sim.cpu_seconds[1] < 0.04 and max(sim.cpu_seconds[1:]) < 0.04


def test_section_settings_reach_adamw_the_preconditioner_and_sgd_and_old_rows_keep_their_identity(tmp_path):
    """``--section``: the shipped config's betas / weight decay drive dense AdamW, the rms preconditioner's beta2
    and SGD's decay (as titan_ds.comm.hooks.rms_options does on real ranks); rows without them keep their key."""
    import json
    s = cs.section_settings(str(ROOT / "ds_configs" / "compress_rms_sketch.json"))
    assert s == {"betas": "0.9,0.95", "weight_decay": 0.1}
    bad = tmp_path / "sgd.json"
    bad.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    with pytest.raises(SystemExit, match="not Adam/AdamW"):
        cs.section_settings(str(bad))
    red = cs.make_reducer("rms_sketch_qtopk2c256_sharded_g0.6_bf16", 100.0, warmup=0, seed=0, beta2=0.95)
    assert red.precondition.beta2 == 0.95 and red.precondition.kind == "rms_sketch"
    hge = cs.make_reducer("rms_sketch_hge", 100.0, warmup=0, seed=0, beta2=0.95)
    assert hge.method == "hge" and hge.precondition.kind == "rms_sketch"
    rng = np.random.default_rng(3)
    corpus = Corpus(train=rng.integers(0, 256, 50_000, dtype=np.uint8),
                    val=rng.integers(0, 256, 5_000, dtype=np.uint8), source="random")
    small = dict(corpus=corpus, micro_batch=2, context=16, val_batches_n=2)
    plain = cs.train_row("none", 1.0, 2, 3, **small)
    shipped = cs.train_row("none", 1.0, 2, 3, **s, **small)
    sk = cs.train_row("rms_sketch_hge", 20.0, 2, 3, **s, **small)
    assert shipped["val_loss"] != plain["val_loss"] and cs._key(shipped) != cs._key(plain)
    assert cs._identity(shipped)["settings"]["betas"] == "0.9,0.95"
    old = {k: v for k, v in plain.items() if k not in ("betas", "weight_decay")}
    assert cs._identity(old) == cs._identity(plain)
    for r in (plain, sk):
        assert r["compute_per_worker_step"] > 0 and r["codec_per_worker_step"] > 0
    assert sk["rounds_per_worker_step"] == 2 * 3  # HGE's two all-reduces + the sketch's one, 2 (W - 1) each


def test_pb_suffix_sets_the_preconditioners_own_beta2_and_only_that(monkeypatch):
    """``<method>_pb<b2>`` is the section's ``precondition_beta2``: the workers' reducers get that beta2 instead of the
    optimizer section's, the rest of the run (SGD, its decay, the codec) is the method's; on a method without a
    preconditioner it is refused."""
    rng = np.random.default_rng(5)
    corpus = Corpus(train=rng.integers(0, 256, 50_000, dtype=np.uint8),
                    val=rng.integers(0, 256, 5_000, dtype=np.uint8), source="random")
    small = dict(corpus=corpus, micro_batch=2, context=16, val_batches_n=2, betas="0.9,0.95", weight_decay=0.1)
    seen = []
    real = cs.make_reducer

    def spy(method, ratio, **kw):
        red = real(method, ratio, **kw)
        seen.append((method, red.precondition.beta2))
        return red

    monkeypatch.setattr(cs, "make_reducer", spy)
    base = cs.train_row("rms_sketch_qtopk2c256_sharded_g0.6_bf16", 20.0, 2, 3, **small)
    pb = cs.train_row("rms_sketch_qtopk2c256_sharded_g0.6_bf16_pb0.99", 20.0, 2, 3, **small)
    assert seen == [("rms_sketch_qtopk2c256_sharded_g0.6_bf16", 0.95)] * 2 + \
        [("rms_sketch_qtopk2c256_sharded_g0.6_bf16", 0.99)] * 2
    assert pb["val_loss"] != base["val_loss"] and cs._key(pb) != cs._key(base)
    assert pb["wire_x_recv"] == base["wire_x_recv"]
    with pytest.raises(ValueError, match="no"):
        cs.train_row("none_pb0.99", 1.0, 2, 1, **small)


def test_shipped_method_names_the_shipped_section_and_reads_back_to_it(tmp_path):
    """The held-out rows and the time model call ds_configs/compress_rms_sketch.json's section by this name: it must
    read back (``qtopk_options``) to the file's bits, chunk, exchange, gather_share and scale dtype, and a section the
    simulator cannot name is refused."""
    import json
    path = ROOT / "ds_configs" / "compress_rms_sketch.json"
    comp = json.loads(path.read_text())["titan"]["compression"]
    name = cs.shipped_method(str(path))
    assert cs.qtopk_options(name) == {"bits": comp["bits"], "chunk": comp["chunk"], "exchange": "sharded",
                                      "gather_share": comp["gather_share"], "scale_dtype": comp["scale_dtype"]}
    assert name.startswith("rms_sketch_") and cs.make_reducer(name, 100.0, warmup=0, seed=0).precondition.kind == \
        "rms_sketch"
    other = tmp_path / "topk.json"
    other.write_text(json.dumps({"titan": {"compression": {"method": "topk", "ratio": 100}}}))
    with pytest.raises(SystemExit, match="not qtopk"):
        cs.shipped_method(str(other))
