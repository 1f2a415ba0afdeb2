"""Train a small MLP under ZeRO-3 (no offload / titan HMS / DeepSpeed's own NVMe swappers) and dump results.

Run in a fresh process per configuration (1 rank: plain python with RANK/WORLD_SIZE set; 2 ranks:
``deepspeed --num_gpus 2``). Usage::

    python tests/hms/zero3_harness.py --mode {none,hms,ds_nvme} --steps N --out result.pt \
        [--save-dir D --save-at K] [--load-dir D] [--nvme PATH] [--prefetch trace] [--sync-prefetch]
        [--record-store]

The dump holds the per-step losses, the full parameters (gathered) and every sub-group's fp32 master and
optimizer state, so that tests compare runs with torch.equal.
"""
import argparse
import json
import os
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# Two sub-groups: the first 279,040 fp32 elements (1.1 MB, above DeepSpeed's 1 MiB swap threshold), the
# second 4,104 elements (16 kB, a "small" sub-group that DeepSpeed keeps in RAM and never restores).
SUB_GROUP = 270_000


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(),
                               torch.nn.Linear(512, 8))


def ds_config(mode, nvme, prefetch, micro, gas, clip, dram_mb=1):
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 3, "sub_group_size": SUB_GROUP, "stage3_param_persistence_threshold": 0}}
    if mode == "hms":
        cfg["titan"] = {"hms": {"nvme_path": nvme, "dram_cache_mb": dram_mb, "prefetch": prefetch, "io_threads": 2}}
    elif mode == "cpu":
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    elif mode == "ds_nvme":
        z = cfg["zero_optimization"]
        z["offload_param"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 8, "buffer_size": 300_000,
                             "max_in_cpu": 0}
        z["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 8}
        cfg["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                      "overlap_events": True}
    return cfg


def batch(step, rank, micro):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(micro, 32, generator=g), torch.randn(micro, 8, generator=g)


def dump_state(engine, mode):
    opt = engine.optimizer
    out = {}
    for i, p in enumerate(opt.fp32_partitioned_groups_flat):
        if mode == "hms":
            sw = opt.optimizer_swapper
            st = {"fp32": sw._read_master(p.ds_id).clone()}  # its file, the partitions it is kept as, or in DRAM
            for n in sw._state_names.get(p.ds_id, []):
                st[n] = sw._read_state(p.ds_id, n).clone()
            for k, v in opt.optimizer.state.get(p, {}).items():
                if k not in st:
                    st[k] = v.clone() if torch.is_tensor(v) else v
        elif mode == "ds_nvme" and opt._swappable_optimizer_subgroup(i):
            opt._optimizer_states_and_gradient_swap_in(i)
            st = {"fp32": p.data.clone(), **{k: (v.clone() if torch.is_tensor(v) else v)
                                             for k, v in opt.optimizer.state.get(p, {}).items()}}
            opt._release_swap_buffers(i)
        else:
            st = {"fp32": p.data.clone(), **{k: (v.clone() if torch.is_tensor(v) else v)
                                             for k, v in opt.optimizer.state.get(p, {}).items()}}
        out[i] = st
    return out


class _SyncPool:
    """Runs a submitted read at once in the caller's thread, so every prefetch completes before the next access
    (the hit rate is then a function of the access order alone, not of thread timing)."""

    def submit(self, fn):
        from concurrent.futures import Future
        f = Future()
        f.set_result(fn())
        return f

    def shutdown(self, wait=True):
        """Nothing runs in the background."""


def slow_writes(store, seconds):
    """Every write-behind write sleeps ``seconds`` on the writer thread before it writes."""
    import time
    put = store._put

    def slow(key, tensor, **kw):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(seconds)
        return put(key, tensor, **kw)

    store._put = slow


def record_store_ops(store):
    """Log every put/get/prefetch/stage on ``store`` from now on as (op, key, nbytes), in call order (nbytes 0
    for a prefetch or a stage), after the DRAM cache's budget, its contents now (LRU first) and the hit counts by kind so far.
    Pending prefetches are dropped first, so nothing that started before the log changes the cache behind it."""
    store.drop_staged()
    log = {"budget": store.cache_budget, "item_max": store.cache_item_max,
           "cache": [(k, t.numel() * t.element_size()) for k, t in store._cache.items()],
           "ops": [], "by_kind": {k: list(v) for k, v in store.stats.by_kind.items()},
           "reads": store.stats.reads}
    ops = log["ops"]
    file_reads = log["file_reads"] = []  # every file the store read, by key (prefetches and missed gets)
    read_file = store._read_file

    def rec_read_file(key, *args, **kw):
        file_reads.append(key)
        return read_file(key, *args, **kw)

    store._read_file = rec_read_file
    put, get, prefetch, stage, behind = store.put, store.get, store.prefetch, store.stage, store.put_behind

    def rec_put(key, tensor, **kw):
        ops.append(("put", key, tensor.numel() * tensor.element_size()))
        return put(key, tensor, **kw)

    def rec_behind(key, tensor, **kw):  # a write-behind put (deterministic under --sync-prefetch: done at once)
        ops.append(("put", key, tensor.numel() * tensor.element_size()))
        f = behind(key, tensor, **kw)
        if kw.get("stage"):  # put_behind(stage=True) holds the value as stage() would after the put
            ops.append(("stage", key, 0))
        return f

    def rec_get(key, out=None):
        t = get(key, out)
        ops.append(("get", key, t.numel() * t.element_size()))
        return t

    def rec_prefetch(key, speculative=False, out=None):
        ops.append(("prefetch", key, 0))
        return prefetch(key, speculative=speculative, out=out)

    def rec_stage(key, tensor):
        ops.append(("stage", key, 0))
        return stage(key, tensor)

    store.put, store.get, store.prefetch, store.stage, store.put_behind = (rec_put, rec_get, rec_prefetch, rec_stage,
                                                                          rec_behind)
    return log


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["none", "cpu", "hms", "ds_nvme"], required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    ap.add_argument("--nvme", default="/tmp/titan_hms_test")
    ap.add_argument("--prefetch", default="trace")
    ap.add_argument("--save-dir")
    ap.add_argument("--save-at", type=int, default=-1)
    ap.add_argument("--load-dir")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--gas", type=int, default=1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--dram-mb", type=int, default=1)
    ap.add_argument("--record-trace", help="write the ZeRO-3 parameter access trace (per step) to this json")
    ap.add_argument("--record-store", action="store_true", help="dump the HMS store's put/get/prefetch calls")
    ap.add_argument("--sync-prefetch", action="store_true",
                    help="HMS prefetch reads and write-behind writes complete when submitted")
    ap.add_argument("--no-pipeline", action="store_true", help="titan.hms.pipeline_optimizer: false")
    ap.add_argument("--pipeline-depth", type=int, default=1)
    ap.add_argument("--no-pooled-reads", action="store_true", help="titan.hms.pooled_reads: false")
    ap.add_argument("--no-param-behind", action="store_true", help="titan.hms.param_write_behind: false")
    ap.add_argument("--param-tier", choices=("nvme", "dram"), default="nvme", help="titan.hms.param_tier")
    ap.add_argument("--no-master-from-parts", action="store_true", help="titan.hms.master_from_partitions: false")
    ap.add_argument("--opt-dram-mb", type=int, default=0, help="titan.hms.optimizer_dram_mb")
    ap.add_argument("--cpu-adam", action="store_true",
                    help="DeepSpeedCPUAdam from the config's optimizer section instead of the client torch AdamW")
    ap.add_argument("--slow-writes", type=float, default=0.0,
                    help="seconds each write-behind write sleeps first (the writes are then still in flight when "
                         "ZeRO-3 goes on)")
    ap.add_argument("--grad-disk", action="store_true", help="titan.hms.gradient_buffer: disk")
    ap.add_argument("--grad-store", action="store_true", help="titan.hms.gradient_store: true (with --grad-disk)")
    ap.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 gradient accumulation")
    ap.add_argument("--zero-init", action="store_true", help="build the model under titan_ds.zero_init(cfg)")
    ap.add_argument("--asdt", action="store_true",
                    help="titan.optimizer: ds_configs/titan_balanced.json's section (ASDT, 8-bit/4-bit state)")
    ap.add_argument("--no-fold", action="store_true",
                    help="TITAN_HMS_FOLD_UNSCALE=0: ZeRO-3's own unscale pass, not the factor folded into ASDT")
    ap.add_argument("--local_rank", type=int, default=0)
    a = ap.parse_args()
    import deepspeed
    import titan_ds.engine as te
    if a.mode == "ds_nvme":  # DeepSpeed's own swappers, over the titan aio-compatible handle (no libaio build)
        from deepspeed.runtime.swap_tensor import (partitioned_optimizer_swapper, partitioned_param_swapper,
                                                   pipelined_optimizer_swapper)
        from titan_ds.hms.io import TitanAIOBuilder
        for m in (partitioned_param_swapper, partitioned_optimizer_swapper, pipelined_optimizer_swapper):
            m.AsyncIOBuilder = TitanAIOBuilder
    cfg = ds_config(a.mode, a.nvme, a.prefetch, a.micro, a.gas, a.clip, a.dram_mb)
    if a.grad_disk:
        cfg["titan"]["hms"]["gradient_buffer"] = "disk"
        cfg["titan"]["hms"]["gradient_store"] = a.grad_store  # the mapping read in place unless --grad-store
    if a.mode == "hms":
        cfg["titan"]["hms"]["pipeline_optimizer"] = not a.no_pipeline
        cfg["titan"]["hms"]["pipeline_depth"] = a.pipeline_depth
        cfg["titan"]["hms"]["param_write_behind"] = not a.no_param_behind
        cfg["titan"]["hms"]["master_from_partitions"] = not a.no_master_from_parts
        cfg["titan"]["hms"]["param_tier"] = a.param_tier
        cfg["titan"]["hms"]["optimizer_dram_mb"] = a.opt_dram_mb
        cfg["titan"]["hms"]["pooled_reads"] = not a.no_pooled_reads
    if a.asdt:
        with open(os.path.join(os.path.dirname(__file__), "..", "..", "ds_configs", "titan_balanced.json")) as f:
            cfg.setdefault("titan", {})["optimizer"] = dict(json.load(f)["titan"]["optimizer"], lr=1e-2)
    if a.no_fold:
        os.environ["TITAN_HMS_FOLD_UNSCALE"] = "0"
    if a.bf16:
        cfg["bf16"] = {"enabled": True}
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    from titan_ds.utils import after_init_distributed
    deepspeed.init_distributed()
    after_init_distributed()
    rank = torch.distributed.get_rank()
    if a.mode == "ds_nvme":  # DeepSpeed's swapper needs the model built under zero.Init on a CPU (seams 0.5)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            net = model()
    elif a.zero_init:
        import titan_ds
        with titan_ds.zero_init(cfg):
            net = model()
    else:
        net = model()
    if a.cpu_adam:  # DeepSpeed builds DeepSpeedCPUAdam (its C++ op) from the section, as ZeRO-Infinity does
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                        "weight_decay": 0.1}}
        cfg["zero_force_ds_cpu_optimizer"] = True
        cfg.pop("zero_allow_untested_optimizer")
        opt = None
        sched = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 3))  # noqa: E731
    elif a.asdt:  # titan.optimizer builds the optimizer; the schedule is a factory of it
        opt = None
        sched = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 3))  # noqa: E731
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    engine, _, _, _ = te.initialize(model=net, optimizer=opt, lr_scheduler=sched, config=cfg)
    start = 0
    ops = None
    if a.mode == "hms":
        store = engine.titan.reports["hms"].store
        if a.sync_prefetch:
            store._prefetch_pool.shutdown(wait=True)
            store._prefetch_pool = _SyncPool()
            for lane, pool in store._lanes.items():
                pool.shutdown(wait=True)
                store._lanes[lane] = _SyncPool()
            store._writer = store._lanes["opt"]
        if a.slow_writes:
            slow_writes(store, a.slow_writes)
        if a.record_store:
            ops = record_store_ops(store)
    if a.record_trace:
        engine.titan.reports["hms"].param_swapper.access_log = [[]]
    if a.load_dir:
        _, client = engine.load_checkpoint(a.load_dir)
        start = engine.global_steps
    losses = {}
    for step in range(start, a.steps):
        for micro in range(a.gas):
            x, y = batch(step * a.gas + micro, rank, a.micro)
            if a.bf16:
                x, y = x.bfloat16(), y.bfloat16()
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.setdefault(step, []).append(loss.item())
        if step + 1 == a.save_at:
            engine.save_checkpoint(a.save_dir)
    if a.mode == "hms":  # the training steps' store calls and counts (writes behind landed), before the dump's reads
        engine.titan.reports["hms"].store.flush()
        metrics = engine.titan.collect_metrics()["hms"]
        if ops is not None:
            ops = dict(ops, ops=list(ops["ops"]), file_reads=list(ops["file_reads"]))
    with deepspeed.zero.GatheredParameters(list(net.parameters())):
        params = {n: p.detach().clone() for n, p in net.named_parameters()}
    res = {"losses": losses, "params": params, "state": dump_state(engine, a.mode),
           "lr": [g["lr"] for g in engine.optimizer.optimizer.param_groups],
           "optimizer": type(engine.optimizer.optimizer).__name__}
    rt = getattr(getattr(engine, "titan", None), "reports", {}).get("hms")
    res["grad_norm_calls"] = rt.grad_norm.calls if rt is not None and rt.grad_norm is not None else 0
    unscale = getattr(engine.optimizer, "unscale_and_clip_grads", None)
    res["unscale"] = {k: getattr(unscale, k, None) for k in ("skipped", "called", "folded")}
    if a.mode == "hms":
        res["hms"] = metrics
        gb = engine.optimizer.grad_partitions_flat_buffer
        res["grad_buffer_mapped"] = gb.untyped_storage().filename is not None
        res["grad_keys"] = sum("/grad/" in k for k in engine.titan.reports["hms"].store.keys())
        res["grads_in_place"] = engine.titan.reports["hms"].opt_swapper.grads_in_place
        res["grads_advised"] = engine.titan.reports["hms"].opt_swapper.grads_advised
        res["grads_stored"] = engine.titan.reports["hms"].opt_swapper.grads_stored
        res["grad_bytes_punched"] = engine.titan.reports["hms"].opt_swapper.grad_bytes_punched
        res["store_bytes_written"] = engine.titan.reports["hms"].store.stats.bytes_written
        res["store_bytes_read"] = engine.titan.reports["hms"].store.stats.bytes_read
        res["master_files"] = sum(k.endswith("/fp32") for k in engine.titan.reports["hms"].store.keys())
        res["subgroups"] = len(engine.optimizer.fp32_partitioned_groups_flat)
        res["numel"] = sum(engine.optimizer.fp16_partitioned_groups_flat_numel)
        res["resident"] = sorted(engine.titan.reports["hms"].opt_swapper._resident)
        res["opt_state_files"] = sum("/state/" in k for k in engine.titan.reports["hms"].store.keys())
        res["store_ops"] = ops
        ps = engine.titan.reports["hms"].param_swapper  # None with param_tier "dram"
        pool = ps.read_pool if ps is not None else None
        res["param_pool"] = {"recycled": ps.recycled if ps is not None else 0,
                             "allocated": pool.allocated if pool is not None else None,
                             "swap_ins": ps.swap_in_count if ps is not None else 0}
        if a.record_trace:
            ps = engine.titan.reports["hms"].param_swapper
            log = [s for s in ps.access_log if s]
            with open(a.record_trace, "w") as f:
                json.dump({"source": "tests/hms/zero3_harness.py --mode hms", "steps": log}, f)
    torch.save(res, a.out.replace(".pt", f".rank{rank}.pt"))


if __name__ == "__main__":
    main()
