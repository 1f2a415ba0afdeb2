"""TRD through ``titan_ds.initialize``: ZeRO 0/1/2/3 training against a plain-PyTorch run, ZeRO-3 partitioning of
the TR cores (also for a model built under ``zero.Init``), and bit-exact checkpoint save/resume.

One process, world size 1, gloo on the CPU (a few seconds per engine). The two-rank ZeRO-3 run is ``slow``.
"""
from __future__ import annotations

from pathlib import Path

import deepspeed
import pytest
import torch
from torch import nn

from titan_ds.inject.trd import TensorRingLinear
from tests.helpers.configs import all_configs

from tests.inject.test_trd import Tiny


@pytest.fixture(autouse=True)
def _world(dist_env):
    """One-process world (tests/conftest.py)."""


def _config(stage: int, **trd) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9,
            "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
            "titan": {"trd": {"rank": 3, "min_features": 16, **trd}}}


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32, (2, 6), generator=g) for _ in range(n)]


def _loss(model, idx):
    return nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten())


def _adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def _engine(stage: int, model=None, **trd):
    from titan_ds.engine import initialize
    torch.manual_seed(0)
    model = model if model is not None else Tiny(d=32)
    engine, *_ = initialize(model=model, optimizer=_adamw, config=_config(stage, **trd))
    return engine


def _train(engine, batches):
    out = []
    for idx in batches:
        loss = _loss(engine, idx)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def _reference_losses(batches, **trd):
    """The same TR model trained by plain PyTorch (no DeepSpeed): the oracle for every ZeRO stage."""
    from titan_ds.inject.trd import TRDPolicy, apply_trd
    torch.manual_seed(0)
    model = Tiny(d=32)
    apply_trd(model, TRDPolicy(rank=3, min_features=16, **trd))
    opt = _adamw(model.parameters())
    out = []
    for idx in batches:
        loss = _loss(model, idx)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_trains_like_plain_pytorch(stage):
    batches = _batches(4)
    engine = _engine(stage)
    losses = _train(engine, batches)
    assert losses == pytest.approx(_reference_losses(batches), rel=1e-5, abs=1e-6)
    assert losses[-1] < losses[0]
    rep = engine.titan.reports["trd"]
    assert len(rep.entries) == 8 and rep.compression_ratio > 1
    m = engine.titan.collect_metrics()
    assert m["trd_compression_ratio"] == rep.compression_ratio and m["trd_model_compression_ratio"] == rep.model_compression_ratio


def test_zero3_partitions_tr_cores():
    engine = _engine(3)
    fc = engine.module.blocks[0].mlp.fc
    assert isinstance(fc, TensorRingLinear)
    for g in fc.cores:
        assert hasattr(g, "ds_id") and g.ds_numel == g.ds_shape.numel() and g.numel() == 0  # released outside forward
    assert engine.titan.reports["trd"].new_params == sum(e.new_params for e in engine.titan.reports["trd"].entries)


def test_zero3_model_built_under_zero_init_tr_svd_gathers_sources():
    """Sources already partitioned (model built under zero.Init): TR-SVD must see the gathered dense weight."""
    torch.manual_seed(0)
    dense = Tiny(d=32)
    want = TensorRingLinear.from_linear(dense.blocks[0].mlp.fc, 3, init="tr_svd").init_error
    cfg = _config(3, init="tr_svd")
    with deepspeed.zero.Init(config_dict_or_path={k: v for k, v in cfg.items() if k != "titan"}):
        torch.manual_seed(0)
        model = Tiny(d=32)
    assert model.blocks[0].mlp.fc.weight.numel() == 0  # partitioned
    engine = _engine(3, model=model, init="tr_svd")
    err = next(e.detail["init_error"] for e in engine.titan.reports["trd"].entries if e.name == "blocks.0.mlp.fc")
    assert err == pytest.approx(want, rel=1e-6) and err < 1.0
    assert engine.titan.reports["trd"].entries[0].dense_params == 32 * 96 + 96  # ds_numel, not the empty local view
    assert all(l == l for l in _train(engine, _batches(2)))


