"""GPU readiness of every gradient compressor, without a GPU: ``GradientReducer.reduce`` on ``meta`` tensors.

A fake two-rank collective checks that every payload is a device tensor and leaves it as it is. Meta raises where a
GPU step would break or stall (a CPU tensor next to a device one; a host read: ``bool``/``int``/``float`` of a
device tensor, ``nonzero``), and :class:`~tests.helpers.meta.NoHostCopies` fails on host-to-device copies after the
first step (tests/helpers/meta.py). The reducer reads one value on the host per step by design, the non-finite
verdict in ``end_step`` (after the optimizer step): ``compressor._read_verdict`` is that seam, replaced here.
"""
from contextlib import nullcontext

import pytest
import torch

import titan_ds.comm.compressor as compressor_mod
from tests.helpers.meta import META, NoHostCopies, all_meta
from titan_ds.comm import GradientReducer, Segment
from titan_ds.comm.base import SparseSent
from titan_ds.comm.dgc import DGCOptions
from titan_ds.comm.precondition import RMSOptions


class MetaCollective:
    """Two ranks as one rank sees them: all-reduce leaves the sum as it is, all-gather repeats this rank's part."""

    world_size = 2
    rank = 0

    def __init__(self):
        self.calls = 0

    def all_reduce_sum(self, t):
        assert t.device == META, f"all-reduce of a {t.device} tensor"
        self.calls += 1

    def all_gather(self, t):
        assert t.device == META, f"all-gather of a {t.device} tensor"
        self.calls += 1
        return [t.clone(), t.clone()]

    def all_to_all(self, t, send=None, recv=None):
        assert t.device == META, f"all-to-all of a {t.device} tensor"
        self.calls += 1
        return t.clone() if send is None else t.new_empty(sum(recv))


@pytest.fixture
def verdicts(monkeypatch):
    """The once-per-step host read of the non-finite verdict: checked to be a device bool, answered 'finite'."""
    seen = []

    def read(bad):
        assert bad.device == META and bad.dtype == torch.bool and bad.dim() == 0
        seen.append(bad)
        return False

    monkeypatch.setattr(compressor_mod, "_read_verdict", read)
    return seen


def _layout():
    """A matrix, a vector and a 3-D tensor in one bucket, and the matrix's tail in a second (a split parameter)."""
    first = [Segment("w", 0, 0, 200, 240, (6, 40)), Segment("b", 0, 200, 6, 6, (6,)),
             Segment("c", 0, 206, 60, 60, (3, 4, 5))]
    return [first, [Segment("w", 200, 0, 40, 240, (6, 40))]]


CASES = {
    "none": dict(method="none"),
    "topk": dict(method="topk"),
    "dgc": dict(method="topk", dgc=DGCOptions(momentum=0.9, local_clip=1.0)),
    "randk": dict(method="randk"),
    "cltk": dict(method="cltk"),
    "tgss": dict(method="tgss"),
    "hge": dict(method="hge"),
    "powersgd": dict(method="powersgd", rank=2, min_compression=1.0),
    "precondition": dict(method="randk", precondition=RMSOptions()),
    "precondition_mean": dict(method="qtopk", chunk=16, precondition=RMSOptions(kind="rms_mean")),
    "precondition_sketch": dict(method="qtopk", chunk=16, exchange="sharded", precondition=RMSOptions(kind="rms_sketch")),
    "ramp": dict(method="topk", ratio_warmup_steps=2, warmup_steps=1),
    "no_error_feedback": dict(method="tgss", error_feedback=False),
    "qtopk": dict(method="qtopk", chunk=16),
    "qtopk_sharded": dict(method="qtopk", chunk=16, exchange="sharded"),
    "qtopk_sharded_bf16": dict(method="qtopk", chunk=16, exchange="sharded", scale_dtype="bf16"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reduce_on_meta(case, dtype, verdicts):
    kw = dict(CASES[case])
    red = GradientReducer(kw.pop("method"), 4.0, **kw)
    comm = MetaCollective()
    for step in range(3):
        with NoHostCopies() if step else nullcontext():
            for layout in _layout():
                n = sum(s.numel for s in layout)
                out = red.reduce(torch.empty(n, device=META, dtype=dtype), layout, comm, step)
                assert out.device == META and out.dtype == dtype and out.shape == (n,)
        red.end_step()
    assert comm.calls and len(verdicts) == 3 - red.warmup_steps
    assert all_meta([dict(st.residuals) for st in red.stores.values()])


def test_sparse_sent_on_meta():
    """Top-k's sent (values at indices): subtracted and masked without a boolean index (a host read)."""
    idx = torch.empty(8, dtype=torch.int64, device=META)
    sent = SparseSent(idx, torch.empty(8, device=META), 64)
    acc, vel = torch.empty(64, device=META), torch.empty(64, device=META)
    with NoHostCopies():
        sent.subtract_from_(acc)
        sent.zero_where_sent_(vel)
    assert sent.dense().device == META


@pytest.mark.parametrize("case", ["precondition", "precondition_sketch"])
def test_residuals_follow_the_lr_on_meta(case, verdicts, monkeypatch):
    """The lr is a host float (engine.get_lr()): rescaling every residual store, the sharded exchange's too, reads
    nothing from the device and copies nothing to it, and the residuals stay device tensors."""
    from titan_ds.comm.base import ResidualStore
    factors, scale = [], ResidualStore.scale_
    monkeypatch.setattr(ResidualStore, "scale_", lambda self, f: (factors.append(f), scale(self, f))[1])
    kw = dict(CASES[case])
    red = GradientReducer(kw.pop("method"), 4.0, **kw)
    comm = MetaCollective()
    for step, lr in enumerate([1e-4, 5e-4, 1e-3, 1e-3]):
        with NoHostCopies() if step else nullcontext():
            for layout in _layout():
                n = sum(s.numel for s in layout)
                red.reduce(torch.empty(n, device=META), layout, comm, step, lr=lr)
        red.end_step()
    # two lr changes; the sharded exchange keeps a second residual store (its owned shards)
    n_stores = 1 + len(getattr(red.compressor, "residual_stores", ()))
    assert factors == pytest.approx([0.2] * n_stores + [0.5] * n_stores)
    assert all_meta([dict(st.residuals) for st in red.stores.values()])
