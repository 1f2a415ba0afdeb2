"""Run by ``deepspeed --num_gpus 2`` from test_hooks.py (not collected by pytest itself).

For one ZeRO stage, trains a small MLP regression with titan compression for each method, counting the
bytes that reach DeepSpeed's communication backend (``deepspeed.comm.comm.cdb``) per collective, and
writes a JSON summary (rank 0) that the test checks: losses, seam calls, the reducer's own byte counts,
backend bytes, and a save/load round trip of the residuals.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

import deepspeed
from deepspeed import comm as dist

import titan_ds.engine as titan_engine
from titan_ds.utils import after_init_distributed

p = argparse.ArgumentParser()
p.add_argument("--stage", type=int, required=True)
p.add_argument("--methods", default="topk,tgss,hge")
p.add_argument("--ratio", type=float, default=20.0)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--reduce-scatter", type=int, default=1)
p.add_argument("--out", required=True)
p.add_argument("--local_rank", type=int, default=0)
args = p.parse_args()

RESUMED = 3  # steps run after the checkpoint, then again after loading it: the two must agree bit for bit
COUNTED = ("all_reduce", "reduce", "all_gather", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast",
           "all_to_all_single")


def count_backend() -> dict[str, int]:
    """Wrap the backend instance's collectives (instance attributes) to count input bytes per op."""
    counts = {op: 0 for op in COUNTED}
    cdb = deepspeed.comm.comm.cdb

    def wrap(op):
        orig = getattr(cdb, op)

        def f(*a, **kw):
            if op in ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
                t = a[1] if len(a) > 1 else kw.get("input_tensor", kw.get("input", kw.get("tensor")))
            else:
                t = a[0] if a else kw["tensor"]
            counts[op] += t.numel() * t.element_size()
            return orig(*a, **kw)

        setattr(cdb, op, f)

    for op in COUNTED:
        wrap(op)
    return counts


def model_and_data(seed: int):
    torch.manual_seed(0)  # same init on all ranks
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128),
                                torch.nn.Tanh(), torch.nn.Linear(128, 8))
    teacher = torch.nn.Linear(32, 8)
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(args.steps + RESUMED, 32, 32, generator=g)
    with torch.no_grad():
        ys = teacher(xs) + 0.01 * torch.randn(args.steps + RESUMED, 32, 8, generator=g)
    return model, xs, ys


def config(method: str) -> dict:
    zero = {"stage": args.stage}
    if args.stage in (1, 2):
        zero["reduce_scatter"] = bool(args.reduce_scatter)
    if args.stage == 3:
        zero.update({"reduce_bucket_size": 5000, "stage3_param_persistence_threshold": 0})
    elif args.stage in (1, 2):
        zero.update({"reduce_bucket_size": 5000, "allgather_bucket_size": 50000})  # several buckets
    if method == "none":
        comp = {"method": "none"}
    elif method == "powersgd":  # rank 1: the MLP's three matrices go as P and Q, its biases dense
        comp = {"method": "powersgd", "rank": 1, "warmup_steps": 2}
    elif method == "dgc":  # topk with DGC's momentum correction, masking and local clipping (ramp: unit tests)
        comp = {"method": "topk", "ratio": args.ratio, "warmup_steps": 2, "momentum": 0.9, "local_clip": 1.0}
    elif method == "qtopk_sharded":  # qtopk whose messages go to shard owners (all-to-all), summed, all-gathered
        comp = {"method": "qtopk", "ratio": args.ratio, "warmup_steps": 2, "exchange": "sharded"}
    elif method == "rms":  # topk of each rank's RMS-normalized gradient; titan turns the client Adam into SGD
        comp = {"method": "topk", "ratio": args.ratio, "precondition": "rms"}
    elif method == "rms_mean":  # qtopk of each rank's estimate of the mean gradient's RMS; SGD with momentum 0.9
        comp = {"method": "qtopk", "ratio": args.ratio, "precondition": "rms_mean"}
    elif method in ("rms_sketch", "rms_sketch_warmup"):  # sharded qtopk of rms at the mean gradient's level (one
        # all-reduced float a tensor), bf16 scales as ds_configs/compress_rms_sketch.json; _warmup: under a linear
        # lr warm-up, its residuals following the lr
        comp = {"method": "qtopk", "ratio": args.ratio, "precondition": "rms_sketch", "exchange": "sharded",
                "scale_dtype": "bf16"}
    else:
        comp = {"method": method, "ratio": args.ratio, "warmup_steps": 2}
    if args.stage > 0 and method != "none":  # the seams under test; the ratio as shipped is tested at ZeRO-0
        comp["allow_dense_parameter_gather"] = True
    return {"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": zero, "zero_allow_untested_optimizer": True,
            "titan": {"compression": comp}}


