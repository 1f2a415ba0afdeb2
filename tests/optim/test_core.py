"""ASDT's chunked core (titan_ds/optim/core.py): chunking changes nothing (bit for bit, against the reference loop
and against one chunk per unit), the quantized state is read and written in ranges exactly as quantize() stores
the whole buffer, and the step's temporaries stay within 4 bytes per element of the tensor it steps."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("torchao")  # the quantized state's code maps (an extra of the package: "quant")

from titan_ds.optim import core, qstate  # noqa: E402
from titan_ds.optim.asdt import ASDT, reference_step  # noqa: E402
from titan_ds.optim.layout import Piece  # noqa: E402

SHAPES = [(37, 29), (5,), (300,), (3, 4, 6), (1,), (41, 17)]  # odd sizes: 4-bit codes straddle bytes


def _grads(ps, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in ps]


def _run(monkeypatch, chunk, dtype=torch.float32, steps=4, **kw):
    monkeypatch.setattr(core, "CHUNK", chunk)
    torch.manual_seed(0)
    ps = [torch.randn(s).to(dtype).requires_grad_() for s in SHAPES]
    opt = ASDT([(f"p{i}", p) for i, p in enumerate(ps)], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
               density=1.0, rounding_seed=3, **kw)
    for t in range(steps):
        for p, g in zip(ps, _grads(ps, t)):
            p.grad = g
        opt.step()
    return ps, opt


CASES = {
    "adaptive-8bit-4bit": dict(update="adaptive", second_moment="coordinate", state_dtype="8bit", second_dtype="4bit"),
    "adaptive-4bit-4bit": dict(update="adaptive", second_moment="coordinate", state_dtype="4bit", second_dtype="4bit"),
    "adaptive-bf16-fp32-clip": dict(update="adaptive", second_moment="coordinate", state_dtype="bf16",
                                    second_dtype="fp32", update_clip=0.5),
    "adaptive-row-8bit": dict(update="adaptive", second_moment="coordinate", state_dtype="8bit", second_dtype="8bit",
                              granularity="row"),
    "adaptive-unit-row-8bit-clip": dict(update="adaptive", granularity="row", state_dtype="8bit", update_clip=1.0),
    "adaptive-unit-tensor-bf16": dict(update="adaptive", state_dtype="bf16"),
    "sign-bf16-grad_weight": dict(update="sign", state_dtype="bf16", importance="grad_weight"),
    "sign-8bit": dict(update="sign", state_dtype="8bit"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_chunks_change_nothing(monkeypatch, case, dtype):
    """Chunks of 256 elements (units split at block boundaries, small units grouped) vs one chunk per unit: the
    same weights and the same stored state, bit for bit (bf16 weights: the same stochastic-rounding draws)."""
    whole, opt_w = _run(monkeypatch, 1 << 20, dtype, **CASES[case])
    small, opt_s = _run(monkeypatch, 256, dtype, **CASES[case])
    assert len(core.plan(opt_s._layouts.of(small[0]).pieces)) > 1  # the 37x29 unit is cut
    for a, b in zip(whole, small):
        assert torch.equal(a.data, b.data)
    for a, b in zip(whole, small):
        for key, v in opt_w.state[a].items():
            if torch.is_tensor(v):
                assert torch.equal(v, opt_s.state[b][key]), key


@pytest.mark.parametrize("state_dtype,second_dtype", [("8bit", "4bit"), ("4bit", "4bit"), ("fp32", "fp32")])
def test_chunked_adaptive_step_is_the_reference(monkeypatch, state_dtype, second_dtype):
    """The chunked core (chunks of 256) against reference_step, unit by unit, with the stored state put through
    the quantizer as ASDT stores it: the same weights bit for bit."""
    from tests.optim.test_asdt_quant import _round_trip
    monkeypatch.setattr(core, "CHUNK", 256)
    torch.manual_seed(0)
    a = [torch.randn(s).requires_grad_() for s in SHAPES]
    b = [p.detach().clone() for p in a]
    hp = dict(lr=1e-2, betas=(0.9, 0.95), density=1.0, weight_decay=0.1, importance="momentum")
    opt = ASDT([(f"p{i}", p) for i, p in enumerate(a)], update="adaptive", second_moment="coordinate",
               state_dtype=state_dtype, second_dtype=second_dtype, **hp)
    quant = ("8bit", "4bit")
    states = {}
    for t in range(5):
        for p, g in zip(a, _grads(a, t)):
            p.grad = g
        opt.step()
        units = [(p.data.view(-1), g.view(-1), states.setdefault((i, 0), {})) for i, (p, g) in
                 enumerate(zip(b, _grads(b, t)))]
        reference_step(units, state_dtype=torch.float32, update="adaptive", second_moment="coordinate",
                       second_dtype=torch.float32, **hp)
        _round_trip(states, b, lambda p: [p.numel()], state_dtype if state_dtype in quant else None,
                    second_dtype if second_dtype in quant else None)
        for pa, pb in zip(a, b):
            assert torch.equal(pa.data, pb), f"step {t}"


@pytest.mark.parametrize("kind", ["8bit", "4bit"])
@pytest.mark.parametrize("signed", [True, False])
def test_range_reads_and_writes_are_the_whole_buffer_s(kind, signed):
    """qstate.read/write of one chunk (whole records, or a piece of one at a block boundary, at odd offsets
    for 4-bit) decode and store exactly what quantize/dequantize of the whole buffer do."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 700, 1, 256, 513, 9]
    x = torch.randn(sum(lengths), generator=g).abs() if not signed else torch.randn(sum(lengths), generator=g)
    codes, absmax = qstate.quantize(x, lengths, kind, signed)
    whole = qstate.dequantize(codes, absmax, lengths, kind, signed)
    pieces, at = [], 0
    for i, n in enumerate(lengths):
        pieces.append(Piece(i, at, n, 0))
        at += n
    sl = core.plan(pieces, chunk=256)
    buf = core.StateBuffer.of({"m": codes.clone(), "m_absmax": absmax.clone()}, "m", kind, signed, lengths)
    got = torch.cat([buf.read(s) for s in sl])
    assert torch.equal(got, whole)
    y = torch.randn(sum(lengths), generator=g)
    y = y.abs() if not signed else y
    for s in sl:  # write a new buffer chunk by chunk, in reverse order: neighbours must be kept
        pass
    for s in reversed(sl):
        buf.write(s, y[s.buf:s.buf + s.n])
    want_codes, want_absmax = qstate.quantize(y, lengths, kind, signed)
    assert torch.equal(buf.data, want_codes) and torch.equal(buf.absmax, want_absmax)


