import math

import pytest
import torch

from titan_ds import StepMetrics, TITANConfig, TitanConfig, build_titan_trainer
from titan_ds.data import Batcher, load_corpus
from titan_ds.models import GPT, GPTConfig

TINY = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=32, vocab_size=256)


def _batches(n, mb=8):
    b = Batcher(load_corpus().train, mb, TINY.block_size, seed=0)
    for i in range(n):
        x, y = b.get(i)
        yield {"input_ids": x, "labels": y}


def loss_fn(model, b):
    logits = model(b["input_ids"])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten())


def test_quickstart_steps_and_metrics(dist_env):
    trainer = build_titan_trainer(GPT(TINY), TitanConfig(), lr=3e-3)
    losses = []
    for batch in _batches(12):
        loss, m = trainer.step(batch, loss_fn)
        assert isinstance(loss, float) and isinstance(m, StepMetrics)
        losses.append(loss)
    assert m.step == 12 and m.tokens_per_s > 0
    n_params = sum(p.numel() for p in trainer.model.parameters())
    assert m.memory.parameters == 4 * n_params          # fp32 parameters, exactly
    assert m.memory.gradients == 4 * n_params           # every parameter has a gradient before step()
    # AdamW: fp32 exp_avg + exp_avg_sq per element, and one 0-dim fp32 `step` tensor per parameter; exactly
    assert m.memory.optimizer_state == 2 * 4 * n_params + 4 * len(list(trainer.model.parameters()))
    assert m.memory.activations > 0 and m.memory.peak_rss > 0
    # pillars off: neutral figures, marked off
    assert m.trd_compression_ratio == 1.0 and not m.trd_on and m.hge_compression_ratio == 1.0 and not m.compression_on
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3  # it learns


def test_quickstart_with_model_batch_dict(dist_env):
    trainer = build_titan_trainer(GPT(TINY), TITANConfig(device="cpu"))
    loss, m = trainer.step(next(_batches(1)), lambda model, b: model(b))  # GPT takes the dict and returns the loss
    assert math.isfinite(loss) and m.step == 1


def test_loss_fn_must_return_scalar(dist_env):
    trainer = build_titan_trainer(GPT(TINY), TitanConfig())
    with pytest.raises(TypeError, match="scalar tensor"):
        trainer.step(next(_batches(1)), lambda model, b: model(b["input_ids"]))


def test_unbuilt_pillar_is_a_clear_error_not_a_noop(dist_env, monkeypatch):
    import titan_ds.engine as eng
    monkeypatch.setattr(eng, "PILLARS", tuple(eng.Pillar(p.key, p.module + "_missing_for_test", p.issue)
                                             for p in eng.PILLARS))
    with pytest.raises(NotImplementedError, match="titan.trd .*issue #3"):
        build_titan_trainer(GPT(TINY), TITANConfig(use_trd=True, trd_rank=4))
