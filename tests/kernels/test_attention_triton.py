"""The Triton attention kernel vs the tiled reference (and SDPA), under TRITON_INTERPRET=1 on CPU, tiny fp32 shapes.

conftest.py sets TRITON_INTERPRET=1 before anything compiles a kernel when there is no GPU.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.deps import require
from titan_ds.kernels import _guard
from titan_ds.kernels.attention import tiled_attention, tiled_attention_reference

require("triton")
# conftest.py sets TRITON_INTERPRET=1 where there is no GPU; only an explicit TRITON_INTERPRET=0 without one skips
pytestmark = pytest.mark.skipif(not (_guard.triton_interpreting() or torch.cuda.is_available()),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
ATOL, RTOL = 2e-5, 2e-5  # fp32 both sides; IEEE products in the kernel


@pytest.fixture
def triton_backend(monkeypatch):
    """TITAN_KERNELS=triton, and the dispatcher's reference path made to fail: what runs is the kernel."""
    import titan_ds.kernels.attention as attention

    def no_reference(*a, **k):
        raise AssertionError("tiled_attention fell back to the reference")

    monkeypatch.setenv("TITAN_KERNELS", "triton")
    monkeypatch.setattr(attention, "tiled_attention_reference", no_reference)


def _run(fn, q, k, v, g):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), g))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,D", [(19, 32), (40, 48)])
def test_triton_matches_reference(triton_backend, causal, T, D):
    B, H = 2, 2
    q = torch.randn(B, T, H, D, device=DEV).transpose(1, 2)  # non-contiguous, as models produce it
    k, v = torch.randn(B, H, T, D, device=DEV), torch.randn(B, H, T, D, device=DEV)
    g = torch.randn(B, H, T, D, device=DEV)
    ours = _run(lambda a, b, c: tiled_attention(a, b, c, causal=causal, tile=16), q, k, v, g)
    ref = _run(lambda a, b, c: tiled_attention_reference(a, b, c, causal=causal, tile=16), q, k, v, g)
    sdpa = _run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), q, k, v, g)
    for a, b, c, n in zip(ours, ref, sdpa, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{n} vs reference: {m}")
        torch.testing.assert_close(a, c, atol=ATOL, rtol=RTOL, msg=lambda m: f"{n} vs sdpa: {m}")


def test_triton_padding_mask_and_cross_lengths(triton_backend):
    B, H, TQ, TK, D = 2, 1, 17, 33, 32
    q, k, v = torch.randn(B, H, TQ, D, device=DEV), torch.randn(B, H, TK, D, device=DEV), torch.randn(B, H, TK, D, device=DEV)
    kpm = torch.arange(TK, device=DEV)[None] < torch.tensor([[33], [5]], device=DEV)
    g = torch.randn(B, H, TQ, D, device=DEV)
    for causal in (False, True):
        ours = _run(lambda a, b, c: tiled_attention(a, b, c, causal=causal, key_padding_mask=kpm, tile=16), q, k, v, g)
        ref = _run(lambda a, b, c: tiled_attention_reference(a, b, c, causal=causal, key_padding_mask=kpm, tile=16),
                   q, k, v, g)
        for a, b, n in zip(ours, ref, ("out", "dq", "dk", "dv")):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"causal={causal} {n}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [32, 64, 128])
def test_triton_low_precision_error_at_most_twice_plain(triton_backend, dtype, D):
    """FlashAttention's rule: error vs an fp64 oracle at most 2x that of plain PyTorch attention in the same dtype."""
    from titan_ds.kernels.attention import eager_attention
    B, H, T = 2, 4, 1000
    q, k, v = (torch.randn(B, H, T, D, device="cuda") for _ in range(3))
    g = torch.randn(B, H, T, D, device="cuda")
    exact = _run(lambda a, b, c: eager_attention(a, b, c, causal=True), q.double(), k.double(), v.double(), g.double())
    plain = _run(lambda a, b, c: eager_attention(a, b, c, causal=True), q.to(dtype), k.to(dtype), v.to(dtype), g.to(dtype))
    ours = _run(lambda a, b, c: tiled_attention(a, b, c, causal=True, tile=128), q.to(dtype), k.to(dtype), v.to(dtype),
                g.to(dtype))
    for o, p, e, n in zip(ours, plain, exact, ("out", "dq", "dk", "dv")):
        err, ref_err = (o.double() - e).abs().max().item(), (p.double() - e).abs().max().item()
        assert err <= 2 * ref_err + 1e-5, f"{n}: {err} > 2 * {ref_err}"
