"""titan_ds.initialize builds ASDT (+BSPS) from the titan section; flags; metrics; resume bit-exact (stage 0, 2)."""
import json
from pathlib import Path

import pytest
import torch

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


def test_builds_asdt_and_sets_zero_flags(dist_env):
    e = _engine(2)
    assert isinstance(e.basic_optimizer, ASDT)
    assert e.config["zero_allow_untested_optimizer"] is True
    m = e.titan.collect_metrics()
    assert set(m["plasticity"]) == {"frozen", "growth", "elastic", "sleeping"}
    assert sum(m["plasticity"].values()) == len(e.basic_optimizer.plasticity.blocks)
    assert "asdt_state_bytes_per_param" in m


def test_offload_sets_force_ds_cpu_optimizer_false(dist_env):
    from titan_ds.engine import InitContext
    from titan_ds.optim import install
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    ctx = InitContext(titan=TitanConfig(optimizer={}), ds_config=ds, model=GPT(TINY))
    install.before_initialize(ctx)
    assert ds["zero_force_ds_cpu_optimizer"] is False and ds["zero_allow_untested_optimizer"] is True
    assert isinstance(ctx.optimizer, ASDT) and ctx.optimizer.plasticity is None


def test_conflicts_and_nonsense_raise(dist_env):
    from titan_ds.engine import InitContext
    from titan_ds.optim import install
    model = GPT(TINY)
    with pytest.raises(TitanConfigError, match="optimizer was also passed"):
        install.before_initialize(InitContext(titan=TitanConfig(optimizer={}), ds_config={}, model=model,
                                              optimizer=torch.optim.SGD(model.parameters(), lr=1)))
    with pytest.raises(TitanConfigError, match="\"optimizer\" section"):
        install.before_initialize(InitContext(titan=TitanConfig(optimizer={}), ds_config={"optimizer": {}},
                                              model=model))
    with pytest.raises(TitanConfigError, match="Lion is the dense"):
        install.before_initialize(InitContext(titan=TitanConfig(optimizer={"name": "lion", "density": 0.1}),
                                              ds_config={}, model=model))
    with pytest.raises(TitanConfigError) as e:
        TitanConfig(optimizer={"density": 1.5, "betas": [0.9, 1.2], "state_dtype": "fp8"},
                    plasticity={"max_active_fraction": 0})
    msg = str(e.value)
    for key in ("titan.optimizer.density", "titan.optimizer.betas", "titan.optimizer.state_dtype",
                "titan.plasticity.max_active_fraction"):
        assert key in msg


def test_lion_is_dense(dist_env):
    from titan_ds.engine import InitContext
    from titan_ds.optim import install
    ctx = InitContext(titan=TitanConfig(optimizer={"name": "lion"}), ds_config={}, model=GPT(TINY))
    install.before_initialize(ctx)
    assert all(g["density"] == 1.0 for g in ctx.optimizer.param_groups)


@pytest.mark.parametrize("path", sorted((ROOT / "ds_configs").glob("asdt*.json")), ids=lambda p: p.name)
def test_shipped_configs_load_and_build(dist_env, path):
    from titan_ds.engine import InitContext
    from titan_ds.optim import install
    ds = json.loads(path.read_text())
    titan = TitanConfig.from_ds_config(ds)
    assert titan.optimizer is not None and "gradient_clipping" in ds
    ds.pop("titan")
    ctx = InitContext(titan=titan, ds_config=ds, model=GPT(TINY))
    install.before_initialize(ctx)
    assert isinstance(ctx.optimizer, ASDT)
