"""ASDT: flat path vs the reference loop, density honoured, bounded step, state dtype, checkpoint, delta."""
import copy
import math

import pytest
import torch

from titan_ds.optim.asdt import ASDT, ELASTIC, GROWTH, asdt_update, reference_step
from titan_ds.optim.delta import apply_delta


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


SHAPES = [(7, 13), (5,), (3, 4, 6), (1,), (33, 9)]


def _params():
    return [torch.randn(s, requires_grad=True) for s in SHAPES]


def _grads(ps, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in ps]


def _run_flat(ps, steps, **kw):
    opt = ASDT([(f"p{i}", p) for i, p in enumerate(ps)], **kw)
    for t in range(steps):
        for p, g in zip(ps, _grads(ps, t)):
            p.grad = g
        opt.step()
    return opt


def _run_reference(ps, steps, granularity="tensor", block_size=4096, **kw):
    states = {}
    for t in range(steps):
        units = []
        for i, (p, g) in enumerate(zip(ps, _grads(ps, t))):
            w, gv = p.data.view(-1), g.view(-1)
            step = p.numel() if granularity == "tensor" else block_size
            for s in range(0, p.numel(), step):
                units.append((w[s:s + step], gv[s:s + step], states.setdefault((i, s), {})))
        reference_step(units, **kw)
    return states


@pytest.mark.parametrize("importance", ["momentum", "grad_weight"])
@pytest.mark.parametrize("density", [1.0, 0.3, 0.05])
@pytest.mark.parametrize("granularity", ["tensor", "block"])
def test_flat_path_matches_reference_bit_exactly(importance, density, granularity):
    a = _params()
    b = [p.detach().clone() for p in a]
    hp = dict(lr=1e-2, betas=(0.9, 0.99), density=density, weight_decay=0.1, importance=importance)
    opt = _run_flat(a, 6, granularity=granularity, block_size=10, **hp)
    states = _run_reference(b, 6, granularity=granularity, block_size=10, state_dtype=torch.float32, **hp)
    for pa, pb in zip(a, b):
        assert torch.equal(pa.data, pb)
    # momentum buffers, unit by unit
    for i, p in enumerate(a):
        m = opt.state[p]["momentum"]
        ref = torch.cat([states[(i, s)]["momentum"] for s in sorted(s for (j, s) in states if j == i)])
        assert torch.equal(m, ref)


def test_asdt_update_alone_matches_reference_on_strided_slices():
    """The function without the optimizer: Growth and Elastic units given as non-contiguous column views, bf16
    momenta and anchors, per-unit lr scales; column 3 is given to neither (frozen)."""
    w, hp = torch.randn(9, 4), dict(lr=1e-2, betas=(0.9, 0.99), density=0.4, weight_decay=0.1)
    ref = w.clone()
    momenta = [torch.zeros(9, dtype=torch.bfloat16) for _ in range(2)]
    anchors = [w[:, 2].clone().to(torch.bfloat16)]
    states = [{}, {}, {}]
    for _ in range(4):
        g = torch.randn(9, 4)
        n = asdt_update([w[:, 0], w[:, 1]], [g[:, 0], g[:, 1]], momenta=momenta, unit_numels=[9, 9], **hp)
        n += asdt_update([w[:, 2]], [g[:, 2]], anchors=anchors, unit_numels=[9], lr_scales=[0.3],
                         elastic_pull=0.2, **hp)
        assert n == 3 * 4  # ceil(0.4 * 9) per unit, continuous scores
        reference_step([(ref[:, j], g[:, j], states[j]) for j in range(3)], importance="momentum",
                       state_dtype=torch.bfloat16, modes=[GROWTH, GROWTH, ELASTIC], lr_scales=[1.0, 1.0, 0.3],
                       elastic_pull=0.2, **hp)
    assert torch.equal(w, ref)
    assert all(torch.equal(m, st["momentum"]) for m, st in zip(momenta, states))
    assert torch.equal(anchors[0], states[2]["anchor"])
    with pytest.raises(ValueError, match="exactly one"):
        asdt_update([w[:, 0]], [g[:, 0]], unit_numels=[9], **hp)
    with pytest.raises(ValueError, match="scores with importance='sketch' only"):
        asdt_update([w[:, 0]], [g[:, 0]], momenta=momenta[:1], unit_numels=[9], scores=[g[:, 0].abs()], **hp)


