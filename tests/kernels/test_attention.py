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


# ---------------------------------------------------------------------------------------------- CUDA dispatch
import logging  # noqa: E402

from tests.helpers.meta import META, NoHostCopies  # noqa: E402
from titan_ds.kernels import attention as attention_mod  # noqa: E402
from titan_ds.kernels.attention import AttentionCall, choose_kernel, sdpa_mask_args  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

CUDA_CASES = [  # dtype, Tq, Tk, D, causal, mask, compute capability -> kernel
    (BF16, 128, 128, 64, True, "none", (9, 0), "sdpa_flash"),
    (FP16, 100, 100, 128, False, "none", (8, 0), "sdpa_flash"),
    (FP16, 128, 128, 256, True, "none", None, "sdpa_flash"),
    (BF16, 17, 33, 64, False, "none", (9, 0), "sdpa_flash"),
    (BF16, 128, 128, 64, True, "padding", (9, 0), "sdpa_efficient"),  # flash takes no mask
    (BF16, 128, 128, 64, False, "dense", (9, 0), "sdpa_efficient"),
    (FP32, 128, 128, 64, True, "none", (9, 0), "sdpa_efficient"),  # flash takes fp16/bf16 only
    (BF16, 17, 33, 64, True, "none", (9, 0), "sdpa_efficient"),  # FA-2 aligns non-square causal bottom-right
    (FP16, 128, 128, 64, True, "none", (7, 5), "sdpa_efficient"),  # a T4: no flash
    (BF16, 128, 128, 24, True, "padding", (9, 0), "sdpa_efficient"),
    (BF16, 128, 128, 64, True, "none", (7, 5), "reference"),  # bf16 before Ampere
    (torch.float64, 128, 128, 64, True, "none", (9, 0), "reference"),
    (FP32, 128, 128, 30, True, "none", (9, 0), "reference"),  # memory-efficient wants D % 4 == 0 in fp32
    (BF16, 128, 128, 20, True, "padding", (9, 0), "reference"),  # ... and D % 8 == 0 in 16-bit
]


@pytest.mark.parametrize("dtype,tq,tk,d,causal,mask,cap,expected", CUDA_CASES)
def test_cuda_calls_choose_sdpa_flash_or_memory_efficient(dtype, tq, tk, d, causal, mask, cap, expected):
    call = AttentionCall("cuda", dtype, tq, tk, d, causal, mask, cap)
    kernel, why = choose_kernel(call, "")
    assert kernel == expected, why
    assert why  # every choice says why (the log line and the fallback warning carry it)


def test_triton_attention_only_when_asked_for():
    call = AttentionCall("cuda", BF16, 128, 128, 64, True, "padding", (9, 0))
    assert choose_kernel(call, "")[0] == "sdpa_efficient"  # never by default, whether Triton imports or not
    assert choose_kernel(call, "triton")[0] == "triton"
    assert choose_kernel(AttentionCall("cuda", BF16, 9, 9, 64, False, "dense"), "triton")[0] == "reference"
    assert choose_kernel(call, "reference")[0] == "reference"
    with pytest.raises(ValueError, match="unknown kernel request 'cuda'"):
        choose_kernel(call, "cuda")


def test_cpu_and_meta_choices_are_unchanged():
    assert choose_kernel(AttentionCall("cpu", FP32, 9, 9, 32, True))[0] == "torch_sdpa"
    assert choose_kernel(AttentionCall("cpu", FP32, 9, 9, 32, True, "padding"))[0] == "reference"
    assert choose_kernel(AttentionCall("meta", BF16, 9, 9, 32, True))[0] == "reference"
    q = torch.empty(2, 3, 9, 32, device=META, dtype=BF16)
    call = AttentionCall.of(q, q, q, causal=True, key_padding_mask=torch.ones(2, 9, dtype=torch.bool))
    assert call == AttentionCall("meta", BF16, 9, 9, 32, True, "padding", None)


def test_report_names_the_kernel_per_device(unset_backend, monkeypatch):
    assert attention_mod.kernels_by_device()["cuda"].startswith("sdpa_flash")
    monkeypatch.setenv("TITAN_KERNELS", "triton")
    assert attention_mod.kernels_by_device()["cuda"] == "triton (TITAN_KERNELS=triton)"
    monkeypatch.setenv("TITAN_KERNELS", "reference")
    assert attention_mod.kernels_by_device() == {"cpu": "reference", "cuda": "reference"}


@pytest.fixture
def as_cuda(monkeypatch, unset_backend):
    """Describe every call as a CUDA call on an H100: what runs is the CUDA path (SDPA, flash + memory-efficient
    only), on the tensors given (on the CPU that is PyTorch's CPU flash kernel, which takes masks; on meta, shapes)."""
    of = AttentionCall.of

    def cuda_of(*a, **kw):
        call = of(*a, **kw)
        return AttentionCall("cuda", call.dtype, call.tq, call.tk, call.head_dim, call.causal, call.mask, (9, 0))

    monkeypatch.setattr(attention_mod.AttentionCall, "of", staticmethod(cuda_of))
    monkeypatch.setattr(attention_mod, "_LOGGED", set())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("masks", ["none", "padding", "dense", "padding+dense"])
