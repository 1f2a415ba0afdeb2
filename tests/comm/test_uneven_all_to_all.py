"""All-to-all with splits (titan_ds/comm/base.py ``Collective``): each piece crosses the wire at its own size, in the
simulator, the thread collective of the tests and the byte count of the real path; the sharded exchange now
receives its pieces unpadded (titan_ds/comm/qtopk.py, "Sharded exchange")."""
import pytest
import torch
import torch.distributed as dist

from tests.helpers.collectives import run_ranks
from titan_ds.comm import Segment
from titan_ds.comm.base import LocalCollective, check_splits
from titan_ds.comm.qtopk import QTopKCompressor, qtopk_message_bytes, shard_bounds, sharded_budgets
from titan_ds.comm.wire import SimCollective, WireCount, count_collectives, split_bytes

W = 3
SEND = [[1, 0, 4], [2, 2, 2], [0, 3, 1]]  # SEND[i][j]: what worker i sends worker j


def _payload(i):
    return torch.arange(sum(SEND[i]), dtype=torch.float32) + 100 * i


def _expected(w):
    return torch.cat([torch.split(_payload(i), SEND[i])[w] for i in range(W)])


def test_the_simulator_delivers_each_piece_and_counts_its_own_bytes():
    sim = SimCollective(W)
    out = sim.run(lambda w, comm: comm.all_to_all(_payload(w), SEND[w], [SEND[i][w] for i in range(W)]))
    for w in range(W):
        assert torch.equal(out[w], _expected(w))
        sent = 4 * (sum(SEND[w]) - SEND[w][w])
        received = 4 * (sum(SEND[i][w] for i in range(W)) - SEND[w][w])
        assert (sim.wire[w].sent, sim.wire[w].received) == (sent, received)


def test_the_thread_collective_of_the_tests_agrees_with_the_simulator():
    out = run_ranks(W, lambda r, comm: comm.all_to_all(_payload(r), SEND[r], [SEND[i][r] for i in range(W)]))
    assert all(torch.equal(out[w], _expected(w)) for w in range(W))


def test_disagreeing_splits_and_bad_splits_are_refused():
    sim = SimCollective(2)
    with pytest.raises(RuntimeError, match="splits disagree"):
        sim.run(lambda w, comm: comm.all_to_all(torch.zeros(3), [1, 2], [1, 1]))
    with pytest.raises(ValueError, match="both send and recv"):
        check_splits(torch.zeros(3), 2, [1, 2], None)
    with pytest.raises(ValueError, match="add up to 4"):
        check_splits(torch.zeros(3), 2, [2, 2], [1, 1])
    with pytest.raises(ValueError, match="2 non-negative entries"):
        check_splits(torch.zeros(3), 2, [3], [1, 1])
    with pytest.raises(ValueError, match="equal pieces"):
        check_splits(torch.zeros(3), 2, None, None)
    assert torch.equal(LocalCollective().all_to_all(torch.ones(2), [2], [2]), torch.ones(2))


def test_the_real_path_counts_an_all_to_all_with_splits_piece_by_piece(monkeypatch):
    """count_collectives on torch.distributed (the backend itself replaced: no process group here)."""
    calls = []
    monkeypatch.setattr(dist, "all_to_all_single", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    count = WireCount()
    with count_collectives(count):
        t = torch.zeros(6, dtype=torch.uint8)
        dist.all_to_all_single(output=torch.zeros(5, dtype=torch.uint8), input=t, output_split_sizes=[1, 2, 2],
                               input_split_sizes=[2, 2, 2])
        dist.all_to_all_single(torch.zeros(6, dtype=torch.uint8), t)  # equal pieces: the ring formula
    assert len(calls) == 2
    assert count.calls == {"all_to_all_single": 2}
    assert split_bytes([2, 2, 2], [1, 2, 2], 1, 1) == (4.0, 3.0)
    assert (count.sent, count.received) == (4.0 + 4.0, 3.0 + 4.0)


def _layout(n):
    return [Segment("w", 0, 0, n, n, (n,))]


@pytest.mark.parametrize("world,n", [(4, 5 * 16 + 3), (6, 9 * 16), (3, 7 * 16)])
def test_the_sharded_exchange_receives_its_pieces_unpadded(world, n):
    """Shards one chunk apart (and a short last one): every worker receives exactly the others' pieces for its shard
    and the other owners' messages, not ``world`` times the largest."""
    chunk, ratio, share = 16, 8.0, 0.6
    gen = torch.Generator().manual_seed(world + n)
    accs = [torch.randn(n, generator=gen) for _ in range(world)]
    comps = [QTopKCompressor(ratio, bits=2, chunk=chunk, exchange="sharded", gather_share=share)
             for _ in range(world)]
    sim = SimCollective(world)
    sim.run(lambda w, comm: comps[w].reduce(accs[w], comm, 0, layout=_layout(n)))
    k, k2 = sharded_budgets(n, ratio, bits=2, chunk=chunk, gather_share=share)
    bounds = shard_bounds(n, chunk, world)
    lens = [qtopk_message_bytes(hi - lo, k, bits=2, chunk=chunk) if hi > lo else 0 for lo, hi in bounds]
    lens2 = [qtopk_message_bytes(hi - lo, k2, bits=2, chunk=chunk) if hi > lo else 0 for lo, hi in bounds]
    assert len(set(lens)) > 1  # the case: unequal pieces
    for w in range(world):
        assert sim.received[w] == (world - 1) * lens[w] + sum(lens2) - lens2[w]
        assert sim.received[w] < (world - 1) * (max(lens) + max(lens2))  # what the padded exchange received
