"""Train a tiny GPT for a few steps through ``deepspeed.initialize`` or ``titan_ds.initialize`` and return the
losses and final parameters; also runnable under the deepspeed launcher for the 2-rank comparison."""
from __future__ import annotations

import sys

import torch

import titan_ds
from titan_ds.data import Batcher, load_corpus
from titan_ds.models import GPT, GPTConfig

TINY = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=256)


def ds_config(stage: int, titan: dict | None = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    if titan is not None:
        cfg["titan"] = titan
    return cfg


def train(init, stage: int, titan: dict | None = None, steps: int = 5):
    import torch.distributed as dist
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = init(model=model, optimizer=opt, config=ds_config(stage, titan))
    rank = dist.get_rank() if dist.is_initialized() else 0
    batches = Batcher(load_corpus().train, 4, TINY.block_size, seed=0, rank=rank)
    losses = []
    for step in range(steps):
        x, y = batches.get(step)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    params = [p.detach().clone() for p in engine.module.parameters()]
    return torch.stack(losses), params


def compare(stage: int) -> None:
    import deepspeed
    a_loss, a_par = train(deepspeed.initialize, stage)
    b_loss, b_par = train(titan_ds.initialize, stage)
    c_loss, c_par = train(titan_ds.initialize, stage, titan={})
    assert torch.equal(a_loss, b_loss), (a_loss, b_loss)
    assert torch.equal(a_loss, c_loss), (a_loss, c_loss)
    assert len(a_par) == len(b_par) == len(c_par)  # zip would skip a parameter one of them lacks
    assert all(torch.equal(x, y) for x, y in zip(a_par, b_par))
    assert all(torch.equal(x, y) for x, y in zip(a_par, c_par))


if __name__ == "__main__":
    stages = [int(a) for a in sys.argv[1:] if a.isdigit()]  # the launcher appends --local_rank=N
    for s in stages:
        compare(s)
    print("EQUAL", stages)
