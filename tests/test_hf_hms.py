"""HMS under the Hugging Face Trainer: with ``titan_ds.install()``, transformers' own
``deepspeed.zero.Init`` (it builds every model under ZeRO-3 that way) becomes ``titan_ds.zero_init`` when the config
has ``titan.hms``, so ``from_pretrained`` streams the parameters to HMS's store as the model is built and the
Trainer's ``deepspeed.initialize`` adopts it. Before, the Trainer refused the model ("build it under
titan_ds.zero_init"). Tiny random Llama, saved with ``save_pretrained`` and loaded back (no network)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import titan_ds
from tests.helpers.deps import require
from titan_ds import deepspeed_compat as dsc
from titan_ds.hms.param_swapper import HMSParamSwapper

transformers = require("transformers")
require("accelerate")

ROOT = Path(__file__).resolve().parents[1]
VOCAB, SEQ = 256, 32


@pytest.fixture
def installed():
    titan_ds.install()
    yield
    titan_ds.uninstall()


def _ds(tmp_path, hms: bool = True, auto: bool = False) -> dict:
    cfg = json.loads((ROOT / "ds_configs" / "hf_hms.json").read_text())
    cfg["titan"]["hms"]["nvme_path"] = str(tmp_path / "store")
    if not auto:  # outside the Trainer nobody fills HF's "auto" values
        cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, gradient_clipping=1.0)
        cfg.pop("train_batch_size")
    if not hms:
        del cfg["titan"]
    return cfg


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random Llama saved with save_pretrained, and its state dict."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   tie_word_embeddings=False)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    return folder, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _hf_zero3(ds: dict):
    """HF's ZeRO-3 switch outside the Trainer (kept alive by the caller: transformers holds a weak reference)."""
    from transformers.integrations import HfDeepSpeedConfig
    return HfDeepSpeedConfig(ds)


def _gathered(model) -> dict[str, torch.Tensor]:
    import deepspeed
    out = {}
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().clone()
    return out


def _swappers(model) -> set:
    return {id(dsc.param_swapper_of(p)) for p in model.parameters()}


# ------------------------------------------------------------------------------------ the routed zero.Init
def test_install_routes_zero_init_only_with_titan_hms_and_uninstall_restores(dist_env, tmp_path):
    import deepspeed
    original = deepspeed.zero.Init
    titan_ds.install()
    try:
        routed = deepspeed.zero.Init
        assert routed is not original and dsc.zero_init_class() is original
        # without titan.hms: DeepSpeed's Init, unchanged (its own swapper: none without NVMe offload)
        ctx = routed(config_dict_or_path=_ds(tmp_path, hms=False))
        with ctx:
            plain = torch.nn.Linear(8, 8)
        assert type(ctx) is original and isinstance(ctx, routed) and issubclass(original, routed)
        assert dsc.is_zero_param(plain.weight) and dsc.param_swapper_of(plain.weight) is None
        # with titan.hms: titan_ds.zero_init (HMS's swapper, parameters in its store)
        ctx = routed(config_dict_or_path=_ds(tmp_path))
        with ctx:
            streamed = torch.nn.Linear(8, 8)
        assert isinstance(ctx, routed) and isinstance(dsc.param_swapper_of(streamed.weight), HMSParamSwapper)
        # a json path, as HF also accepts (another store: the first model still lives in tmp_path/store)
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(_ds(tmp_path / "second")))
        with routed(config_dict_or_path=str(path)):
            from_path = torch.nn.Linear(8, 8)
        swapper = dsc.param_swapper_of(from_path.weight)
        assert isinstance(swapper, HMSParamSwapper) and swapper is not dsc.param_swapper_of(streamed.weight)
        assert routed.__name__ == "Init" and routed.override_module_apply is original.override_module_apply
    finally:
        titan_ds.uninstall()
    assert deepspeed.zero.Init is original and deepspeed.zero.Init is dsc.zero_init_class()


def test_a_second_model_in_the_same_store_is_refused_while_the_first_lives(dist_env, tmp_path, installed):
    import deepspeed
    from titan_ds.config import TitanConfigError
    with deepspeed.zero.Init(config_dict_or_path=_ds(tmp_path)):
        first = torch.nn.Linear(8, 8)
    with pytest.raises(TitanConfigError, match="another titan.hms.nvme_path"):
        deepspeed.zero.Init(config_dict_or_path=_ds(tmp_path))
    del first
    with deepspeed.zero.Init(config_dict_or_path=_ds(tmp_path)):
        torch.nn.Linear(8, 8)  # the first model is gone: its folder may be reused


# ------------------------------------------------------------------------------------ from_pretrained under HMS
def test_from_pretrained_under_hms_loads_the_saved_weights_into_the_store(dist_env, tmp_path, installed, saved):
    folder, state = saved
    ds = _ds(tmp_path)
    keep = _hf_zero3(ds)
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    params = list(model.parameters())
    # partitioned as built: every parameter is a placeholder, its partition lives in the one HMS store
    assert all(dsc.is_zero_param(p) and p.data.numel() == 0 for p in params)
    swapper = dsc.param_swapper_of(params[0])
    assert isinstance(swapper, HMSParamSwapper) and _swappers(model) == {id(swapper)}
    n = sum(p.ds_numel for p in params)
    assert swapper.store.stats.bytes_written >= 4 * n
    got = _gathered(model)
    assert got.keys() == {k for k in state if "rotary" not in k}
    for k, v in got.items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0, msg=k)
    del keep


