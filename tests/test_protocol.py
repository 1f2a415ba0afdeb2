"""The pillar protocol of ``titan_ds.initialize``: every problem is found before anything is touched,
and a failure anywhere after that leaves nothing half-done.

* Validation: each cross-field rule (titan_ds/rules.py) and each pillar's own check refuses its combination with a
  TitanConfigError naming the fix, before any file, model, global or process setting is touched (the transaction
  is never opened, init_distributed and mallopt are never called, the model is bitwise as it was); a section
  with several problems reports them all at once.
* Rollback (fault injection): for each pillar and each failure point (its apply, deepspeed.initialize, its attach,
  the engine's wrappers) the user's model (module tree, parameters, buffers, dtypes, hooks, forward and backward),
  the optimizer and scheduler passed to initialize and every DeepSpeed symbol are as they were; under ZeRO-3 (HMS)
  the error says plainly that the model was consumed, the symbols and mallopt are restored, and a file that
  existed before is still there.
"""
from __future__ import annotations

import copy
import os
import threading

import pytest
import torch

import titan_ds
import titan_ds.engine as te
from titan_ds import deepspeed_compat as dsc
from titan_ds.config import TitanConfigError
from titan_ds.models import GPT
from tests.helpers.equal_run import TINY, ds_config


def _symbols() -> list:
    from deepspeed.runtime.zero import stage3
    return [dsc.resolve(s) for s in dsc.SYMBOLS] + [stage3.torch]


def _fingerprint(model: torch.nn.Module) -> dict:
    """Everything about the model a user could see, by identity and by value."""
    return {"modules": [(n, id(m), type(m), sorted(vars(m))) for n, m in model.named_modules()],
            "params": [(n, id(p), p.dtype, p.requires_grad, sorted(vars(p)), p.grad) for n, p in model.named_parameters()],
            "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _assert_same(model: torch.nn.Module, before: dict, twin: torch.nn.Module) -> None:
    now = _fingerprint(model)
    assert now["modules"] == before["modules"] and now["params"] == before["params"]
    assert now["state"].keys() == before["state"].keys()
    for k, v in before["state"].items():
        assert now["state"][k].dtype == v.dtype and torch.equal(now["state"][k], v), k
    x = torch.randint(0, TINY.vocab_size, (2, TINY.block_size), generator=torch.Generator().manual_seed(1))
    loss, ref = model(x, x), twin(x, x)
    assert torch.equal(loss, ref)  # forward as before
    loss.backward()
    ref.backward()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):  # no hook left from DeepSpeed or titan
        assert torch.equal(p.grad, q.grad), n
        p.grad = q.grad = None


# ------------------------------------------------------------------ validation before anything is touched
@pytest.fixture
def untouchable(monkeypatch):
    """Fails the test if initialize gets past validation: no transaction, no process group, no mallopt."""
    import deepspeed

    import titan_ds.hms.install as hi

    def touched(what):
        def fail(*a, **kw):
            raise AssertionError(f"{what} was reached: validation did not refuse first")
        return fail
    monkeypatch.setattr(te, "Transaction", touched("the transaction"))
    monkeypatch.setattr(deepspeed, "init_distributed", touched("deepspeed.init_distributed"))
    monkeypatch.setattr(hi, "_mallopt", touched("mallopt"))


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


