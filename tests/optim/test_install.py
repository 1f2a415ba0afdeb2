"""titan_ds.initialize builds ASDT (+BSPS) from the titan section; flags; metrics; resume bit-exact (stage 0, 2)."""
import json
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers.checkpoints import bsps_states
from tests.helpers.configs import all_configs

import titan_ds
from titan_ds.config import TitanConfig, TitanConfigError
from titan_ds.data import Batcher, load_corpus
from titan_ds.models import GPT, GPTConfig
from titan_ds.optim.asdt import ASDT

ROOT = Path(__file__).resolve().parents[2]
TINY = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=256)
TITAN = {"optimizer": {"name": "asdt", "lr": 3e-3, "density": 0.25, "weight_decay": 0.1, "state_dtype": "bf16"},
         "plasticity": {"max_active_fraction": 0.5, "block": "module", "warmup_steps": 1, "sleep_after": 2,
                        "wake_every": 3, "plateau_ratio": 0.98}}


def _cfg(stage, titan=TITAN, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
           "steps_per_print": 10 ** 9, "titan": titan}
    cfg.update(extra)
    return cfg


def _engine(stage, titan=TITAN):
    torch.manual_seed(0)
    engine, opt, _, _ = titan_ds.initialize(model=GPT(TINY), config=_cfg(stage, titan))
    return engine


def _steps(engine, start, stop):
    import torch.distributed as dist
    batches = Batcher(load_corpus().train, 4, TINY.block_size, seed=0, rank=dist.get_rank())
    for step in range(start, stop):
        x, y = batches.get(step)
        engine.backward(engine(x, y))
        engine.step()


def _weights(engine):
    return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage", [0, 2])
def test_resume_is_bit_exact(dist_env, tmp_path, stage):
    a = _engine(stage)
    _steps(a, 0, 4)
    a.save_checkpoint(str(tmp_path), tag="s4")
    saved = bsps_states(tmp_path / "s4")
    assert len(saved) == 1  # once: inside ASDT's state dict, not again in client_state["titan"]
    if stage > 0:  # under ZeRO step 4's signals are folded in at step 5: the saved state holds this rank's part
        assert float(saved[0]["acc"].abs().sum()) > 0
    _steps(a, 4, 9)
    b = _engine(stage)
    b.load_checkpoint(str(tmp_path), tag="s4")
    _steps(b, 4, 9)
    for x, y in zip(_weights(a), _weights(b)):
        assert torch.equal(x, y)
    pa, pb = a.titan.collect_metrics()["plasticity"], b.titan.collect_metrics()["plasticity"]
    assert pa == pb
    events = a.basic_optimizer.plasticity.events
    assert {e.dst for e in events} >= {"growth", "elastic", "sleeping"}  # the checkpoint crossed transitions


def test_checkpoint_with_the_old_duplicate_bsps_entry_resumes_bit_exact(dist_env, tmp_path):
    """Checkpoints written before BSPS was saved once also hold client_state["titan"]["bsps"]: they load (the
    copy in ASDT's state dict is used) and resume bit-exactly."""
    a = _engine(2)
    pl = a.basic_optimizer.plasticity
    a.titan.state_sources["bsps"] = (pl.state_dict, pl.load_state_dict)  # what install.py registered before
    _steps(a, 0, 4)
    a.save_checkpoint(str(tmp_path), tag="s4")
    assert len(bsps_states(tmp_path / "s4")) == 2
    _steps(a, 4, 9)
    b = _engine(2)
    assert "bsps" not in b.titan.state_sources
    b.load_checkpoint(str(tmp_path), tag="s4")
    _steps(b, 4, 9)
    for x, y in zip(_weights(a), _weights(b)):
        assert torch.equal(x, y)
    assert b.basic_optimizer.plasticity.events == pl.events


def test_builds_asdt_and_sets_zero_flags(dist_env):
    e = _engine(2)
    assert isinstance(e.basic_optimizer, ASDT)
    assert e.config["zero_allow_untested_optimizer"] is True
    m = e.titan.collect_metrics()
    assert set(m["plasticity"]) == {"frozen", "growth", "elastic", "sleeping"}
    assert sum(m["plasticity"].values()) == len(e.basic_optimizer.plasticity.blocks)
    _steps(e, 0, 3)
    m = e.titan.collect_metrics()
    opt = e.basic_optimizer
    # one bf16 buffer over the active units (BSPS: not every block holds state): 0 < bytes/param <= 2
    assert m["asdt_state_bytes_per_param"] == opt.state_bytes() / sum(u.numel for u in opt.units)
    assert 0 < m["asdt_state_bytes_per_param"] <= 2.0


