"""examples/hf_trainer.py: the HF Trainer + titan_ds.install() + ds_configs/hf_*.json trains a
tiny random HF model on its held-out-split corpus, in this process (the README shows the same script under the
``deepspeed`` launcher)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.helpers.configs import config_path
from tests.helpers.deps import require

require("transformers")
require("accelerate")

import titan_ds  # noqa: E402
from titan_ds.optim.asdt import ASDT  # noqa: E402
from tests.inject.test_chunked_loss_hf import ce_calls  # noqa: E402,F401  (fixture: calls of the chunked loss)

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12


def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example", ROOT / "examples" / "hf_trainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, config: str, model: str) -> dict:
    try:
        return _example().main(["--deepspeed", str(config_path(config)), "--model", model,
                                "--steps", str(STEPS), "--seq", "64", "--lr", "3e-3", "--eval-blocks", "8",
                                "--output-dir", str(tmp_path)])
    finally:
        titan_ds.uninstall()


def _assert_trained(res: dict) -> None:
    losses = res["train_losses"]
    assert len(losses) == STEPS
    # a real drop from the first steps (a byte-level random model starts at ln 256 = 5.55), on the training
    # batches and on the held-out modules
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    assert res["eval_after"] < res["eval_before"] - 0.3, res


@pytest.mark.parametrize("config, model, pillars, trd_layers", [
    ("hf_asdt.json", "tiny-llama", ["mlme", "optimizer"], 0),
    ("hf_trd.json", "tiny-gpt2", ["mlme", "optimizer", "trd"], 8),  # GPT-2 Conv1D c_attn, c_proj, c_fc, c_proj x 2
])
def test_example_trains_with_titan(dist_env, tmp_path, ce_calls, config, model, pillars, trd_layers):
    res = _run(tmp_path, config, model)
    engine = res["trainer"].model_wrapped
    assert res["titan"] == pillars and isinstance(engine.basic_optimizer, ASDT)
    assert [e.name for e in engine.titan.reports["mlme"].by_policy("mlme.chunked_loss").entries] == ["lm_head"]
    assert len(ce_calls) == STEPS  # every training step went through the chunked loss
    if trd_layers:
        assert len(engine.titan.reports["trd"].entries) == trd_layers
    _assert_trained(res)


@pytest.mark.parametrize("config", ["hf_asdt_backward.json", "hf_asdt_8bit.json"])
def test_example_steps_in_backward(dist_env, tmp_path, ce_calls, config):
    """hf_asdt_backward.json: titan's ASDT updates in the gradient hooks and clips there by the previous step's
    norm at the Trainer's max_grad_norm (1.0, filled into "gradient_clipping": "auto"); no gradient is left in
    .grad after a step. hf_asdt_8bit.json: the same with the momentum stored in 8-bit codes between steps."""
    res = _run(tmp_path, config, "tiny-llama")
    engine = res["trainer"].model_wrapped
    opt = engine.basic_optimizer
    assert isinstance(opt, ASDT) and opt.step_in_backward and not engine.enable_backward_allreduce
    assert res["trainer"].args.max_grad_norm == 1.0 == opt._clip_max and engine.gradient_clipping() == 0
    assert opt.last_grad_norm is not None
    assert all(p.grad is None for p in engine.module.parameters())
    assert 0 < opt.grad_bytes == max(p.numel() * p.element_size() for p in engine.module.parameters())
    momentum = {st["momentum"].dtype for st in opt.state.values()}
    assert momentum == ({torch.uint8} if "8bit" in config else {torch.bfloat16})
    assert len(ce_calls) == STEPS
    _assert_trained(res)


def test_example_plain_config_is_plain_deepspeed(dist_env, tmp_path, ce_calls):
    res = _run(tmp_path, "hf_plain.json", "tiny-llama")
    engine = res["trainer"].model_wrapped
    assert res["titan"] == [] and not hasattr(engine, "titan") and not ce_calls
    assert isinstance(engine.basic_optimizer, torch.optim.AdamW)
    assert res["eval_at_start"] == res["eval_before"]  # nothing replaced
    _assert_trained(res)


@pytest.mark.slow
@pytest.mark.heavy
def test_hf_finetune_bench_rows_are_resumable(tmp_path):
    """launch/bench/hf_finetune.py on the tiny model: two rows, each one `deepspeed` launch, saved as they finish;
    a rerun with the same settings launches nothing. ASDT's accounted optimizer state is below AdamW's."""
    import json
    import os
    import subprocess
    import sys
    out = tmp_path / "t.md"
    cmd = [sys.executable, str(ROOT / "launch" / "bench" / "hf_finetune.py"), "--model", "tiny-llama", "--steps", "3",
           "--seq", "64", "--eval-blocks", "4", "--rows", "plain,titan_asdt", "--out", str(out)]
    env = {**os.environ, "TITAN_CACHE": os.environ.get("TITAN_CACHE", str(ROOT / ".cache"))}
    subprocess.run(cmd, check=True, cwd=tmp_path, env=env, timeout=600)
    recs = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]  # the results store
    rows = [r["result"] for r in recs]
    assert [r["row"] for r in recs] == ["plain", "titan_asdt"] and rows[1]["titan"] == ["mlme", "optimizer"]
    plain, asdt = (r["memory"] for r in rows)
    assert plain["parameters"] == asdt["parameters"] > 0 and plain["gradients"] == plain["parameters"]
    # AdamW: two fp32 moments (+ a 4-byte step tensor per parameter tensor); ASDT: density 0.25, bf16 state
    assert plain["optimizer_state"] == pytest.approx(2 * plain["parameters"], rel=1e-3)
    assert 0 < asdt["optimizer_state"] < plain["optimizer_state"] / 2
    assert out.read_text().count("\n| ") == 3  # header + 2 rows
    again = subprocess.run(cmd, check=True, cwd=tmp_path, env=env, timeout=600, capture_output=True, text=True)
    assert again.stderr.count("already in") == 2 and "spawned" not in again.stdout + again.stderr
    assert len(out.with_suffix(".jsonl").read_text().splitlines()) == 2


def test_hf_finetune_trd_rank_rows(tmp_path):
    """``titan_trd_r<R>`` runs hf_trd.json with only trd.rank changed; a row that is neither shipped nor of that form
    stops before any launch, naming the choices."""
    import importlib.util
    import json
    spec = importlib.util.spec_from_file_location("hf_finetune", ROOT / "launch" / "bench" / "hf_finetune.py")
    hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf)
    shipped = json.loads((ROOT / "launch" / "experiments" / "configs" / "hf_trd.json").read_text())
    assert hf._row_config("titan_asdt", tmp_path) == ROOT / "launch" / "experiments" / "configs" / "hf_asdt.json"
    made = json.loads(hf._row_config("titan_trd_r48", tmp_path).read_text())
    assert made["titan"]["trd"]["rank"] == 48 and shipped["titan"]["trd"]["rank"] != 48
    made["titan"]["trd"]["rank"] = shipped["titan"]["trd"]["rank"]
    assert made == shipped
    with pytest.raises(SystemExit, match=r"unknown rows \['titan_trd_rx'\].*titan_trd_r<RANK>"):
        hf.main(["--rows", "plain,titan_trd_rx", "--model", str(tmp_path)])