def test_gathered_parameters_writes_and_hf_zero3_init_reach_the_store(dist_env, tmp_path, installed, saved):
    import deepspeed
    ds = _ds(tmp_path)
    keep = _hf_zero3(ds)
    cfg = transformers.LlamaConfig.from_pretrained(saved[0])
    model = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.float32)  # HF's zero3 weight init
    assert isinstance(dsc.param_swapper_of(model.lm_head.weight), HMSParamSwapper)
    got = _gathered(model)
    w = got["model.layers.0.mlp.up_proj.weight"]
    assert torch.allclose(got["model.norm.weight"], torch.ones(cfg.hidden_size))  # RMSNorm init: ones
    assert w.abs().sum() > 0 and abs(float(w.std()) - cfg.initializer_range) < 0.2 * cfg.initializer_range
    p = model.model.layers[0].mlp.up_proj.weight
    with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
        p.data.mul_(-2.0).add_(1.0)
    assert p.data.numel() == 0  # released again
    torch.testing.assert_close(_gathered(model)["model.layers.0.mlp.up_proj.weight"], w * -2.0 + 1.0)
    del keep


# ------------------------------------------------------------------------------------ Trainer + install + HMS
def test_trainer_with_hms_trains_a_pretrained_llama(dist_env, tmp_path, installed, saved):
    folder, state = saved
    ds = _ds(tmp_path, auto=True)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), deepspeed=copy.deepcopy(ds), per_device_train_batch_size=4, max_steps=3,
        learning_rate=1e-2, warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True)
    try:
        model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert isinstance(dsc.param_swapper_of(model.lm_head.weight), HMSParamSwapper)
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(0))
        data = [{"input_ids": ids, "labels": ids}] * 16  # one sequence: the loss must fall step after step
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        engine = trainer.model_wrapped
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), losses
        assert losses[2] < losses[1] < losses[0], losses
        assert "hms" in engine.titan.reports
        assert engine.titan.reports["hms"].param_swapper is dsc.param_swapper_of(model.lm_head.weight)
        assert engine.titan.reports["hms"].store.stats.bytes_written > 0
    finally:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        unset_hf_deepspeed_config()


# ------------------------------------------------------------------------------------ under a memory cap
CAP_GIB = 1.75  # measured uncapped (6 GiB cap), 103M-parameter Llama, 3 steps, peak anonymous memory: ZeRO-3 CPU
# offload 4.41 GiB, ZeRO-Infinity (optimizer on NVMe, DeepSpeedCPUAdam) 2.29-2.47 GiB, Trainer + HMS 1.55-1.60 GiB.
# Capped, ZeRO-Infinity gives some of it back: it trained under 2 GiB once (1.98 GiB peak, a CI run); under 1.75 GiB
# it was killed twice and HMS peaked at 1.52 / 1.57 (tests/helpers/hf_hms_capped.py; docs/integrations.md)


@pytest.mark.slow
def test_under_a_cap_deepspeed_offload_is_killed_and_hms_trains(tmp_path):
    """A 103M-parameter Llama (412 MB of fp32 weights) fine-tuned 3 steps by the Trainer under a 1.75 GiB cgroup:
    ZeRO-3 with CPU offload (parameters, fp32 masters, gradients and Adam moments in RAM) and ZeRO-Infinity
    (optimizer state on NVMe, parameters in RAM; where DeepSpeed's async_io op builds) are OOM-killed; with
    titan.hms the same run trains (parameters and optimizer state in the store, the model built into it)."""
    import subprocess
    import sys

    from tests.helpers.launch import clean_env  # not this worker's MASTER_PORT: its process group holds it
    from titan_ds.memcap import cgroup_available, run_capped
    from titan_ds.plan import aio_buildable
    if not cgroup_available():
        pytest.skip("needs a cgroup v1 memory controller and root")
    modes = ["cpu", "hms"]
    if aio_buildable():  # its ops built uncapped first: a JIT build inside the cgroup would be what got killed
        from launch.bench.hms_scale import build_ops
        build_ops(clean_env())
        modes.insert(1, "zinf")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    runs = {}
    for mode in modes:
        work = tmp_path / mode
        work.mkdir()
        with open(work / "log.txt", "w") as log:
            runs[mode] = run_capped([sys.executable, str(ROOT / "tests" / "helpers" / "hf_hms_capped.py"),
                                     "--model-dir", str(tmp_path / "model"), "--work", str(work), "--mode", mode,
                                     "--steps", "3"], int(CAP_GIB * 2**30), env=clean_env(), stdout=log,
                                    stderr=subprocess.STDOUT,
                                    timeout=900)
    tail = {m: (tmp_path / m / "log.txt").read_text()[-3000:] for m in runs}
    for mode in modes[:-1]:
        assert runs[mode].oom_killed and runs[mode].returncode != 0, tail[mode]
    assert runs["hms"].ok, tail["hms"]
    losses = json.loads(tail["hms"].strip().splitlines()[-1])
    assert len(losses) == 3 and losses[2] < losses[0], losses
