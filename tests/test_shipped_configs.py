"""Every config (ds_configs/, tests/configs/, launch/experiments/configs/: tests/helpers/configs.py) trains a tiny GPT for three steps through titan_ds.initialize (1 rank); the
ones with gradient compression refuse one rank with a clear error (they run on 2 ranks in test_compose.py and
the benchmarks)."""
import json
import math
from pathlib import Path

import pytest
import torch

import titan_ds
from launch.bench.harness import localise_paths
from tests.helpers.configs import all_configs
from titan_ds.config import TitanConfig, TitanConfigError
from titan_ds.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = all_configs()  # the user profiles, the test configs and the experiments' configs
TINY = GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32)


# what HF's Trainer puts in place of each "auto" of the shipped ds_configs/hf_*.json (from TrainingArguments:
# micro-batch x accumulation x world, accumulation 1, max_grad_norm 1.0); any other "auto" fails the test
HF_AUTO = {"train_batch_size": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}


def _fill_auto(cfg: dict) -> dict:
    out = {k: HF_AUTO[k] if v == "auto" and k in HF_AUTO else v for k, v in cfg.items()}
    assert '"auto"' not in json.dumps(out), f'an "auto" this test does not fill: {out}'
    return out


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_trains_three_steps(dist_env, tmp_path, path):
    cfg = localise_paths(json.loads(path.read_text()), tmp_path)
    cfg["train_micro_batch_size_per_gpu"] = 2
    cfg = _fill_auto(cfg)
    cfg.pop("csv_monitor", None)
    titan = TitanConfig.from_ds_config(cfg)
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = None if titan is not None and titan.optimizer is not None else torch.optim.AdamW(model.parameters(), 1e-3)
    if cfg.get("zero_optimization", {}).get("stage", 0) > 0:
        cfg.setdefault("zero_allow_untested_optimizer", True)
    if titan is not None and titan.compression is not None:
        with pytest.raises(TitanConfigError, match="rank"):
            titan_ds.initialize(model=model, optimizer=opt, config=cfg)
        return
    engine, *_ = titan_ds.initialize(model=model, optimizer=opt, config=cfg)
    x = torch.randint(0, 256, (2, TINY.block_size))
    losses = []
    for _ in range(3):  # three optimizer steps (titan_memory.json accumulates 4 micro-batches a step)
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
        losses.append(float(loss))
    assert all(math.isfinite(v) for v in losses), losses
    # the same batch after two steps: the optimizer moved the model (with titan.plasticity, step 1 is BSPS's
    # probe step and updates nothing: measured losses[1] == losses[0] for those configs)
    assert losses[2] < losses[0], losses
