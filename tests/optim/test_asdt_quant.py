"""ASDT's quantized state (qstate.py) and per-coordinate second moment (second_moment="coordinate").

Oracles: torchao's own quantized-state tensors (the codes and scales of one block-aligned buffer), torch's Adam
(a per-coordinate second moment in fp32 is Adam), and ASDT's reference loop with each tensor's buffers passed
through the quantizer's round trip after every step (the optimizer must equal it bit for bit)."""
import pytest
import torch

from tests.helpers.deps import require

require("torchao")

from titan_ds.optim import qstate  # noqa: E402
from titan_ds.optim.asdt import ASDT, reference_step  # noqa: E402

SHAPES = [(7, 13), (5,), (3, 4, 6), (1,), (33, 9), (300,)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _params():
    return [torch.randn(s, requires_grad=True) for s in SHAPES]


def _grads(ps, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in ps]


@pytest.mark.parametrize("kind,cls,block", [("8bit", "OptimState8bit", 256), ("4bit", "OptimState4bit", 128)])
@pytest.mark.parametrize("signed", [True, False])
def test_codes_and_scales_are_torchaos(kind, cls, block, signed):
    import importlib
    mod = importlib.import_module(f"torchao.optim.subclass_{kind}")
    x = torch.randn(8 * block)
    x = x if signed else x.abs()
    ref = getattr(mod, cls).zeros(x.shape, signed, block)
    ref.copy_(x)
    codes, absmax = qstate.quantize(x, [x.numel()], kind, signed)
    assert torch.equal(absmax, ref.scale.view(-1))
    theirs = ref.codes.view(-1)
    if kind == "4bit":  # compare unpacked codes
        codes, theirs = (torch.stack([c >> 4, c & 15], -1).view(-1) for c in (codes, theirs))
    # the same nearest code, except within a rounding error of a midpoint (bucketize vs torchao's search)
    differ = codes != theirs
    assert int(differ.sum()) <= 2 and (codes.int() - theirs.int()).abs().max() <= 1
    same = qstate.dequantize(ref.codes.view(-1), absmax, [x.numel()], kind, signed)
    assert torch.equal(same, ref.dequantize().view(-1))  # decoding is torchao's


@pytest.mark.parametrize("kind", ["8bit", "4bit"])
@pytest.mark.parametrize("signed", [True, False])
def test_each_code_is_a_nearest_level(kind, signed):
    q = qstate.qmap(kind, signed)
    x = torch.rand(20000) * 2 - 1 if signed else torch.rand(20000)
    x = torch.cat([x, q, (q[1:] + q[:-1]) / 2])  # the levels and the midpoints themselves
    c = qstate._encode(x, kind, signed).long()
    err = (q[c] - x).abs()
    best = (q[None, :] - x[:, None]).abs().min(1).values
    assert torch.all(err <= best + 1e-6)


@pytest.mark.parametrize("kind", ["8bit", "4bit"])
@pytest.mark.parametrize("signed", [True, False])
def test_table_encoding_is_bucketize(kind, signed):
    """The table lookup gives exactly bucketize's codes: random values over many magnitudes, the levels, the
    midpoints, their float neighbours, signed zeros and the ends."""
    q, mids = qstate.qmap(kind, signed), qstate._midpoints(kind, signed)
    x = torch.rand(200000) * torch.pow(10.0, -8 * torch.rand(200000))
    x = x * torch.where(torch.rand(200000) < 0.5, -1.0, 1.0) if signed else x
    edges = torch.cat([q, mids, torch.nextafter(mids, torch.full_like(mids, 2.0)),
                       torch.nextafter(mids, torch.full_like(mids, -2.0)), torch.tensor([0.0, -0.0, 1.0, 1e-12])])
    x = torch.cat([x, edges if signed else edges.abs()])
    want = torch.bucketize(x, mids, right=True).to(torch.uint8)
    assert torch.equal(qstate._encode(x, kind, signed), want)


@pytest.mark.parametrize("kind", ["8bit", "4bit"])
def test_blocks_restart_at_each_record(kind, monkeypatch):
    """A record's codes are those of the record quantized alone (its neighbours do not change them), chunking
    included; sizes: 1.016 / 0.531 bytes a value plus the partial last block of each record."""
    monkeypatch.setattr(qstate, "_CHUNK", 700)  # several chunks per run
    lens = [300, 5, 5, 5, 1000, 1, 513, 513, 513]
    x = torch.randn(sum(lens))
    codes, absmax = qstate.quantize(x, lens, kind, True)
    dec = qstate.dequantize(codes, absmax, lens, kind, True)
    block = qstate.KINDS[kind][0]
    assert absmax.numel() == sum(-(-n // block) for n in lens)
    off = 0
    for n in lens:
        c1, a1 = qstate.quantize(x[off:off + n], [n], kind, True)
        assert torch.equal(qstate.dequantize(c1, a1, [n], kind, True), dec[off:off + n])
        off += n
    err = (dec - x).abs().max()
    assert err <= (0.05 if kind == "8bit" else 0.5) * x.abs().max()
    with pytest.raises(ValueError, match="sum to"):
        qstate.quantize(x, lens[:-1], kind, True)


def test_coordinate_second_moment_in_fp32_is_adam():
    w = torch.randn(40, 3, requires_grad=True)
    ref = w.detach().clone().requires_grad_()
    opt = ASDT([("w", w)], lr=1e-2, betas=(0.9, 0.95), density=1.0, update="adaptive", second_moment="coordinate")
    adam = torch.optim.Adam([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(8):
        g = torch.randn(40, 3)
        w.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        adam.step()
    torch.testing.assert_close(w.data, ref.data, rtol=1e-5, atol=1e-6)


def _round_trip(states, ps, lens_of, state_kind, second_kind):
    """What ASDT stores between steps: each tensor's momentum / variance buffer (its units end to end) through
    the quantizer, written back into the reference's per-unit states."""
    for i, p in enumerate(ps):
        keys = sorted(s for (j, s) in states if j == i)
        lens = lens_of(p)
        for key, kind, signed in (("momentum", state_kind, True), ("v", second_kind, False)):
            if kind is None:
                continue
            buf = torch.cat([states[(i, s)][key].float().view(-1) for s in keys])
            dec = qstate.dequantize(*qstate.quantize(buf, lens, kind, signed), lens, kind, signed)
            for s, part in zip(keys, torch.split(dec, lens)):
                states[(i, s)][key] = part.clone()


def _units(p, granularity):
    n = p.numel()
    step = n if granularity == "tensor" else (n // p.shape[0] if p.dim() >= 2 else 1)
    return [(s, step) for s in range(0, n, step)]


@pytest.mark.parametrize("state_dtype,second_dtype", [("8bit", "4bit"), ("8bit", "8bit"), ("4bit", "fp32"),
                                                      ("bf16", "bf16")])
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("density", [1.0, 0.3])
def test_quantized_coordinate_path_matches_reference_bit_exactly(state_dtype, second_dtype, granularity, density):
    a = _params()
    b = [p.detach().clone() for p in a]
    hp = dict(lr=1e-2, betas=(0.9, 0.95), density=density, weight_decay=0.1, importance="momentum")
    opt = ASDT([(f"p{i}", p) for i, p in enumerate(a)], update="adaptive", granularity=granularity,
               state_dtype=state_dtype, second_moment="coordinate", second_dtype=second_dtype, **hp)
    quant = ("8bit", "4bit")
    dt = {"bf16": torch.bfloat16}
    states = {}
    for t in range(6):
        for p, g in zip(a, _grads(a, t)):
            p.grad = g
        opt.step()
        units = [(p.data.view(-1)[s:s + n], g.view(-1)[s:s + n], states.setdefault((i, s), {}))
                 for i, (p, g) in enumerate(zip(b, _grads(b, t))) for s, n in _units(p, granularity)]
        reference_step(units, state_dtype=dt.get(state_dtype, torch.float32), update="adaptive",
                       second_moment="coordinate", second_dtype=dt.get(second_dtype, torch.float32), **hp)
        _round_trip(states, b, lambda p: [n for _, n in _units(p, granularity)],
                    state_dtype if state_dtype in quant else None, second_dtype if second_dtype in quant else None)
        for pa, pb in zip(a, b):
            assert torch.equal(pa.data, pb), f"step {t}"
    st = opt.state[a[0]]
    if state_dtype in quant:
        assert st["momentum"].dtype == torch.uint8 and st["momentum_absmax"].dtype == torch.float32
    if second_dtype in quant:
        assert st["variance"].dtype == torch.uint8


def test_state_bytes_are_the_codes_and_scales():
    ps = [torch.randn(64, 256, requires_grad=True), torch.randn(256, requires_grad=True)]
    opt = ASDT([(f"p{i}", p) for i, p in enumerate(ps)], lr=1e-3, density=1.0, update="adaptive",
               state_dtype="8bit", second_moment="coordinate", second_dtype="4bit")
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    n = sum(p.numel() for p in ps)
    momentum = n + 4 * (n // 256)
    variance = n // 2 + 4 * (n // 128)
    assert opt.state_bytes() == momentum + variance + 8 * len(ps)  # + (v, t) of each unit
    assert opt.state_bytes() / n < 1.6


def test_quantized_resume_is_bit_exact():
    from tests.optim.test_asdt import _resume  # train 6 steps vs 3 + restore + 3, same weights
    dtypes = _resume(dict(lr=1e-2, density=1.0, weight_decay=0.1, update="adaptive", state_dtype="8bit",
                          second_moment="coordinate", second_dtype="4bit"))
    assert dtypes["momentum"] == dtypes["variance"] == torch.uint8  # torch's fp32 cast of the codes is undone
    assert dtypes["momentum_absmax"] == dtypes["variance_absmax"] == torch.float32


@pytest.mark.parametrize("hp", [
    dict(state_dtype="8bit"),
    dict(state_dtype="4bit", update="adaptive", second_moment="coordinate", second_dtype="fp32"),
    dict(state_dtype="bf16", update="adaptive", granularity="row"),
], ids=["8bit-absmax", "coordinate-fp32", "row-second"])
def test_resume_with_bf16_params_keeps_fp32_state_exactly(hp):
    """torch's load_state_dict casts floating state to a bf16 param's dtype; ASDT takes its fp32 block scales and
    second moments again from the saved dict (before, they came back rounded to bf16 and resume was not exact)."""
    from tests.optim.test_asdt import _resume
    _resume(dict(lr=1e-2, density=1.0, weight_decay=0.1, **hp), dtype=torch.bfloat16)


def test_bad_second_moment_arguments_raise():
    w = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match="needs update"):
        ASDT(w, second_moment="coordinate")
    with pytest.raises(ValueError, match="needs second_moment"):
        ASDT(w, update="adaptive", second_dtype="8bit")
    with pytest.raises(ValueError, match="unknown second_moment"):
        ASDT(w, update="adaptive", second_moment="row")
    with pytest.raises(ValueError, match="state_dtype"):
        ASDT(w, state_dtype="int8")


def test_quantized_state_with_bsps_frees_and_restarts_units():
    """BSPS moves units in and out of the buffers: the records change between steps, and the codes follow them
    (the unpack / place / pack of one tensor's update, and of stage 0's freeing)."""
    from titan_ds.optim.bsps import Plasticity
    torch.manual_seed(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    named = list(model.named_parameters())
    opt = ASDT(named, lr=1e-2, density=1.0, update="adaptive", state_dtype="8bit", second_moment="coordinate",
               second_dtype="4bit")
    blocks = sorted({n.split(".")[0] for n, _ in named})
    sizes = [sum(p.numel() for n, p in named if n.split(".")[0] == b) for b in blocks]
    pl = Plasticity(blocks, sizes, max_active_fraction=0.5, warmup_steps=2, sleep_after=2, wake_every=3,
                    plateau_ratio=0.99)
    opt.attach_plasticity(pl, [blocks.index(u.param.split(".")[0]) for u in opt.units])
    x = torch.randn(32, 16)
    for _ in range(12):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        for st in opt.state.values():
            n = sum(r.length for r in st["units"] if r.buffer == "momentum")
            assert st["momentum"].dtype == torch.uint8 and st["momentum"].numel() == n
            assert st["variance"].numel() == (n + 1) // 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert len(pl.events) > 0


def test_importing_torchao_for_the_state_drops_only_its_known_lines():
    """A fresh process that builds a 4-bit code map (titan's first torchao import) prints neither torchao's
    "Failed to load .../_C_*.so" lines nor torch's pytree deprecation of torchao's Enum; a torchao warning logged
    after the import still shows (the filters are gone once torchao is imported)."""
    import subprocess
    import sys
    from pathlib import Path
    code = ("from titan_ds.optim import qstate; qstate.qmap('4bit', True); import logging; "
            "logging.getLogger('torchao').warning('Failed to load /x/torchao/_C_later.so: still shown')")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    err = r.stderr + r.stdout
    assert "is an Enum subclass" not in err and "_C_mxfp8" not in err and "_C_cutlass" not in err, err
    assert "_C_later.so: still shown" in err