def test_bf16_state_matches_reference_and_is_bf16():
    a = _params()
    b = [p.detach().clone() for p in a]
    hp = dict(lr=1e-2, betas=(0.9, 0.99), density=0.25, weight_decay=0.0, importance="momentum")
    opt = _run_flat(a, 5, state_dtype="bf16", **hp)
    _run_reference(b, 5, state_dtype=torch.bfloat16, **hp)
    for pa, pb in zip(a, b):
        assert torch.equal(pa.data, pb)
    assert all(st["momentum"].dtype == torch.bfloat16 for st in opt.state.values())
    n = sum(p.numel() for p in a)
    assert opt.state_bytes() == 2 * n


@pytest.mark.parametrize("density", [0.1, 0.5])
def test_density_is_honoured_and_step_is_bounded(density):
    ps = _params()
    before = [p.detach().clone() for p in ps]
    lr = 1e-3
    opt = _run_flat(ps, 1, lr=lr, density=density, weight_decay=0.0)
    changed = sum(int((p.data != b).sum()) for p, b in zip(ps, before))
    allowed = sum(math.ceil(density * p.numel()) for p in ps)
    assert changed == allowed and opt.last_selected == allowed  # continuous scores: no ties; each selected moves
    for p, b in zip(ps, before):
        # |w - lr*sign| is rounded to fp32: one ulp of |w| on top of lr
        ulp = torch.finfo(torch.float32).eps * float(b.abs().max())
        assert float((p.data - b).abs().max()) <= lr + ulp


def test_fails_if_sparsity_is_off():
    """density 0.1 changes ~10% of the elements; a dense sign step (density 1) would change all of them."""
    ps = _params()
    before = [p.detach().clone() for p in ps]
    _run_flat(ps, 1, lr=1e-3, density=0.1)
    frac = sum(int((p.data != b).sum()) for p, b in zip(ps, before)) / sum(p.numel() for p in ps)
    assert frac < 0.2
    ps2 = [b.clone().requires_grad_() for b in before]
    _run_flat(ps2, 1, lr=1e-3, density=1.0)
    assert all(bool((p.data != b).all()) for p, b in zip(ps2, before))


def test_density_one_is_lion():
    """Lion (Chen et al. 2023, Alg. 2) with decoupled decay, written out independently."""
    ps = _params()
    ref = [p.detach().clone() for p in ps]
    m = [torch.zeros_like(r) for r in ref]
    lr, (b1, b2), wd = 3e-3, (0.9, 0.99), 0.1
    _run_flat(ps, 4, lr=lr, betas=(b1, b2), density=1.0, weight_decay=wd)
    for t in range(4):
        for i, g in enumerate(_grads(ref, t)):
            c = m[i] * b1 + g * (1 - b1)
            ref[i] = ref[i] - (torch.sign(c) + wd * ref[i]) * lr
            m[i] = m[i] * b2 + g * (1 - b2)
    for p, r in zip(ps, ref):
        assert torch.equal(p.data, r)


def test_sketch_importance_selects_density_and_differs_from_momentum():
    ps = _params()
    q = [p.detach().clone().requires_grad_() for p in ps]
    before = [p.detach().clone() for p in ps]
    o1 = _run_flat(ps, 3, lr=1e-2, density=0.2, importance="sketch", sketch_width=1 << 12)
    moved = sum(int((p.data != b).sum()) for p, b in zip(ps, before))
    assert moved >= sum(math.ceil(0.2 * p.numel()) for p in ps)  # it updates (at least one step's selection)
    _run_flat(q, 3, lr=1e-2, density=0.2, importance="momentum")
    assert o1.last_selected <= sum(math.ceil(0.2 * p.numel()) for p in ps) + 5  # sketch ties are rare
    assert any(not torch.equal(a.data, b.data) for a, b in zip(ps, q))
    assert o1.state_bytes() == sum(4 * p.numel() for p in ps) + o1.sketch.nbytes


