"""The torch seam (titan_ds/torch_compat.py) against the installed torch: the C++ kernel's reads of ATen's CPU
generator give the draws ``torch.randint(0, 2**16)`` gives and leave the generator where torch leaves it; the
version check names both versions; outside the range (or switched off) bf16 weights never reach the kernel."""
import re
from pathlib import Path

import pytest
import torch

from titan_ds import torch_compat
from titan_ds.optim import core_cpu

ROOT = Path(__file__).resolve().parents[1]
needs_kernel = pytest.mark.skipif(not core_cpu.available(), reason="the C++ kernel did not build here")


def _pair(seed: int, predraw: int):
    """Two generators in the same state: seeded alike, then ``predraw`` values drawn from each by torch."""
    a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    for g in (a, b):
        torch.randint(0, 1 << 16, (predraw,), generator=g)
    return a, b


@needs_kernel
@pytest.mark.parametrize("predraw", [0, 1, 623, 1000])
@pytest.mark.parametrize("n", [1, 623, 624, 625, 1248, 5000])
def test_kernel_draws_are_torch_randint(predraw, n):
    """Canary: the draws the kernel takes through the seam, and the generator's state after them (the engine's
    words, position and everything else get_state serializes), are torch's, across the 624-word twists."""
    kernel_gen, torch_gen = _pair(7, predraw)
    got = core_cpu._module().generator_draws16(kernel_gen, n)
    want = torch.randint(0, 1 << 16, (n,), generator=torch_gen, dtype=torch.int32)
    assert torch.equal(got, want)
    assert torch.equal(kernel_gen.get_state(), torch_gen.get_state())
    # and the next draws by torch itself continue alike
    assert torch.equal(torch.rand(100, generator=kernel_gen), torch.rand(100, generator=torch_gen))


def test_version_check_names_installed_and_supported():
    assert torch_compat.check_version() is None, "the installed torch is the one the seam was checked on"
    msg = torch_compat.check_version("2.99.0")
    assert msg is not None and "torch 2.99.0 is installed" in msg and ",".join(torch_compat.SUPPORTED) in msg
    assert torch_compat.check_version("2.12.1") is not None and torch_compat.check_version("not-a-version")
    assert torch_compat.check_version(torch_compat.SUPPORTED[0].lstrip(">=")) is None


@pytest.mark.parametrize("how", ["version", "switch"])
def test_outside_the_seam_bf16_weights_take_the_eager_loop(monkeypatch, how):
    """Outside the supported torch (a warning naming it) or with TITAN_TORCH_SEAM=0 the kernel is not used for
    bf16 weights (the eager loop steps them); fp32 weights still take it."""
    torch_compat._version_ok.cache_clear()
    if how == "version":
        monkeypatch.setattr(torch, "__version__", "2.99.0")
    else:
        monkeypatch.setattr(torch_compat, "_env", "0")
    try:
        w16 = torch.zeros(8, dtype=torch.bfloat16)
        if how == "version":
            with pytest.warns(RuntimeWarning, match="torch 2.99.0 is installed"):
                assert not core_cpu.runs(w16, w16)
        else:
            assert not core_cpu.runs(w16, w16)
        w32 = torch.zeros(8)
        assert core_cpu.runs(w32, w32) == core_cpu.available()
    finally:
        monkeypatch.undo()
        torch_compat._version_ok.cache_clear()
    assert core_cpu.runs(w16, w16) == core_cpu.available()  # back on


def test_atens_private_generator_is_read_only_in_the_seam():
    """The kernel's source reads CPUGeneratorImpl / mt19937 state only inside its "torch seam" block."""
    src = (ROOT / "titan_ds" / "optim" / "csrc" / "core_cpu.cpp").read_text()
    begin = src.index(" the torch seam\n")
    end = src.index("end of the torch seam")
    outside = src[:begin] + src[end:]
    private = re.compile(r"CPUGeneratorImpl|mt19937|engine\(\)|set_engine")
    lines = [line for line in outside.splitlines()
             if private.search(line) and not line.lstrip().startswith(("//", "#include"))]
    assert lines == []
