"""The fused Triton kernel of ASDT's adaptive update (titan_ds/optim/core_triton.py) against the eager loop it
replaces, on CPU tensors in Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 where there is no GPU): the
same weights and the same stored state, bit for bit, for the state kinds of the shipped configs, over several
steps; production's in-kernel stochastic rounding is unbiased; and on ``meta`` one step of a GPT-shaped model
dispatches at most 3x the ops of torch's foreach AdamW."""
import pytest
import torch

pytest.importorskip("torchao")  # the quantized state's code maps
from tests.helpers.deps import require  # noqa: E402

require("triton")

import titan_ds.optim.asdt as asdt_mod  # noqa: E402
from launch.bench.op_count import ops_per_step  # noqa: E402  (the op counts of results/op_count.md)
from titan_ds.kernels import _guard  # noqa: E402
from titan_ds.optim import core, core_cpu, core_triton  # noqa: E402
from titan_ds.optim.asdt import ASDT  # noqa: E402

pytestmark = pytest.mark.skipif(not (_guard.triton_interpreting() or torch.cuda.is_available()),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"

# several units of different lengths, units longer than a tile (256) with partial last blocks, odd sizes
SHAPES = [(37, 29), (5,), (300,), (3, 4, 6), (1,), (600,)]
ROWS = [(5, 37), (3, 300), (7,)]  # granularity="row": rows of 37 and 300 (a tile and a partial one), a vector

CASES = {  # the state kinds of the shipped configs, and fp32
    "balanced-8bit-4bit": dict(second_moment="coordinate", state_dtype="8bit", second_dtype="4bit"),
    "memory-4bit-4bit": dict(second_moment="coordinate", state_dtype="4bit", second_dtype="4bit"),
    "fp32-fp32": dict(second_moment="coordinate", state_dtype="fp32", second_dtype="fp32"),
    "bf16-bf16-clip-grad_weight": dict(second_moment="coordinate", state_dtype="bf16", second_dtype="bf16",
                                       update_clip=0.5, importance="grad_weight"),
    "8bit-8bit-row": dict(second_moment="coordinate", state_dtype="8bit", second_dtype="8bit", granularity="row"),
    "lean-bf16-unit-row": dict(state_dtype="bf16", granularity="row"),
    "hf-8bit-unit-row-clip": dict(state_dtype="8bit", granularity="row", update_clip=1.0),
}


def _run(monkeypatch, backend, dtype, shapes, steps=3, **kw):
    monkeypatch.setenv("TITAN_KERNELS", backend)
    monkeypatch.setattr(core_cpu, "ENABLED", False)  # the eager loop is the oracle
    monkeypatch.setattr(core_triton, "DRAWS_FROM_GENERATOR", True)  # the eager loop's rounding words
    calls = []
    step = core_triton.step
    monkeypatch.setattr(core_triton, "step", lambda *a, **k: calls.append(1) or step(*a, **k))
    torch.manual_seed(0)
    ps = [torch.randn(s, device=DEV).to(dtype).requires_grad_() for s in shapes]
    opt = ASDT([(f"p{i}", p) for i, p in enumerate(ps)], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
               density=1.0, rounding_seed=3, update="adaptive", **kw)
    for t in range(steps):
        gen = torch.Generator().manual_seed(100 + t)
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=gen) * (1 + t)).to(device=DEV, dtype=p.dtype)
        opt.step()
    return ps, opt, len(calls)


STEPS, LR, C_MAX = 3, 1e-2, 16.0  # _run's steps and lr; a bound on |m / denominator| for its gradients


def _same(monkeypatch, dtype, shapes, kw):
    """The fused run stores what the eager run stores, bit for bit; with the per-unit second moment (whose fp64
    sums are added in another order: core_triton's docstring) ``v`` and the weights within what that allows: the
    fp32 mean of a unit within 1 ulp each step, so ``v`` within ``STEPS * 2^-22`` (relative), the denominators and
    directions within ``STEPS * 2^-22 + 2^-24``, and each step's change of a weight within that of ``LR * C_MAX``
    plus a rounding of the weight."""
    eager, opt_e, n_e = _run(monkeypatch, "reference", dtype, shapes, steps=STEPS, **kw)
    fused, opt_f, n_f = _run(monkeypatch, "triton", dtype, shapes, steps=STEPS, **kw)
    assert n_e == 0 and n_f == STEPS * len(shapes)  # the kernel stepped every tensor in one run, none in the other
    per_unit = kw.get("second_moment", "unit") == "unit"
    rel = STEPS * 2.0 ** -22 + 2.0 ** -24
    for a, b in zip(eager, fused):
        if per_unit:
            ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -23
            torch.testing.assert_close(a.data.float(), b.data.float(), rtol=STEPS * ulp,
                                       atol=STEPS * LR * C_MAX * rel)
        else:
            assert torch.equal(a.data, b.data)
        assert opt_e.state[a].keys() == opt_f.state[b].keys()
        for key, v in opt_e.state[a].items():
            if not torch.is_tensor(v):
                continue
            if per_unit and key == "second":  # (v, t) rows: t exact, v within the bound
                assert torch.equal(v[1::2], opt_f.state[b][key][1::2])
                torch.testing.assert_close(v[0::2], opt_f.state[b][key][0::2], rtol=STEPS * 2.0 ** -22, atol=0)
            else:
                assert torch.equal(v, opt_f.state[b][key]), key
    assert int(opt_e._last_selected) == int(opt_f._last_selected) > 0


