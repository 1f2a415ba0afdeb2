"""qtopk's sharded exchange (titan_ds/comm/qtopk.py, "Sharded exchange"): bit for bit its oracle over several steps,
identical sums on every rank, received bytes flat in the number of ranks, checkpointed shard residuals, refusals."""
import pytest
import torch

from tests.helpers.collectives import run_ranks
from titan_ds.comm import GradientReducer, Segment
from titan_ds.comm.qtopk import QTopKCompressor, reference_sharded_qtopk, shard_bounds
from titan_ds.comm.wire import SimCollective
from titan_ds.config import CompressionConfig

RATIO, BITS, CHUNK = 8.0, 4, 16


def _layout(n):
    return [Segment("w", 0, 0, n - 7, n - 7, (n - 7,)), Segment("b", 0, n - 7, 7, 7, (7,))]


@pytest.mark.parametrize("world,n,share", [(2, 100, 0.5), (3, 257, 0.5), (5, 64, 0.5), (4, 16, 0.5),  # (4, 16):
                                           (3, 257, 0.75), (2, 100, 0.3)])              # one chunk, 3 empty shards
def test_sharded_reduce_is_its_oracle_bit_for_bit_over_steps(world, n, share):
    gen = torch.Generator().manual_seed(world * 1000 + n)
    steps = [[torch.randn(n, generator=gen) for _ in range(world)] for _ in range(3)]
    comps = [QTopKCompressor(RATIO, bits=BITS, chunk=CHUNK, exchange="sharded", gather_share=share)
             for _ in range(world)]
    kept = [None] * world
    for accs in steps:
        outs = run_ranks(world, lambda r, comm: comps[r].reduce(accs[r], comm, 0, layout=_layout(n)))
        summed, sent, residuals = reference_sharded_qtopk(accs, RATIO, kept, bits=BITS, chunk=CHUNK,
                                                          gather_share=share)
        for r, (out, own) in enumerate(outs):
            assert torch.equal(out, summed), f"rank {r}'s sum"
            assert torch.equal(own.dense(), sent[r]), f"rank {r}'s sent"
        for r, (lo, hi) in enumerate(shard_bounds(n, CHUNK, world)):
            stored = list(comps[r].stores["shard_residuals"].residuals.values())
            if hi > lo:
                assert len(stored) == 1 and torch.equal(stored[0], residuals[r])
            else:
                assert stored == []
            comps[r].stores["shard_residuals"].commit()
        kept = [r if r.numel() else None for r in residuals]


def test_shard_bounds_are_whole_chunks_tiling_the_vector():
    for n, chunk, world in [(100, 16, 3), (16, 16, 4), (1000, 7, 9), (5, 2, 2)]:
        b = shard_bounds(n, chunk, world)
        assert b[0][0] == 0 and b[-1][1] == n and all(b[i][1] == b[i + 1][0] for i in range(world - 1))
        assert all(lo % chunk == 0 for lo, hi in b if hi > lo)


def _received_per_worker(world, n, exchange):
    sim = SimCollective(world)
    gen = torch.Generator().manual_seed(0)
    accs = [torch.randn(n, generator=gen) for _ in range(world)]
    comps = [QTopKCompressor(100.0, bits=2, chunk=256, exchange=exchange) for _ in range(world)]
    outs = sim.run(lambda w, comm: comps[w].reduce(accs[w], comm, 0, layout=_layout(n))[0])
    assert all(torch.equal(o, outs[0]) for o in outs)
    return max(sim.received) / (2 * (world - 1) / world * 4 * n)  # of a dense fp32 ring all-reduce


def test_received_bytes_stay_flat_in_the_number_of_ranks():
    n = 256 * 64
    gathered = [_received_per_worker(w, n, "all_gather") for w in (2, 8, 32)]
    sharded = [_received_per_worker(w, n, "sharded") for w in (2, 8, 32)]
    assert gathered[2] > 10 * gathered[0]  # all-gather: ~W/2 times the message's share
    assert all(s <= 1.15 / 100 for s in sharded), sharded  # ~1/ratio of dense at every W (padding: < 15%)


def test_shard_residuals_are_checkpointed_and_rolled_back():
    n, world = 300, 3
    gen = torch.Generator().manual_seed(1)
    accs = [[torch.randn(n, generator=gen) for _ in range(world)] for _ in range(3)]

    def run(reds, steps):
        out = None
        for s in steps:
            out = run_ranks(world, lambda r, comm: reds[r].reduce(accs[s][r].clone(), _layout(n), comm, s))
            for red in reds:
                red.end_step()
        return out

    make = lambda: GradientReducer("qtopk", RATIO, bits=BITS, chunk=CHUNK, exchange="sharded")  # noqa: E731
    reds = [make() for _ in range(world)]
    run(reds, [0, 1])
    saved = [red.state_dict() for red in reds]
    assert all("shard_residuals" in s["stores"] and s["stores"]["shard_residuals"] for s in saved)
    want = run(reds, [2])
    fresh = [make() for _ in range(world)]
    for red, s in zip(fresh, saved):
        red.load_state_dict(s)
    got = run(fresh, [2])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # a skipped step (rollback) leaves the shard residuals as they were
    before = [{k: v.clone() for k, v in red.stores["shard_residuals"].residuals.items()} for red in fresh]
    run_ranks(world, lambda r, comm: fresh[r].reduce(accs[0][r].clone(), _layout(n), comm, 3))
    for red in fresh:
        red.stores["shard_residuals"].rollback()
    for red, b in zip(fresh, before):
        assert all(torch.equal(red.stores["shard_residuals"].residuals[k], v) for k, v in b.items())