def step(engine, xs, ys, s: int) -> float:
    loss = torch.nn.functional.mse_loss(engine(xs[s]), ys[s])
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def train(method: str, rank: int) -> dict:
    model, xs, ys = model_and_data(100 + rank)
    # torch's Adam as the client optimizer: after an in-process load_checkpoint, DeepSpeed's FusedAdam (CPU) gave
    # different updates from bit-identical params, grads, param_groups and state tensors (measured with topk at
    # ZeRO-0; torch Adam repeats bit for bit), which would hide what the resume check below is for
    warm = (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (args.steps + 10)))
            if method.endswith("_warmup") else None)  # still warming up through the resumed steps
    engine, _, _, _ = titan_engine.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=3e-3),
                                              config=config(method), lr_scheduler=warm)
    hooks = engine.titan.reports["compression"]
    counts = count_backend()
    losses, metrics, lr_trail = [], [], []
    dense_total = wire_total = 0
    for s in range(args.steps):
        before = dict(counts)
        lr_now = engine.get_lr()[0]
        loss = torch.nn.functional.mse_loss(engine(xs[s]), ys[s])
        engine.backward(loss)
        engine.step()
        lr_trail.append([lr_now, hooks.reducer._lr_prev])
        m = engine.titan.collect_metrics()
        step_bytes = {op: counts[op] - before[op] for op in COUNTED}
        metrics.append({"wire": m["wire_bytes"], "dense": m["dense_grad_bytes"], "backend": step_bytes})
        if s >= 2:
            dense_total += m["dense_grad_bytes"]
            wire_total += m["wire_bytes"]
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        losses.append(float(lt) / dist.get_world_size())
    out = {"losses": losses, "seam_calls": dict(hooks.seam_calls), "steps": metrics,
           "optimizer": type(getattr(engine, "basic_optimizer", None)).__name__,
           "momentum": getattr(engine, "basic_optimizer").param_groups[0].get("momentum"),
           "dense_total": dense_total, "wire_total": wire_total, "lr_trail": lr_trail}
    # checkpoint round trip: residuals and every other store (DGC's momentum, PowerSGD's Q) of every rank come back
    if method != "none":
        stores = hooks.reducer.stores
        before = {name: {k: v.clone() for k, v in st.residuals.items()} for name, st in stores.items()}
        ckdir = os.environ.get("TITAN_TEST_CKPT") or tempfile.mkdtemp()
        engine.save_checkpoint(ckdir, tag=f"{method}")
        for st in stores.values():
            for v in st.residuals.values():
                v.zero_()
        engine.load_checkpoint(ckdir, tag=f"{method}")
        after = {name: {k: v.clone() for k, v in st.residuals.items()} for name, st in stores.items()}
        out["stores"] = {name: len(v) for name, v in before.items()}
        out["residuals_restored"] = all(set(before[n]) == set(after[n])
                                        and all(torch.equal(before[n][k], after[n][k]) for k in before[n])
                                        for n in before)
        out["residual_norm"] = hooks.reducer.residuals.norm()
        # bit-exact resume: RESUMED more steps, then load the checkpoint and run them again
        first = [step(engine, xs, ys, s) for s in range(args.steps, args.steps + RESUMED)]
        engine.load_checkpoint(ckdir, tag=f"{method}")
        again = [step(engine, xs, ys, s) for s in range(args.steps, args.steps + RESUMED)]
        out["resume_bit_exact"] = first == again and len(set(first)) > 1
    hooks.uninstall()
    return out


def main():
    deepspeed.init_distributed()
    after_init_distributed()
    rank = dist.get_rank()
    results = {}
    for method in args.methods.split(","):
        results[method] = train(method, rank)
    # rank 1's restore check travels to rank 0 for the report
    flags = [None, None]
    dist.all_gather_object(flags, {m: (r.get("residuals_restored"), r.get("resume_bit_exact"))
                                   for m, r in results.items()})
    for m in results:
        results[m]["restored_by_rank"] = [f[m][0] for f in flags]
        results[m]["resumed_by_rank"] = [f[m][1] for f in flags]
    from deepspeed.runtime.zero import stage3
    results["stage3_global_restored"] = stage3.reduce_scatter_coalesced.__module__ != "titan_ds.comm.hooks"
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()  # titan_ds.utils.guard_interpreter_exit (via after_init_distributed) keeps the exit clean