def _resume(hp, dtype=torch.float32):
    """Train 6 steps; restore the state saved after step 3 into a fresh optimizer and train 3 more: the same
    weights, and right after the restore the same state tensors, value and dtype (returned: the resumed state's
    dtypes). ``dtype``: of the parameters (torch casts floating state to it on load)."""
    ps = [p.detach().to(dtype).requires_grad_() for p in _params()]
    q = [p.detach().clone().requires_grad_() for p in ps]
    opt = ASDT([(f"p{i}", p) for i, p in enumerate(ps)], **hp)
    for t in range(6):
        for p, g in zip(ps, _grads(ps, t)):
            p.grad = g.to(dtype)
        opt.step()
        if t == 2:
            saved = copy.deepcopy(opt.state_dict())
            qs = [p.detach().clone() for p in ps]
    opt2 = ASDT([(f"p{i}", p) for i, p in enumerate(q)], **hp)
    for p, v in zip(q, qs):
        p.data.copy_(v)
    opt2.load_state_dict(saved)
    dtypes = {k: v.dtype for st in opt2.state.values() for k, v in st.items() if isinstance(v, torch.Tensor)}
    restored = opt2.state_dict()["state"]
    for i, st in saved["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert restored[i][k].dtype == v.dtype and torch.equal(restored[i][k], v), (i, k)
    for t in range(3, 6):
        for p, g in zip(q, _grads(q, t)):
            p.grad = g.to(dtype)
        opt2.step()
    for a, b in zip(ps, q):
        assert torch.equal(a.data, b.data)
    return dtypes


def test_resume_is_bit_exact():
    dtypes = _resume(dict(lr=1e-2, density=0.2, weight_decay=0.1, state_dtype="bf16", importance="sketch",
                          sketch_width=256))
    assert dtypes["momentum"] == torch.bfloat16


def test_delta_round_trip(tmp_path):
    ps = _params()
    base = {f"p{i}": p.detach().clone() for i, p in enumerate(ps)}
    torch.save(base, tmp_path / "base.pt")
    opt = _run_flat(ps, 3, lr=1e-2, density=0.1)
    info = opt.save_delta(str(tmp_path / "d.pt"), str(tmp_path / "base.pt"))
    restored = {k: v.clone() for k, v in base.items()}
    apply_delta(restored, str(tmp_path / "d.pt"))
    for i, p in enumerate(ps):
        assert torch.equal(restored[f"p{i}"], p.data)
    total = sum(p.numel() for p in ps)
    assert 0 < info["changed"] <= 3 * sum(math.ceil(0.1 * p.numel()) for p in ps) < total


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="density"):
        ASDT([torch.zeros(2, requires_grad=True)], density=1.5)
    with pytest.raises(ValueError, match="importance"):
        ASDT([torch.zeros(2, requires_grad=True)], importance="magic")


# ---------------------------------------------------------------------------------------------- update="adaptive"
def _row_units(p):
    """granularity="row": one unit per row of the first dimension of a matrix, per element of a vector."""
    n = p.numel()
    step = n // p.shape[0] if p.dim() >= 2 else 1
    return [(s, step) for s in range(0, n, step)]


@pytest.mark.parametrize("importance", ["momentum", "grad_weight"])
@pytest.mark.parametrize("density", [1.0, 0.3])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_adaptive_flat_path_matches_reference_bit_exactly(importance, density, state_dtype):
    a = _params()
    b = [p.detach().clone() for p in a]
    hp = dict(lr=1e-2, betas=(0.9, 0.95), density=density, weight_decay=0.1, importance=importance)
    opt = ASDT([(f"p{i}", p) for i, p in enumerate(a)], update="adaptive", granularity="row",
               state_dtype=state_dtype, **hp)
    states = {}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[state_dtype]
    for t in range(6):
        for p, g in zip(a, _grads(a, t)):
            p.grad = g
        opt.step()
        units = [(p.data.view(-1)[s:s + n], g.view(-1)[s:s + n], states.setdefault((i, s), {}))
                 for i, (p, g) in enumerate(zip(b, _grads(b, t))) for s, n in _row_units(p)]
        reference_step(units, state_dtype=dtype, update="adaptive", **hp)
        for pa, pb in zip(a, b):
            assert torch.equal(pa.data, pb), f"step {t}"
    for i, p in enumerate(a):  # the (v, t) of each unit and the momentum
        keys = sorted(s for (j, s) in states if j == i)
        second = opt.state[p]["second"].view(-1, 2)
        assert torch.equal(second[:, 0], torch.stack([states[(i, s)]["v"] for s in keys]))
        assert second[:, 1].tolist() == [6.0] * len(keys)
        assert torch.equal(opt.state[p]["momentum"], torch.cat([states[(i, s)]["momentum"] for s in keys]))


