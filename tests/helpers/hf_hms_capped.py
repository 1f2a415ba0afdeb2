"""One HF ``Trainer`` run of a saved Llama under ZeRO-3, for the capped comparison of tests/test_hf_hms.py:
``--mode hms`` (ds_configs/hf_hms.json: parameters and optimizer state in HMS's store, the model built under
``titan_ds.zero_init`` through ``titan_ds.install()``), ``--mode cpu`` (the same config without ``titan``,
parameters and optimizer state offloaded to CPU memory: DeepSpeed's own way to fit a model in RAM) or ``--mode
zinf`` (ZeRO-Infinity as ``titan-ds plan`` and launch/bench/hms_scale.py configure it: optimizer state on NVMe
through DeepSpeed's async_io op, parameters in CPU memory, DeepSpeedCPUAdam; needs libaio). Prints the training
losses as the last line (JSON).

    python tests/helpers/hf_hms_capped.py --model-dir DIR --work DIR --mode hms|cpu|zinf --steps 3 [--load-only]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def ds_config(mode: str, work: Path) -> dict:
    cfg = json.loads((ROOT / "ds_configs" / "hf_hms.json").read_text())
    if mode == "hms":
        cfg["titan"]["hms"]["nvme_path"] = str(work / "store")
        return cfg
    del cfg["titan"]
    if mode == "cpu":
        cfg["zero_optimization"].update(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
        return cfg
    from titan_ds.plan import candidate_config
    zinf = candidate_config("zero_inf", nvme_path=str(work / "zinf"))  # its offload, buffer and aio settings
    cfg["zero_optimization"].update({k: v for k, v in zinf["zero_optimization"].items() if k != "stage"})
    cfg["aio"] = zinf["aio"]
    cfg["zero_force_ds_cpu_optimizer"] = True  # accelerate turns the Trainer's AdamW into DeepSpeedCPUAdam
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--mode", choices=("hms", "cpu", "zinf"), required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--load-only", action="store_true", help="stop after from_pretrained (its memory alone)")
    a = ap.parse_args()
    import torch
    import transformers

    import titan_ds
    from titan_ds.utils import ensure_dist_env
    ensure_dist_env()
    titan_ds.install()
    work = Path(a.work)
    targs = transformers.TrainingArguments(
        output_dir=str(work / "out"), deepspeed=ds_config(a.mode, work), per_device_train_batch_size=1,
        max_steps=a.steps, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True)
    model = transformers.LlamaForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    if a.load_only:
        print(json.dumps({"parameters": sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())}))
        return
    ids = torch.randint(0, model.config.vocab_size, (a.seq,), generator=torch.Generator().manual_seed(0))
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=[{"input_ids": ids, "labels": ids}] * 8)
    trainer.train()
    print(json.dumps([h["loss"] for h in trainer.state.log_history if "loss" in h]))


if __name__ == "__main__":
    main()
