"""ZeRO-3's unscale and clip factor folded into ASDT's read of the gradient (``ASDT.fold_grad_scale``,
``core.dense_step(grad_scale=)``): the step equals the one after ZeRO-3's pass ``grad.mul_(1. / combined_scale)``
bit for bit, weights and stored state, on every path (the C++ kernel, which multiplies as it reads; the eager loop,
which scales each chunk in place just before it; the per-unit second moment and the sparse update, which scale the
whole gradient first), for a 0-dim fp32 tensor factor (ZeRO-3's, from the norm) and a Python float (a loss scale
alone). The engine-level run is tests/hms/test_gradnorm.py::test_an_active_clip_is_folded_into_asdts_read_bit_for_bit."""
import pytest
import torch

pytest.importorskip("torchao")  # the quantized state's code maps

from tests.optim.test_core_cpu import CASES, SHAPES  # noqa: E402
from titan_ds.optim import core, core_cpu  # noqa: E402
from titan_ds.optim.asdt import ASDT  # noqa: E402

CASES = dict(CASES, **{"sparse-half": dict(second_moment="coordinate", state_dtype="8bit", density=0.5)})


def _factor(kind, t):
    combined = torch.clamp((torch.tensor(40.0 + 7 * t) / 1.0 + 1e-6) / 0.37, min=1.0)  # ZeRO-3's expression
    return 1. / combined if kind == "tensor" else 1. / (3.0 + t)


def _run(monkeypatch, native, fold, kind, dtype, steps=3, **kw):
    monkeypatch.setattr(core_cpu, "ENABLED", native)
    monkeypatch.setattr(core, "CHUNK", 256)
    torch.manual_seed(0)
    ps = [torch.randn(s).to(dtype).requires_grad_() for s in SHAPES]
    kw = dict(dict(density=1.0), **kw)
    opt = ASDT([(f"p{i}", p) for i, p in enumerate(ps)], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
               rounding_seed=3, update="adaptive", **kw)
    calls = []
    step = core_cpu.step
    monkeypatch.setattr(core_cpu, "step", lambda *a, **k: calls.append(k.get("grad_scale", 1.0)) or step(*a, **k))
    for t in range(steps):
        gen = torch.Generator().manual_seed(100 + t)
        scale = _factor(kind, t)
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=gen) * 50).to(dtype)  # (fp32: ZeRO-3's gradient partitions)
            if fold:
                opt.fold_grad_scale(p, scale)
            else:
                p.grad.mul_(scale)
        opt.step()
    return ps, opt, calls


@pytest.mark.parametrize("kind", ["tensor", "float"])
@pytest.mark.parametrize("native", [True, False], ids=["kernel", "eager"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_folded_step_is_the_step_after_the_pass(monkeypatch, case, native, kind):
    if native and not core_cpu.available():  # pragma: no cover
        pytest.skip("the C++ kernel did not build here")
    ref, opt_r, _ = _run(monkeypatch, native, False, kind, torch.float32, **CASES[case])
    got, opt_f, calls = _run(monkeypatch, native, True, kind, torch.float32, **CASES[case])
    for a, b in zip(ref, got):
        assert torch.equal(a.data, b.data)
        for key, v in opt_r.state[a].items():
            if torch.is_tensor(v):
                assert torch.equal(v, opt_f.state[b][key]), key
    if native and CASES[case].get("density", 1.0) >= 1.0 and CASES[case].get("second_moment") == "coordinate":
        assert calls and all(c != 1.0 for c in calls)  # the kernel itself took the factor: no pass before it
    assert not opt_f._grad_scales  # nothing left over for the next step


def test_bf16_weights_fold_too(monkeypatch):
    """bf16 weights and gradients (rounded stochastically from the generator; the factor is applied by the pass the
    kernel would not fold): the same bits and the same generator state."""
    kw = CASES["balanced"]
    ref, opt_r, _ = _run(monkeypatch, True, False, "tensor", torch.bfloat16, **kw)
    got, opt_f, _ = _run(monkeypatch, True, True, "tensor", torch.bfloat16, **kw)
    for a, b in zip(ref, got):
        assert torch.equal(a.data, b.data)
    for key, gen in opt_r._generators.items():
        assert torch.equal(gen.get_state(), opt_f._generators[key].get_state())


def test_the_kernel_leaves_the_gradient_unwritten(monkeypatch):
    if not core_cpu.available():  # pragma: no cover
        pytest.skip("the C++ kernel did not build here")
    monkeypatch.setattr(core_cpu, "ENABLED", True)
    p = torch.randn(1000).requires_grad_()
    opt = ASDT([("p", p)], lr=1e-2, density=1.0, update="adaptive", **CASES["balanced"])
    p.grad = torch.randn(1000)
    g = p.grad.clone()
    opt.fold_grad_scale(p, torch.tensor(0.25))
    opt.step()
    assert torch.equal(p.grad, g)  # read times the factor, not scaled in place: no page of it dirtied
