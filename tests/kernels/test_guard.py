"""kernels/_guard.py: backend choice from TITAN_KERNELS, actionable errors, the availability report."""
import pytest
import torch

from titan_ds.kernels import _guard


def test_dispatch(monkeypatch):
    x = torch.randn(1, 1, 4, 32)
    monkeypatch.setenv("TITAN_KERNELS", "reference")
    assert _guard.kernel_backend(x) == "reference"
    monkeypatch.setenv("TITAN_KERNELS", "cuda")
    with pytest.raises(ValueError, match="TITAN_KERNELS='cuda'"):
        _guard.kernel_backend(x)
    monkeypatch.setenv("TITAN_KERNELS", "triton")
    assert _guard.kernel_backend(x) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not torch.cuda.is_available():
        with pytest.raises(_guard.KernelBackendError, match="TRITON_INTERPRET=1"):
            _guard.kernel_backend(x)
    monkeypatch.delenv("TITAN_KERNELS")
    assert _guard.kernel_backend(x) == "reference"  # default on CPU tensors


def test_missing_triton_is_actionable(monkeypatch):
    monkeypatch.setattr(_guard, "_triton_import_error", lambda: "ModuleNotFoundError: No module named 'triton'")
    monkeypatch.setenv("TITAN_KERNELS", "triton")
    with pytest.raises(_guard.KernelBackendError, match="pip install 'titan-ds\\[triton\\]'.*TITAN_KERNELS=reference"):
        _guard.kernel_backend(torch.zeros(1))
    monkeypatch.delenv("TITAN_KERNELS")
    assert _guard.kernel_backend(torch.zeros(1)) == "reference"


def test_describe_and_no_eager_triton_import():
    import subprocess
    import sys
    d = _guard.describe()
    assert set(d) >= {"triton", "cuda", "aio", "triton_interpret", "TITAN_KERNELS"}
    assert isinstance(d["aio"], bool)
    code = "import sys, titan_ds.kernels, titan_ds.inject.mlme; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # importing the kernels or the policy never imports triton


def test_triton_attention_in_the_interpreter_refuses_bf16(monkeypatch):
    """Triton's interpreter computes titan's attention kernel wrongly in bf16, with no error: refused by name."""
    from titan_ds.kernels.attention import tiled_attention
    monkeypatch.setenv("TITAN_KERNELS", "triton")
    monkeypatch.setattr(_guard, "triton_interpreting", lambda: True)
    q = torch.randn(1, 2, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(_guard.KernelBackendError, match="only fp32 correctly; they are torch.bfloat16"):
        tiled_attention(q, q, q, causal=True, tile=16)
