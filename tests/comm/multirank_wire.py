"""Run by ``deepspeed --num_gpus 2`` from test_wire_count.py (not collected by pytest itself).

For each ZeRO stage given, a tiny GPT with AdamW is initialized and trained a few steps inside titan's wire counter
(:func:`titan_ds.comm.wire.count_collectives`, entered before ``deepspeed.initialize``, before DeepSpeed's backend
binds its collectives). An independent counter sits one layer lower: it wraps the methods of torch's C++
``ProcessGroup`` class, which every collective of every path reaches whatever Python name it was called by, and
prices each call with the same ring costs. Rank 0 writes both counts per stage to a JSON file.
"""
from __future__ import annotations

import argparse
import json

import torch

p = argparse.ArgumentParser()
p.add_argument("--stages", default="0,1,2,3")
p.add_argument("--steps", type=int, default=3)
p.add_argument("--out", required=True)
p.add_argument("--local_rank", type=int, default=0)
args = p.parse_args()

# ProcessGroup method -> (the collective's name in titan_ds.comm.wire.ring_bytes, which argument's bytes price it)
PG_METHODS = {
    "allreduce": ("all_reduce", "tensors"),
    "allreduce_coalesced": ("all_reduce", "tensors"),
    "broadcast": ("broadcast", "tensors"),
    "allgather": ("all_gather", "input"),
    "_allgather_base": ("all_gather_into_tensor", "input"),
    "all_gather_single": ("all_gather_into_tensor", "input"),
    "allgather_into_tensor_coalesced": ("all_gather_into_tensor", "input"),
    "_reduce_scatter_base": ("reduce_scatter_tensor", "input"),
    "reduce_scatter_single": ("reduce_scatter_tensor", "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor", "input"),
    "alltoall_base": ("all_to_all_single", "input"),
}


class ProcessGroupCount:
    """Received bytes and calls by op, counted at ``torch._C._distributed_c10d.ProcessGroup``'s methods."""

    def __init__(self) -> None:
        self.received, self.calls, self._saved = 0.0, {}, {}

    def _tensors(self, x):
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, (list, tuple)):
            return [t for item in x for t in self._tensors(item)]
        return []

    def __enter__(self):
        import torch.distributed as dist
        from titan_ds.comm.wire import ring_bytes
        cls = torch._C._distributed_c10d.ProcessGroup
        for method, (op, which) in PG_METHODS.items():
            if not hasattr(cls, method):
                continue
            original = self._saved[method] = getattr(cls, method)

            def counted(pg, *a, __op=op, __which=which, __method=method, __orig=original, **kw):
                world = pg.size()
                # (output, input, ...) for the base/single forms and alltoall_base; (tensors, opts) for allreduce
                # and broadcast; (output_lists, input_list, opts) for allgather and its coalesced form
                if __which == "tensors":
                    tensors = self._tensors(a[0])
                else:
                    tensors = self._tensors(a[1])
                    if __method in ("allgather", "allgather_into_tensor_coalesced",
                                    "reduce_scatter_tensor_coalesced"):
                        tensors = self._tensors(a[1])
                for t in tensors:
                    is_root = __op == "broadcast" and dist.get_rank() == _root(a)
                    self.received += ring_bytes(__op, t.numel() * t.element_size(), world, is_root=is_root)[1]
                self.calls[__op] = self.calls.get(__op, 0) + 1
                return __orig(pg, *a, **kw)

            setattr(cls, method, counted)
        return self

    def __exit__(self, *exc):
        cls = torch._C._distributed_c10d.ProcessGroup
        for method, fn in self._saved.items():
            setattr(cls, method, fn)


def _root(a) -> int:
    opts = a[1] if len(a) > 1 else None
    return int(getattr(opts, "rootRank", 0))


def main() -> None:
    import deepspeed
    import torch.distributed as dist

    from tests.helpers.equal_run import TINY, ds_config
    from titan_ds.comm.wire import WireCount, count_collectives
    from titan_ds.data import Batcher, load_corpus
    from titan_ds.models import GPT
    from titan_ds.utils import guard_interpreter_exit

    # plain deepspeed.initialize (titan's initialize would do this): without it a gloo worker can abort the
    # finished process at interpreter exit (see guard_interpreter_exit; CI saw exit -6 here once)
    guard_interpreter_exit()
    results = {}
    for stage in [int(s) for s in args.stages.split(",")]:
        count, independent = WireCount(), ProcessGroupCount()
        with independent, count_collectives(count):
            torch.manual_seed(0)
            model = GPT(TINY)
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                              config=ds_config(stage))
            rank = dist.get_rank()
            batches = Batcher(load_corpus().train, 4, TINY.block_size, seed=0, rank=rank)
            for step in range(args.steps):
                x, y = batches.get(step)
                engine.backward(engine(x, y))
                engine.step()
        params = sum(p.numel() for p in model.parameters())
        results[stage] = {"titan": count.received, "titan_calls": dict(count.calls),
                          "independent": independent.received, "independent_calls": independent.calls,
                          "params": params}
        engine.destroy()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()  # join gloo's workers while the interpreter is whole


if __name__ == "__main__":
    main()
