"""StripeFFN vs the eager MLP: outputs, input gradient and every parameter gradient, fp32."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from titan_ds.kernels.stripe_ffn import StripeFFN, linear_parts, stripe_ffn

ATOL, RTOL = 1e-5, 1e-5


class EagerMLP(nn.Module):
    def __init__(self, d=24, bias=True):
        super().__init__()
        self.fc, self.act, self.out = nn.Linear(d, 4 * d, bias=bias), nn.GELU(), nn.Linear(4 * d, d, bias=bias)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


class EagerGated(nn.Module):
    def __init__(self, d=24, h=40):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.down_proj, self.act_fn = nn.Linear(h, d, bias=False), nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _check(eager, striped, x):
    g = torch.randn(*x.shape[:-1], striped(x).shape[-1])
    outs = []
    for mod in (eager, striped):
        xx = x.detach().clone().requires_grad_()
        y = mod(xx)
        grads = torch.autograd.grad(y, [xx, *mod.parameters()], g)
        outs.append((y, grads, [n for n, _ in mod.named_parameters()]))
    (y0, g0, n0), (y1, g1, n1) = outs
    assert n0 == n1  # same parameter names, same order: the state dict is unchanged
    torch.testing.assert_close(y1, y0, atol=ATOL, rtol=RTOL)
    for a, b, name in zip(g1, g0, ["x"] + n0):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("stripe", [1, 7, 64, 1000])
@pytest.mark.parametrize("bias", [True, False])
def test_plain_matches_eager(stripe, bias):
    eager = EagerMLP(bias=bias)
    striped = StripeFFN.plain(eager.fc, eager.act, eager.out, stripe)
    _check(eager, striped, torch.randn(3, 13, 24))


def test_noncontiguous_input_and_function_activation():
    eager = EagerMLP()
    striped = StripeFFN.plain(eager.fc, F.gelu, eager.out, 5)
    x = torch.randn(13, 3, 24).transpose(0, 1)
    _check(eager, striped, x)
    assert set(striped.state_dict()) == set(eager.state_dict())


def test_gated_matches_eager():
    eager = EagerGated()
    striped = StripeFFN.gated(eager.gate_proj, eager.up_proj, eager.down_proj, eager.act_fn, 6)
    _check(eager, striped, torch.randn(2, 17, 24))
    assert set(striped.state_dict()) == set(eager.state_dict())


def test_frozen_parameters_get_no_gradient():
    eager = EagerMLP()
    eager.fc.weight.requires_grad_(False)
    striped = StripeFFN.plain(eager.fc, eager.act, eager.out, 4)
    x = torch.randn(9, 24, requires_grad=True)
    striped(x).sum().backward()
    assert eager.fc.weight.grad is None and eager.fc.bias.grad is not None and x.grad is not None


def _saved_shapes(module, x):
    params = {p.data_ptr() for p in module.parameters()}
    shapes = []

    def pack(t):
        if t.data_ptr() not in params:
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return shapes


def test_hidden_is_recomputed_not_saved():
    """Only x (and parameters) are saved: no tensor with the 4d hidden width."""
    eager = EagerMLP(d=16)
    striped = StripeFFN.plain(eager.fc, eager.act, eager.out, 8)
    assert _saved_shapes(striped, torch.randn(32, 16, requires_grad=True)) == [(32, 16)]


def test_errors():
    with pytest.raises(ValueError, match="stripe"):
        StripeFFN.plain(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4), 0)
    with pytest.raises(TypeError, match="nn.Linear"):
        linear_parts(nn.Conv2d(1, 1, 1))
    with pytest.raises(ValueError, match="stripe"):
        stripe_ffn(torch.randn(2, 4), lambda x: x, [], torch.randn(4, 4), None, 0)


class Doubler(nn.Module):
    """A non-Linear output projection (stands in for a tensor-ring layer): recomputed whole."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, h):
        return 2 * self.lin(h)


def test_non_linear_output_module_is_recomputed_whole():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act, self.out = nn.Linear(12, 30), nn.GELU(), Doubler(30, 12)

        def forward(self, x):
            return self.out(self.act(self.fc(x)))

    eager = M()
    striped = StripeFFN.plain(eager.fc, eager.act, eager.out, 4)
    assert not striped.out_is_linear
    _check(eager, striped, torch.randn(2, 9, 12))


