"""The compiled fused chunk step of ASDT's core (core._fused_chunk under torch.compile) against the eager chunk
loop, its oracle: the same weights and the same stored state (codes and block scales), bit for bit, on one
unit, many units of one length, and units whose chunks fall back to the eager loop (lengths off the 256-value
row, 4-bit codes starting mid-byte), fp32 and bf16 weights (stochastic rounding: the same draws), 8-bit and
4-bit state. All cases share one compiled function (compiling on this CPU takes seconds a variant)."""
import pytest
import torch

pytest.importorskip("torchao")  # the quantized state's code maps (an extra of the package: "quant")

from titan_ds.optim import core, qstate  # noqa: E402
from titan_ds.optim.layout import Piece  # noqa: E402

# (unit lengths, chunk): one unit cut into 4 chunks; 12 units of 512 in chunks of 2048 (4 units each); mixed
# lengths: 768 after a unit of 3 starts mid-byte (eager), 256 and 1024 start on a byte (compiled), 300 is off the
# 256-value row (eager).
LAYOUTS = {
    "one-unit": ([4096], 1024),
    "many-units": ([512] * 12, 2048),
    "odd-4bit": ([3, 768, 5, 256, 300, 1024], 256),
}
KINDS = [("8bit", "4bit"), ("4bit", "4bit")]


@pytest.fixture(autouse=True)
def _compiled_or_error():
    """Past dynamo's recompile limit a compiled function silently runs eagerly, which would make these
    comparisons trivially pass: raise instead."""
    import torch._dynamo
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield


def _setup(lengths, state_kinds, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    w = torch.randn(n, generator=g).to(dtype)
    pieces, at = [], 0
    for i, length in enumerate(lengths):
        pieces.append(Piece(i, at, length, 0))
        at += length
    st = {}
    for key, kind, signed, x in (("m", state_kinds[0], True, torch.randn(n, generator=g) * 0.1),
                                 ("v", state_kinds[1], False, torch.rand(n, generator=g) * 0.01)):
        st[key], st[f"{key}_absmax"] = qstate.quantize(x, lengths, kind, signed)
    seconds = torch.zeros(len(lengths), 2)
    seconds[:, 1] = torch.arange(len(lengths), dtype=torch.float32)  # units at different steps: t differs
    return w, pieces, st, seconds


def _run(lengths, chunk, state_kinds, dtype, compiled, steps=3, betas=(0.9, 0.95), **kw):
    """``steps`` dense steps of a fresh setup; the weights, the state dict and the changed-element count."""
    w, pieces, st, seconds = _setup(lengths, state_kinds, dtype)
    slices = core.plan(pieces, chunk)
    lens = tuple(lengths)
    gen = torch.Generator().manual_seed(7) if dtype == torch.bfloat16 else None
    count = 0
    for t in range(steps):
        g = torch.randn(w.numel(), generator=torch.Generator().manual_seed(100 + t)).to(dtype)
        count += int(core.dense_step(
            w, g, slices, core.StateBuffer.of(st, "m", state_kinds[0], True, lens),
            variance=core.StateBuffer.of(st, "v", state_kinds[1], False, lens), seconds=seconds, lr=1e-2,
            betas=betas, weight_decay=0.1, generator=gen, compiled=compiled, **kw))
    return w, st, count


def _fused_chunks(lengths, chunk, state_kinds):
    w, pieces, st, _ = _setup(lengths, state_kinds, torch.float32)
    lens = tuple(lengths)
    bufs = [core.StateBuffer.of(st, k, kind, s, lens) for k, kind, s in zip("mv", state_kinds, (True, False))]
    return sum(core._fusable(s, *bufs) for s in core.plan(pieces, chunk)), len(core.plan(pieces, chunk))


# Each variant compiles (kinds, weight dtype, one unit or many): 10-100 s on this 2-core machine, hence slow.
@pytest.mark.slow
@pytest.mark.heavy  # 12 compiles of 10-100 s each on 2 cores; CI runs the clip case below and the wrong-beta one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("state_kinds", KINDS, ids=["-".join(k) for k in KINDS])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_compiled_step_is_the_eager_step_bit_for_bit(layout, state_kinds, dtype):
    lengths, chunk = LAYOUTS[layout]
    fused, total = _fused_chunks(lengths, chunk, state_kinds)
    assert fused > 0  # the compiled step is exercised in every layout
    if layout == "odd-4bit" and state_kinds[1] == "4bit":
        assert fused < total  # ... and the eager fallback beside it
    we, se, ce = _run(lengths, chunk, state_kinds, dtype, compiled=False)
    wc, sc, cc = _run(lengths, chunk, state_kinds, dtype, compiled=True)
    assert torch.equal(we, wc)
    for key in se:
        assert torch.equal(se[key], sc[key]), key
    assert ce == cc


@pytest.mark.slow
def test_compiled_step_clip_and_grad_weight_importance():
    """The other arguments the compiled step takes: update_clip and importance="grad_weight"."""
    lengths, chunk = LAYOUTS["many-units"]
    kw = dict(update_clip=0.05, importance="grad_weight")
    we, se, _ = _run(lengths, chunk, KINDS[0], torch.float32, compiled=False, **kw)
    wc, sc, _ = _run(lengths, chunk, KINDS[0], torch.float32, compiled=True, **kw)
    assert torch.equal(we, wc) and all(torch.equal(se[k], sc[k]) for k in se)


def test_a_wrong_beta_in_the_compiled_step_fails(monkeypatch):
    """The comparison can fail: the compiled step with b2 off by 1e-3 stores other codes and weights."""
    lengths, chunk = LAYOUTS["one-unit"]
    we, se, _ = _run(lengths, chunk, KINDS[0], torch.float32, compiled=False)
    real = core._fused_chunk

    def wrong(w, g, m_raw, v_raw, bc1, inv_bc2, hp, *rest):
        hp = hp.clone()
        hp[2] -= 1e-3
        return real(w, g, m_raw, v_raw, bc1, inv_bc2, hp, *rest)

    monkeypatch.setattr(core, "_compiled", lambda *static: wrong)  # eager _fused_chunk: the same function, uncompiled
    wc, sc, _ = _run(lengths, chunk, KINDS[0], torch.float32, compiled=True)
    assert not torch.equal(we, wc)
    assert not torch.equal(se["v"], sc["v"])
