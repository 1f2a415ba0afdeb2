"""Tiled attention (reference backend) vs F.scaled_dot_product_attention: outputs and every input gradient, fp32."""
import math

import pytest
import torch
import torch.nn.functional as F

from titan_ds.kernels.attention import TiledAttention, eager_attention, tiled_attention_reference

# fp32 on CPU: the tiled sum is a reordering of SDPA's; errors are a few ulps of O(1) values times sqrt(T).
ATOL, RTOL = 2e-5, 2e-5


def _inputs(B, H, Tq, Tk, D, noncontig=False):
    if noncontig:  # (B, T, H, D) storage viewed as (B, H, T, D), as models produce it
        q, k, v = (torch.randn(B, T, H, D).transpose(1, 2) for T in (Tq, Tk, Tk))
    else:
        q, k, v = torch.randn(B, H, Tq, D), torch.randn(B, H, Tk, D), torch.randn(B, H, Tk, D)
    return [t.requires_grad_() for t in (q, k, v)]


def _grads(fn, q, k, v, g):
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    return out, dq, dk, dv


def _assert_all_close(ours, ref):
    for a, b, name in zip(ours, ref, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,D,tile", [(37, 32, 16), (64, 64, 16), (5, 48, 16), (50, 128, 32), (33, 32, 64)])
def test_matches_sdpa(causal, T, D, tile):
    q, k, v = _inputs(2, 3, T, T, D, noncontig=(T == 37))
    g = torch.randn(2, 3, T, D)
    ref = _grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), q, k, v, g)
    ours = _grads(lambda a, b, c: tiled_attention_reference(a, b, c, causal=causal, tile=tile), q, k, v, g)
    _assert_all_close(ours, ref)


@pytest.mark.parametrize("causal", [True, False])
def test_ragged_lengths_with_padding_mask(causal):
    """Right-padded batch with lengths 29, 7, 1 of T=29: pads neither influence real rows nor get gradients."""
    B, H, T, D = 3, 2, 29, 32
    lengths = torch.tensor([29, 7, 1])
    kpm = torch.arange(T)[None, :] < lengths[:, None]
    q, k, v = _inputs(B, H, T, T, D)
    g = torch.randn(B, H, T, D)
    dense = kpm[:, None, None, :]
    if causal:
        dense = dense & torch.ones(T, T, dtype=torch.bool).tril()
    ref = _grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=dense), q, k, v, g)
    ours = _grads(lambda a, b, c: tiled_attention_reference(a, b, c, causal=causal, key_padding_mask=kpm, tile=8),
                  q, k, v, g)
    _assert_all_close(ours, ref)
    dk = ours[2]
    assert torch.all(dk[1, :, 7:] == 0) and torch.all(dk[2, :, 1:] == 0)  # padded keys get exactly no gradient


def test_cross_lengths_and_custom_scale_and_dense_mask():
    q, k, v = _inputs(1, 2, 11, 23, 32)
    g = torch.randn(1, 2, 11, 32)
    dense = torch.rand(1, 2, 11, 23) > 0.3
    dense[..., 0] = True  # every row sees a key
    ref = _grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=dense, scale=0.3), q, k, v, g)
    ours = _grads(lambda a, b, c: tiled_attention_reference(a, b, c, attn_mask=dense, scale=0.3, tile=8), q, k, v, g)
    _assert_all_close(ours, ref)


def test_fully_masked_row_is_zero_not_nan():
    q, k, v = _inputs(1, 1, 4, 4, 32)
    kpm = torch.tensor([[False, False, True, True]])
    out = tiled_attention_reference(q, k, v, causal=True, key_padding_mask=kpm, tile=2)
    assert torch.all(out[0, 0, :2] == 0) and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.all(q.grad[0, 0, :2] == 0)


def test_tile_changes_order_not_result():
    q, k, v = _inputs(1, 2, 40, 40, 32)
    a = tiled_attention_reference(q, k, v, causal=True, tile=8)
    b = tiled_attention_reference(q, k, v, causal=True, tile=64)  # one tile = plain softmax
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def test_module_and_errors():
    q, k, v = _inputs(1, 2, 9, 9, 32)
    mod = TiledAttention(causal=True, tile=4)
    torch.testing.assert_close(mod(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="head dim"):
        tiled_attention_reference(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))
    with pytest.raises(ValueError, match="key_padding_mask"):
        tiled_attention_reference(q, k, v, key_padding_mask=torch.ones(1, 9))
    with pytest.raises(ValueError, match="tile"):
        TiledAttention(tile=0)


