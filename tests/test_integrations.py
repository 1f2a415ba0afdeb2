"""titan_ds.install(): deepspeed.initialize routed through titan_ds.initialize, for any caller.

The HF ``Trainer`` tests build tiny random Llama / GPT-2 configs in code (no network, no files) and run 1-rank
DeepSpeed on the CPU accelerator in this process.
"""
from __future__ import annotations

import pytest
import torch

import titan_ds
from tests.helpers.deps import require
from titan_ds import integrations

transformers = require("transformers")
require("accelerate")

VOCAB, SEQ, BATCH = 64, 16, 4


@pytest.fixture
def installed():
    titan_ds.install()
    yield
    titan_ds.uninstall()


# ------------------------------------------------------------------------------------ install / uninstall
def test_install_is_idempotent_and_uninstall_restores():
    import deepspeed
    original = deepspeed.initialize
    titan_ds.install()
    routed = deepspeed.initialize
    titan_ds.install()
    assert deepspeed.initialize is routed and routed is not original and titan_ds.is_installed()
    assert routed.__titan_original__ is original
    titan_ds.uninstall()
    assert deepspeed.initialize is original and not titan_ds.is_installed()
    titan_ds.uninstall()  # nothing to undo
    assert deepspeed.initialize is original


def test_uninstall_refuses_to_drop_a_later_patch(monkeypatch):
    import deepspeed
    original = deepspeed.initialize
    titan_ds.install()
    later = lambda *a, **k: None  # noqa: E731  (another library's patch on top of ours)
    deepspeed.initialize = later
    try:
        with pytest.raises(RuntimeError, match="replaced after titan_ds.install"):
            titan_ds.uninstall()
        with pytest.raises(RuntimeError, match="replaced after titan_ds.install"):
            titan_ds.install()
    finally:
        deepspeed.initialize = integrations._routed
        titan_ds.uninstall()
    assert deepspeed.initialize is original


def test_route_binds_deepspeed_signature(installed, monkeypatch):
    """Positional arguments are bound by DeepSpeed's order (distributed_port before config), config_params kept."""
    import deepspeed
    seen = {}
    monkeypatch.setattr(integrations, "titan_initialize", lambda **kw: seen.update(kw) or "engine")
    model = torch.nn.Linear(2, 2)
    assert deepspeed.initialize(None, model, None, None, None, None, 29500, config_params={"a": 1}) == "engine"
    assert seen == {"args": None, "model": model, "optimizer": None, "model_parameters": None,
                    "training_data": None, "lr_scheduler": None, "distributed_port": 29500,
                    "config_params": {"a": 1}}
    with pytest.raises(TypeError):
        deepspeed.initialize(model=model, no_such_argument=1)


def _two_steps(init, cfg: dict):
    """(engine, client optimizer, parameters before, parameters after) of 2 steps through ``init``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = init(model=model, optimizer=opt, config_params=cfg)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        engine.backward(engine(x).square().mean())
        engine.step()
    return engine, opt, before, [p.detach().clone() for p in engine.module.parameters()]


def test_installed_initialize_applies_titan_section_from_config_params(dist_env):
    """A user script (or accelerate: config_params=) calling deepspeed.initialize gets titan: the same engine,
    step for step, as titan_ds.initialize called directly (ASDT stepped every parameter; the client AdamW never
    stepped), not DeepSpeed's; after uninstall the same call is DeepSpeed's again."""
    import deepspeed
    from titan_ds.optim.asdt import ASDT
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "titan": {"optimizer": {"lr": 1e-3}}}
    original = deepspeed.initialize
    titan_ds.install()
    try:
        engine, client, before, routed = _two_steps(deepspeed.initialize, cfg)
    finally:
        titan_ds.uninstall()
    assert deepspeed.initialize is original
    opt = engine.basic_optimizer
    assert engine.titan.reports["optimizer"]["name"] == "asdt" and isinstance(opt, ASDT)
    assert [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in engine.module.parameters()]
    assert all(opt.state[p]["step"] == 2 for p in engine.module.parameters()) and not client.state
    assert all(not torch.equal(a, b) for a, b in zip(before, routed, strict=True))
    direct = _two_steps(titan_ds.initialize, cfg)[3]
    assert all(torch.equal(a, b) for a, b in zip(routed, direct, strict=True))
    plain_engine, plain_client, _, plain = _two_steps(deepspeed.initialize, cfg)  # uninstalled: DeepSpeed's
    assert not hasattr(plain_engine, "titan") and plain_engine.basic_optimizer is plain_client
    assert all(plain_client.state[p]["step"] == 2 for p in plain_engine.module.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(routed, plain, strict=True))


def test_accelerate_prepare_with_its_own_scheduler_drives_titan(dist_env, installed):
    """accelerator.prepare(model, opt, dl, sched): deepspeed.initialize gets opt (replaced by titan's) but not
    sched, a LambdaLR built over opt; it still warms titan's lr up."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin
    from titan_ds.optim.asdt import ASDT
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
          "zero_optimization": {"stage": 2}, "titan": {"optimizer": {"density": 0.5}}}
    try:
        acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds))
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        client = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(client, lambda s: min(1.0, s / 3))
        data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
        engine, opt, dl, sched = acc.prepare(model, client, torch.utils.data.DataLoader(data, batch_size=4), sched)
        titan_opt = engine.basic_optimizer
        assert engine.titan.reports["optimizer"]["name"] == "asdt" and isinstance(titan_opt, ASDT)
        before = [p.detach().clone() for p in engine.module.parameters()]
        lrs = []
        for x, y in list(dl)[:5]:
            lrs.append(engine.basic_optimizer.param_groups[0]["lr"])
            acc.backward(torch.nn.functional.mse_loss(engine(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert lrs == pytest.approx([0.0, 1e-2 / 3, 2e-2 / 3, 1e-2, 1e-2], rel=1e-12)
    # accelerate's opt.step() stepped titan's optimizer 5 times, never the client AdamW, and the model moved
    assert {int(st["step"]) for st in titan_opt.state.values()} == {5} and not client.state
    assert any(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters(), strict=True))


# ------------------------------------------------------------------------------------ HF Trainer
def _tiny_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ)
    return transformers.GPT2LMHeadModel(cfg)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 16):
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _ds_config(stage: int, titan: dict | None = None, scheduler: dict | None = None) -> dict:
    # "auto" everywhere HF fills it from TrainingArguments
    cfg = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    if titan is not None:
        cfg["titan"] = titan
    return cfg


