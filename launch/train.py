"""Train the reference GPT on the byte-level corpus with DeepSpeed + titan_ds.

    deepspeed launch/train.py --deepspeed_config ds_configs/baseline_adamw.json
    deepspeed --num_gpus 2 launch/train.py --deepspeed_config ds_configs/compress_rms_sketch.json --steps 100
    python launch/train.py --deepspeed_config ds_configs/baseline_adamw.json --steps 20   # 1 rank, no launcher

With a ``"titan"`` section the pillars it names are applied by ``titan_ds.initialize``; without one this is plain
DeepSpeed. When the section has an ``optimizer`` the titan optimizer is built from it; otherwise the client
optimizer is ``--optimizer`` (default torch AdamW, betas 0.9/0.95, ``--beta1`` to change the first) at ``--lr``, with ``--weight-decay`` (default
0.1) on matrices and none on vectors; the other choices are the low-memory optimizers a user would pick instead
of titan (see :data:`CLIENT_OPTIMIZERS`). The learning rate warms up linearly and decays by a cosine to 10%.
Batches are a pure function of (seed, step, rank), so a resumed run sees exactly the batches the uninterrupted
run would have seen.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import titan_ds  # noqa: E402
from titan_ds.comm.wire import WireCount, count_collectives  # noqa: E402
from titan_ds.config import TitanConfig, load_ds_config  # noqa: E402
from titan_ds.data import Batcher, load_corpus, val_batches  # noqa: E402
from titan_ds.hms import timeline  # noqa: E402
from titan_ds.metrics import (ActivationCounter, accounted_memory, host_values, optimizer_state_bytes,  # noqa: E402
                              peak_rss_bytes)
from titan_ds.models import GPT, GPTConfig  # noqa: E402
from titan_ds.utils import ensure_dist_env, get_logger  # noqa: E402

log = get_logger("titan_ds.train")


DEFAULT_WEIGHT_DECAY = 0.1


def _adamw(groups: list[dict], lr: float, beta1: float = 0.9) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=lr, betas=(beta1, 0.95))


def _adafactor(groups: list[dict], lr: float) -> torch.optim.Optimizer:
    # torch's defaults otherwise (beta2_decay -0.8, eps (None, 1e-3), d 1): lr caps the relative step size
    # rho_t = min(lr, 1/sqrt(t)), and the weight decay is param *= 1 - lr * weight_decay
    return torch.optim.Adafactor(groups, lr=lr)


def _lion(groups: list[dict], lr: float) -> torch.optim.Optimizer:
    try:
        from lion_pytorch import Lion
    except ImportError as e:
        raise SystemExit(f"--optimizer lion needs the lion-pytorch package ({e}); install it with "
                         "`pip install --no-deps lion-pytorch==0.2.5` or `pip install -e .[bench]`") from e
    return Lion(groups, lr=lr, betas=(0.9, 0.99))  # the paper's betas; weight decay: p *= 1 - lr * wd


def _torchao(cls_name: str, bf16_stochastic_round: bool = False):
    def build(groups: list[dict], lr: float) -> torch.optim.Optimizer:
        try:
            import torchao.optim
        except ImportError as e:
            raise SystemExit(f"--optimizer {cls_name.lower()} needs torchao ({e}); install it with "
                             "`pip install --no-deps torchao==0.18.0` or `pip install -e .[bench]`") from e
        return getattr(torchao.optim, cls_name)(groups, lr=lr, betas=(0.9, 0.95),  # AdamW's betas here
                                                bf16_stochastic_round=bf16_stochastic_round)
    return build


# name -> builder(param groups, lr): the one list of client optimizers (the --optimizer choices)
CLIENT_OPTIMIZERS = {"adamw": _adamw, "adafactor": _adafactor, "lion": _lion,
                     "adamw8bit": _torchao("AdamW8bit"), "adamw4bit": _torchao("AdamW4bit"),
                     # torchao's own recipe for bf16 training with no fp32 copy: bf16 weights, stochastic rounding
                     "adamw4bit_bf16": _torchao("AdamW4bit", bf16_stochastic_round=True)}
BF16_WEIGHTS = {"adamw4bit_bf16"}  # the model is cast to bf16 before the optimizer is built over it


def make_optimizer(model: torch.nn.Module, lr: float, name: str = "adamw",
                   weight_decay: float = DEFAULT_WEIGHT_DECAY, beta1: "float | None" = None) -> torch.optim.Optimizer:
    """The client optimizer ``name`` over two groups: matrices with ``weight_decay``, vectors without."""
    if name not in CLIENT_OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {sorted(CLIENT_OPTIMIZERS)}")
    if beta1 is not None and name != "adamw":
        raise ValueError(f"--beta1 sets torch AdamW's beta1; the {name!r} optimizer keeps its own betas")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if beta1 is not None:
        return _adamw(groups, lr, beta1)
    return CLIENT_OPTIMIZERS[name](groups, lr)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=None,
                   help="defaults to the config's train_micro_batch_size_per_gpu (16 in the shipped configs)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=None, help="peak lr of the client optimizer (default 1e-3)")
    p.add_argument("--optimizer", choices=sorted(CLIENT_OPTIMIZERS), default=None,
                   help="client optimizer when the config has no titan.optimizer nor DeepSpeed 'optimizer' section "
                        "(default adamw)")
    p.add_argument("--weight-decay", type=float, default=None,
                   help=f"client optimizer's decoupled weight decay on matrices (default {DEFAULT_WEIGHT_DECAY})")
    p.add_argument("--beta1", type=float, default=None,
                   help="AdamW's beta1 (default 0.9); 0 when titan.compression.momentum (DGC) already applies the momentum")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP)
    p.add_argument("--val-every", type=int, default=0,
                   help="validate before training and every N steps (0: only at the end)")
    p.add_argument("--val-batches", type=int, default=64)
    p.add_argument("--val-micro-batch", type=int, default=None,
                   help="sequences per validation batch (default: the training micro-batch); the validation set "
                        "depends on it, so runs at different micro-batches compare on the same set by fixing it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="text file or folder (default: CPython stdlib sources)")
    p.add_argument("--save-dir", default=None)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--load-dir", default=None, help="resume from the latest checkpoint in this folder")
    p.add_argument("--metrics-out", default=None, help="JSON lines, one per step (rank 0)")
    p.add_argument("--summary-out", default=None, help="one JSON object at the end (rank 0)")
    p.add_argument("--plot", default=None, help="PNG of loss and memory at the end (rank 0)")
    p.add_argument("--timeline-out", default=None,
                   help="JSON of the per-step timeline: forward/backward/step and the HMS swappers' waits and "
                        "writes (titan_ds.hms.timeline; rank 0)")
    p.add_argument("--log-every", type=int, default=10,
                   help="read the loss and titan's per-step metrics back from the device every N steps (and at a "
                        "checkpoint, a validation and the end); every step still gets its record. On a GPU each "
                        "read waits for the device, so 1 syncs every step")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--count-wire", action="store_true",
                   help="count every collective from initialize to the last step, DeepSpeed's included (titan_ds/comm/wire.py: "
                        "ring costs, sent and received); the summary gets wire_per_rank and peak_rss_per_rank")
    p.add_argument("--zero-init", action="store_true",
                   help="build the model under titan_ds.zero_init (ZeRO-3: partitioned, and with titan.hms streamed "
                        "to disk, as each module is built; for models that do not fit whole in RAM)")
    p = titan_ds.engine.add_titan_args(p)
    return p.parse_args(argv)


DEFAULT_WARMUP = 50  # steps of linear lr warm-up (--warmup)


def lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac))
    return f


@torch.no_grad()
def validate(engine, corpus, args, micro_batch: int) -> float:
    engine.eval()
    total = 0.0
    for x, y in val_batches(corpus.val, args.val_batches, micro_batch, args.context):
        total += float(engine(x.to(engine.device), y.to(engine.device)))
    engine.train()
    return total / max(1, args.val_batches)


def _client_optimizer(model: torch.nn.Module, args: argparse.Namespace, ds: dict,
                      titan: "TitanConfig | None") -> "torch.optim.Optimizer | None":
    """``--optimizer`` unless the config builds its own (then asking for one is an error, never ignored)."""
    owner = "titan.optimizer" if titan is not None and titan.optimizer is not None else \
        "the ds_config's 'optimizer' section" if "optimizer" in ds else None
    if owner is not None:
        for flag, value in (("--optimizer", args.optimizer), ("--lr", args.lr),
                            ("--weight-decay", args.weight_decay), ("--beta1", args.beta1)):
            if value is not None:
                raise SystemExit(f"{flag} {value} conflicts with {owner} in {args.deepspeed_config}: the optimizer "
                                 f"comes from the config; drop {flag} or the config's optimizer")
        return None
    wd = DEFAULT_WEIGHT_DECAY if args.weight_decay is None else args.weight_decay
    if args.optimizer in BF16_WEIGHTS:
        if any((ds.get(k) or {}).get("enabled") for k in ("bf16", "fp16")):
            raise SystemExit(f"--optimizer {args.optimizer} trains bf16 weights with no fp32 copy; the ds_config's "
                             f"bf16/fp16 section would add one: remove it")
        model.to(torch.bfloat16)
    return make_optimizer(model, 1e-3 if args.lr is None else args.lr, args.optimizer or "adamw", wd, args.beta1)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch to the device without waiting for it: from pinned memory, asynchronously, on CUDA (a blocking copy
    from pageable memory waits for the work queued before it)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def log_records(records: list, history: list, mfile, monitor, bar) -> dict:
    """Read ``records`` (one per step since the last logging step) to the host, one logging window at once, and
    log them: ``history``, the metrics file, DeepSpeed's monitor, the progress bar. Returns the titan metrics of
    the last one (host values). The only place the training loop reads device values (a host sync on a GPU)."""
    last: dict = {}
    for record in records:
        record = host_values(record)
        last = record.pop("titan", {})
        record.update({k: v for k, v in last.items() if isinstance(v, (int, float, str, bool, dict, list))})
        history.append(record)
        if mfile:
            mfile.write(json.dumps(record) + "\n")
        if monitor is not None and monitor.enabled:
            monitor.write_events([("Train/loss", record["loss"], record["step"])] +
                                 ([("Train/val_loss", record["val_loss"], record["step"])] if "val_loss" in record
                                  else []))
    if mfile:
        mfile.flush()
    if bar and records:
        bar.set_postfix(loss=f"{history[-1]['loss']:.3f}")
        bar.update(len(records))
    return last


def _sum_over_ranks(value: int, world: int) -> int:
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(t)  # every rank runs this line once, after its last step
    return int(t.item())


def _per_rank(wire: dict, rss: int, world: int) -> dict:
    """``wire_per_rank`` and ``peak_rss_per_rank``: every rank's (in rank order; every rank runs this once)."""
    gathered: list = [(wire, rss)]
    if world > 1:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, (wire, rss))
    return {"wire_per_rank": [g[0] for g in gathered], "peak_rss_per_rank": [g[1] for g in gathered]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.log_every < 1:
        raise SystemExit(f"--log-every must be >= 1 (steps between reads of the metrics), got {args.log_every}")
    ensure_dist_env()
    torch.manual_seed(args.seed)
    ds = load_ds_config(args.deepspeed_config) if args.deepspeed_config else {}
    if not ds:
        raise SystemExit("pass --deepspeed_config <ds_config.json> (see ds_configs/)")
    titan = TitanConfig.from_ds_config(ds)  # validate before any work: every error at once
    tl = timeline.enable() if args.timeline_out else None

    def phase(name: str):
        return tl.span(name) if tl is not None else contextlib.nullcontext()

    micro_batch = args.micro_batch or int(ds.get("train_micro_batch_size_per_gpu", 16))
    ds["train_micro_batch_size_per_gpu"] = micro_batch
    # gradient accumulation: a step is gas micro-batches of the step's micro_batch * gas sequences (the sequences
    # a run of gas=1 and that many per micro-batch sees), validated on batches of that size
    gas = int(ds.get("gradient_accumulation_steps", 1))
    val_mb = args.val_micro_batch or micro_batch * gas
    ds.pop("train_batch_size", None)
    gcfg = GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=args.heads, block_size=args.context,
                     vocab_size=args.vocab)
    if args.zero_init:
        with titan_ds.zero_init(ds):
            model = GPT(gcfg)
    else:
        model = GPT(gcfg)
    optimizer = _client_optimizer(model, args, ds, titan)
    scheduler = None if "scheduler" in ds else \
        (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup, args.steps)))
    args.deepspeed_config = None
    wire, counting = WireCount(), contextlib.ExitStack()
    if args.count_wire:  # every collective from initialize's broadcast to the last step (DeepSpeed's, titan's),
        counting.enter_context(count_collectives(wire))  # not the final summary's
    engine, _, _, _ = titan_ds.initialize(args=args, model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                          config=ds)
    wire_init = {"sent": wire.sent, "received": wire.received}  # initialize's own collectives (the broadcast)
    rank = engine.global_rank
    world = engine.world_size
    corpus = load_corpus(args.data)
    batches = Batcher(corpus.train, micro_batch * gas, args.context, seed=args.seed, rank=rank, world=world)
    start = 0
    if args.load_dir:
        path, client = engine.load_checkpoint(args.load_dir)
        if path is None:
            raise SystemExit(f"--load-dir {args.load_dir}: no checkpoint found (no 'latest' file)")
        start = int(client["step"])
        log.info("resumed from %s at step %d", path, start)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if hasattr(model, "parameters") and any(hasattr(p, "ds_numel") for p in model.parameters()):
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    acts = ActivationCounter(engine.module)
    for out in (args.metrics_out, args.summary_out, args.plot):
        if out and rank == 0:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
    mfile = open(args.metrics_out, "a" if args.load_dir else "w") if (args.metrics_out and rank == 0) else None
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    history, val_history, peak = [], [], None
    opt_state_peak = 0  # bytes of the client optimizer's state tensors on this rank, peak over steps
    timed_tokens, timed_s = 0, 0.0
    last: dict = {}
    pending: list = []  # this logging window's records, device values not yet read
    if args.val_every and start == 0:  # the untrained baseline, so a curve (and a test) can show the drop
        val_history.append((0, validate(engine, corpus, args, val_mb)))
    for step in range(start + 1, args.steps + 1):
        x, y = batches.get(step)
        if tl is not None:
            tl.step = step
        t0 = time.perf_counter()
        losses, act_peak = [], 0
        for xm, ym in zip(x.split(micro_batch), y.split(micro_batch)):  # engine.step applies after the last
            with acts.track():  # forward and backward: a block recomputed in backward saves again there
                with phase("forward"):
                    loss = engine(_to(xm, engine.device), _to(ym, engine.device))
                with phase("backward"):
                    engine.backward(loss)
            act_peak = max(act_peak, acts.bytes)
            losses.append(loss.detach())
            if len(losses) < gas:
                with phase("step"):
                    engine.step()
        mem = accounted_memory(engine, activations=act_peak)
        with phase("step"):
            engine.step()
        loss = torch.stack(losses).float().mean()
        dt = time.perf_counter() - t0
        if tl is not None:
            tl.add("wall", t0, t0 + dt, lane="steps")
        mem.optimizer_state = max(mem.optimizer_state, accounted_memory(engine).optimizer_state)
        opt_state_peak = max(opt_state_peak, optimizer_state_bytes(engine))
        peak = mem if peak is None else type(mem)(**{k: max(getattr(peak, k) or 0, getattr(mem, k) or 0)
                                                     for k in mem.__dataclass_fields__})
        if step > start + 3:  # the first steps pay one-off costs (allocations, lazy state)
            timed_tokens += x.numel() * world
            timed_s += dt
        # the loss and titan's per-step counters stay device tensors here; they are read when logged (below)
        record = {"step": step, "loss": loss.detach(), "lr": engine.get_lr()[0], "step_s": dt,
                  "tokens_per_s": x.numel() * world / dt, "skipped": not engine.was_step_applied()}
        if getattr(engine, "titan", None) is not None:
            record["titan"] = engine.titan.collect_metrics()  # every step: take_metrics windows are per step
        if args.val_every and step % args.val_every == 0 and step != args.steps:
            record["val_loss"] = validate(engine, corpus, args, val_mb)
            val_history.append((step, record["val_loss"]))
        pending.append(record)
        saving = bool(args.save_dir and args.save_every and step % args.save_every == 0)
        if step % args.log_every == 0 or step == args.steps or saving or "val_loss" in record:
            last = log_records(pending, history, mfile, engine.monitor if rank == 0 else None, bar) or last
            pending = []
        if saving:  # the metrics file holds every step up to a checkpoint, so a resumed run appends after it
            engine.save_checkpoint(args.save_dir, tag=f"step{step}", client_state={"step": step})
    counting.close()
    if bar:
        bar.close()
    val = validate(engine, corpus, args, val_mb)
    val_history.append((args.steps, val))
    if args.save_dir and not (args.save_every and args.steps % args.save_every == 0):
        engine.save_checkpoint(args.save_dir, tag=f"step{args.steps}", client_state={"step": args.steps})
    opt_state_total = _sum_over_ranks(opt_state_peak, world)
    summary = {
        "steps": args.steps, "start_step": start, "world_size": world, "micro_batch": micro_batch,
        "model": model.cfg.to_dict() if hasattr(model, "cfg") else {}, "trainable_params": trainable,
        "val_loss": val, "train_loss_last10": sum(r["loss"] for r in history[-10:]) / max(1, len(history[-10:])),
        "tokens_per_s": timed_tokens / timed_s if timed_s else float("nan"),
        "step_s": timed_s / max(1, len(history) - 3),
        "memory": peak.to_dict() if peak else {}, "peak_rss": peak_rss_bytes(),
        # measured from the optimizer's state tensors (not assumed), every rank's partition: see
        # titan_ds.metrics.optimizer_state_bytes; per trainable parameter of this model (after TRD, if on)
        "optimizer_state_bytes": opt_state_total,
        "optimizer_bytes_per_param": opt_state_total / max(1, trainable),
        "optimizer": type(getattr(engine, "basic_optimizer", None)).__name__,
        "skipped_steps": sum(1 for r in history if r["skipped"]),
        "pillars": titan.enabled_pillars if titan else [],
        "titan_metrics": {k: v for k, v in last.items() if isinstance(v, (int, float, str, bool, dict, list))},
        "val_history": val_history,
    }
    if args.count_wire:
        summary.update(_per_rank({"sent": wire.sent, "received": wire.received, "calls": dict(wire.calls),
                                   "init": wire_init},
                                 peak_rss_bytes(), world))
    if rank == 0:
        log.info("final validation loss %.4f", val)
        if mfile:
            mfile.close()
        if args.summary_out:
            Path(args.summary_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.summary_out).write_text(json.dumps(summary, indent=1))
        if tl is not None:
            Path(args.timeline_out).parent.mkdir(parents=True, exist_ok=True)
            tl.save(args.timeline_out, steps=args.steps, start_step=start, layers=args.layers, width=args.width)
        if args.plot:
            from titan_ds.plot import plot_run
            plot_run(history, val_history, summary, args.plot)
    return summary


if __name__ == "__main__":
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))
    main()
