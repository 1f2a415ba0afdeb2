"""qtopk's bf16 scales (``scale_dtype: "bf16"``, titan_ds/comm/qtopk.py): bit for bit the oracle that rounds each
chunk's scale to bf16 before quantizing, all-gathered and sharded; 2 bytes a chunk fewer; the budget they free; the
rounding kept by error feedback; non-finite values carried; the config's limits."""
import pytest
import torch

from tests.helpers.collectives import run_ranks
from titan_ds.comm import GradientReducer, Segment
from titan_ds.comm.base import LocalCollective
from titan_ds.comm.qtopk import (QTopKCompressor, qtopk_budget, qtopk_max_ratio, qtopk_message_bytes,
                                 reference_qtopk, reference_sharded_qtopk, shard_bounds, sharded_budgets)
from titan_ds.config import CompressionConfig


def _layout(n):
    return [Segment("w", 0, 0, n, n, (n,))]


@pytest.mark.parametrize("bits,chunk", [(2, 256), (4, 16), (8, 300)])
def test_message_is_the_bf16_oracle_bit_for_bit_and_two_bytes_a_chunk_smaller(bits, chunk):
    gen = torch.Generator().manual_seed(bits * 1000 + chunk)
    n = 3 * chunk + 17
    acc = torch.randn(n, generator=gen) * 1e-3
    k = qtopk_budget(n, 6.0, bits=bits, chunk=chunk)
    c16 = QTopKCompressor(6.0, bits=bits, chunk=chunk, scale_dtype="bf16")
    c32 = QTopKCompressor(6.0, bits=bits, chunk=chunk)
    msg16, msg32 = c16.encode(acc, k), c32.encode(acc, k)
    chunks = -(-n // chunk)
    assert msg16.numel() == qtopk_message_bytes(n, k, bits=bits, chunk=chunk, scale_dtype="bf16")
    assert msg32.numel() - msg16.numel() == 2 * chunks
    got = c16._dense(msg16, n, k, acc.device)
    assert torch.equal(got, reference_qtopk(acc, 6.0, bits=bits, chunk=chunk, k=k, scale_dtype="bf16"))
    # the rounding is real: the fp32 message decodes differently; and the message is not empty
    assert not torch.equal(got, c32._dense(msg32, n, k, acc.device))
    nz = got[got != 0].abs()
    assert nz.numel() > 0


@pytest.mark.parametrize("world,n,share", [(2, 600, 0.8), (3, 1100, 0.7), (4, 256, 0.5)])
def test_sharded_bf16_is_its_oracle_bit_for_bit_over_steps(world, n, share):
    gen = torch.Generator().manual_seed(world * 100 + n)
    comps = [QTopKCompressor(100.0, bits=2, chunk=16, exchange="sharded", gather_share=share, scale_dtype="bf16")
             for _ in range(world)]
    kept = [None] * world
    for _ in range(3):
        accs = [torch.randn(n, generator=gen) for _ in range(world)]
        outs = run_ranks(world, lambda r, comm: comps[r].reduce(accs[r], comm, 0, layout=_layout(n)))
        summed, sent, residuals = reference_sharded_qtopk(accs, 100.0, kept, bits=2, chunk=16, gather_share=share,
                                                          scale_dtype="bf16")
        for r, (out, own) in enumerate(outs):
            assert torch.equal(out, summed) and torch.equal(own.dense(), sent[r]), f"rank {r}"
        for r, (lo, hi) in enumerate(shard_bounds(n, 16, world)):
            if hi > lo:
                assert torch.equal(next(iter(comps[r].stores["shard_residuals"].residuals.values())), residuals[r])
            comps[r].stores["shard_residuals"].commit()
        kept = [r if r.numel() else None for r in residuals]


def test_error_feedback_keeps_the_rounding_of_the_scale():
    """One rank: what was sent plus the new residual is what was to be sent (the scale's rounding included)."""
    gen = torch.Generator().manual_seed(3)
    red = GradientReducer("qtopk", 20.0, bits=2, chunk=256, scale_dtype="bf16")
    n, old = 2000, torch.zeros(2000)
    for step in range(3):
        x = torch.randn(n, generator=gen)
        out = red.reduce(x.clone(), _layout(n), LocalCollective(), step)
        red.end_step()
        new = next(iter(red.residuals.residuals.values()))
        assert torch.equal(out, reference_qtopk(x + old, 20.0, bits=2, chunk=256, scale_dtype="bf16"))
        torch.testing.assert_close(out + new, x + old, rtol=0, atol=1e-6)
        old = new.clone()


def test_non_finite_values_reach_the_sum():
    acc = torch.randn(512)
    acc[7] = float("nan")
    c = QTopKCompressor(10.0, bits=2, chunk=256, scale_dtype="bf16")
    summed, _ = c.reduce(acc, LocalCollective(), 0, layout=_layout(512))
    assert not torch.isfinite(summed).all()


def test_the_bytes_freed_buy_values_and_the_config_follows():
    assert qtopk_max_ratio(bits=2, chunk=256, scale_dtype="bf16") == pytest.approx(4 * 256 / 3.25)
    n = 137_000
    assert sharded_budgets(n, 100.0, bits=2, chunk=256, gather_share=0.7) == (1, 8)
    assert sharded_budgets(n, 100.0, bits=2, chunk=256, gather_share=0.8, scale_dtype="bf16") == (1, 11)
    cfg = CompressionConfig(method="qtopk", ratio=100, chunk=256, exchange="sharded", gather_share=0.8,
                            scale_dtype="bf16")
    assert cfg.scale_dtype == "bf16"
    with pytest.raises(ValueError, match="gather_share"):  # fp32 scales: pieces at 250x, above 195x
        CompressionConfig(method="qtopk", ratio=100, chunk=256, exchange="sharded", gather_share=0.8)
    with pytest.raises(ValueError, match="scale_dtype 'bf16'"):  # 250x all-gathered: one value a chunk is 5.25 B
        CompressionConfig(method="qtopk", ratio=250, chunk=256)
    assert CompressionConfig(method="qtopk", ratio=250, chunk=256, scale_dtype="bf16")
    with pytest.raises(ValueError, match="scale_dtype"):
        CompressionConfig(method="topk", ratio=50, scale_dtype="bf16")
    with pytest.raises(ValueError):
        CompressionConfig(method="qtopk", ratio=50, scale_dtype="fp16")
    with pytest.raises(ValueError, match="scale_dtype"):
        QTopKCompressor(10.0, scale_dtype="fp16")
