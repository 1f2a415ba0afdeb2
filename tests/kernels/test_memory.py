"""Memory contract: saved-activation bytes of tiled attention and StripeFFN grow linearly in sequence length and,
at L=2048 on the seed model's shapes (8 heads of 32, width 256), are at most 1/8 of eager attention's."""
import pytest
import torch
from torch import nn

from titan_ds.kernels.attention import eager_attention, tiled_attention_reference
from titan_ds.kernels.saved import SavedTensorMeter
from titan_ds.kernels.stripe_ffn import StripeFFN

H, DH, WIDTH = 8, 32, 256
LENGTHS = (256, 512, 1024, 2048)


def _attn_saved(fn, L):
    q, k, v = (torch.randn(1, H, L, DH, requires_grad=True) for _ in range(3))
    with SavedTensorMeter() as m:
        fn(q, k, v)
    return m.bytes


def _mlp_saved(mlp, L):
    x = torch.randn(1, L, WIDTH, requires_grad=True)
    with SavedTensorMeter(exclude=mlp.parameters()) as m:
        mlp(x)
    return m.bytes


@pytest.fixture(scope="module")
def measured():
    torch.manual_seed(0)
    fc, out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
    eager_mlp = nn.Sequential(fc, nn.GELU(), out)
    stripe = StripeFFN.plain(fc, nn.GELU(), out, stripe=256)
    rows = {}
    for L in LENGTHS:
        rows[L] = dict(
            tiled=_attn_saved(lambda q, k, v: tiled_attention_reference(q, k, v, causal=True, tile=128), L),
            eager=_attn_saved(lambda q, k, v: eager_attention(q, k, v, causal=True), L),
            stripe=_mlp_saved(stripe, L),
            eager_mlp=_mlp_saved(eager_mlp, L),
        )
    return rows


def test_linear_in_sequence_length(measured):
    for key in ("tiled", "stripe"):
        per_token = [measured[L][key] / L for L in LENGTHS]
        assert max(per_token) == pytest.approx(min(per_token), rel=0.01), (key, per_token)
    # the oracle is sensitive: eager attention's per-token bytes grow with L
    eager_per_token = [measured[L]["eager"] / L for L in LENGTHS]
    assert eager_per_token[-1] > 4 * eager_per_token[0]


def test_at_2048_at_most_an_eighth_of_eager(measured):
    row = measured[2048]
    assert row["tiled"] <= row["eager"] / 8, row
    assert row["stripe"] <= row["eager_mlp"] / 8, row
    assert row["tiled"] + row["stripe"] <= row["eager"] / 8, row


def test_exact_saved_bytes(measured):
    """Tiled attention keeps q, k, v, out (fp32) and the fp32 log-sum-exp; StripeFFN keeps its input only."""
    L = 1024
    assert measured[L]["tiled"] == 4 * (H * L * DH * 4) + H * L * 4
    assert measured[L]["stripe"] == L * WIDTH * 4


def test_meter_sees_eager_scores():
    """The meter's oracle: the eager softmax output, a (L, L) matrix per head, is counted."""
    assert _attn_saved(lambda q, k, v: eager_attention(q, k, v), 64) >= H * 64 * 64 * 4