def test_offload_sets_force_ds_cpu_optimizer_false(dist_env):
    from titan_ds.engine import InitContext, prepare
    from titan_ds.optim import install
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    ctx = InitContext(titan=TitanConfig(optimizer={}), ds_config=ds, model=GPT(TINY))
    prepare(ctx)
    assert ds["zero_force_ds_cpu_optimizer"] is False and ds["zero_allow_untested_optimizer"] is True
    assert isinstance(ctx.optimizer, ASDT) and ctx.optimizer.plasticity is None


def test_conflicts_and_nonsense_raise(dist_env):
    from titan_ds.engine import InitContext, prepare
    from titan_ds.optim import install
    model = GPT(TINY)
    with pytest.raises(TitanConfigError, match="weight_decay=0.1 is set and an optimizer was passed"):
        prepare(InitContext(titan=TitanConfig(optimizer={"weight_decay": 0.1}), ds_config={},
                                              model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1)))
    with pytest.raises(TitanConfigError, match="not a torch.optim.Optimizer"):
        prepare(InitContext(titan=TitanConfig(optimizer={}), ds_config={}, model=model,
                                              optimizer=lambda params: None))
    with pytest.raises(TitanConfigError, match="not parameters of the model"):
        prepare(InitContext(titan=TitanConfig(optimizer={}), ds_config={}, model=model,
                                              optimizer=torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=1)))
    with pytest.raises(TitanConfigError, match="\"optimizer\" section"):
        prepare(InitContext(titan=TitanConfig(optimizer={}), ds_config={"optimizer": {}},
                                              model=model))
    with pytest.raises(TitanConfigError, match="Lion is the dense"):
        prepare(InitContext(titan=TitanConfig(optimizer={"name": "lion", "density": 0.1}),
                                              ds_config={}, model=model))
    with pytest.raises(TitanConfigError, match="Lion is the sign"):
        prepare(InitContext(titan=TitanConfig(optimizer={"name": "lion", "update": "adaptive"}),
                                              ds_config={}, model=model))
    with pytest.raises(TitanConfigError) as e:
        TitanConfig(optimizer={"density": 1.5, "betas": [0.9, 1.2], "state_dtype": "fp8"},
                    plasticity={"max_active_fraction": 0})
    msg = str(e.value)
    for key in ("titan.optimizer.density", "titan.optimizer.betas", "titan.optimizer.state_dtype",
                "titan.plasticity.max_active_fraction"):
        assert key in msg


def _passed(model, lr=1e-2):
    """The HF Trainer's shape of optimizer: a decay group (matrices) and a no-decay group."""
    named = list(model.named_parameters())
    return torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.05},
                              {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}], lr=lr)


def _warmup(step):
    return min(1.0, step / 4)


@pytest.mark.parametrize("titan_lr", [None, 3e-3])
def test_passed_optimizer_is_replaced_over_its_groups(titan_lr, caplog):
    from titan_ds.engine import InitContext, prepare
    from titan_ds.optim import install
    model = GPT(TINY)
    passed = _passed(model)
    opt_cfg = {} if titan_lr is None else {"lr": titan_lr}
    ctx = InitContext(titan=TitanConfig(optimizer=opt_cfg), ds_config={}, model=model, optimizer=passed)
    with caplog.at_level("INFO", logger="titan_ds"):
        prepare(ctx)
    opt = ctx.optimizer
    assert isinstance(opt, ASDT) and opt is not passed
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    assert [g["lr"] for g in opt.param_groups] == [titan_lr or 1e-2] * 2
    named = list(model.named_parameters())
    for group, want in zip(opt.param_groups, ([np for np in named if np[1].dim() >= 2],
                                              [np for np in named if np[1].dim() < 2])):
        assert len(group["params"]) == len(want) and all(p is q for p, (_, q) in zip(group["params"], want))
    assert opt.names == [n for n, p in named if p.dim() >= 2] + [n for n, p in named if p.dim() < 2]
    said = [r.message for r in caplog.records if "passed to initialize is replaced" in r.message]
    assert len(said) == 1 and said[0].startswith("titan: the AdamW passed to initialize is replaced by ASDT")


@pytest.mark.parametrize("titan_lr", [None, 3e-3])
def test_scheduler_given_to_initialize_is_repointed(titan_lr):
    """A LambdaLR built over the passed optimizer (and already at warm-up step 0) drives ASDT from then on."""
    from titan_ds.engine import InitContext, prepare
    from titan_ds.optim import install
    model = GPT(TINY)
    passed = _passed(model)
    sched = torch.optim.lr_scheduler.LambdaLR(passed, _warmup)
    ctx = InitContext(titan=TitanConfig(optimizer={} if titan_lr is None else {"lr": titan_lr}), ds_config={},
                      model=model, optimizer=passed, lr_scheduler=sched)
    prepare(ctx)
    opt, base = ctx.optimizer, titan_lr or 1e-2
    assert sched.optimizer is opt and sched.base_lrs == [base, base]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "optimizer.step() has been overridden ..." among them
        for step in range(6):
            assert [g["lr"] for g in opt.param_groups] == pytest.approx([base * _warmup(step)] * 2, rel=1e-12), step
            opt.step()
            sched.step()