def test_budget_stripe_is_the_largest_stripe_within_the_byte_budget(monkeypatch):
    import sys
    sf = sys.modules["titan_ds.kernels.stripe_ffn"]  # the module (titan_ds.kernels.stripe_ffn is also a function)
    mib = 2**20
    # the seed GPT's MLP (hidden 1024): fc output + GELU output per token, 4 bytes each in fp32
    assert sf.budget_stripe("plain", 1024, torch.float32) == sf.STRIPE_BUDGET_BYTES // (2 * 1024 * 4) == 2048
    assert sf.budget_stripe("plain", 1024, torch.bfloat16) == 4096
    assert sf.budget_stripe("gated", 1536, torch.float32, budget=6 * mib) == 6 * mib // (4 * 1536 * 4)
    assert sf.budget_stripe("plain", 10**9, torch.float32) == 1  # never 0 tokens
    eager = EagerMLP()
    striped = StripeFFN.plain(eager.fc, eager.act, eager.out, "budget")
    assert striped.stripe_for(torch.float32) == sf.STRIPE_BUDGET_BYTES // (2 * 96 * 4)
    _check(eager, striped, torch.randn(3, 13, 24))  # one stripe

    calls = []
    monkeypatch.setattr(sf, "STRIPE_BUDGET_BYTES", 5 * 2 * 96 * 4)  # 5 tokens per stripe
    hidden = striped.hidden
    monkeypatch.setattr(striped, "hidden", lambda x: calls.append(x.shape[0]) or hidden(x))
    assert striped.stripe_for(torch.float32) == 5
    _check(eager, striped, torch.randn(3, 13, 24))
    assert calls[:8] == [5] * 7 + [4]  # 39 tokens: 7 stripes of 5 and one of 4 in forward
    with pytest.raises(ValueError, match="'budget'"):
        StripeFFN.plain(eager.fc, eager.act, eager.out, "big")


# ------------------------------------------------------------------ saves="pre_activation"
@pytest.mark.parametrize("stripe", [1, 7, 1000])
@pytest.mark.parametrize("bias", [True, False])
def test_pre_activation_plain_matches_eager(stripe, bias):
    eager = EagerMLP(bias=bias)
    striped = StripeFFN.plain(eager.fc, eager.act, eager.out, stripe, saves="pre_activation")
    assert striped.saves_used == "pre_activation"
    _check(eager, striped, torch.randn(3, 13, 24))


def test_pre_activation_gated_and_function_activation_match_eager():
    eager = EagerGated()
    striped = StripeFFN.gated(eager.gate_proj, eager.up_proj, eager.down_proj, eager.act_fn, 6, saves="pre_activation")
    _check(eager, striped, torch.randn(2, 17, 24))
    eager = EagerMLP()
    striped = StripeFFN.plain(eager.fc, F.gelu, eager.out, 5, saves="pre_activation")
    _check(eager, striped, torch.randn(13, 3, 24).transpose(0, 1))


def test_pre_activation_saves_the_projections_and_recomputes_no_matmul(monkeypatch):
    eager = EagerMLP(d=16)
    striped = StripeFFN.plain(eager.fc, eager.act, eager.out, 8, saves="pre_activation")
    assert _saved_shapes(striped, torch.randn(32, 16, requires_grad=True)) == [(32, 16), (32, 64)]
    gated = EagerGated(d=16, h=40)
    striped_g = StripeFFN.gated(gated.gate_proj, gated.up_proj, gated.down_proj, gated.act_fn, 8,
                                saves="pre_activation")
    assert _saved_shapes(striped_g, torch.randn(32, 16, requires_grad=True)) == [(32, 16), (32, 40), (32, 40)]
    # backward runs no linear layer's forward: fc is never called again (the "input" mode calls it per stripe)
    x = torch.randn(32, 16, requires_grad=True)
    y = striped(x)
    calls = []
    monkeypatch.setattr(eager.fc, "forward", lambda *a: calls.append(1) or nn.Linear.forward(eager.fc, *a))
    y.sum().backward()
    assert calls == [] and x.grad is not None and eager.fc.weight.grad is not None
    y = StripeFFN.plain(eager.fc, eager.act, eager.out, 8)(x)
    calls.clear()
    y.sum().backward()
    assert len(calls) == 4  # the "input" mode: one recompute of fc per stripe


def test_pre_activation_frozen_parameters_and_fallback():
    eager = EagerMLP()
    eager.fc.weight.requires_grad_(False)
    striped = StripeFFN.plain(eager.fc, eager.act, eager.out, 4, saves="pre_activation")
    x = torch.randn(9, 24, requires_grad=True)
    striped(x).sum().backward()
    assert eager.fc.weight.grad is None and eager.fc.bias.grad is not None and x.grad is not None
    # a non-linear output projection (a tensor-ring layer) or an activation with parameters: "input" is used
    m = StripeFFN.plain(nn.Linear(12, 30), nn.GELU(), Doubler(30, 12), 4, saves="pre_activation")
    assert m.saves_used == "input" and "saves=input" in repr(m)
    m = StripeFFN.plain(nn.Linear(12, 30), nn.PReLU(), nn.Linear(30, 12), 4, saves="pre_activation")
    assert m.saves_used == "input"
    with pytest.raises(ValueError, match="saves"):
        StripeFFN.plain(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4), 4, saves="hidden")


def test_pre_activation_saves_nothing_without_grad():
    eager = EagerMLP(d=16)
    striped = StripeFFN.plain(eager.fc, eager.act, eager.out, 8, saves="pre_activation")
    with torch.no_grad():
        torch.testing.assert_close(striped(torch.randn(4, 16)).shape, torch.Size([4, 16]))
