"""HMS's ZeRO-3 gradient norms into one reused fp64 buffer (titan_ds/hms/gradnorm.py): the same bits as DeepSpeed's
``_constant_buffered_norm2``, on its own and inside whole clipped runs against DeepSpeed's own CPU offload (whose
norms are DeepSpeed's); the buffer is dropped before each optimizer step."""
import pytest
import torch

from tests.hms.test_swapper import assert_same, run
from titan_ds import deepspeed_compat as dsc
from titan_ds.hms.gradnorm import ScratchNorm


def _deepspeeds(input, buffer_size=250000000):
    """stage3.py:1960's body, called unbound (it reads nothing of the optimizer)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    return DeepSpeedZeroOptimizer_Stage3._constant_buffered_norm2(None, input, buffer_size)


def test_same_bits_as_deepspeeds_norm_on_random_sizes_and_offsets():
    g = torch.Generator().manual_seed(0)
    norm = ScratchNorm(_deepspeeds, dsc.z3_norm_dtype())
    assert norm.dtype == torch.float64  # (what this CPU accelerator asks for)
    for i in range(120):
        n = int(torch.randint(1, 300_000, (1,), generator=g))
        scale = 10.0 ** int(torch.randint(-8, 4, (1,), generator=g))
        base = torch.randn(n + 7, generator=g) * scale
        x = base[i % 7:i % 7 + n]  # views at several offsets, as ZeRO-3's partitions are
        if i % 3 == 0:
            x = x.bfloat16()
        ref, out = _deepspeeds(x), norm(x)
        assert out.dtype == ref.dtype and torch.equal(out, ref), (n, float(out), float(ref))
    assert norm.calls == 120 and norm.buf.numel() >= 299_000 // 2  # one buffer, grown to the largest seen
    big = norm.buf
    norm(torch.ones(10))
    assert norm.buf is big  # a smaller one reuses it
    norm.release()
    assert norm.buf is None


def test_what_it_does_not_handle_goes_to_deepspeeds():
    seen = []

    def original(input, buffer_size=250000000):
        seen.append(input.numel())
        return _deepspeeds(input, buffer_size)
    norm = ScratchNorm(original, torch.float64)
    x = torch.randn(1000)
    assert torch.equal(norm(x, buffer_size=300), _deepspeeds(x, 300))  # split in parts by DeepSpeed: its own sum
    norm(torch.empty(0))
    norm(torch.empty(5000, device="meta"))  # a device tensor (meta stands in for a GPU): no CPU buffer mixed in
    assert seen == [1000, 0, 5000] and norm.calls == 0 and norm.buf is None


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("hms_gradnorm")


def test_clipped_runs_equal_deepspeeds_cpu_offload(tmp):
    """A clip far below the gradient norm: every step's update is scaled by clip / norm, so a norm off by one bit
    in fp64 would show in the parameters. DeepSpeed's CPU offload takes the same norms with its own function."""
    ref, = run(tmp, "cpu_c", "--mode", "cpu", "--clip", 0.01)
    hms, = run(tmp, "hms_c", "--mode", "hms", "--clip", 0.01)
    assert_same(ref, hms)
    assert hms["grad_norm_calls"] > 0 and ref["grad_norm_calls"] == 0


@pytest.mark.parametrize("clip", [0.0, 1e6])
def test_a_unit_unscale_factor_is_skipped_bit_for_bit(tmp, clip):
    """No clipping, or a clip above the norm: ZeRO-3's factor is exactly 1, so HMS skips its pass over the
    gradients (``fold_unscale``); the run equals DeepSpeed's CPU offload (which multiplies by 1.0) bit for
    bit. The active clip of the test above goes through DeepSpeed's own unscale every time."""
    ref, = run(tmp, f"cpu_u{clip:g}", "--mode", "cpu", "--clip", clip)
    hms, = run(tmp, f"hms_u{clip:g}", "--mode", "hms", "--clip", clip)
    assert_same(ref, hms)
    assert hms["unscale"]["skipped"] > 0 and hms["unscale"]["called"] == 0, hms["unscale"]
    clipped, = run(tmp, "hms_c", "--mode", "hms", "--clip", 0.01)
    assert clipped["unscale"]["called"] > 0 and clipped["unscale"]["skipped"] == 0, clipped["unscale"]


def test_an_active_clip_is_folded_into_asdts_read_bit_for_bit(tmp):
    """titan's optimizer (titan_balanced's section: the CPU kernel, 8-bit / 4-bit state) under an active clip: HMS
    hands ZeRO-3's factor to the optimizer (``fold_unscale``: the kernel multiplies each gradient value as it reads
    it) instead of running ZeRO-3's pass over the gradient; the run equals the one with the pass
    (``TITAN_HMS_FOLD_UNSCALE=0``) bit for bit, parameters and losses."""
    passed, = run(tmp, "asdt_pass", "--mode", "hms", "--clip", 0.01, "--asdt", "--no-fold")
    folded, = run(tmp, "asdt_fold", "--mode", "hms", "--clip", 0.01, "--asdt")
    assert folded["optimizer"] == passed["optimizer"] == "ASDT"
    assert passed["unscale"]["called"] > 0 and not passed["unscale"]["folded"], passed["unscale"]
    assert folded["unscale"]["folded"] > 0 and folded["unscale"]["called"] == 0, folded["unscale"]
    assert_same(passed, folded)
