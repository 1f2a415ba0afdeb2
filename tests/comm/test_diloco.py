"""Local updates with a compressed outer step (titan_ds/comm/diloco.py): the outer step against the plain-PyTorch
oracle, bit for bit, over threads and over the simulator; bytes; state; config refusals."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.collectives import run_ranks
from titan_ds.comm import GradientReducer
from titan_ds.comm.base import topk_budget
from titan_ds.comm.diloco import OuterStep, param_layout, reference_round
from titan_ds.comm.qtopk import QTopKCompressor, qtopk_budget, qtopk_message_bytes, reference_qtopk
from titan_ds.comm.wire import SimCollective, ring_allgather_bytes, ring_allreduce_bytes
from titan_ds.config import TitanConfig, TitanConfigError

SHAPES = [(7, 5), (13,), (3, 4, 2)]  # odd shapes: 35 + 13 + 24 = 72 elements


def _params(seed: int) -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"p{i}", torch.nn.Parameter(torch.randn(s, generator=g))) for i, s in enumerate(SHAPES)]


def _inner(named, rank: int, rnd: int) -> None:
    """A stand-in for H inner steps: a rank- and round-dependent move of every parameter."""
    g = torch.Generator().manual_seed(1000 * rnd + rank)
    with torch.no_grad():
        for _, p in named:
            p.add_(torch.randn(p.shape, generator=g), alpha=0.1)


def _flat(named) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for _, p in named])


QTOPK = {"bits": 2, "chunk": 16}  # 72 elements: 4 full chunks and a partial one


def _outer(method, ratio, *, mu=0.9, ef=True, scale_dtype="fp32"):
    kw = {} if method == "none" else {"error_feedback": ef, **(QTOPK if method == "qtopk" else {})}
    if scale_dtype != "fp32":
        kw["scale_dtype"] = scale_dtype
    return lambda named: OuterStep(named, GradientReducer(method, ratio, **kw), outer_lr=0.7, outer_momentum=mu)


def _run_threads(world, rounds, make):
    def fn(rank, comm):
        named = _params(0)  # identical start on every rank
        outer = make(named)
        for rnd in range(rounds):
            _inner(named, rank, rnd)
            outer.sync(comm)
        return _flat(named), outer
    return run_ranks(world, fn)


def _run_reference(world, rounds, method, ratio, mu=0.9, ef=True, scale_dtype="fp32"):
    anchor = _flat(_params(0)).clone()
    m, res = None, [None] * world
    for rnd in range(rounds):
        xs = []
        for r in range(world):
            named = [(n, torch.nn.Parameter(anchor[o:o + p.numel()].view_as(p).clone()))
                     for (n, p), o in zip(_params(0), (0, 35, 48))]
            _inner(named, r, rnd)
            xs.append(_flat(named))
        anchor, m, res = reference_round(xs, anchor, m, res, method=method, ratio=ratio, outer_lr=0.7,
                                         outer_momentum=mu, error_feedback=ef, scale_dtype=scale_dtype, **QTOPK)
    return anchor


@pytest.mark.parametrize("method,ratio,scale_dtype", [("none", 1.0, "fp32"), ("topk", 4.0, "fp32"),
                                                      ("qtopk", 4.0, "fp32"), ("qtopk", 4.0, "bf16")])
def test_outer_step_equals_reference_bitwise(method, ratio, scale_dtype):
    out = _run_threads(3, 4, _outer(method, ratio, scale_dtype=scale_dtype))
    ref = _run_reference(3, 4, method, ratio, scale_dtype=scale_dtype)
    if scale_dtype == "bf16":  # the rounding is real: not the fp32 scales' result
        assert not torch.equal(ref, _run_reference(3, 4, method, ratio))
    for x, _ in out:
        assert torch.equal(x, ref)
    assert not torch.equal(ref, _flat(_params(0)))


@pytest.mark.parametrize("method", ["topk", "qtopk"])
def test_outer_momentum_and_error_feedback_change_the_result(method):
    base = _run_reference(2, 3, method, 4.0)
    assert not torch.equal(_run_threads(2, 3, _outer(method, 4.0, mu=0.0))[0][0], base)
    assert not torch.equal(_run_threads(2, 3, _outer(method, 4.0, ef=False))[0][0], base)
    assert torch.equal(_run_threads(2, 3, _outer(method, 4.0, ef=False))[0][0],
                       _run_reference(2, 3, method, 4.0, ef=False))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("chunk,n", [(16, 72), (256, 1000), (300, 1000), (4096, 9000)])
def test_qtopk_message_equals_reference_and_its_bytes_are_its_real_size(bits, chunk, n):
    """One worker: what it sends (decoded from its packed message) is the oracle's, bit for bit; the message is a
    uint8 tensor of the size the budget promised, within 4 n / ratio bytes; W workers each receive (W-1) of them."""
    ratio, world = 10.0, 3
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(17 * r + bits)) for r in range(world)]
    xs[0][5] = 0.0  # an exact zero and a partial last chunk (n % chunk) on the way
    comp = QTopKCompressor(ratio, bits=bits, chunk=chunk)
    k = qtopk_budget(n, ratio, bits=bits, chunk=chunk)
    msg = comp.encode(xs[0], k)
    assert msg.dtype == torch.uint8 and msg.numel() == qtopk_message_bytes(n, k, bits=bits, chunk=chunk)
    assert msg.numel() <= 4 * n / ratio or k == 1
    sim = SimCollective(world)
    out = sim.run(lambda w, comm: comp.reduce(xs[w].clone(), comm, 0, layout=[]))
    refs = [reference_qtopk(x, ratio, bits=bits, chunk=chunk) for x in xs]
    for w in range(world):
        assert torch.equal(out[w][1].dense(), refs[w])
        assert torch.equal(out[w][0], refs[0] + refs[1] + refs[2])
    assert sim.received == [(world - 1) * msg.numel()] * world
    levels = 2 ** (bits - 1)
    for lo in range(0, n, chunk):  # each chunk: k values (fewer only in a short last chunk), each within half a level
        x, s = xs[0][lo:lo + chunk], refs[0][lo:lo + chunk]
        sel = s != 0
        assert int(sel.sum()) == min(k, x.numel())
        scale = x[sel].abs().max()
        assert bool(((x[sel] - s[sel]).abs() <= scale / (2 * levels) + 1e-6 * scale).all())
        assert bool(((torch.sign(s[sel]) == torch.sign(x[sel])) | (x[sel] == 0)).all())


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("chunk,n", [(16, 1000), (300, 5000)])
def test_qtopk_blocks_change_nothing(monkeypatch, bits, chunk, n):
    """encode/decode run block by block (a few chunks each here, several blocks and a partial last one): the
    message is the one-block message byte for byte, and the sums are the oracle's."""
    from titan_ds.comm import qtopk
    ratio, world = 6.0, 2
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(5 * r + bits)) for r in range(world)]
    comp = QTopKCompressor(ratio, bits=bits, chunk=chunk)
    k = qtopk_budget(n, ratio, bits=bits, chunk=chunk)
    whole = comp.encode(xs[0], k)
    assert len(comp._blocks(-(-n // chunk))) == 1
    monkeypatch.setattr(qtopk, "BLOCK", 5 * chunk)  # 4 chunks a block
    assert len(comp._blocks(-(-n // chunk))) > 2
    assert torch.equal(comp.encode(xs[0], k), whole)
    out = SimCollective(world).run(lambda w, comm: comp.reduce(xs[w].clone(), comm, 0, layout=[]))
    refs = [reference_qtopk(x, ratio, bits=bits, chunk=chunk) for x in xs]
    for w in range(world):
        assert torch.equal(out[w][1].dense(), refs[w]) and torch.equal(out[w][0], refs[0] + refs[1])


def test_qtopk_sends_more_coordinates_than_topk_and_error_feedback_keeps_the_rest():
    """At the same bytes 2-bit qtopk sends > 3x topk's coordinates (2-byte in-chunk index + 2 bits against 8 bytes);
    the reducer's residual is what was not sent: acc where nothing was sent, the quantization error where it was."""
    n, ratio = 4 * 4096 - 5, 20.0
    named = [("w", torch.nn.Parameter(torch.zeros(n)))]
    reducer = GradientReducer("qtopk", ratio, bits=2, chunk=4096)
    acc = torch.randn(n, generator=torch.Generator().manual_seed(3))
    layout = param_layout(named)
    summed = SimCollective(1).run(lambda w, comm: reducer.reduce(acc.clone(), layout, comm, 0))[0]
    reducer.end_step()
    sent = reference_qtopk(acc, ratio, bits=2, chunk=4096)
    assert torch.equal(summed, sent)
    assert int((sent != 0).sum()) > 3 * topk_budget(n, ratio)
    residual = torch.zeros(n)
    reducer.residuals.add_into(residual, layout)
    assert torch.equal(residual, acc - sent)
    assert torch.equal(residual[sent == 0], acc[sent == 0])
    assert bool((residual[sent != 0].abs() < acc[sent != 0].abs()).all())


def test_qtopk_refuses_bits_and_chunks_it_cannot_pack():
    for kw, words in [({"bits": 3}, "bits=3"), ({"chunk": 1}, "chunk=1"), ({"chunk": 70000}, "chunk=70000")]:
        with pytest.raises(ValueError, match=words):
            QTopKCompressor(10.0, **kw)


def test_qtopk_config_keys_reach_the_reducer_and_refusals_name_the_fix():
    """bits/chunk are qtopk's own keys (another method refuses them), validated where a user writes them; a ratio
    above one value per chunk is refused naming the fix; the pillar builds the reducer from them, per step and for
    the outer step; the shipped DiLoCo config is qtopk's H=20 x ratio 5 = 100x received at W=2."""
    from titan_ds.comm.hooks import CompressionPillar
    from titan_ds.comm.qtopk import qtopk_max_ratio
    for comp in ({"method": "qtopk", "ratio": 30, "bits": 8, "chunk": 1000},
                 {"method": "qtopk", "ratio": 5, "bits": 4, "chunk": 64, "sync_every": 10}):
        pillar = CompressionPillar(TitanConfig(compression=comp))
        pillar.apply(None)
        c = pillar.reducer.compressor
        assert (type(c), c.ratio, c.bits, c.chunk) == (QTopKCompressor, comp["ratio"], comp["bits"], comp["chunk"])
    assert qtopk_max_ratio(bits=2, chunk=256) == 4 * 256 / 5.25
    TitanConfig(compression={"method": "qtopk", "ratio": 195, "chunk": 256})
    for bad, words in [({"method": "qtopk", "ratio": 196}, r"ratio=196 .*chunk=256.*at most 195.*raise chunk"),
                       ({"method": "qtopk", "ratio": 193, "chunk": 300}, r"at most 192x.*raise chunk"),
                       ({"method": "qtopk", "bits": 3}, r"bits must be one of 2, 4 or 8, got 3"),
                       ({"method": "qtopk", "chunk": 1}, r"chunk must be >= 2"),
                       ({"method": "qtopk", "chunk": 65537}, r"chunk must be <= 65536"),
                       ({"method": "topk", "bits": 4}, r"has bits, which method='topk' does not use"),
                       ({"method": "randk", "chunk": 256}, r"has chunk, which method='randk' does not use"),
                       ({"method": "qtopk", "momentum": 0.9}, r"has momentum, which method='qtopk' does not use"),
                       ({"method": "qtopk", "sketch_rows": 2}, r"has sketch_rows, which method='qtopk' does not use"),
                       ({"method": "qtopk", "sync_every": 20, "precondition": "rms"}, r"remove precondition"),
                       ({"method": "qtopk", "sync_every": 20, "ratio_warmup_steps": 5}, r"ratio_warmup_steps")]:
        with pytest.raises(TitanConfigError, match=words):
            TitanConfig(compression=bad)
    import json

    from tests.helpers.launch import ROOT
    shipped = TitanConfig.from_ds_config(ROOT / "launch/experiments/configs/compress_diloco_qtopk.json").compression
    assert (shipped.method, shipped.bits, shipped.chunk, shipped.sync_every) == ("qtopk", 2, 256, 20)
    assert shipped.sync_every * shipped.ratio * 2 / 2 == 100  # H x ratio x 2 / W received at W=2 (bench_diloco)
    assert json.loads((ROOT / "launch/experiments/configs/compress_diloco_qtopk.json").read_text())["gradient_clipping"] == 0.0


def test_bench_diloco_builds_qtopk_through_the_registry():
    from launch.bench.bench_diloco import _reducer
    red = _reducer("qtopk4c64", 5.0, 0)
    assert (red.method, type(red.compressor), red.compressor.bits, red.compressor.chunk) == \
        ("qtopk", QTopKCompressor, 4, 64)
    assert _reducer("qtopk2", 5.0, 0).compressor.chunk == 4096  # the simulator's names keep their meaning


def test_simulator_equals_threads_and_counts_received_bytes():
    world, rounds = 4, 3
    threads = _run_threads(world, rounds, _outer("topk", 4.0))
    sim = SimCollective(world)
    named = [_params(0) for _ in range(world)]
    outers = [_outer("topk", 4.0)(n) for n in named]
    for rnd in range(rounds):
        for r in range(world):
            _inner(named[r], r, rnd)
        sim.run(lambda w, comm: outers[w].sync(comm))
    for r in range(world):
        assert torch.equal(_flat(named[r]), threads[r][0])
    k = int(72 / 8.0)  # topk_budget(72, 4)
    per_round = 2 * ring_allgather_bytes(4 * k, world)  # int32 indices and fp32 values
    assert sim.received == [rounds * per_round] * world
    dense = ring_allreduce_bytes(4 * 72, world)
    assert dense / per_round == 2.0  # ratio 4 sent, but received is ratio * 2 / W: it shrinks as W grows


def test_state_round_trip_resumes_bitwise():
    def fn(rank, comm, stop=None):
        named = _params(0)
        outer = _outer("topk", 4.0)(named)
        for rnd in range(4):
            if rnd == 2:
                saved = (outer.state_dict(), outer.reducer.state_dict(),
                         [p.detach().clone() for _, p in named])
                named = _params(0)
                outer = _outer("topk", 4.0)(named)
                outer.load_state_dict(saved[0])
                outer.reducer.load_state_dict(saved[1])
                with torch.no_grad():
                    for (_, p), s in zip(named, saved[2]):
                        p.copy_(s)
            _inner(named, rank, rnd)
            outer.sync(comm)
        return _flat(named)
    resumed = run_ranks(2, fn)
    straight = _run_threads(2, 4, _outer("topk", 4.0))
    for a, (b, _) in zip(resumed, straight):
        assert torch.equal(a, b)


def test_config_refusals():
    ok = TitanConfig(compression={"method": "randk", "ratio": 5, "sync_every": 20, "outer_lr": 0.7})
    assert ok.compression.sync_every == 20
    for bad, words in [({"method": "topk", "outer_lr": 0.5}, "sync_every"),
                       ({"method": "topk", "sync_every": 10, "precondition": "rms"}, "precondition"),
                       ({"method": "topk", "sync_every": 10, "momentum": 0.9}, "momentum"),
                       ({"method": "topk", "sync_every": 10, "warmup_steps": 5}, "warmup_steps"),
                       ({"method": "topk", "sync_every": 0}, "sync_every")]:
        with pytest.raises(TitanConfigError, match=words):
            TitanConfig(compression=bad)


def _problems(comp: dict, ds: dict, world: int = 2, titan: dict | None = None) -> list[str]:
    from titan_ds.pillar import View
    from titan_ds.rules import problems
    cfg = TitanConfig(compression=comp, **(titan or {}))
    return problems(View.of(cfg, {"train_micro_batch_size_per_gpu": 1, **ds}, torch.nn.Linear(2, 2),
                            world_size=world))


LOCAL = {"method": "randk", "ratio": 5, "sync_every": 20}


def test_rules_accept_zero0_fp32_and_refuse_what_local_updates_cannot_do():
    assert _problems(LOCAL, {"zero_optimization": {"stage": 0}}) == []
    for ds, world, titan, words in [
            ({"zero_optimization": {"stage": 1}}, 2, None, "needs ZeRO stage 0"),
            ({"zero_optimization": {"stage": 3}}, 2, None, "needs ZeRO stage 0"),
            ({"bf16": {"enabled": True}}, 2, None, "train in fp32"),
            ({"fp16": {"enabled": True}}, 2, None, "train in fp32"),
            ({"gradient_clipping": 1.0}, 2, None, "gradient_clipping"),
            ({}, 2, {"optimizer": {"name": "asdt", "step_in_backward": True}}, "step_in_backward to false")]:
        got = _problems(LOCAL, ds, world, titan)
        assert any(words in m and "sync_every=20" in m for m in got), (ds, got)
    assert any("at least 2" in m for m in _problems(LOCAL, {}, 1))
    assert any("sync_every=20" in m and "at least 2" in m for m in _problems({"method": "none", "sync_every": 20}, {}, 1))


@pytest.mark.slow
def test_two_ranks_deepspeed_path_equals_reference_and_simulator(tmp_path):
    """ZeRO-0, 2 real ranks, sync_every 4, methods none, topk and qtopk (bits 4, chunk 100: set in the ds_config):
    DeepSpeed's parameters equal the oracle's and the simulator's bit for bit; a mid-round checkpoint resumes bit
    for bit; received bytes on torch.distributed equal the simulator's plus DeepSpeed's own 4-byte all-reduce per
    step, and for qtopk the message size formula per sync; the per-step all-reduce is off while installed and back
    after uninstall."""
    import json

    from tests.helpers.launch import ROOT, run_deepspeed
    out = tmp_path / "diloco.json"
    proc = run_deepspeed(ROOT / "tests/comm/multirank_diloco.py", "--steps", "12", "--sync-every", "4",
                         "--out", str(out), timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for method in ("none", "topk", "qtopk"):
        r = res[method]
        assert r["moved"] and r["ranks_equal"] and r["equals_reference"] and r["equals_simulator"], (method, r)
        assert r["resume_bit_exact"] and r["allreduce_off"] and r["allreduce_restored"], (method, r)
        steps = 12
        assert r["received_real"] == [r["received_sim"][0] + 4.0 * steps] * 2, (method, r)
    assert res["topk"]["received_real"][0] < res["none"]["received_real"][0] / 3
    n = res["qtopk"]["params"]
    k = qtopk_budget(n, 4.0, bits=4, chunk=100)
    # 3 syncs, each an all-gather of one uint8 message per rank: (W - 1) = 1 message received
    assert res["qtopk"]["received_real"] == [3 * qtopk_message_bytes(n, k, bits=4, chunk=100) + 4.0 * steps] * 2
    assert 3 * qtopk_message_bytes(n, k, bits=4, chunk=100) <= 3 * 4 * n / 4.0
