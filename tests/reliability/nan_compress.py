"""2 ranks (run under the deepspeed launcher): rank 0 alone gets a NaN gradient at step 3, with gradient
compression on. Writes, per rank and case, whether each step was skipped and whether the compressor's residuals,
the optimizer state and the parameters came through the skipped step unchanged."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.equal_run import TINY  # noqa: E402
from titan_ds import build_titan_trainer  # noqa: E402
from titan_ds.models import GPT  # noqa: E402

CASES = [(0, "topk"), (2, "hge"), (3, "tgss")]
POISON_STEP = 3


def snapshot(trainer, hooks):
    eng = trainer.engine
    opt = eng.basic_optimizer
    state = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for s in opt.state.values()]
    res = {k: v.clone() for k, v in hooks.reducer.residuals.residuals.items()}
    params = [p.detach().clone() for p in eng.module.parameters()]
    return state, res, params


def same(a, b):
    sa, ra, pa = a
    sb, rb, pb = b
    state_same = len(sa) == len(sb) and all(
        s0.keys() == s1.keys() and all(torch.equal(torch.as_tensor(s0[k]), torch.as_tensor(s1[k])) for k in s0)
        for s0, s1 in zip(sa, sb))
    res_same = ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)
    params_same = len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb))
    return {"optimizer_state": state_same, "residuals": res_same, "parameters": params_same}


def run(stage, method, rank):
    torch.manual_seed(0)
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
          "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
          "titan": {"compression": {"method": method, "ratio": 8.0, "allow_dense_parameter_gather": stage > 0}}}
    trainer = build_titan_trainer(GPT(TINY), ds, lr=1e-2)
    hooks = trainer.engine.titan.reports["compression"]
    g = torch.Generator().manual_seed(100 + rank)
    out = {"skipped": [], "losses": [], "nonfinite_metric": [], "residual_norm_finite": []}
    for step in range(7):
        x = torch.randint(0, 256, (4, TINY.block_size), generator=g)
        before = snapshot(trainer, hooks)
        handle = None
        if step == POISON_STEP and rank == 0:  # the fault: one rank's gradient turns NaN on one step
            handle = next(trainer.engine.module.parameters()).register_hook(lambda grad: grad * float("nan"))
        loss, m = trainer.step({"input_ids": x, "labels": x}, lambda eng, b: eng(b["input_ids"], b["labels"]))
        if handle is not None:
            handle.remove()
        if step == POISON_STEP:
            out["unchanged"] = same(before, snapshot(trainer, hooks))
        out["skipped"].append(m.skipped_step)
        out["losses"].append(float(loss))
        out["nonfinite_metric"].append(m.extra.get("compression_nonfinite_steps"))
        out["residual_norm_finite"].append(bool(torch.isfinite(torch.tensor(hooks.reducer.residuals.norm()))))
    out["compression_state"] = m.memory.compression_state  # measured after backward: residuals + their journal
    out["residual_bytes"] = sum(t.numel() * t.element_size() for t in hooks.reducer.residuals.residuals.values())
    out["final_params_finite"] = all(bool(torch.isfinite(p).all()) for p in trainer.engine.module.parameters())
    return out


if __name__ == "__main__":
    import deepspeed
    deepspeed.init_distributed()
    rank = int(os.environ["RANK"])
    result = {f"zero{stage}_{method}": run(stage, method, rank) for stage, method in CASES}
    out_dir = [a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
