"""ASDT's step in backward (titan.optimizer.step_in_backward): each parameter updated in its gradient hook, its
gradient freed at once. The oracle is the same optimizer stepping after backward: the steps are bit-identical
(tied weights and titan's reentrant block recompute included), only the gradients held at once differ. With
clipping, the oracle clips each step's gradients by the previous step's global norm."""
import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import titan_ds
from titan_ds.config import TitanConfig, TitanConfigError
from titan_ds.models import GPT
from titan_ds.optim.asdt import ASDT

from tests.optim.test_install import TINY, _steps


class _Tied(nn.Module):
    """An embedding tied to the output projection and two blocks run under reentrant recompute, as titan's
    recompute_blocks does (titan_ds.inject.recompute)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16)) for _ in range(2))
        self.norm = nn.LayerNorm(16)

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = h + checkpoint(b, h, use_reentrant=True)
        logits = self.norm(h) @ self.emb.weight.t()
        return nn.functional.cross_entropy(logits.view(-1, 32), y.view(-1))


def _opt(model, **kw):
    named = list(model.named_parameters())
    return ASDT([{"params": [np for np in named if np[1].dim() >= 2], "weight_decay": 0.1},
                 {"params": [np for np in named if np[1].dim() < 2], "weight_decay": 0.0}], **kw)


KINDS = {"adaptive_row_bf16": dict(lr=1e-2, betas=(0.9, 0.95), density=1.0, update="adaptive", granularity="row",
                                   state_dtype="bf16"),
         "sign_sparse": dict(lr=1e-3, betas=(0.9, 0.99), density=0.25, importance="grad_weight")}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_step_in_backward_is_bit_identical_to_step_after_backward(kind):
    torch.manual_seed(0)
    a = _Tied()
    b = _Tied()
    b.load_state_dict(a.state_dict())
    oa, ob = _opt(a, **KINDS[kind]), _opt(b, **KINDS[kind])
    ob.attach_backward_steps()
    largest = max(p.numel() * p.element_size() for p in b.parameters())
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        x, y = torch.randint(0, 32, (4, 8), generator=gen), torch.randint(0, 32, (4, 8), generator=gen)
        a(x, y).backward()
        oa.step()
        oa.zero_grad()
        b(x, y).backward()
        assert all(p.grad is None for p in b.parameters()), "a gradient outlived its hook"
        assert ob.held_grad_bytes() == largest
        ob.step()
        for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(pa, pb), f"step {step}: {n}"
    for pa, pb in zip(a.parameters(), b.parameters()):
        for key, va in oa.state[pa].items():
            vb = ob.state[pb][key]
            assert torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb, key
    assert ob.grad_bytes == largest and oa.grad_bytes == sum(p.numel() * 4 for p in a.parameters())


def _norm(model):
    return float(sum(torch.linalg.vector_norm(p.grad.float()).double() ** 2 for p in model.parameters()).sqrt())


@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_clipping_uses_the_previous_steps_global_norm(max_norm):
    """max_norm 0.05 clips every step after the first (these gradients' norms are ~1); 1e6 never clips."""
    torch.manual_seed(0)
    a, b = _Tied(), _Tied()
    b.load_state_dict(a.state_dict())
    oa, ob = _opt(a, **KINDS["adaptive_row_bf16"]), _opt(b, **KINDS["adaptive_row_bf16"])
    ob.attach_backward_steps(max_norm=max_norm)
    gen = torch.Generator().manual_seed(1)
    coef, coefs = 1.0, []
    for step in range(5):
        x, y = torch.randint(0, 32, (4, 8), generator=gen), torch.randint(0, 32, (4, 8), generator=gen)
        a(x, y).backward()
        norm = _norm(a)
        for p in a.parameters():
            p.grad.mul_(coef) if coef < 1.0 else None
        oa.step()
        oa.zero_grad()
        coefs.append(coef)
        coef = min(1.0, max_norm / (norm + 1e-6))
        b(x, y).backward()
        ob.step()
        assert ob.last_grad_norm == pytest.approx(norm, rel=1e-12)
        for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(pa, pb), f"step {step}: {n}"
    assert (min(coefs[1:]) < 0.5) == (max_norm < 1)


def test_a_second_backward_in_one_step_raises_and_detach_restores_step():
    torch.manual_seed(0)
    m = _Tied()
    opt = _opt(m, **KINDS["adaptive_row_bf16"])
    opt.attach_backward_steps()
    x = torch.randint(0, 32, (2, 8))
    m(x, x).backward()
    with pytest.raises(RuntimeError, match="gradient twice in one step"):
        m(x, x).backward()  # gradient accumulation: the weights were already updated by the first backward
    opt.step()
    m(x, x).backward()  # a new step: fine again
    opt.step()
    opt.detach_backward_steps()
    m(x, x).backward()
    assert all(p.grad is not None for p in m.parameters())  # step() updates from .grad again


def test_refuses_what_needs_every_gradient_first():
    m = _Tied()
    opt = _opt(m, importance="sketch")
    with pytest.raises(ValueError, match="sketch"):
        opt.attach_backward_steps()


# ---------------------------------------------------------------- through titan_ds.initialize (DeepSpeed stage 0)
TITAN = {"optimizer": {"name": "asdt", "update": "adaptive", "granularity": "row", "lr": 3e-3, "betas": [0.9, 0.95],
                       "density": 1.0, "weight_decay": 0.1, "state_dtype": "bf16"}}


def _engine(step_in_backward, clip=0.0, **ds):
    torch.manual_seed(0)
    titan = {"optimizer": {**TITAN["optimizer"], "step_in_backward": step_in_backward}}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": clip, "zero_optimization": {"stage": 0},
           "steps_per_print": 10 ** 9, "titan": titan, **ds}
    return titan_ds.initialize(model=GPT(TINY), config=cfg)[0]


