"""launch/train.py's client optimizers (--optimizer, --weight-decay) and the measured optimizer-state bytes.

Lion (lion-pytorch) is checked bitwise against a hand loop of the paper's update, through train.py's own argument
parsing, parameter groups and lr schedule; every choice is checked to apply --lr and --weight-decay; state bytes
are measured from the tensors, torchao's quantized states by their inner tensors.
"""
import importlib.util
import math

import pytest
import torch

from titan_ds.metrics import optimizer_state_bytes
from tests.conftest import ROOT
from tests.helpers.deps import require

_spec = importlib.util.spec_from_file_location("titan_train_script", ROOT / "launch" / "train.py")
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)

require("torchao")  # the adamw8bit / adamw4bit choices
require("lion_pytorch")
NAMES = sorted(train.CLIENT_OPTIMIZERS)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.Linear(7, 3))  # odd shapes, biases


def _grads(model: torch.nn.Module, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


def test_lion_through_train_args_matches_a_hand_loop_bitwise():
    lr, wd, (b1, b2), steps, warmup = 3e-4, 1.0, (0.9, 0.99), 6, 3
    args = train.parse_args(["--optimizer", "lion", "--lr", str(lr), "--weight-decay", str(wd)])
    model = _model()
    opt = train._client_optimizer(model, args, {}, None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, train.lr_lambda(warmup, steps))
    ref = [p.detach().clone() for p in model.parameters()]
    mom = [torch.zeros_like(p) for p in ref]
    for step in range(steps):
        grads = _grads(model, step)
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        # the hand loop (Chen et al. 2023, Lion with decoupled weight decay on matrices only)
        lr_t = lr * train.lr_lambda(warmup, steps)(step)
        for w, m, g in zip(ref, mom, grads):
            w.mul_(1 - lr_t * (wd if w.dim() >= 2 else 0.0))
            c = m.clone().mul_(b1).add(g, alpha=1 - b1)
            w.add_(c.sign(), alpha=-lr_t)
            m.mul_(b2).add_(g, alpha=1 - b2)
        sched.step()
        for w, p in zip(ref, model.parameters()):
            assert torch.equal(w, p.detach()), step
    for m, p in zip(mom, model.parameters()):
        assert torch.equal(m, opt.state[p]["exp_avg"])


@pytest.mark.parametrize("name", NAMES)
def test_each_client_optimizer_applies_lr_and_weight_decay(name):
    """Matrices get --weight-decay and vectors none; changing the lr or the decay changes the weights."""
    def run(lr: float, wd: float) -> list[torch.Tensor]:
        model = _model()
        opt = train.make_optimizer(model, lr, name, wd)
        assert [g["weight_decay"] for g in opt.param_groups] == [wd, 0.0]
        assert all(g["lr"] == lr for g in opt.param_groups)
        for step in range(2):
            for p, g in zip(model.parameters(), _grads(model, step)):
                p.grad = g
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    start = [p.detach() for p in _model().parameters()]
    base, other_lr, other_wd = run(1e-2, 0.1), run(2e-2, 0.1), run(1e-2, 0.5)
    assert not any(torch.equal(a, b) for a, b in zip(base, start))
    assert not torch.equal(base[0], other_lr[0])
    assert not torch.equal(base[0], other_wd[0])   # a matrix: decayed
    assert torch.equal(base[1], other_wd[1])       # a bias: never decayed


def test_an_unknown_optimizer_and_a_conflict_with_the_configs_optimizer_are_errors():
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'; choose one of"):
        train.make_optimizer(_model(), 1e-3, "sgd")
    from titan_ds.config import TitanConfig
    titan = TitanConfig.from_ds_config({"titan": {"optimizer": {"name": "asdt"}}})
    args = train.parse_args(["--optimizer", "lion", "--deepspeed_config", "x.json"])
    with pytest.raises(SystemExit, match="--optimizer lion conflicts with titan.optimizer"):
        train._client_optimizer(_model(), args, {}, titan)
    args = train.parse_args(["--weight-decay", "0.3"])
    with pytest.raises(SystemExit, match="--weight-decay 0.3 conflicts with the ds_config's 'optimizer' section"):
        train._client_optimizer(_model(), args, {"optimizer": {"type": "Adam"}}, None)
    args = train.parse_args(["--lr", "3e-3"])  # titan_full's AdamW section: --lr would be ignored, so it is refused
    with pytest.raises(SystemExit, match="--lr 0.003 conflicts with the ds_config's 'optimizer' section"):
        train._client_optimizer(_model(), args, {"optimizer": {"type": "AdamW"}}, None)
    assert train._client_optimizer(_model(), train.parse_args([]), {"optimizer": {"type": "Adam"}}, None) is None
    assert train._client_optimizer(_model(), train.parse_args([]), {}, None).param_groups[0]["lr"] == 1e-3


def test_optimizer_state_bytes_are_measured_from_the_state():
    model = _model()
    n = sum(p.numel() for p in model.parameters())
    opt = train.make_optimizer(model, 1e-3, "adamw")
    assert optimizer_state_bytes(opt) == 0  # lazily created
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    # exp_avg + exp_avg_sq in fp32, and one fp32 step counter per tensor
    assert optimizer_state_bytes(opt) == 8 * n + 4 * len(list(model.parameters()))
    opt.state[next(model.parameters())]["alias"] = opt.state[next(model.parameters())]["exp_avg"]
    assert optimizer_state_bytes(opt) == 8 * n + 4 * len(list(model.parameters()))  # a storage counts once


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_states_count_their_inner_tensors(bits):
    """torchao's states report fp32 and the logical shape; their bytes are the codes, scales and table."""
    if bits == 8:
        from torchao.optim.subclass_8bit import OptimState8bit as State
    else:
        from torchao.optim.subclass_4bit import OptimState4bit as State
    w = torch.nn.Parameter(torch.zeros(256, 512))
    opt = torch.optim.SGD([w], lr=1.0)
    opt.state[w] = {"exp_avg": State.zeros(w.shape, signed=True), "exp_avg_sq": State.zeros(w.shape, signed=False)}
    s = opt.state[w]["exp_avg"]
    assert s.dtype == torch.float32 and s.numel() * s.element_size() == 4 * w.numel()  # what a naive count says
    inner = sum(getattr(t, a).numel() * getattr(t, a).element_size()
                for t in opt.state[w].values() for a in t.__tensor_flatten__()[0])
    assert optimizer_state_bytes(opt) == inner
    per_param = optimizer_state_bytes(opt) / w.numel()
    assert 2 * bits / 8 <= per_param < 2 * bits / 8 + 0.1, per_param
    assert math.isfinite(per_param)


def test_adamw4bit_bf16_casts_the_model_and_refuses_a_bf16_section():
    args = train.parse_args(["--optimizer", "adamw4bit_bf16"])
    with pytest.raises(SystemExit, match="remove it"):
        train._client_optimizer(_model(), args, {"bf16": {"enabled": True}}, None)
    model = _model()
    opt = train._client_optimizer(model, args, {}, None)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert opt.bf16_stochastic_round