def test_unit_sums_over_many_blocks(monkeypatch):
    """The per-unit second moment of units of several tiles added in several blocks (UNIT_BLOCK of 2 tiles)."""
    monkeypatch.setattr(core_triton, "UNIT_BLOCK", 2)
    _same(monkeypatch, torch.float32, SHAPES, dict(state_dtype="8bit", update_clip=1.0))


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_is_the_eager_loop(monkeypatch, case):
    """fp32 weights: weights, momentum codes and scales, second moment, (v, t) rows and the count, bit for bit."""
    kw = CASES[case]
    _same(monkeypatch, torch.float32, ROWS if kw.get("granularity") == "row" else SHAPES, kw)


@pytest.mark.parametrize("case", ["memory-4bit-4bit", "lean-bf16-unit-row"])
def test_bf16_weights_with_the_same_words_are_the_eager_loop(monkeypatch, case):
    """bf16 weights rounded stochastically with the eager loop's words (drawn from the same generator)."""
    kw = CASES[case]
    _same(monkeypatch, torch.bfloat16, ROWS if kw.get("granularity") == "row" else SHAPES, kw)


def test_bf16_weights_rounded_to_nearest(monkeypatch):
    _same(monkeypatch, torch.bfloat16, SHAPES, dict(CASES["balanced-8bit-4bit"], rounding="nearest"))


def test_4bit_units_on_odd_values_take_the_eager_loop(monkeypatch):
    """4-bit codes of rows of odd length share bytes between units: the kernel declines such a layout once the
    state is stored in 4 bits (the first step works on fp32 state, which the kernel takes)."""
    kw = dict(granularity="row", second_moment="coordinate", state_dtype="4bit", second_dtype="4bit")
    assert _run(monkeypatch, "triton", torch.float32, [(3, 5)], steps=2, **kw)[2] == 1
    assert _run(monkeypatch, "triton", torch.float32, [(3, 6)], steps=2, **kw)[2] == 2


def test_cpu_tensors_without_the_interpreter_raise_with_the_fix(monkeypatch):
    """TITAN_KERNELS=triton on CPU tensors outside the interpreter: an error naming the fixes, not a silent
    fallback; unset, the CPU keeps its own kernels."""
    w = torch.zeros(4)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("TITAN_KERNELS", "triton")
    with pytest.raises(_guard.KernelBackendError, match="TRITON_INTERPRET=1"):
        core_triton.runs(w, w, None, None)
    monkeypatch.delenv("TITAN_KERNELS")
    assert not core_triton.runs(w, w, None, None)
    assert core_triton.runs(w.to("meta"), w.to("meta"), None, None)  # meta: the op's fake implementation


def test_step_counts_read_once(monkeypatch):
    """The units' step count is read from the device when a state is first seen, then counted on the host (ASDT
    hands a fresh view of the (v, t) rows each step); a write by anyone else makes it read again."""
    reads = []
    read = core_triton._read_t
    monkeypatch.setattr(core_triton, "_read_t", lambda s: reads.append(1) or read(s))
    ps, opt, _ = _run(monkeypatch, "triton", torch.float32, ROWS[:1], steps=3, **CASES["8bit-8bit-row"])
    assert len(reads) == 1
    opt.state[ps[0]]["second"].view(-1, 2)[:, 1].add_(1)  # someone else counts a step
    opt.step()
    assert len(reads) == 2


def test_step_counts_uneven_take_the_per_unit_corrections(monkeypatch):
    """Units whose step counts differ (a state put back from elsewhere) get their own bias corrections."""
    kw = dict(CASES["8bit-8bit-row"])
    out = []
    for backend in ("reference", "triton"):
        ps, opt, _ = _run(monkeypatch, backend, torch.float32, ROWS[:1], steps=1, **kw)
        st = opt.state[ps[0]]
        st["second"].view(-1, 2)[2, 1] += 5  # row 2 has taken 5 steps more
        ps[0].grad = torch.randn(ps[0].shape, device=DEV)
        opt.step()
        out.append((ps[0].data.clone(), {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}))
    assert torch.equal(out[0][0], out[1][0])
    for key in out[0][1]:
        assert torch.equal(out[0][1][key], out[1][1][key]), key


