"""Train a tiny model with ASDT through deepspeed.initialize at a given ZeRO stage; return per-step weights.

Used in-process by test_zero_parity.py (1 rank) and as a script under ``deepspeed --num_gpus 2`` (slow test):
``deepspeed --num_gpus 2 tests/optim/zero_harness.py --out DIR`` writes DIR/rank{r}_stage{s}_{case}.pt and, for
stage 0 with ASDT's step in backward, DIR/rank{r}_backward_{case}.pt.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Optional

import torch
import torch.nn as nn

STEPS = 5
CASES = {
    "dense": dict(density=1.0),
    "sparse": dict(density=0.25, weight_decay=0.1),
    "block_bf16": dict(density=0.1, granularity="block", block_size=50, state_dtype="bf16"),
    "grad_weight": dict(density=0.3, importance="grad_weight"),
    "bsps": dict(density=0.5),
    "adaptive": dict(density=0.5, update="adaptive", granularity="row", state_dtype="bf16", weight_decay=0.1),
    # 8-bit momentum, 4-bit per-coordinate second moment (qstate.py): blocks restart at each unit, so one rank's
    # flat partitions hold stage 0's codes (not with 2 ranks: a split unit's blocks restart at the split)
    "quant": dict(density=1.0, update="adaptive", granularity="tensor", state_dtype="8bit",
                  second_moment="coordinate", second_dtype="4bit", weight_decay=0.1),
}


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(23, 12)
        self.fc1 = nn.Linear(12, 37)
        self.ln = nn.LayerNorm(37)
        self.fc2 = nn.Linear(37, 11)

    def forward(self, x, y):
        h = self.fc2(torch.relu(self.ln(self.fc1(self.emb(x)))))
        return nn.functional.cross_entropy(h.reshape(-1, 11), y.reshape(-1))


def ds_config(stage: int, world: int, extra: Optional[dict] = None, offload: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "train_batch_size": 4 * world, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
           "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    if stage == 3:
        cfg["zero_optimization"].update(sub_group_size=300, stage3_param_persistence_threshold=0)
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
    cfg.update(extra or {})
    return cfg


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 23, (4, 6), generator=g), torch.randint(0, 11, (4, 6), generator=g)


def full_weights(engine, stage: int) -> dict[str, torch.Tensor]:
    import deepspeed
    params = list(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().clone() for n, p in params}
    return {n: p.detach().clone() for n, p in params}


def run(stage: int, case: str, world: int = 1, rank: int = 0, plasticity: Any = None,
        offload: bool = False, step_in_backward: bool = False) -> list[dict[str, torch.Tensor]]:
    """Per-step full weights after each of STEPS steps (``step_in_backward``: stage 0, ASDT updating in the
    gradient hooks, gradients averaged across ranks there)."""
    import deepspeed

    from titan_ds.config import OptimizerConfig
    from titan_ds.optim.install import attach_zero_layout, build_optimizer, build_plasticity

    torch.manual_seed(0)
    model = Tiny()
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2, **CASES[case]))  # two groups: decay / no decay
    if case == "bsps":
        build_plasticity(opt, model, plasticity or _bsps_cfg())
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, world, offload=offload))
    attach_zero_layout(engine, opt)
    if step_in_backward:
        from titan_ds.optim.install import attach_backward_steps
        attach_backward_steps(engine, opt)
    out = []
    for t in range(STEPS):
        x, y = batch(t, rank)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        out.append(full_weights(engine, stage))
    return out


def _bsps_cfg():
    from titan_ds.config import PlasticityConfig
    return PlasticityConfig(max_active_fraction=0.6, block="parameter", warmup_steps=1, sleep_after=1,
                            wake_every=2, plateau_ratio=0.99)


def init_single_process() -> None:
    import deepspeed
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend="gloo")
    from titan_ds.utils import after_init_distributed
    after_init_distributed()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--cases", default="sparse,block_bf16,bsps,adaptive")
    a = ap.parse_args()
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    from titan_ds.utils import after_init_distributed
    after_init_distributed()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    for case in a.cases.split(","):
        for stage in (0, 1, 2, 3):
            torch.save(run(stage, case, world, rank), os.path.join(a.out, f"rank{rank}_stage{stage}_{case}.pt"))
        if case != "bsps":  # BSPS needs the whole step's gradients: refused with step in backward
            torch.save(run(0, case, world, rank, step_in_backward=True),
                       os.path.join(a.out, f"rank{rank}_backward_{case}.pt"))