def run_trainer(tmp_path, kind: str, ds_config: dict, steps: int = 3, warmup: int = 2, lr: float = 1e-3,
                resume: str | None = None, **extra):
    """Train ``steps`` steps; returns (per-step losses, final parameters, the engine optimizer's lr at the start of
    each step, trainer, parameters at the start of each step). ``extra``: more TrainingArguments."""
    losses, lrs, snapshots = [], [], []

    class Recorder(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            engine = trainer.model_wrapped
            lrs.append([g["lr"] for g in engine.basic_optimizer.param_groups])
            snapshots.append([p.detach().clone() for p in trainer.model.parameters()])

    class Recording(transformers.Trainer):
        def compute_loss(self, model, inputs, *a, **kw):
            loss = super().compute_loss(model, inputs, *a, **kw)
            losses.append(loss.detach().clone())
            return loss

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), deepspeed=ds_config, per_device_train_batch_size=BATCH, max_steps=steps,
        learning_rate=lr, warmup_steps=warmup, lr_scheduler_type="linear", weight_decay=0.1, seed=0,
        report_to=[], logging_strategy="no", disable_tqdm=True, **{"save_strategy": "no", **extra})
    trainer = Recording(model=_tiny_model(kind), args=args, train_dataset=_Tokens(), callbacks=[Recorder()])
    trainer.train(resume_from_checkpoint=resume)
    params = [p.detach().clone() for p in trainer.model.parameters()]
    return torch.stack(losses), params, lrs, trainer, snapshots


def _assert_bitwise(a, b) -> None:
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_trainer_without_section_or_install_is_plain_deepspeed(dist_env, tmp_path, kind, stage):
    plain = run_trainer(tmp_path, kind, _ds_config(stage))
    section_not_installed = run_trainer(tmp_path, kind, _ds_config(stage, titan={"optimizer": {"lr": 1e-3}}))
    assert not hasattr(section_not_installed[3].model_wrapped, "titan")
    titan_ds.install()
    try:
        installed_no_section = run_trainer(tmp_path, kind, _ds_config(stage))
    finally:
        titan_ds.uninstall()
    assert not hasattr(installed_no_section[3].model_wrapped, "titan")
    _assert_bitwise(plain, section_not_installed)
    _assert_bitwise(plain, installed_no_section)
    assert any(not torch.equal(p, q) for p, q in zip(plain[1], _tiny_model(kind).parameters()))  # it trained


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_trainer_with_section_runs_titan_optimizer_over_trainer_groups(dist_env, tmp_path, installed, kind, stage):
    from titan_ds.optim.asdt import ASDT
    titan = {"optimizer": {"density": 0.5}}
    losses, params, lrs, trainer, snaps = run_trainer(tmp_path, kind, _ds_config(stage, titan))
    engine = trainer.model_wrapped
    assert engine.titan.reports["optimizer"]["name"] == "asdt"
    opt = engine.basic_optimizer
    assert isinstance(opt, ASDT)
    # the Trainer's decay / no-decay groups, with TrainingArguments.weight_decay and learning_rate
    decay = set(trainer.get_decay_parameter_names(trainer.model))
    named = [n for n, _ in trainer.model.named_parameters()]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    n_decay = len(opt.param_groups[0]["params"]) if stage == 0 else len([n for n in named if n in decay])
    assert opt.names[:n_decay] == [n for n in named if n in decay]
    assert opt.names[n_decay:] == [n for n in named if n not in decay] and 0 < n_decay < len(named)
    assert all(g["initial_lr"] == 1e-3 for g in opt.param_groups)
    assert torch.isfinite(losses).all()
    # ASDT took the Trainer's 3 steps (step 1 at the warm-up's lr 0) and they moved the model's parameters
    assert len(opt.state) > 0 and {int(st["step"]) for st in opt.state.values()} == {3}
    assert any(not torch.equal(a, b) for a, b in zip(snaps[1], params, strict=True))


