"""BSPS: transitions on signals, the capacity bound, state round trip, and the memory it really saves."""
import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import zero_harness as h  # noqa: E402

from titan_ds.config import PlasticityConfig  # noqa: E402
from titan_ds.optim.asdt import ASDT, ELASTIC, FROZEN, GROWTH, SLEEPING, reference_step  # noqa: E402
from titan_ds.optim.bsps import Plasticity  # noqa: E402
from titan_ds.optim.install import build_plasticity  # noqa: E402
from titan_ds.optim.layout import UnitState  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _feed(p: Plasticity, t: int, sig: list[float]) -> None:
    for b, s in enumerate(sig):
        p.observe(b, s * s * p.numels[b])  # sum of squares that gives RMS s


def test_full_cycle_on_signals():
    p = Plasticity(["a", "b", "c"], [10, 10, 10], max_active_fraction=0.67, warmup_steps=2, sleep_after=2,
                   wake_every=100, ema=0.0, plateau_ratio=0.5)
    _feed(p, 1, [3.0, 2.0, 1.0])
    p.end_step(1)
    assert p.modes == [GROWTH, GROWTH, FROZEN]        # strongest two fit in 20 of 30 elements
    for t, sig in ((2, [3.0, 2.0, 0]), (3, [1.0, 2.0, 0])):  # a's gradient falls to a third of its peak
        _feed(p, t, sig)
        p.end_step(t)
    assert p.modes[0] == ELASTIC and p.modes[1] == GROWTH
    for t in (4, 5):
        _feed(p, t, [1.0, 2.0, 0])
        p.end_step(t)
    assert p.modes == [SLEEPING, GROWTH, GROWTH]      # a slept after 2 elastic steps; c took its place
    assert [(e.block, e.src, e.dst) for e in p.events] == [
        ("a", "frozen", "growth"), ("b", "frozen", "growth"), ("a", "growth", "elastic"),
        ("a", "elastic", "sleeping"), ("c", "frozen", "growth")]


def test_capacity_bound_holds_under_random_signals():
    g = torch.Generator().manual_seed(3)
    numels = torch.randint(1, 50, (12,), generator=g).tolist()
    p = Plasticity([str(i) for i in range(12)], numels, max_active_fraction=0.4, warmup_steps=1, sleep_after=2,
                   wake_every=3, ema=0.5, plateau_ratio=0.9)
    for t in range(1, 60):
        _feed(p, t, torch.rand(12, generator=g).tolist())
        p.end_step(t)
        assert 0 < p.active_elements() <= p.capacity
    assert {e.dst for e in p.events} == {"growth", "elastic", "sleeping"}


def test_state_round_trip_continues_identically():
    mk = lambda: Plasticity(["a", "b", "c", "d"], [5, 6, 7, 8], max_active_fraction=0.5, warmup_steps=1,
                            sleep_after=1, wake_every=2, ema=0.5, plateau_ratio=0.95)
    g = torch.Generator().manual_seed(1)
    sigs = [torch.rand(4, generator=g).tolist() for _ in range(20)]
    p, q = mk(), mk()
    for t in range(1, 21):
        _feed(p, t, sigs[t - 1])
        p.end_step(t)
        if t == 10:
            q.load_state_dict(copy.deepcopy(p.state_dict()))
        if t > 10:
            _feed(q, t, sigs[t - 1])
            q.end_step(t)
            assert q.modes == p.modes
    with pytest.raises(ValueError, match="different blocks"):
        Plasticity(["x"], [1]).load_state_dict(p.state_dict())


def test_flat_path_matches_reference_with_modes():
    """Growth / Elastic (scaled lr, pull to anchor) / Frozen units: flat path vs reference_step."""
    ps = [torch.randn(s) for s in [(6, 5), (9,), (4, 4)]]
    ref = [p.clone() for p in ps]
    opt = ASDT([(f"p{i}", p.requires_grad_()) for i, p in enumerate(ps)], lr=1e-2, density=0.4, weight_decay=0.1)
    pl = Plasticity(["p0", "p1", "p2"], [30, 9, 16], max_active_fraction=1.0, elastic_lr_scale=0.3,
                    elastic_pull=0.2)
    pl.modes, pl.assigned = [GROWTH, ELASTIC, FROZEN], True
    pl.is_probe = lambda t: False
    pl.end_step = lambda t, group=None: []
    opt.attach_plasticity(pl, [0, 1, 2])
    states = [{}, {}, {}]
    for t in range(4):
        gs = [torch.randn(p.shape) for p in ps]
        for p, g in zip(ps, gs):
            p.grad = g
        opt.step()
        reference_step([(r.view(-1), g.view(-1), s) for r, g, s in zip(ref, gs, states)], lr=1e-2,
                       betas=(0.9, 0.99), density=0.4, weight_decay=0.1, importance="momentum",
                       state_dtype=torch.float32, modes=[GROWTH, ELASTIC, FROZEN], lr_scales=[1.0, 0.3, 0.0],
                       elastic_pull=0.2)
    for p, r in zip(ps, ref):
        assert torch.equal(p.data, r)
    assert torch.equal(opt.state[ps[1]]["anchor"], states[1]["anchor"])