def test_bf16_error_within_twice_plain_bf16():
    """Low precision: our error vs an fp64 oracle is at most 2x that of plain bf16 PyTorch attention (FA's rule)."""
    q, k, v = (t.detach() for t in _inputs(1, 2, 64, 64, 64))
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    plain = torch.softmax((q.bfloat16() @ k.bfloat16().transpose(-1, -2)) / math.sqrt(64) +
                          torch.full((64, 64), float("-inf")).triu(1), -1).bfloat16() @ v.bfloat16()
    ours = tiled_attention_reference(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, tile=16)
    assert (ours.double() - exact).abs().max() <= 2 * (plain.double() - exact).abs().max()


def test_eager_baseline_matches_sdpa():
    q, k, v = (t.detach() for t in _inputs(2, 2, 13, 13, 32))
    kpm = torch.arange(13)[None] < torch.tensor([[13], [6]])
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=kpm[:, None, None] & torch.ones(13, 13, dtype=torch.bool).tril())
    torch.testing.assert_close(eager_attention(q, k, v, causal=True, key_padding_mask=kpm), ref, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------------------------------- CPU dispatch
from titan_ds.kernels.attention import attention_kernel, tiled_attention  # noqa: E402
from titan_ds.kernels.saved import SavedTensorMeter  # noqa: E402


@pytest.fixture
def unset_backend(monkeypatch):
    monkeypatch.delenv("TITAN_KERNELS", raising=False)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,D", [(37, 32), (128, 64), (5, 16)])
def test_cpu_path_is_torch_flash_sdpa_and_matches_the_reference(unset_backend, causal, T, D):
    """Unmasked CPU calls run PyTorch's CPU flash kernel (its autograd node says so), with the reference's result and
    every gradient, and keep exactly the reference's saved bytes (q, k, v, O, LSE: O(T*D), no (T, T) matrix)."""
    q, k, v = _inputs(2, 3, T, T, D, noncontig=(T == 37))
    assert attention_kernel(q, k, v) == "torch_sdpa"
    g = torch.randn(2, 3, T, D)
    with SavedTensorMeter() as fast_saved:
        out = tiled_attention(q, k, v, causal=causal, tile=16)
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"
    with SavedTensorMeter() as ref_saved:
        tiled_attention_reference(q, k, v, causal=causal, tile=16)
    assert fast_saved.bytes == ref_saved.bytes == 4 * q.numel() * 4 + 2 * 3 * T * 4
    ours = (out, *torch.autograd.grad(out, (q, k, v), g))
    ref = _grads(lambda a, b, c: tiled_attention_reference(a, b, c, causal=causal, tile=16), q, k, v, g)
    _assert_all_close(ours, ref)


def test_cpu_path_bf16_is_the_flash_kernel_within_twice_plain_bf16(unset_backend):
    q, k, v = (t.detach() for t in _inputs(1, 2, 64, 64, 64))
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    assert attention_kernel(qb, kb, vb) == "torch_sdpa"
    ours = tiled_attention(qb, kb, vb, causal=True)
    assert type(ours.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    plain = torch.softmax((qb.detach() @ kb.detach().transpose(-1, -2)) / math.sqrt(64) +
                          torch.full((64, 64), float("-inf")).triu(1), -1).bfloat16() @ vb.detach()
    assert (ours.double() - exact).abs().max() <= 2 * (plain.double() - exact).abs().max()


def test_masks_forced_reference_and_other_devices_run_the_reference(unset_backend, monkeypatch):
    q, k, v = _inputs(1, 2, 9, 9, 32)
    kpm = torch.tensor([[False, False] + [True] * 7])
    assert attention_kernel(q, k, v, key_padding_mask=kpm) == "reference"  # a row may see no key: 0, not NaN
    out = tiled_attention(q, k, v, causal=True, key_padding_mask=kpm)
    assert type(out.grad_fn).__name__ == "_TiledAttentionFnBackward" and torch.all(out[0, :, :2] == 0)
    assert attention_kernel(q, k, v, attn_mask=torch.ones(1, 1, 9, 9, dtype=torch.bool)) == "reference"
    meta = [torch.empty(1, 2, 9, 32, device="meta") for _ in range(3)]
    assert attention_kernel(*meta) == "reference"
    monkeypatch.setenv("TITAN_KERNELS", "reference")  # the oracle stays reachable on the CPU
    assert attention_kernel(q, k, v) == "reference"
    assert type(tiled_attention(q, k, v, causal=True).grad_fn).__name__ == "_TiledAttentionFnBackward"
