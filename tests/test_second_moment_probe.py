"""launch/bench/second_moment_probe.py: the probe's rules are what its table says they are.

``Probe`` stays in the bench script: it is a one-off probe whose only output is
results/second_moment_probe.md, quoted by docs/log.md (ASDT); the rule it chose is ASDT's ``update="adaptive"``,
tested against its own reference in tests/optim. These tests keep that table's row descriptions true."""
import importlib.util

import torch

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("smp", ROOT / "launch/bench/second_moment_probe.py")
smp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(smp)


def _train(rule, params, steps=5, wd=0.1, grad=None):
    """``steps`` steps of the probe rule (None: torch AdamW) on gradients ``grad(p, generator)`` (default N(0, 1))."""
    opt = smp.Probe([{"params": params, "weight_decay": wd}], 1e-2, rule) if rule else \
        torch.optim.AdamW([{"params": params, "weight_decay": wd}], lr=1e-2, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for p in params:
            p.grad = grad(p, g) if grad else torch.randn(p.shape, generator=g)
        opt.step()
    return opt


def test_full_rule_is_adamw_up_to_the_bf16_momentum():
    torch.manual_seed(0)
    a = [torch.randn(6, 5), torch.randn(5)]
    b = [x.clone() for x in a]
    _train("full", a)
    _train(None, b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=2e-3)  # bf16 momentum: close, not equal
        assert not torch.equal(x, y)


def test_row_and_column_grains():
    """One row per unit: a single-column matrix gives every coordinate its own v (= full); a single-row matrix
    gives one v for the row, so row and tensor agree; the state is what the table says."""
    torch.manual_seed(0)
    col = torch.randn(7, 1)
    r, f = [col.clone()], [col.clone()]
    _train("row", r)
    _train("full", f)
    assert torch.equal(r[0], f[0])
    row = torch.randn(1, 9)
    r, t = [row.clone()], [row.clone()]
    opt = _train("row", r)
    _train("tensor", t)
    torch.testing.assert_close(r[0], t[0], rtol=1e-6, atol=1e-7)
    m = torch.randn(4, 3)
    st = _train("factored", [m]).state[m]
    assert st["m"].dtype == torch.bfloat16 and st["r"].shape == (4, 1) and st["c"].shape == (1, 3)
    assert opt.state[r[0]]["v"].shape == (1, 1)


def test_factored_and_tensor_rules_are_exact_where_their_assumption_holds():
    """Adafactor's row x column factors reproduce a per-coordinate v exactly when every squared gradient is the
    same rank-1 matrix up to a scale (g_t = s_t a b^T); one v per tensor does when |g| is the same everywhere.
    There each rule must train like ``full``; on a generic gradient it must not."""
    torch.manual_seed(0)
    a, b = torch.randn(6, 1), torch.randn(1, 4)

    def rank1(p, g):
        return torch.randn((), generator=g) * a * b

    def flat(p, g):
        return torch.randn((), generator=g) * torch.randint(0, 2, p.shape, generator=g).mul(2).sub(1).float()

    w = torch.randn(6, 4)
    for rule, grad in (("factored", rank1), ("tensor", flat)):
        runs = {r: [w.clone()] for r in (rule, "full")}
        for r, params in runs.items():
            _train(r, params, grad=grad)
        torch.testing.assert_close(runs[rule][0], runs["full"][0], rtol=1e-5, atol=1e-6)
        generic = {r: [w.clone()] for r in (rule, "full")}
        for r, params in generic.items():
            _train(r, params)
        assert (generic[rule][0] - generic["full"][0]).abs().max() > 1e-3, rule