def test_trainer_with_bf16_weights_trains_them_with_no_fp32_copy(dist_env, tmp_path, installed):
    """titan.optimizer.weight_dtype="bf16" through the HF Trainer (bf16=False, as the refusal asks): the Trainer's
    model is bf16 in place, ASDT steps it directly (no DeepSpeed wrapper with an fp32 master), and it learns."""
    titan = {"optimizer": {"weight_dtype": "bf16", "update": "adaptive", "density": 1.0, "state_dtype": "8bit",
                           "second_moment": "coordinate", "second_dtype": "4bit"}}
    losses, params, _, trainer, snapshots = run_trainer(tmp_path, "llama", _ds_config(0, titan), steps=4)
    engine = trainer.model_wrapped
    assert type(engine.optimizer).__name__ == "ASDT"
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert torch.isfinite(losses).all()
    assert any(not torch.equal(a, b) for a, b in zip(snapshots[0], params))


def _linear_warmup(lr: float, warmup: int, total: int, step: int) -> float:
    if step < warmup:
        return lr * step / warmup
    return lr * max(0.0, (total - step) / (total - warmup))


def test_trainer_schedule_drives_titan_optimizer(dist_env, tmp_path, installed):
    """The Trainer's linear warm-up sets the lr of titan's param groups step by step; at lr 0 nothing moves."""
    steps, warmup, titan_lr = 5, 3, 2e-3
    losses, _, lrs, trainer, snaps = run_trainer(tmp_path, "llama", _ds_config(2, {"optimizer": {"lr": titan_lr}}),
                                                 steps=steps, warmup=warmup, lr=1e-3)
    expected = [_linear_warmup(titan_lr, warmup, steps, k) for k in range(steps)]
    assert [g[0] for g in lrs] == pytest.approx(expected, rel=1e-12, abs=0)
    assert all(len(set(g)) == 1 for g in lrs)
    assert expected[0] == 0.0 and all(torch.equal(p, q) for p, q in zip(snaps[0], snaps[1]))  # step 1 ran at lr 0
    assert any(not torch.equal(p, q) for p, q in zip(snaps[1], snaps[2]))


def test_ds_scheduler_section_with_auto_drives_titan_optimizer(dist_env, tmp_path):
    """A ds_config "scheduler" whose "auto" values HF fills: DeepSpeed builds it over titan's optimizer, which
    gets the same lr at every step as plain DeepSpeed's AdamW does."""
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                            "warmup_num_steps": "auto", "warmup_type": "linear"}}
    plain = run_trainer(tmp_path, "gpt2", _ds_config(0, None, sched), steps=4, warmup=2)
    titan_ds.install()
    try:
        titan = run_trainer(tmp_path, "gpt2", _ds_config(0, {"optimizer": {}}, sched), steps=4, warmup=2)
    finally:
        titan_ds.uninstall()
    from titan_ds.optim.asdt import ASDT
    engine = titan[3].model_wrapped
    assert isinstance(engine.basic_optimizer, ASDT)
    assert type(engine.lr_scheduler).__name__ == "WarmupLR" and engine.lr_scheduler.optimizer is engine.basic_optimizer
    assert titan[2] == plain[2] and len({lr for g in plain[2] for lr in g}) == 3  # 0, half, full: it warms up


def test_trainer_checkpoint_resume_with_titan_is_bitwise(dist_env, tmp_path, installed):
    """The Trainer saves through titan's checkpoint wrapper and resumes titan's optimizer state exactly."""
    cfg = _ds_config(2, {"optimizer": {"density": 0.5}})
    full = run_trainer(tmp_path / "full", "llama", cfg, steps=4, save_strategy="steps", save_steps=2)
    assert (tmp_path / "full" / "checkpoint-2" / "latest").read_text() == "global_step2"
    resumed = run_trainer(tmp_path / "full", "llama", cfg, steps=4, resume=str(tmp_path / "full" / "checkpoint-2"))
    assert len(resumed[0]) == 2 and torch.equal(full[0][2:], resumed[0])
    assert all(torch.equal(a, b) for a, b in zip(full[1], resumed[1]))
    assert not all(torch.equal(a, b) for a, b in zip(full[4][2], resumed[1]))  # steps 3-4 changed something