def test_adaptive_one_unit_per_coordinate_is_adam():
    """Units of one element (block_size 1): v_u is the coordinate's own second moment, so the step is Adam's
    (torch.optim.Adam, bias corrections and eps included) up to rounding."""
    w = torch.randn(40, requires_grad=True)
    ref = w.detach().clone().requires_grad_()
    opt = ASDT([("w", w)], lr=1e-2, betas=(0.9, 0.95), density=1.0, update="adaptive", granularity="block",
               block_size=1)
    adam = torch.optim.Adam([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for t in range(8):
        g = torch.randn(40)
        w.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        adam.step()
    torch.testing.assert_close(w.data, ref.data, rtol=1e-5, atol=1e-6)
    assert not torch.equal(w.data, ref.data.new_zeros(40))


def test_adaptive_state_is_the_momentum_and_two_numbers_per_unit():
    ps = _params()
    opt = _run_flat(ps, 2, lr=1e-2, density=1.0, update="adaptive", granularity="row", state_dtype="bf16")
    units = sum(len(_row_units(p)) for p in ps)
    assert opt.state_bytes() == sum(2 * p.numel() for p in ps) + 8 * units
    assert all(st["second"].dtype == torch.float32 for st in opt.state.values())


def test_adaptive_resume_is_bit_exact():
    dtypes = _resume(dict(lr=1e-2, density=0.5, weight_decay=0.1, state_dtype="bf16", update="adaptive",
                          granularity="row"))
    assert dtypes["momentum"] == torch.bfloat16 and dtypes["second"] == torch.float32


def test_adaptive_bad_arguments_raise():
    with pytest.raises(ValueError, match="update"):
        ASDT([torch.zeros(2, requires_grad=True)], update="adam")
    with pytest.raises(ValueError, match="eps"):
        ASDT([torch.zeros(2, requires_grad=True)], update="adaptive", eps=-1.0)
    with pytest.raises(ValueError, match="granularity"):
        ASDT([torch.zeros(2, requires_grad=True)], granularity="column")


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_adaptive_update_clip_matches_reference_and_bounds_the_step(state_dtype):
    """update_clip clamps each coordinate's adaptive step c to [-clip, clip]: the flat path equals the reference
    loop bit for bit, and no weight moves by more than lr * (clip + weight_decay * |w|)."""
    a = _params()
    b = [p.detach().clone() for p in a]
    hp = dict(lr=1e-2, betas=(0.9, 0.95), density=1.0, weight_decay=0.1, importance="momentum")
    opt = ASDT([(f"p{i}", p) for i, p in enumerate(a)], update="adaptive", granularity="row",
               state_dtype=state_dtype, update_clip=0.5, **hp)
    states = {}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[state_dtype]
    clipped = 0
    for t in range(4):
        before = [p.detach().clone() for p in a]
        for p, g in zip(a, _grads(a, t)):
            p.grad = g
        opt.step()
        units = [(p.data.view(-1)[s:s + n], g.view(-1)[s:s + n], states.setdefault((i, s), {}))
                 for i, (p, g) in enumerate(zip(b, _grads(b, t))) for s, n in _row_units(p)]
        reference_step(units, state_dtype=dtype, update="adaptive", update_clip=0.5, **hp)
        for pa, pb, w0 in zip(a, b, before):
            assert torch.equal(pa.data, pb), f"step {t}"
            bound = 1e-2 * (0.5 + 0.1 * w0.abs()) + 1e-6  # + fp32 rounding of w (~1e-7 at |w| ~ 1)
            assert bool(((pa.data - w0).abs() <= bound).all())
            clipped += int(((pa.data - w0).abs() > 1e-2 * 0.45).sum())
    assert clipped > 0  # the clamp was active
    with pytest.raises(ValueError, match="update_clip"):
        ASDT([("w", torch.zeros(3, requires_grad=True))], update="sign", update_clip=1.0)
