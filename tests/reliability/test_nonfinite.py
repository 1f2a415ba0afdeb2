"""NaN/Inf gradients on one step: skipped on every rank, parameters and optimizer state unchanged, reported in
StepMetrics, training continues."""

import pytest
import torch

from titan_ds import TitanConfig, build_titan_trainer
from titan_ds.models import GPT
from tests.helpers.equal_run import TINY


def _opt_state(trainer):
    opt = trainer.engine.basic_optimizer
    return [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for s in opt.state.values()]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nan_step_is_skipped_and_training_continues(dist_env, stage):
    torch.manual_seed(0)
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
          "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    trainer = build_titan_trainer(GPT(TINY), TitanConfig(), ds_config=ds, lr=1e-2)
    x = torch.randint(0, 256, (4, TINY.block_size))
    batch = {"input_ids": x, "labels": x}
    trainer.step(batch, lambda m, b: m(b))
    params = [p.detach().clone() for p in trainer.engine.module.parameters()] if stage < 3 else None
    state = _opt_state(trainer)
    poison = next(trainer.engine.module.parameters())
    handle = poison.register_hook(lambda g: g * float("nan"))  # injected fault: one step's gradient is NaN
    loss, m = trainer.step(batch, lambda m, b: m(b))
    handle.remove()
    assert m.skipped_step
    if params is not None:
        assert all(torch.equal(a, b) for a, b in zip(params, trainer.engine.module.parameters()))
    after = _opt_state(trainer)
    assert len(after) == len(state)
    for s0, s1 in zip(state, after):
        for k in s0:
            assert torch.equal(torch.as_tensor(s0[k]), torch.as_tensor(s1[k])), k
    loss, m = trainer.step(batch, lambda m, b: m(b))
    assert not m.skipped_step and torch.isfinite(loss)
    assert all(torch.isfinite(p).all() for p in trainer.engine.module.parameters())