def test_plan_groups_small_units_and_cuts_large_ones_at_the_chunk():
    pieces = [Piece(0, 0, 100, 0), Piece(1, 100, 100, 0), Piece(2, 200, 600, 0), Piece(3, 900, 50, 0)]
    sl = core.plan(pieces, chunk=256)
    assert [(s.flat, s.buf, s.lo, s.hi, s.lengths, s.offset) for s in sl] == [
        (0, 0, 0, 2, (100, 100), 0), (200, 200, 2, 3, (256,), 0), (456, 456, 2, 3, (256,), 256),
        (712, 712, 2, 3, (88,), 512), (900, 800, 3, 4, (50,), 0)]  # piece 3 is not contiguous in the tensor
    with pytest.raises(ValueError, match="multiple of 256"):
        core.plan(pieces, chunk=100)


_TEMP = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads(1)
    from titan_ds.optim.asdt import ASDT
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))
    n, kw = int(sys.argv[1]), json.loads(sys.argv[2])
    p = torch.nn.Parameter(torch.randn(n) * 0.02)
    p.grad = torch.randn(n)
    opt = ASDT([p], lr=1e-3, **{"density": 1.0, **kw})
    opt.step()
    before = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    opt.step()
    print(json.dumps((status("VmHWM") - before) / n))
""")


@pytest.mark.parametrize("case", ["adaptive-8bit-4bit", "adaptive-4bit-4bit", "sign-8bit"])
def test_step_temporaries_within_4_bytes_per_element(case):
    """One step of a 4M-element tensor holds at most 4 bytes/element above its state (the issue's bound; the
    flat path before the core held 25-28): peak RSS of a fresh process, after the state exists."""
    per_element = step_temporaries(1 << 22, CASES[case])
    assert per_element <= 4.0, per_element


def step_temporaries(n: int, kw: dict) -> float:
    """Peak RSS above the state during the second step of ``ASDT([p], lr=1e-3, **kw)`` on an ``n``-element
    tensor (density 1 unless given), per element, measured in a fresh process with glibc's mmap threshold at 1 MiB
    (as HMS and launch/bench/optim_step.py set it: else freed blocks stay resident and the peak hides a step's
    temporaries)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576")
    out = subprocess.run([sys.executable, "-c", _TEMP, str(n), json.dumps(kw)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_default_chunks_are_at_least_256k_dense_and_64k_sparse():
    """The chunk sizes the speed was measured at (core.CHUNK's comment): a SmolLM2 MLP weight (1536 rows of 576)
    steps in 4 dense chunks, not 14 (64K each, ~1 ms of fixed costs a chunk); the sparse strategy keeps 64K; a
    large tensor still steps in a 32nd (64th sparse) capped at MAX_CHUNK (the temporaries bound)."""
    from titan_ds.optim import sparse
    rows = [Piece(i, 576 * i, 576, 0) for i in range(1536)]
    dense = core.plan(rows)
    assert len(dense) == 4 and max(s.n for s in dense) <= 1 << 18
    sparse_plan = core.plan(rows, parts=sparse.PARTS, least=min(core.CHUNK, sparse.CHUNK))
    assert len(sparse_plan) == 14 and max(s.n for s in sparse_plan) <= 1 << 16
    big = [Piece(0, 0, 1 << 26, 0)]
    assert {s.n for s in core.plan(big)} == {core.MAX_CHUNK}
    assert {s.n for s in core.plan([Piece(0, 0, 1 << 22, 0)])} == {1 << 18}