def test_cuda_path_matches_the_reference_with_masks(as_cuda, causal, masks):
    """The SDPA call of the CUDA path (mask built by sdpa_mask_args, causality folded in) gives the reference's output
    and every gradient; padded keys get exactly no gradient. Right-padded lengths 29, 7, 1 of T = 29."""
    B, H, T, D = 3, 2, 29, 32
    q, k, v = _inputs(B, H, T, T, D, noncontig=True)
    kpm = torch.arange(T)[None, :] < torch.tensor([29, 7, 1])[:, None] if "padding" in masks else None
    dense = None
    if "dense" in masks:
        dense = torch.rand(B, 1, T, T) > 0.3
        dense[..., 0] = True  # every row sees a key
    g = torch.randn(B, H, T, D)
    kw = dict(causal=causal, key_padding_mask=kpm, attn_mask=dense)
    assert attention_mod.attention_kernel(q, k, v, **kw) == "sdpa_efficient"  # fp32 on "CUDA"
    out = tiled_attention(q, k, v, tile=8, **kw)
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"  # SDPA's fused kernel ran
    ours = (out, *torch.autograd.grad(out, (q, k, v), g))
    ref = _grads(lambda a, b, c: tiled_attention_reference(a, b, c, tile=8, **kw), q, k, v, g)
    _assert_all_close(ours, ref)
    if kpm is not None:
        assert torch.all(ours[2][1, :, 7:] == 0) and torch.all(ours[2][2, :, 1:] == 0)


def test_sdpa_mask_args_keep_padding_broadcast():
    kpm = torch.tensor([[True] * 5 + [False] * 2])
    mask, is_causal = sdpa_mask_args(False, kpm, None, 7, 7, kpm.device)
    assert mask.shape == (1, 1, 1, 7) and not is_causal  # O(B * Tk), not a (Tq, Tk) matrix
    mask, is_causal = sdpa_mask_args(True, kpm, None, 7, 7, kpm.device)
    assert mask.shape == (1, 1, 7, 7) and not is_causal and torch.equal(mask[0, 0], torch.ones(7, 7).tril().bool() &
                                                                        kpm)
    assert sdpa_mask_args(True, None, None, 7, 7, kpm.device) == (None, True)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("masks", ["none", "padding", "dense"])
def test_cuda_path_on_meta(as_cuda, dtype, masks):
    """The SDPA call the CUDA path makes, on meta tensors (shapes and dtypes; no host read, no host copy)."""
    q, k, v = (torch.empty(2, 3, 9, 32, device=META, dtype=dtype, requires_grad=True) for _ in range(3))
    kw = {"causal": True}
    if masks == "padding":
        kw["key_padding_mask"] = torch.empty(2, 9, dtype=torch.bool, device=META)
    if masks == "dense":
        kw["attn_mask"] = torch.empty(2, 1, 9, 9, dtype=torch.bool, device=META)
    expected = "sdpa_flash" if masks == "none" and dtype != FP32 else "sdpa_efficient"
    assert attention_mod.attention_kernel(q, k, v, **kw) == expected
    with NoHostCopies():
        out = tiled_attention(q, k, v, **kw)
        out.sum().backward()
    assert out.shape == q.shape and out.dtype == dtype and out.device == META
    assert all(t.grad.shape == t.shape and t.grad.dtype == dtype for t in (q, k, v))


def test_cuda_path_falls_back_to_the_reference_when_sdpa_refuses(as_cuda, monkeypatch, caplog):
    q, k, v = _inputs(1, 2, 9, 9, 32)
    sdpa = F.scaled_dot_product_attention

    def refuse(*a, **kw):
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(F, "scaled_dot_product_attention", refuse)
    with caplog.at_level(logging.INFO, logger="titan_ds.kernels"):
        out = tiled_attention(q, k, v, causal=True)
        tiled_attention(q, k, v, causal=True)
    assert type(out.grad_fn).__name__ == "_TiledAttentionFnBackward"
    torch.testing.assert_close(out, sdpa(q, k, v, is_causal=True), atol=ATOL, rtol=RTOL)
    refused = [r for r in caplog.records if "refused both" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.WARNING  # once, and it says what runs instead
    chosen = [r.getMessage() for r in caplog.records if "-> sdpa_efficient" in r.getMessage()]
    assert len(chosen) == 1 and "cuda float32 causal" in chosen[0]

    def broken(*a, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(F, "scaled_dot_product_attention", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):  # other errors are not swallowed
        tiled_attention(q, k, v, causal=True)