@pytest.mark.parametrize("stage", [0, 3])
def test_checkpoint_resume_is_bit_exact(stage, tmp_path):
    batches = _batches(6)
    a = _engine(stage)
    first = _train(a, batches[:3])
    a.save_checkpoint(str(tmp_path), tag="t")
    cont = _train(a, batches[3:])
    b = _engine(stage)  # fresh random cores: everything must come from the checkpoint
    b.load_checkpoint(str(tmp_path), tag="t")
    resumed = _train(b, batches[3:])
    assert first[-1] != cont[0]
    assert resumed == cont  # bit-exact: float equality of every loss
    for (n, p), (_, q) in zip(a.module.named_parameters(), b.module.named_parameters()):
        if stage == 3:
            with deepspeed.zero.GatheredParameters([p, q]):
                assert torch.equal(p, q), n
        else:
            assert torch.equal(p, q), n


_TWO_RANK = r"""
import os, pathlib, torch
from tests.inject.test_trd import Tiny
from tests.inject.test_trd_deepspeed import _config, _adamw, _loss, _batches
from titan_ds.engine import initialize
torch.manual_seed(0)
engine, *_ = initialize(model=Tiny(d=32), optimizer=_adamw, config=dict(_config(3), train_micro_batch_size_per_gpu=1))
fc = engine.module.blocks[0].mlp.fc
local = [g.ds_tensor.numel() for g in fc.cores]
losses = []
for _ in range(4):  # one fixed sample per rank: the loss must fall
    idx = _batches(1)[0][int(os.environ["RANK"]):][:1]
    loss = _loss(engine, idx); engine.backward(loss); engine.step(); losses.append(loss.item())
# one file per rank: two ranks printing to one stdout can interleave their lines
pathlib.Path(__file__).with_name("result" + os.environ["RANK"] + ".txt").write_text(
    " ".join(map(str, (os.environ["RANK"], local, [g.ds_numel for g in fc.cores], losses))))
"""


@pytest.mark.slow
def test_zero3_two_ranks_partition_and_train(tmp_path):
    """Two CPU ranks under the deepspeed launcher: each holds about half of every TR core and the loss falls."""
    from tests.helpers.launch import run_deepspeed
    script = tmp_path / "two_rank.py"
    script.write_text(_TWO_RANK)
    out = run_deepspeed(script, num_ranks=2, timeout=900)
    lines = [f.read_text() for f in sorted(tmp_path.glob("result*.txt"))]
    assert len(lines) == 2, out.stdout[-3000:] + out.stderr[-3000:]
    for line in lines:
        rank, local, full, losses = _parse(line)
        assert all(2 * l >= f and l < f for l, f in zip(local, full))
        assert losses[-1] < losses[0]


def _parse(line: str):
    rank, rest = line.split(" ", 1)
    local, full, losses = (eval(p) for p in rest.replace("] [", "]\n[").split("\n"))
    return int(rank), local, full, losses


@pytest.mark.parametrize("path", all_configs("trd*.json"),
                         ids=lambda p: p.name)
def test_shipped_trd_configs_train_the_gpt(path):
    """Each shipped TRD config, as launch/train.py uses it: GPT, an AdamW *instance* with decay groups (remapped
    onto the cores), two steps through titan_ds.initialize; every block linear replaced."""
    import json
    import titan_ds
    from titan_ds.models import GPT, GPTConfig
    cfg = json.loads(path.read_text())
    cfg["train_micro_batch_size_per_gpu"] = 2
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=16, vocab_size=256))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}], lr=1e-3)
    engine, *_ = titan_ds.initialize(model=model, optimizer=opt, config=cfg)
    assert engine.titan.reports["trd"].names == [f"blocks.{i}.{n}" for i in range(2)
                                                 for n in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.out")]
    x = torch.randint(0, 256, (2, 16))
    losses = []
    for _ in range(3):
        loss = engine(x, x.roll(-1, 1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
