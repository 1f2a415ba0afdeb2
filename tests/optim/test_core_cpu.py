"""The C++ CPU kernel of ASDT's adaptive chunk (titan_ds/optim/core_cpu.py) against the eager loop it replaces:
the same weights and the same stored state, bit for bit, for every state kind, weight dtype, second moment,
granularity, clip and importance the dense core takes, over several steps and chunk sizes."""
import pytest
import torch

pytest.importorskip("torchao")  # the quantized state's code maps

from titan_ds.optim import core, core_cpu  # noqa: E402
from titan_ds.optim.asdt import ASDT  # noqa: E402

if not core_cpu.available():  # pragma: no cover (a machine without a compiler: the warning says why)
    pytest.skip("the C++ kernel did not build here", allow_module_level=True)

# odd sizes (4-bit codes straddle bytes, units start on either half), a unit over 256 (several work items), a
# large one cut into pieces at small chunk sizes
SHAPES = [(37, 29), (5,), (300,), (3, 4, 6), (1,), (41, 17), (700, 3)]

CASES = {
    "balanced": dict(second_moment="coordinate", state_dtype="8bit", second_dtype="4bit"),
    "memory": dict(second_moment="coordinate", state_dtype="4bit", second_dtype="4bit"),
    "8bit-8bit-row": dict(second_moment="coordinate", state_dtype="8bit", second_dtype="8bit", granularity="row"),
    "bf16-fp32-clip": dict(second_moment="coordinate", state_dtype="bf16", second_dtype="fp32", update_clip=0.5),
    "fp32-bf16-grad_weight": dict(second_moment="coordinate", state_dtype="fp32", second_dtype="bf16",
                                  importance="grad_weight"),
    "unit-row-8bit-clip": dict(granularity="row", state_dtype="8bit", update_clip=1.0),
    "unit-row-4bit": dict(granularity="row", state_dtype="4bit"),
    "unit-tensor-bf16": dict(state_dtype="bf16"),
}


def _run(monkeypatch, native, chunk, dtype, steps=4, **kw):
    monkeypatch.setattr(core_cpu, "ENABLED", native)
    monkeypatch.setattr(core, "CHUNK", chunk)
    torch.manual_seed(0)
    ps = [torch.randn(s).to(dtype).requires_grad_() for s in SHAPES]
    opt = ASDT([(f"p{i}", p) for i, p in enumerate(ps)], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
               density=1.0, rounding_seed=3, update="adaptive", **kw)
    calls = []
    step = core_cpu.step
    monkeypatch.setattr(core_cpu, "step", lambda *a, **k: calls.append(1) or step(*a, **k))
    for t in range(steps):
        gen = torch.Generator().manual_seed(100 + t)
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=gen) * (1 + t)).to(p.dtype)
        opt.step()
    return ps, opt, len(calls)


@pytest.mark.parametrize("chunk", [256, 1 << 20], ids=["chunk256", "whole"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_is_the_eager_loop(monkeypatch, case, dtype, chunk):
    eager, opt_e, n_e = _run(monkeypatch, False, chunk, dtype, **CASES[case])
    native, opt_n, n_n = _run(monkeypatch, True, chunk, dtype, **CASES[case])
    assert n_e == 0 and n_n > 0  # the kernel ran in one run and not in the other
    for a, b in zip(eager, native):
        assert torch.equal(a.data, b.data)
        for key, v in opt_e.state[a].items():
            if torch.is_tensor(v):
                assert torch.equal(v, opt_n.state[b][key]), key
    assert int(opt_e._last_selected) == int(opt_n._last_selected)
    # bf16 weights are rounded stochastically: the kernel's draws leave the generator where torch's leave it
    assert opt_e._generators.keys() == opt_n._generators.keys()
    for key, gen in opt_e._generators.items():
        assert torch.equal(gen.get_state(), opt_n._generators[key].get_state())


def test_no_kernel_off_the_cpu(monkeypatch):
    """Tensors on another device (meta stands in for a GPU) never reach the kernel."""
    w = torch.empty(512, device="meta")
    assert not core_cpu.supports(w, w, None)
    assert core_cpu.supports(torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), None)


def _floats_around(points: torch.Tensor, ulps: int) -> torch.Tensor:
    """Every float32 within ``ulps`` steps of each of ``points`` (same sign)."""
    bits = points.float().view(torch.int32).unsqueeze(1) + torch.arange(-ulps, ulps + 1, dtype=torch.int32)
    return bits.reshape(-1).view(torch.float32)


@pytest.mark.parametrize("kind,signed", [("4bit", False), ("4bit", True), ("8bit", True), ("8bit", False)])
def test_kernel_codes_are_the_tables(kind, signed):
    """The kernel's encoding (the lookup, and the arithmetic one of the linear unsigned 4-bit map) gives qstate's
    codes: near every midpoint and code, at the ends, for NaNs, subnormals and random bit patterns. Not for an
    infinite x / scale, which a block scaled by its absmax never holds (an inf in the block makes the scale inf
    and the quotient NaN; qstate's table then gives 16 for +inf, the kernel 15)."""
    from titan_ds.optim import qstate
    q = qstate.qmap(kind, signed)
    mids = qstate._midpoints(kind, signed)
    edges = torch.cat([mids, q, torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, 16.0, 1e-12, 3e38])])
    g = torch.Generator().manual_seed(0)
    x = torch.cat([_floats_around(edges, 300), _floats_around(-edges, 300),
                   torch.randint(-2**31, 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int32).view(torch.float32),
                   torch.rand(1 << 18, generator=g) * 2 - 1,
                   torch.tensor([float("nan"), -float("nan"), 1e-45, -1e-45])])
    _, table = core_cpu._tables(kind, signed)
    for scale in (1.0, 0.37, 1e-12):
        xs = x * scale
        quotient = xs / scale
        finite_or_nan = ~torch.isinf(quotient)
        got = core_cpu._module().encode_codes(xs[finite_or_nan], scale, q, table)
        want = qstate._encode(quotient[finite_or_nan], kind, signed).view(-1)
        x = x[finite_or_nan]
        bad = torch.nonzero(got != want).view(-1)
        assert bad.numel() == 0, (scale, x[bad[:5]].tolist(), got[bad[:5]].tolist(), want[bad[:5]].tolist())