REFUSED = [  # (titan section, ds_config changes, passed optimizer factory, world, expected text)
    ({"optimizer": {"step_in_backward": True}, "hms": {"nvme_path": "{nvme}"}}, {"zero_optimization": {"stage": 3}},
     None, 1, "step_in_backward=true with titan.hms"),
    ({"optimizer": {"step_in_backward": True}}, {"zero_optimization": {"stage": 2}}, None, 1, "needs ZeRO stage 0"),
    ({"optimizer": {"step_in_backward": True}}, {"gradient_accumulation_steps": 2}, None, 1,
     "gradient_accumulation_steps=2"),
    ({"optimizer": {"step_in_backward": True}}, {"bf16": {"enabled": "auto"}}, None, 1, "bf16.enabled"),
    ({"optimizer": {"step_in_backward": True}, "plasticity": {}}, {}, None, 1, "with titan.plasticity"),
    ({"optimizer": {"step_in_backward": True, "importance": "sketch"}}, {}, None, 1, "importance=\"sketch\""),
    ({"optimizer": {"weight_dtype": "bf16"}}, {"zero_optimization": {"stage": 1}}, None, 1,
     "weight_dtype=\"bf16\" needs ZeRO stage 0"),
    ({"optimizer": {"weight_dtype": "bf16"}}, {"bfloat16": {"enabled": True}}, None, 1, "with bf16.enabled"),
    ({"optimizer": {"weight_dtype": "bf16"}}, {"fp16": {"enabled": "true"}}, None, 1, "with fp16.enabled"),
    ({"optimizer": {}}, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, None, 1, "\"optimizer\" section"),
    ({"optimizer": {"weight_decay": 0.1}}, {}, _adamw, 1, "weight_decay=0.1 is set and an optimizer was passed"),
    ({"optimizer": {}}, {"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": False}, None, 1,
     "zero_allow_untested_optimizer=False in the ds_config conflicts"),
    ({"compression": {"method": "topk"}}, {}, None, 1, "needs at least 2 data-parallel ranks"),
    ({"compression": {"method": "topk"}}, {"zero_optimization": {"stage": 3, "reduce_scatter": False}}, None, 2,
     "reduce_scatter=false"),
    ({"compression": {"method": "topk"}}, {"sparse_gradients": True}, None, 2, "sparse_gradients"),
    ({"compression": {"method": "topk", "precondition": "rms"}}, {"gradient_clipping": 1.0}, None, 2,
     "set gradient_clipping to 0"),
    ({"compression": {"method": "topk", "precondition": "rms"}, "optimizer": {}}, {"gradient_clipping": 0}, None, 2,
     "cannot run with titan.optimizer"),
    ({"compression": {"method": "topk", "precondition": "rms"}}, {"gradient_clipping": 0},
     lambda m: torch.optim.RMSprop(m.parameters()), 2, "was given RMSprop"),
    ({"hms": {"nvme_path": "{nvme}"}}, {"zero_optimization": {"stage": 2}}, None, 1, "stage is 2: set it to 3"),
    ({"hms": {"nvme_path": "{nvme}"}}, {"zero_optimization": {"offload_param": {"device": "cpu"}}}, None, 1,
     "set titan.hms.param_tier to \"dram\""),
    ({"hms": {"nvme_path": "{nvme}", "param_tier": "dram"}},
     {"zero_optimization": {"offload_param": {"device": "nvme"}}}, None, 1, "offload_param.device must be \"cpu\""),
    ({"hms": {"nvme_path": "{file}"}}, {}, None, 1, "exists but is not a folder"),
    ({"trd": {"rank": 2, "min_features": 16}}, {}, "stepped", 1, "already has state for"),
    ({"mlme": {"attention": "off", "stripe_ffn": None, "chunked_loss": False, "recompute_blocks": True}}, {},
     None, 1, "recompute_blocks matched no block"),
]


