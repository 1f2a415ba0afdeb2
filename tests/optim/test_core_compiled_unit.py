"""The compiled per-unit step of ASDT's core (core._fused_unit_chunk under torch.compile: the adaptive update with
one second moment per unit, the HF profiles' ``granularity="row"``) against the eager chunk loop, its oracle: the
same weights and the same stored momentum (codes and block scales), bit for bit. Rows of 576 (SmolLM2's width:
two whole 256-value blocks and a partial one), a 1-D unit, a chunk of fewer rows (the row count turns dynamic), a
unit cut into pieces (eager) and 4-bit codes starting mid-byte (eager), fp32 and bf16 weights (stochastic rounding:
the same draws), 8-bit, 4-bit and plain (fp32, the first step's working form) momentum."""
import itertools

import pytest
import torch

pytest.importorskip("torchao")  # the quantized state's code maps (an extra of the package: "quant")

from titan_ds.optim import core, qstate  # noqa: E402
from titan_ds.optim.layout import Piece  # noqa: E402
from tests.optim.test_core_compiled import _compiled_or_error  # noqa: E402,F401 (autouse: no silent eager fallback)

@pytest.fixture(autouse=True)
def _fresh_unit_lengths(monkeypatch):
    """Each test starts with no compiled unit length: the process-wide cap (core.UNIT_FUSED_LENGTHS) would
    otherwise leave a later test's new lengths to the eager loop, depending on which tests ran before it."""
    monkeypatch.setattr(core, "_unit_lengths", set())


# (unit lengths, chunk): 7 rows of 576 in chunks of 2048 (3 rows, 3 rows, 1 row: two row counts); a 1-D unit of
# 576 beside rows of 1536; units of 3 and 1 (4-bit: the 1 starts mid-byte; core.plan puts both in a chunk of mixed
# lengths: eager), then a row of 576 starting on a byte again (compiled in 4-bit too), one of 40000 cut in pieces
# (its first piece compiled, the rest eager).
LAYOUTS = {
    "rows-576": ([576] * 7, 2048),
    "mixed": ([576, 1536, 1536, 3, 1, 576, 40000], 4096),
}


def _setup(lengths, kind, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    w = torch.randn(n, generator=g).to(dtype)
    starts = [0, *itertools.accumulate(lengths)][:-1]
    pieces = [Piece(i, at, length, 0) for i, (at, length) in enumerate(zip(starts, lengths))]
    m = torch.randn(n, generator=g) * 0.1
    st = {"m": m} if kind is None else dict(zip(("m", "m_absmax"), qstate.quantize(m, lengths, kind, True)))
    seconds = torch.zeros(len(lengths), 2)
    seconds[:, 0] = torch.rand(len(lengths), generator=g) * 0.01
    seconds[:, 1] = torch.arange(len(lengths), dtype=torch.float32)  # units at different steps: t differs
    return w, pieces, st, seconds


def _run(lengths, chunk, kind, dtype, compiled, steps=3, **kw):
    """``steps`` dense steps of a fresh setup; the weights, the state dict, the seconds and the changed count."""
    w, pieces, st, seconds = _setup(lengths, kind, dtype)
    slices = core.plan(pieces, chunk)
    gen = torch.Generator().manual_seed(7) if dtype == torch.bfloat16 else None
    count = 0
    for t in range(steps):
        g = torch.randn(w.numel(), generator=torch.Generator().manual_seed(100 + t)).to(dtype)
        count += int(core.dense_step(
            w, g, slices, core.StateBuffer.of(st, "m", kind, True, tuple(lengths)), seconds=seconds,
            unit_numels=list(lengths), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, update_clip=1.0,
            generator=gen, compiled=compiled, **kw))
    return w, st, seconds, count


def _fused(lengths, chunk, kind):
    w, pieces, st, _ = _setup(lengths, kind, torch.float32)
    buf = core.StateBuffer.of(st, "m", kind, True, tuple(lengths))
    slices = core.plan(pieces, chunk)
    return sum(core._unit_fusable(s, buf) for s in slices), len(slices)


def _same(a, b):
    we, se, ve, ce = a
    wc, sc, vc, cc = b
    assert torch.equal(we, wc)
    for key in se:
        assert torch.equal(se[key], sc[key]), key
    assert torch.equal(ve, vc) and ce == cc


@pytest.mark.slow
@pytest.mark.heavy  # 12 variants, each compiling for 5-20 s on 2 cores; CI runs the mixed 8-bit bf16 case below
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["8bit", "4bit", None], ids=["8bit", "4bit", "fp32-state"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_compiled_unit_step_is_the_eager_step_bit_for_bit(layout, kind, dtype):
    lengths, chunk = LAYOUTS[layout]
    fused, total = _fused(lengths, chunk, kind)
    assert fused > 0  # the compiled step is exercised in every layout
    if layout == "mixed":
        assert fused < total  # ... and the eager fallback beside it
    _same(_run(lengths, chunk, kind, dtype, compiled=False), _run(lengths, chunk, kind, dtype, compiled=True))


@pytest.mark.slow
def test_compiled_unit_step_mixed_lengths_8bit_bf16():
    """What the HF profile meets: 8-bit momentum, rows of two lengths, a 1-D unit, pieces of a large unit, bf16
    weights with stochastic rounding."""
    lengths, chunk = LAYOUTS["mixed"]
    _same(_run(lengths, chunk, "8bit", torch.bfloat16, compiled=False),
          _run(lengths, chunk, "8bit", torch.bfloat16, compiled=True))


@pytest.mark.slow
def test_compiled_unit_step_grad_weight_importance():
    lengths, chunk = LAYOUTS["rows-576"]
    kw = dict(importance="grad_weight")
    _same(_run(lengths, chunk, "8bit", torch.float32, compiled=False, **kw),
          _run(lengths, chunk, "8bit", torch.float32, compiled=True, **kw))


def test_a_wrong_beta_in_the_compiled_unit_step_fails(monkeypatch):
    """The comparison can fail: the compiled step with b1 off by 1e-3 stores other codes and weights."""
    lengths, chunk = LAYOUTS["rows-576"]
    eager = _run(lengths, chunk, "8bit", torch.float32, compiled=False)
    real = core._fused_unit_chunk

    def wrong(w, g, m_raw, denom, hp, *rest):
        hp = hp.clone()
        hp[0] -= 1e-3
        return real(w, g, m_raw, denom, hp, *rest)

    monkeypatch.setattr(core, "_compiled_unit", lambda *static: wrong)  # uncompiled, the same function otherwise
    wc, sc, _, _ = _run(lengths, chunk, "8bit", torch.float32, compiled=True)
    assert not torch.equal(eager[0], wc)
    assert not torch.equal(eager[1]["m"], sc["m"])


def test_the_uncompiled_unit_function_is_the_eager_step(monkeypatch):
    """_fused_unit_chunk run eagerly (no compile: fast) stores what the eager loop stores: the function's
    arithmetic and the slicing of codes and block scales around it, whatever inductor then does."""
    monkeypatch.setattr(core, "_compiled_unit", lambda *static: core._fused_unit_chunk)
    for layout, (lengths, chunk) in LAYOUTS.items():
        for kind in ("8bit", "4bit", None):
            _same(_run(lengths, chunk, kind, torch.float32, compiled=False),
                  _run(lengths, chunk, kind, torch.float32, compiled=True))