def test_config_exchange_is_qtopk_only_and_needs_error_feedback():
    cfg = CompressionConfig(method="qtopk", ratio=50, chunk=4096, exchange="sharded")
    assert cfg.exchange == "sharded"
    with pytest.raises(ValueError, match="exchange"):
        CompressionConfig(method="topk", ratio=50, exchange="sharded")
    with pytest.raises(ValueError, match="error_feedback"):
        CompressionConfig(method="qtopk", ratio=50, chunk=4096, exchange="sharded", error_feedback=False)
    with pytest.raises(ValueError, match="exchange"):
        QTopKCompressor(10.0, exchange="ring")
    with pytest.raises(ValueError, match="gather_share"):
        CompressionConfig(method="qtopk", ratio=50, chunk=4096, gather_share=0.7)
    with pytest.raises(ValueError, match="gather_share"):  # the pieces would need 150x at chunk 256 (max ~195x)...
        CompressionConfig(method="qtopk", ratio=100, chunk=256, exchange="sharded", gather_share=0.1)
    assert CompressionConfig(method="qtopk", ratio=100, chunk=256, exchange="sharded", gather_share=0.6)
    with pytest.raises(ValueError, match="gather_share"):
        QTopKCompressor(10.0, exchange="sharded", gather_share=1.0)


def test_gather_share_moves_bytes_between_the_two_messages():
    from titan_ds.comm.qtopk import sharded_budgets
    n = 256 * 40
    k1, k2 = sharded_budgets(n, 100.0, bits=4, chunk=256, gather_share=0.5)
    assert k1 == k2
    k1b, k2b = sharded_budgets(n, 100.0, bits=4, chunk=256, gather_share=0.75)
    assert k1b < k1 < k2b


@pytest.mark.parametrize("world,n,k,scale_dtype", [(3, 257, 3, "fp32"), (5, 64, 2, "bf16"), (4, 16, 5, "fp32"),
                                                   (7, 1000, 1, "bf16")])
def test_all_shards_at_once_are_each_shard_encoded_alone_byte_for_byte(world, n, k, scale_dtype):
    """The exchange encodes every shard's message in one pass over the vector and decodes the owners' messages in
    one gather; each message is byte for byte ``encode`` of its shard, and the decode is each message's."""
    comp = QTopKCompressor(RATIO, bits=BITS, chunk=CHUNK, exchange="sharded", scale_dtype=scale_dtype)
    acc = torch.randn(n, generator=torch.Generator().manual_seed(n))
    plan = comp._layout(n, k, world, acc.device)
    messages, (pos, val) = comp._encode_shards(acc, k, plan)
    alone = [comp.encode(acc[lo:hi], k) if hi > lo else torch.zeros(0, dtype=torch.uint8)
             for lo, hi in shard_bounds(n, CHUNK, world)]
    assert torch.equal(messages, torch.cat(alone)) and plan.lens == [m.numel() for m in alone]
    want = [comp._entries(m, hi - lo, k, lo) for m, (lo, hi) in zip(alone, shard_bounds(n, CHUNK, world)) if hi > lo]
    assert torch.equal(pos, torch.cat([p for p, _ in want])) and torch.equal(val, torch.cat([v for _, v in want]))
    dpos, dval = comp._decode_shards(messages, plan)
    dense = torch.zeros(-(-n // CHUNK) * CHUNK)
    dense.index_put_((dpos,), dval)
    for m, (lo, hi) in zip(alone, shard_bounds(n, CHUNK, world)):
        if hi > lo:
            assert torch.equal(dense[lo:hi], comp._dense(m, hi - lo, k, acc.device))


def test_the_exchange_dispatches_about_one_op_more_per_rank():
    """Each rank's reduce dispatches a fixed number of tensor ops plus one per rank (the owner's sum in rank order),
    not a decode per message (~170 ops a rank before: each an accelerator kernel launch); counted on meta by
    launch/bench/exchange_ops.py (the shipped section)."""
    from launch.bench.exchange_ops import count, is_view
    small, large = count(4, 64 * 256), count(32, 64 * 256)
    launches = [sum(v for k, v in c.items() if not is_view(k)) for c in (small, large)]
    assert sum(large.values()) - sum(small.values()) <= 6 * (32 - 4), (small, large)
    assert launches[1] - launches[0] <= 2 * (32 - 4), launches
    assert large["aten.index_add_.default"] == 32  # the owner's W pieces, in rank order
