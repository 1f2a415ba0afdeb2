"""Run by ``deepspeed --num_gpus 2`` from test_diloco.py (not collected by pytest itself).

Local updates (``titan.compression.sync_every``) on DeepSpeed's path at ZeRO-0, for each outer method (``none``,
``topk``, ``qtopk`` at ``--bits``/``--chunk``): the final parameters against the plain-PyTorch oracle
(:func:`titan_ds.comm.diloco.reference_round`, both ranks' inner loops run in this process) and against the
simulator (:class:`titan_ds.comm.wire.SimCollective`), bit for bit;
bytes counted on ``torch.distributed`` (:func:`titan_ds.comm.wire.count_collectives`) against the simulator's;
a checkpoint saved mid-round resumes bit for bit. Rank 0 writes a JSON summary.
"""
from __future__ import annotations

import argparse
import copy
import json
import tempfile

import torch

import deepspeed
from deepspeed import comm as dist

import titan_ds.engine as titan_engine
from titan_ds.comm import GradientReducer
from titan_ds.comm.diloco import OuterStep, reference_round
from titan_ds.comm.wire import SimCollective, WireCount, count_collectives
from titan_ds.utils import after_init_distributed

p = argparse.ArgumentParser()
p.add_argument("--methods", default="none,topk,qtopk")
p.add_argument("--bits", type=int, default=4)     # qtopk: not the defaults (2, 256), so that the config's reach
p.add_argument("--chunk", type=int, default=100)  # the reducer is tested; 731 parameters: 7 chunks + a partial one
p.add_argument("--ratio", type=float, default=4.0)
p.add_argument("--sync-every", type=int, default=4)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--out", required=True)
p.add_argument("--local_rank", type=int, default=0)
args = p.parse_args()
LR, OUTER_LR, MU = 3e-3, 0.7, 0.9


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # same init on all ranks
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))


def data(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    xs = torch.randn(args.steps, 8, 16, generator=g)
    return xs, torch.sin(xs[..., :5]) + 0.01 * torch.randn(args.steps, 8, 5, generator=g)


def comp(method: str) -> dict:
    out = {"method": method, "sync_every": args.sync_every, "outer_lr": OUTER_LR, "outer_momentum": MU}
    if method != "none":
        out["ratio"] = args.ratio
    if method == "qtopk":
        out.update(bits=args.bits, chunk=args.chunk)
    return out


def qtopk_options(method: str) -> dict:
    return {"bits": args.bits, "chunk": args.chunk} if method == "qtopk" else {}


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([q.detach().reshape(-1) for q in model.parameters()])


def step(module, opt_step, backward, xs, ys, s: int) -> None:
    loss = torch.nn.functional.mse_loss(module(xs[s]), ys[s])
    backward(loss)
    opt_step()


def deepspeed_run(method: str, rank: int, ckdir: str) -> dict:
    model = make_model()
    engine, _, _, _ = titan_engine.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=LR),
        config={"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                "zero_optimization": {"stage": 0}, "titan": {"compression": comp(method)}})
    xs, ys = data(rank)
    count = WireCount()
    half = args.steps // 2 + 1  # mid-round: local parameters and Adam states differ between the ranks
    with count_collectives(count):
        for s in range(half):
            step(engine, engine.step, engine.backward, xs, ys, s)
    engine.save_checkpoint(ckdir, tag=method)
    with count_collectives(count):
        for s in range(half, args.steps):
            step(engine, engine.step, engine.backward, xs, ys, s)
    final = flat(engine.module).clone()
    engine.load_checkpoint(ckdir, tag=method)
    for s in range(half, args.steps):
        step(engine, engine.step, engine.backward, xs, ys, s)
    resumed = flat(engine.module).clone()
    patched = engine.enable_backward_allreduce
    engine.titan.reports["compression"].uninstall()
    return {"final": final, "resumed": resumed, "sent": count.sent, "received": count.received,
            "calls": dict(count.calls), "allreduce_off_while_installed": patched is False,
            "allreduce_back_after_uninstall": engine.enable_backward_allreduce is True}


def inner_models(world: int):
    models = [make_model() for _ in range(world)]
    opts = [torch.optim.Adam(m.parameters(), lr=LR) for m in models]
    return models, opts, [data(r) for r in range(world)]


def reference_run(method: str, world: int) -> torch.Tensor:
    models, opts, datas = inner_models(world)
    anchor, m, res = flat(models[0]).clone(), None, [None] * world
    for s in range(args.steps):
        for model, opt, (xs, ys) in zip(models, opts, datas):
            opt.zero_grad()
            step(model, opt.step, lambda loss: loss.backward(), xs, ys, s)
        if (s + 1) % args.sync_every == 0:
            anchor, m, res = reference_round([flat(x) for x in models], anchor, m, res, method=method,
                                             ratio=args.ratio, outer_lr=OUTER_LR, outer_momentum=MU,
                                             **qtopk_options(method))
            with torch.no_grad():
                for model in models:
                    off = 0
                    for q in model.parameters():  # copies: the anchor must not alias a parameter Adam updates
                        q.copy_(anchor[off:off + q.numel()].view_as(q))
                        off += q.numel()
    return anchor


def simulator_run(method: str, world: int) -> tuple[torch.Tensor, SimCollective]:
    models, opts, datas = inner_models(world)
    kw = {} if method == "none" else {"error_feedback": True, **qtopk_options(method)}
    outers = [OuterStep(list(x.named_parameters()), GradientReducer(method, args.ratio if method != "none" else 1.0,
                                                                    **kw), outer_lr=OUTER_LR, outer_momentum=MU)
              for x in models]
    sim = SimCollective(world)
    for s in range(args.steps):
        for model, opt, (xs, ys) in zip(models, opts, datas):
            opt.zero_grad()
            step(model, opt.step, lambda loss: loss.backward(), xs, ys, s)
        if (s + 1) % args.sync_every == 0:
            sim.run(lambda w, comm: outers[w].sync(comm))
    return flat(models[0]), sim


def main() -> None:
    deepspeed.init_distributed()
    after_init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for method in args.methods.split(","):
        ckdir = tempfile.mkdtemp() if rank == 0 else None
        box = [ckdir]
        dist.broadcast_object_list(box, src=0)
        r = deepspeed_run(method, rank, box[0])
        finals: list = [None] * world
        dist.all_gather_object(finals, (r["final"], r["resumed"], r["received"]))
        ref = reference_run(method, world)
        sim_final, sim = simulator_run(method, world)
        results[method] = {
            "ranks_equal": all(torch.equal(f[0], finals[0][0]) for f in finals),
            "equals_reference": all(torch.equal(f[0], ref) for f in finals),
            "equals_simulator": torch.equal(sim_final, ref) and torch.equal(sim_final, finals[0][0]),
            "resume_bit_exact": all(torch.equal(f[0], f[1]) for f in finals),
            "moved": not torch.equal(ref, flat(make_model())),
            "received_real": [f[2] for f in finals], "received_sim": sim.received, "sent_real": r["sent"],
            "params": flat(make_model()).numel(),
            "calls_real": r["calls"], "allreduce_off": r["allreduce_off_while_installed"],
            "allreduce_restored": r["allreduce_back_after_uninstall"]}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