def test_engine_steps_match_and_gradients_are_not_held(dist_env, tmp_path):
    from titan_ds.metrics import accounted_memory
    a, b = _engine(False), _engine(True)
    assert b.enable_backward_allreduce is False and b.basic_optimizer.step_in_backward
    seen = {}

    def hook(key, engine):
        def pre(opt, args, kw):
            seen.setdefault(key, accounted_memory(engine))  # the first step's: the state does not exist yet
        return pre

    b.basic_optimizer.register_step_pre_hook(hook("mem", b))
    a.basic_optimizer.register_step_pre_hook(hook("dense", a))
    _steps(a, 0, 4)
    _steps(b, 0, 4)
    for (n, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
        assert torch.equal(pa, pb), n
    largest = max(p.numel() * p.element_size() for p in b.module.parameters())
    assert seen["mem"].gradients == largest
    assert seen["dense"].gradients == sum(p.numel() * p.element_size() for p in a.module.parameters())


def test_engine_clips_in_the_hooks_and_resumes_bit_exact(dist_env, tmp_path):
    """gradient_clipping 0.05 (active at every step after the first): the hooks clip, DeepSpeed's own clipping
    (which would find no gradient) is off, and the next step's coefficient is in the checkpoint."""
    b = _engine(True, clip=0.05)
    opt = b.basic_optimizer
    assert opt._clip_max == 0.05 and b.gradient_clipping() == 0.0
    _steps(b, 0, 4)
    assert opt._clip_coef < 0.5 and opt.last_grad_norm > 0.1
    c = _engine(True, clip=0.05)
    _steps(c, 0, 2)
    c.save_checkpoint(str(tmp_path), tag="s2")
    d = _engine(True, clip=0.05)
    d.load_checkpoint(str(tmp_path), tag="s2")
    assert d.basic_optimizer._clip_coef == c.basic_optimizer._clip_coef < 1.0
    _steps(d, 2, 4)
    for pb, pd in zip(b.module.parameters(), d.module.parameters()):
        assert torch.equal(pb, pd)


def test_configs_that_need_every_gradient_first_are_refused(dist_env):
    from titan_ds.engine import InitContext, prepare
    from titan_ds.optim import install
    titan = TitanConfig(optimizer={"step_in_backward": True, "importance": "sketch"}, plasticity={},
                        compression={"method": "topk"})
    ds = {"gradient_accumulation_steps": 2, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 2}}
    with pytest.raises(TitanConfigError) as e:
        prepare(InitContext(titan=titan, ds_config=ds, model=GPT(TINY)))
    msg = str(e.value)
    for what in ("ZeRO stage 0", "gradient_accumulation_steps=1", "bf16.enabled",
                 "titan.plasticity", "importance=\"sketch\"", "titan.compression"):
        assert what in msg, what
    ok = {"gradient_clipping": 1.0, "zero_optimization": {"stage": 0}}  # clipping: by the previous step's norm
    ctx = InitContext(titan=TitanConfig(optimizer={"step_in_backward": True}), ds_config=ok, model=GPT(TINY))
    prepare(ctx)  # nothing to refuse
    assert isinstance(ctx.optimizer, ASDT)