@pytest.mark.parametrize("kind,signed", [("4bit", False), ("4bit", True), ("8bit", True)])
def test_quantize_takes_the_kernels_encoding_with_the_same_codes(monkeypatch, kind, signed):
    """qstate.quantize of a large CPU buffer (a fresh state's first packing) encodes with the kernel: the same codes
    and scales as the eager lookup, NaNs and uneven records included."""
    from titan_ds.optim import qstate
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1 << 17, generator=g) * torch.logspace(-8, 0, 1 << 17)
    x[::9973] = float("nan")
    x[5000:9000] = 0.0
    lens = [1000, 77, (1 << 17) - 1077]
    calls = []
    encode = core_cpu._module().encode_codes
    monkeypatch.setattr(core_cpu._module(), "encode_codes", lambda *a: calls.append(1) or encode(*a), raising=False)
    fast = qstate.quantize(x, lens, kind, signed)
    assert calls, "the kernel's encoding was not used"
    monkeypatch.setattr(qstate, "_KERNEL_MIN", 1 << 40)
    eager = qstate.quantize(x, lens, kind, signed)
    assert torch.equal(fast[0], eager[0]) and torch.equal(fast[1].view(torch.int32), eager[1].view(torch.int32))


def test_a_build_is_keyed_by_the_cpu(tmp_path):
    """A -march=native build is loaded only by a CPU with the same flags (and the same torch): the extension's name
    carries their hash, so a shared TORCH_EXTENSIONS_DIR holds one build per CPU; with no flags to read, the build
    targets the compiler's baseline."""
    assert core_cpu._module().__name__ == core_cpu.build_name()
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: sse2 avx2 fma\n\nprocessor\t: 1\n"
                   "flags\t\t: sse2 avx2 fma\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n")
    assert core_cpu._cpu_flags(str(x86)) == "avx2 fma sse2"
    assert core_cpu._cpu_flags(str(arm)) == "asimd fp sve"
    assert core_cpu._cpu_flags(str(tmp_path / "absent")) is None
    with_512 = core_cpu.build_name("avx2 avx512f fma sse2")
    assert core_cpu.build_name("avx2 fma sse2") != with_512 != core_cpu.build_name(None)
    assert core_cpu.build_name("avx2 fma sse2") == core_cpu.build_name("avx2 fma sse2")
    assert "-march=native" in core_cpu.build_flags("avx2 fma sse2")
    assert "-march=native" not in core_cpu.build_flags(None)
    assert "-ffp-contract=off" in core_cpu.build_flags(None)  # bit for bit with the eager loop either way


def test_bf16_weights_need_a_cpu_generator():
    """The kernel rounds CPU bf16 weights from a CPU generator only; another (a CUDA one; this CPU wheel cannot
    make one, so a stand-in with its device) is refused by name."""
    from types import SimpleNamespace
    opt_w = torch.zeros(300, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CPU generator"):
        core_cpu.step(opt_w, opt_w, None, None, None, unit_denom=None, bc1=None, inv_bc2=None, betas=(0.9, 0.95),
                      eps=1e-8, lr=1e-3, weight_decay=0.0, update_clip=None, importance="momentum",
                      generator=SimpleNamespace(device=torch.device("cuda")))