@pytest.mark.parametrize("titan,ds,passed,world,needle", REFUSED, ids=[c[-1][:40] for c in REFUSED])
def test_a_refused_combination_raises_before_anything_is_touched(dist_env, untouchable, monkeypatch, tmp_path,
                                                                titan, ds, passed, world, needle):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    (tmp_path / "a_file").write_text("x")
    paths = {"{nvme}": str(tmp_path / "nvme"), "{file}": str(tmp_path / "a_file")}
    titan = {k: {kk: paths.get(vv, vv) if isinstance(vv, str) else vv for kk, vv in v.items()} for k, v in titan.items()}
    model = GPT(TINY) if "mlme" not in titan else torch.nn.Sequential(torch.nn.Linear(4, 4))
    optimizer = None
    if passed == "stepped":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.randint(0, TINY.vocab_size, (2, TINY.block_size))
        model(x, x).backward()
        optimizer.step()
    elif passed is not None:
        optimizer = passed(model)
    before = _fingerprint(model)
    opt_before = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    cfg = ds_config(0, titan)
    for k, v in ds.items():
        cfg[k] = dict(cfg[k], **v) if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
    with pytest.raises(TitanConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        titan_ds.initialize(model=model, optimizer=optimizer, config=cfg)
    now = _fingerprint(model)
    assert now["modules"] == before["modules"] and now["params"] == before["params"]
    assert all(torch.equal(now["state"][k], v) for k, v in before["state"].items())
    assert not (tmp_path / "nvme").exists()
    if optimizer is not None:
        assert str(optimizer.state_dict()) == str(opt_before)


def test_every_problem_of_every_pillar_is_reported_at_once(dist_env, untouchable, tmp_path):
    (tmp_path / "f").write_text("x")
    cfg = ds_config(2, {"optimizer": {"step_in_backward": True, "weight_dtype": "bf16"},
                        "compression": {"method": "topk"}, "trd": {"rank": 2}})
    cfg["sparse_gradients"] = True
    with pytest.raises(TitanConfigError) as e:
        titan_ds.initialize(model=GPT(TINY), config=cfg)
    msg = str(e.value)
    for needle in ("step_in_backward=true needs ZeRO stage 0", "weight_dtype=\"bf16\" needs ZeRO stage 0",
                   "step_in_backward=true with titan.compression", "needs at least 2 data-parallel ranks",
                   "sparse_gradients=true"):
        assert needle in msg, needle
    assert msg.startswith(f"{len(e.value.errors)} problems in the \"titan\" config section")


# ------------------------------------------------------------------ rollback on failure (fault injection)
def _fail_at(monkeypatch, point: str) -> None:
    """Make ``initialize`` raise at ``point`` after the step there did its work."""
    def raise_after(fn):
        def failing(*a, **kw):
            fn(*a, **kw)
            raise RuntimeError(f"injected failure at {point}")
        return failing
    phase, _, key = point.partition(":")
    if phase in ("apply", "attach"):
        cls = te._pillar_class(next(p for p in te.PILLARS if p.key == key))
        monkeypatch.setattr(cls, phase, raise_after(getattr(cls, phase)))
    elif point == "deepspeed.initialize":
        real = te._deepspeed_initialize()
        monkeypatch.setattr(te, "_deepspeed_initialize", lambda: raise_after(real))
    else:  # the engine's once-only wrappers, the last thing initialize does
        monkeypatch.setattr(te, "_install_nonfinite_guard", raise_after(te._install_nonfinite_guard))


def _points(keys: list[str]) -> list[str]:
    return [f"apply:{k}" for k in keys] + ["deepspeed.initialize"] + [f"attach:{k}" for k in keys] + ["wrap"]


STAGE0 = ["trd", "mlme", "optimizer"]       # + a passed AdamW and scheduler, weight_dtype bf16 (an in-place cast)
STAGE2 = ["trd", "mlme", "compression"]     # + a passed AdamW and scheduler, ZeRO-2 flattens the weights


@pytest.mark.parametrize("stage,point", [(0, p) for p in _points(STAGE0)] + [(2, p) for p in _points(STAGE2)])
def test_a_failure_anywhere_restores_model_optimizer_scheduler_and_deepspeed(dist_env, monkeypatch, stage, point):
    torch.manual_seed(0)
    model = GPT(TINY)
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    groups_before = [dict(g) for g in opt.param_groups]
    sched_before = dict(vars(sched))
    titan = {"trd": {"rank": 2, "min_features": 16}, "mlme": {"tile": 16}}
    titan.update({"optimizer": {"weight_dtype": "bf16", "update": "adaptive", "density": 1.0}} if stage == 0
                 else {"compression": {"method": "none"}})
    before, symbols = _fingerprint(model), _symbols()
    _fail_at(monkeypatch, point)
    with pytest.raises(RuntimeError, match=f"injected failure at {point}") as e:
        titan_ds.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds_config(stage, titan))
    assert "the model, the optimizer and scheduler passed to it, DeepSpeed's patched symbols" in e.value.__notes__[0]
    assert all(a is b for a, b in zip(_symbols(), symbols))
    assert [dict(g) for g in opt.param_groups] == groups_before and opt.param_groups[0]["params"][0] is \
        groups_before[0]["params"][0] and not opt.state
    assert vars(sched).keys() == sched_before.keys() and sched.optimizer is opt and \
        sched.base_lrs == sched_before["base_lrs"]
    _assert_same(model, before, twin)