@pytest.mark.parametrize("given", ["built over the passed optimizer", "built by DeepSpeed"])
def test_torch_scheduler_sees_the_replaced_optimizer_step_first(dist_env, given):
    """Through ``titan_ds.initialize`` at ZeRO-0 (where titan also guards the step against non-finite gradients):
    a LambdaLR, whether built over the passed AdamW or by DeepSpeed over ASDT (a callable ``lr_scheduler``, as
    launch/train.py passes), warms ASDT up and raises none of torch's scheduler warnings."""
    model = GPT(TINY)
    passed = _passed(model)
    sched = torch.optim.lr_scheduler.LambdaLR(passed, _warmup) if given.startswith("built over") else \
        (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _warmup))
    engine, opt, _, sched = titan_ds.initialize(model=model, optimizer=passed, lr_scheduler=sched,
                                                config=_cfg(0, {"optimizer": {"lr": 3e-3}}))
    assert isinstance(opt, ASDT) and sched.optimizer is opt
    batches = Batcher(load_corpus().train, 4, TINY.block_size, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for step in range(1, 6):
            assert [g["lr"] for g in opt.param_groups] == pytest.approx([3e-3 * _warmup(step - 1)] * 2), step
            x, y = batches.get(step)
            engine.backward(engine(x, y))
            engine.step()


def test_deepspeed_scheduler_given_to_initialize_is_repointed():
    """DeepSpeed's WarmupLR (absolute lrs, set on the passed optimizer at construction) drives ASDT."""
    from deepspeed.runtime.lr_schedules import WarmupLR
    from titan_ds.engine import InitContext, prepare
    from titan_ds.optim import install
    model = GPT(TINY)
    passed = _passed(model)
    kw = dict(warmup_min_lr=1e-4, warmup_max_lr=1e-2, warmup_num_steps=4, warmup_type="linear")
    sched = WarmupLR(passed, **kw)
    oracle = _passed(GPT(TINY))  # the same schedule on a plain optimizer
    oracle_sched = WarmupLR(oracle, **kw)
    ctx = InitContext(titan=TitanConfig(optimizer={"lr": 3e-3}), ds_config={}, model=model, optimizer=passed,
                      lr_scheduler=sched)
    prepare(ctx)
    opt = ctx.optimizer
    assert sched.optimizer is opt
    seen = []
    for step in range(6):
        seen.append([g["lr"] for g in opt.param_groups])
        assert seen[-1] == [g["lr"] for g in oracle.param_groups], step
        opt.step()
        sched.step()
        oracle_sched.step()
    assert len({lr for lrs in seen for lr in lrs}) >= 4  # it warms up


def test_scheduler_not_given_still_drives_asdt_and_refuses_another_lr():
    """accelerator.prepare(model, opt, dl, sched) does not hand sched to deepspeed.initialize: ASDT takes the
    passed groups' place, so sched still sets its lr; a titan lr that sched cannot know is refused."""
    from titan_ds.engine import InitContext, prepare
    from titan_ds.optim import install
    model = GPT(TINY)
    passed = _passed(model)
    sched = torch.optim.lr_scheduler.LambdaLR(passed, _warmup)
    with pytest.raises(TitanConfigError, match="scheduler that initialize\\(\\) was not given"):
        prepare(InitContext(titan=TitanConfig(optimizer={"lr": 3e-3}), ds_config={},
                                              model=model, optimizer=passed))
    ctx = InitContext(titan=TitanConfig(optimizer={}), ds_config={}, model=model, optimizer=passed)
    prepare(ctx)
    opt = ctx.optimizer
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()" among them
        for step in range(6):
            assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-2 * _warmup(step)] * 2, rel=1e-12), step
            opt.step()
            sched.step()


def test_lion_is_dense(dist_env):
    from titan_ds.engine import InitContext, prepare
    from titan_ds.optim import install
    ctx = InitContext(titan=TitanConfig(optimizer={"name": "lion"}), ds_config={}, model=GPT(TINY))
    prepare(ctx)
    assert all(g["density"] == 1.0 for g in ctx.optimizer.param_groups)


@pytest.mark.parametrize("path", all_configs("asdt*.json"), ids=lambda p: p.name)
def test_shipped_configs_load_and_build(dist_env, path):
    from titan_ds.engine import InitContext, prepare
    from titan_ds.optim import install
    ds = json.loads(path.read_text())
    titan = TitanConfig.from_ds_config(ds)
    assert titan.optimizer is not None and "gradient_clipping" in ds
    ds.pop("titan")
    ctx = InitContext(titan=titan, ds_config=ds, model=GPT(TINY))
    prepare(ctx)
    assert isinstance(ctx.optimizer, ASDT)