def test_in_kernel_stochastic_rounding_is_unbiased(monkeypatch):
    """Production rounding (Philox words drawn in the kernel): 2^14 copies of one fp32 value between two bf16
    neighbours round up with the probability that makes the mean the value, within 4 standard errors; rounding to
    nearest (what an unrounded store would give) is 0.3 of a bf16 step off, far outside."""
    monkeypatch.setenv("TITAN_KERNELS", "triton")
    n = 1 << 14
    lr = 0.3 * 2.0 ** -8  # weights at 1.0 - ...: bf16 steps of 2^-8 below 1.0
    w = torch.full((n,), 0.75, dtype=torch.bfloat16, device=DEV)  # bf16 step 2^-8 in [0.5, 1)
    w32 = w.float()

    def one_step(weights):
        p = weights.clone().requires_grad_()
        opt = ASDT([("w", p)], lr=lr, betas=(0.9, 0.95), density=1.0, update="adaptive", weight_decay=0.0,
                   second_moment="coordinate", state_dtype="fp32", rounding_seed=7)
        p.grad = torch.ones_like(p)
        opt.step()
        return p.data.float()

    exact = one_step(w32)[0].item()  # the fp32 result: c ~ 1 at the first step
    got = one_step(w)
    step = 2.0 ** -8
    lo = 0.75 - step
    assert lo < exact < 0.75
    assert set(got.unique().tolist()) == {lo, 0.75}
    frac = (0.75 - exact) / step  # the probability of rounding down
    se = step * (frac * (1 - frac) / n) ** 0.5
    assert abs(got.mean().item() - exact) < 4 * se, (got.mean().item(), exact, se)
    assert abs(0.75 - exact) > 40 * se  # rounding to nearest would fail the bound above
    again = one_step(w)
    assert torch.equal(again, got)


# ------------------------------------------------------------------------------------------ ops per step, on meta
@pytest.fixture
def _meta_generator(monkeypatch):
    """meta has no generator of its own (tests/optim/test_meta_device.py): a CPU one."""
    monkeypatch.setattr(asdt_mod, "_device_generator", lambda device, seed: torch.Generator().manual_seed(seed))
    monkeypatch.delenv("TITAN_KERNELS", raising=False)


@pytest.mark.parametrize("section", ["titan_balanced", "titan_memory", "hf_asdt_8bit", "titan_lean"])
def test_ops_per_step_within_3x_foreach_adamw(section, _meta_generator):
    """One fused op per tensor (and its flat views): the step of a shipped section dispatches at most 3x the ops
    foreach AdamW does on the same parameters (measured here: 263 against 116 for each of the four)."""
    # a vocabulary of 8192 rows (not GPT-2's 50304): the same 52 tensors, and every count per tensor, not per value
    # (the row sections' first step places a state per row, ~20 s at 50304 rows on this machine)
    ours, adamw, ops = ops_per_step(section, vocab=8192)
    assert ops["titan.asdt_adaptive_step.default"] == 52
    assert ours <= 3 * adamw, (ours, adamw, ops.most_common(8))


def test_torch_compile_sees_one_op(monkeypatch):
    """Under torch.compile (fullgraph) one tensor's update is one node, the op, and running the graph steps the
    tensor as the op does eagerly."""
    from titan_ds.optim.layout import Piece
    monkeypatch.setenv("TITAN_KERNELS", "triton")
    slices = core.plan([Piece(0, 0, 300, 0), Piece(1, 300, 37, 0)])
    table, tiles = core_triton._table(slices, torch.device(DEV))[:2]
    g = torch.randn(337, device=DEV)

    def fresh():
        return (torch.randn(337, device=DEV), torch.zeros(337, device=DEV), torch.zeros(337, device=DEV),
                torch.zeros(2, 2, device=DEV), torch.zeros((), dtype=torch.int64, device=DEV))

    def step(w, m, v, seconds, count):
        torch.ops.titan.asdt_adaptive_step(
            w, g, table, tiles, m, None, 0, True, v, None, 0, seconds, None, None, None, None, count,
            [0.9, 0.1, 0.95, 0.05, 1e-8, 1e-2, 0.1, 0.0, 0.1, 20.0], 0, 1.0, 0, 0, False, False, None, 0, [])

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(1)
    eager = fresh()
    step(*eager)
    torch.manual_seed(1)
    compiled = fresh()
    torch.compile(step, backend=backend, fullgraph=True)(*compiled)
    calls = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert calls == [torch.ops.titan.asdt_adaptive_step]
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    assert int(eager[4]) > 0


def test_rounding_key_follows_the_generator_state():
    """The kernel's Philox key moves on with the generator and comes back with its saved state (a checkpoint
    resumes the same words)."""
    gen = torch.Generator().manual_seed(3)
    cpu = torch.device("cpu")
    first = core_triton._seed(gen, cpu)
    saved = gen.get_state()
    second = core_triton._seed(gen, cpu)
    gen.set_state(saved)
    assert core_triton._seed(gen, cpu) == second != first
    assert first >= 1 << 32 and second < 1 << 63