@pytest.mark.parametrize("point", ["apply:hms", "apply:optimizer", "deepspeed.initialize", "attach:hms", "wrap"])
def test_a_failure_under_hms_says_the_model_was_consumed_and_restores_the_rest(dist_env, monkeypatch, tmp_path,
                                                                               point):
    import titan_ds.hms.install as hi
    stale = tmp_path / "nvme" / "titan_hms" / "rank0"
    stale.mkdir(parents=True)
    (stale / "from_an_earlier_run").write_text("keep me")
    calls = []
    real_mallopt = hi._mallopt()
    monkeypatch.setattr(hi, "_mallopt", lambda: lambda k, v: calls.append((k, v)) or real_mallopt(k, v))
    threads = set(threading.enumerate())
    symbols = _symbols()
    _fail_at(monkeypatch, point)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "titan": {"hms": {"nvme_path": str(tmp_path / "nvme"), "gradient_buffer": "disk"},
                     "mlme": {"tile": 16}, "optimizer": {}}}
    with pytest.raises(RuntimeError, match=f"injected failure at {point}") as e:
        titan_ds.initialize(model=GPT(TINY), config=cfg)
    assert "the model was consumed: ZeRO-3 had partitioned its parameters" in e.value.__notes__[0]
    assert all(a is b for a, b in zip(_symbols(), symbols))
    assert calls[-2:] == list(hi._GLIBC_DEFAULTS.items())  # mallopt set, then put back to glibc's defaults
    assert sorted(os.listdir(tmp_path / "nvme" / "titan_hms")) == ["rank0"]  # the stale folder moved back
    assert (stale / "from_an_earlier_run").read_text() == "keep me"
    assert os.listdir(stale) == ["from_an_earlier_run"]  # titan's own swap files are gone with its folder
    leaked = {t for t in threading.enumerate() if t.is_alive()} - threads
    assert not [t.name for t in leaked if "titan" in t.name.lower() or "hms" in t.name.lower()]


def test_success_deletes_the_stale_swap_files_only_then(dist_env, tmp_path):
    stale = tmp_path / "nvme" / "titan_hms" / "rank0"
    stale.mkdir(parents=True)
    (stale / "from_an_earlier_run").write_text("stale")
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "titan": {"hms": {"nvme_path": str(tmp_path / "nvme")}}}
    model = GPT(TINY)
    titan_ds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
    assert not (stale / "from_an_earlier_run").exists() and sorted(os.listdir(tmp_path / "nvme" / "titan_hms")) == \
        ["rank0"]


def test_one_reader_of_the_precision_flags_agrees_with_deepspeed():
    """titan_ds.config.ds_precision is the only reader (rules and HMS use it): DeepSpeed's pydantic config takes
    "true"/1 as on, bfloat16 is bf16's alias, and HF's unfilled "auto" counts as on (refusals then hold for it)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from titan_ds.config import ds_precision
    for section, want in [({}, "fp32"), ({"bf16": {"enabled": False}}, "fp32"), ({"bf16": {"enabled": True}}, "bf16"),
                          ({"bfloat16": {"enabled": "true"}}, "bf16"), ({"fp16": {"enabled": 1}}, "fp16"),
                          ({"fp16": {"enabled": "false"}}, "fp32"), ({"bf16": {"enabled": "auto"}}, "bf16")]:
        assert ds_precision(section) == want, section
        if "auto" not in str(section):
            ds = DeepSpeedConfig(dict(section, train_batch_size=1))
            assert ("bf16" if ds.bfloat16_config.enabled else "fp16" if ds.float16_config.enabled else "fp32") == want