def _block_modes_opt(p: torch.Tensor) -> tuple[ASDT, Plasticity]:
    """25 elements in blocks of 10, 10, 5 (one BSPS block each), modes set by hand, no transitions."""
    opt = ASDT([("w", p)], lr=1e-2, density=0.4, granularity="block", block_size=10)
    pl = Plasticity(["b0", "b1", "b2"], [10, 10, 5], max_active_fraction=1.0)
    pl.modes, pl.assigned = [GROWTH, ELASTIC, GROWTH], True
    pl.is_probe = lambda t: False
    pl.end_step = lambda t, group=None: []
    opt.attach_plasticity(pl, [0, 1, 2])
    return opt, pl


def test_state_records_follow_modes_and_save_in_the_checkpoint_format():
    """One UnitState per active unit in memory; state dicts keep the format checkpoints always had
    (``<buffer>_units``/``_lens``); a state put back in that form directly (as HMS does) steps identically."""
    p = torch.randn(25, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    opt, pl = _block_modes_opt(p)
    p.grad = torch.randn(25)
    opt.step()
    assert opt.state[p]["units"] == [UnitState(0, "momentum", 0, 10), UnitState(2, "momentum", 10, 5),
                                     UnitState(1, "anchor", 0, 10)]
    saved = opt.state_dict()["state"][0]
    assert "units" not in saved and saved["momentum_units"] == [0, 2] and saved["anchor_units"] == [1]
    assert saved["momentum_lens"] == {0: 10, 2: 5} and saved["anchor_lens"] == {1: 10}
    kept = opt.state[p]["momentum"][10:15].clone()  # unit 2's momentum
    opt2, pl2 = _block_modes_opt(q)
    q.data.copy_(p.data)
    opt2.state[q] = copy.deepcopy(saved)
    opt2._engine_step = opt._engine_step
    pl.modes = pl2.modes = [FROZEN, GROWTH, GROWTH]
    for o, t in ((opt, p), (opt2, q)):
        t.grad = torch.ones(25)
        o.step()
    assert torch.equal(p.data, q.data)
    assert opt.state[p]["units"] == opt2.state[q]["units"] == [UnitState(1, "momentum", 0, 10),
                                                               UnitState(2, "momentum", 10, 5)]
    assert opt.state[p]["anchor"].numel() == 0
    assert torch.equal(opt.state[p]["momentum"][10:15], kept * 0.99 + (1 - 0.99))  # unit 2 kept its momentum


def _bsps_model(max_active=0.5):
    m = h.Tiny()
    opt = ASDT(list(m.named_parameters()), lr=1e-2, density=0.5, state_dtype="bf16")
    pl = build_plasticity(opt, m, PlasticityConfig(max_active_fraction=max_active, block="parameter",
                                                   warmup_steps=100, wake_every=1000))
    return m, opt, pl


def test_stage0_frozen_blocks_hold_no_gradient_and_no_state():
    m, opt, pl = _bsps_model()
    total = sum(p.numel() for p in m.parameters())
    for t in range(3):
        x, y = h.batch(t, 0)
        opt.zero_grad(set_to_none=True)
        m(x, y).backward()
        held = sum(p.grad.numel() * 4 for p in m.parameters() if p.grad is not None)
        opt.step()
        active = pl.active_elements()
        assert active <= 0.5 * total
        if t == 0:
            assert held == 4 * total  # step 1 is the probe: every block has a gradient
        else:
            assert held == 4 * active  # accounted: only Growth/Elastic blocks have gradients
            assert opt.grad_bytes == held
        assert opt.state_bytes() == 2 * active  # one bf16 buffer per active element, nothing else
    frozen = [n for n, p in m.named_parameters() if not p.requires_grad]
    assert frozen and all(pl.modes[pl.blocks.index(n)] in (FROZEN, SLEEPING) for n in frozen)


def test_zero_frozen_blocks_hold_gradients_but_no_state():
    """Under ZeRO requires_grad is fixed at init: gradients are held for every block (stated, not hidden);
    optimizer state still covers only the active elements."""
    import deepspeed
    h.init_single_process()
    m, opt, pl = _bsps_model()
    engine, _, _, _ = deepspeed.initialize(model=m, optimizer=opt, config=h.ds_config(2, 1))
    from titan_ds.optim.install import attach_zero_layout
    attach_zero_layout(engine, opt)
    total = sum(p.numel() for p in m.parameters())
    for t in range(3):
        x, y = h.batch(t, 0)
        engine.backward(engine(x, y))
        engine.step()
    assert opt.grad_bytes >= 4 * total
    assert opt.state_bytes() == 2 * pl.active_elements() < 2 * total
