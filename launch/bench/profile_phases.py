"""Where a training step's time goes: forward, loss, backward (recompute included), optimizer step and the rest,
for plain DeepSpeed + AdamW and the titan profiles, on the seed GPT.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 flock /tmp/titan_timed.lock \\
        python launch/bench/profile_phases.py --steps 20 --out results/profile_phases          # the table
    python launch/bench/profile_phases.py --steps 3 --warmup 1 --out results/tmp/profile_phases # a smoke run

Each row builds the engine as ``launch/train.py`` does (same model, data, micro-batch, gradient accumulation and
client optimizer; ``plain`` is ``ds_configs/baseline_adamw.json`` with torch AdamW at lr 1e-3, the frontier's
AdamW row) in its own fresh process, runs ``--warmup`` steps, then times ``--steps`` steps with
``time.perf_counter`` marks:

* forward: ``engine(x, y)`` minus the loss; loss: the model's ``lm_loss`` module (LM head + cross-entropy, chunked
  or not), timed by forward hooks on it; backward: ``engine.backward(loss)`` (block recomputation and StripeFFN's
  recompute happen here); optimizer: every ``torch.optim.Optimizer.step`` (global step hooks), inside
  ``engine.step``; rest: the step's wall time minus those (gradient clipping, DeepSpeed's engine bookkeeping,
  reduce, zero_grad, lr scheduler, the batch loop).

Summed over a step's micro-batches, averaged over the timed steps. Then ``--profile-steps`` more steps run under
``torch.autograd.profiler`` (one profiler per phase, so ops are attributed to forward / backward) and the top ops
by self CPU time of forward and backward are listed. Rows are saved to ``<out>.jsonl`` as they finish (a rerun
with the same settings skips them); ``<out>.md`` is rebuilt each time.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from launch.bench.harness import ResultLog, baseline_config  # noqa: E402

__all__ = ["ROWS", "row_config", "measure", "write_table", "main"]

ROWS = ("plain", "titan_exact", "titan_balanced", "titan_memory")
PHASES = ("forward", "loss", "backward", "optimizer", "rest")
MODEL_ARGS = ["--layers", "6", "--width", "256", "--heads", "8", "--context", "128", "--vocab", "256"]


def row_config(name: str) -> tuple[dict[str, Any], list[str]]:
    """(ds_config, launch/train.py arguments) of a row: ``plain``, a ``ds_configs/<name>.json`` profile, or a row of
    ``launch/bench/speed.py`` (e.g. ``titan_exact_no_recompute_pre``)."""
    if name == "plain":
        return baseline_config(0), ["--optimizer", "adamw", "--lr", "1e-3"]
    path = ROOT / "ds_configs" / f"{name}.json"
    if path.exists():
        return json.loads(path.read_text()), []
    from launch.bench.speed import build_rows
    by = {r.name: r for r in build_rows()}
    if name not in by:
        raise SystemExit(f"unknown row {name!r}: no {path} and no such speed row; rows are 'plain', a "
                         f"ds_configs/*.json profile name or one of {sorted(by)}")
    return copy.deepcopy(by[name].cfg), list(by[name].args)


class _Clock:
    """Wall-time sums per phase; ``loss`` by hooks on the loss module, ``optimizer`` by global optimizer hooks."""

    def __init__(self, loss_module):
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        self.total: dict[str, float] = defaultdict(float)
        self._t: dict[str, float] = {}
        self.on = False
        self._handles = [loss_module.register_forward_pre_hook(lambda *a: self._start("loss")),
                         loss_module.register_forward_hook(lambda *a: self._stop("loss")),
                         register_optimizer_step_pre_hook(lambda *a: self._start("optimizer")),
                         register_optimizer_step_post_hook(lambda *a: self._stop("optimizer"))]

    def _start(self, k: str) -> None:
        self._t[k] = time.perf_counter()

    def _stop(self, k: str) -> None:
        if self.on and k in self._t:
            self.total[k] += time.perf_counter() - self._t.pop(k)

    @contextlib.contextmanager
    def phase(self, k: str):
        t0 = time.perf_counter()
        yield
        if self.on:
            self.total[k] += time.perf_counter() - t0


def _build(name: str, steps: int, work: Path, train_args: Sequence[str]):
    """The engine, model and batcher of a row, built as launch/train.py builds them."""
    import torch

    import titan_ds
    from launch import train
    from titan_ds.config import TitanConfig
    from titan_ds.data import Batcher, load_corpus
    from titan_ds.models import GPT, GPTConfig
    from titan_ds.utils import ensure_dist_env
    cfg, row_args = row_config(name)
    path = work / f"{name}.json"
    path.write_text(json.dumps(cfg))
    args = train.parse_args(["--deepspeed_config", str(path), "--steps", str(steps), *MODEL_ARGS, *row_args,
                             *train_args])
    ensure_dist_env()
    torch.manual_seed(args.seed)
    ds = dict(cfg)
    titan = TitanConfig.from_ds_config(ds)
    mb = args.micro_batch or int(ds.get("train_micro_batch_size_per_gpu", 16))
    ds["train_micro_batch_size_per_gpu"] = mb
    gas = int(ds.get("gradient_accumulation_steps", 1))
    model = GPT(GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=args.heads, block_size=args.context,
                          vocab_size=args.vocab))
    opt = train._client_optimizer(model, args, ds, titan)
    sched = lambda o: torch.optim.lr_scheduler.LambdaLR(o, train.lr_lambda(args.warmup, steps))  # noqa: E731
    args.deepspeed_config = None
    engine, *_ = titan_ds.initialize(args=args, model=model, optimizer=opt, lr_scheduler=sched, config=ds)
    batches = Batcher(load_corpus(args.data).train, mb * gas, args.context, seed=args.seed)
    return engine, batches, mb, gas, args


def _step(engine, clock: _Clock, x, y, mb: int, gas: int) -> None:
    n = 0
    for xm, ym in zip(x.split(mb), y.split(mb)):
        with clock.phase("forward_and_loss"):
            loss = engine(xm, ym)
        with clock.phase("backward"):
            engine.backward(loss)
        n += 1
        if n < gas:
            engine.step()  # DeepSpeed: a no-op until the accumulation boundary
    engine.step()


def _top_ops(engine, clock: _Clock, batches, first: int, n: int, mb: int, gas: int, top: int) -> dict[str, list]:
    """Self CPU ms/step of the top ops of forward (loss included) and of backward, over ``n`` profiled steps."""
    from torch.autograd.profiler import profile
    acc: dict[str, dict[str, float]] = {"forward": defaultdict(float), "backward": defaultdict(float)}
    for step in range(first, first + n):
        x, y = batches.get(step)
        for xm, ym in zip(x.split(mb), y.split(mb)):
            with profile() as p:
                loss = engine(xm, ym)
            for e in p.key_averages():
                acc["forward"][e.key] += e.self_cpu_time_total / 1e3 / n
            with profile() as p:
                engine.backward(loss)
            for e in p.key_averages():
                acc["backward"][e.key] += e.self_cpu_time_total / 1e3 / n
        engine.step()
    return {ph: [[k, round(v, 3)] for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]] for ph, d in acc.items()}


def measure(name: str, steps: int, warmup: int, profile_steps: int, top: int,
            train_args: Sequence[str] = ()) -> dict[str, Any]:
    """Build the row's engine and time its phases (module docstring); one call per process."""
    import torch
    with tempfile.TemporaryDirectory(prefix="titan_profile_") as work:
        engine, batches, mb, gas, args = _build(name, warmup + steps + profile_steps, Path(work), train_args)
        clock = _Clock(engine.module.lm_loss)
        for step in range(1, warmup + 1):
            _step(engine, clock, *batches.get(step), mb, gas)
        clock.on = True
        t_steps = []
        for step in range(warmup + 1, warmup + steps + 1):
            t0 = time.perf_counter()
            _step(engine, clock, *batches.get(step), mb, gas)
            t_steps.append(time.perf_counter() - t0)
        clock.on = False
        ops = _top_ops(engine, clock, batches, warmup + steps + 1, profile_steps, mb, gas, top) if profile_steps \
            else {}
        mlme = getattr(engine, "titan", None) and engine.titan.reports.get("mlme")
    per = {k: v / steps * 1e3 for k, v in clock.total.items()}
    total = sum(t_steps) / steps * 1e3
    ms = {"forward": per["forward_and_loss"] - per.get("loss", 0.0), "loss": per.get("loss", 0.0),
          "backward": per["backward"], "optimizer": per.get("optimizer", 0.0)}
    ms["rest"] = total - sum(ms.values())
    return {"row": name, "steps": steps, "warmup": warmup, "micro_batch": mb, "gas": gas,
            "tokens_per_step": mb * gas * args.context, "step_ms": total, "ms": ms,
            "step_ms_min": min(t_steps) * 1e3, "top_ops": ops, "threads": torch.get_num_threads(),
            "kernels": _kernels(mlme), "date": datetime.date.today().isoformat()}


def _kernels(report) -> dict[str, str]:
    """What the MLME report says each replaced part runs (policy -> the first entry's detail)."""
    if not report:
        return {}
    out: dict[str, str] = {}
    for e in report.entries:
        out.setdefault(e.policy, json.dumps(e.detail, sort_keys=True))
    return out


def write_table(records: list[dict[str, Any]], out: Path, command: str) -> str:
    import torch
    lines = [f"### Training-step phases: plain DeepSpeed + AdamW and titan's profiles (seed GPT 6x256, context 128)",
             "", f"Command: `{command}`",
             f"Machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__} ({records[0]['threads'] if records else '?'} "
             f"intra-op thread(s)); {datetime.date.today().isoformat()}. Each row: its own process, "
             f"{records[0]['warmup'] if records else '?'} warm-up steps, mean over {records[0]['steps'] if records else '?'} "
             "timed steps (time.perf_counter marks; see launch/bench/profile_phases.py). ms per optimizer step (16 "
             "sequences of 128 tokens; titan_memory: 4 micro-batches of 4); % of the step.", "",
             "| row | step ms | " + " | ".join(f"{p} ms | {p} %" for p in PHASES) + " | vs plain |",
             "|---|---|" + "---|---|" * len(PHASES) + "---|"]
    base = next((r for r in records if r["row"] == "plain"), None)
    for r in records:
        cells = [r["row"], f"{r['step_ms']:.1f}"]
        for p in PHASES:
            cells += [f"{r['ms'][p]:.1f}", f"{100 * r['ms'][p] / r['step_ms']:.0f}"]
        cells.append(f"{r['step_ms'] / base['step_ms']:.2f}x" if base else "-")
        lines.append("| " + " | ".join(cells) + " |")
    for r in records:
        if r.get("kernels"):
            lines += ["", f"{r['row']}: MLME replacements: " + "; ".join(f"{k} {v}" for k, v in r["kernels"].items())]
    for r in records:
        if r["row"] == "plain" or not r.get("top_ops"):
            continue
        for ph, ops in r["top_ops"].items():
            lines += ["", f"{r['row']}, top ops of {ph} (self CPU ms/step, under the profiler):", "",
                      "| op | ms/step |", "|---|---|"] + [f"| `{k}` | {v:.2f} |" for k, v in ops]
    md = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(md)
    return md


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows (default {','.join(ROWS)})")
    p.add_argument("--steps", type=int, default=20, help="timed steps per row (after the warm-up)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile-steps", type=int, default=3, help="steps under the profiler for the top ops (0: none)")
    p.add_argument("--top", type=int, default=8, help="ops listed per phase")
    p.add_argument("--out", default=str(ROOT / "results" / "profile_phases"), help="writes <out>.md and <out>.jsonl")
    p.add_argument("--train-args", default="", help="extra launch/train.py flags (tests: a tiny model)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: measure one row, print its JSON
    return p.parse_args(argv)


def _run_child(name: str, a: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", name, "--steps", str(a.steps), "--warmup",
           str(a.warmup), "--profile-steps", str(a.profile_steps), "--top", str(a.top), "--train-args", a.train_args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"row {name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.one, a.steps, a.warmup, a.profile_steps, a.top, shlex.split(a.train_args))))
        return []
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    for r in rows:
        row_config(r)  # every name checked before the first run
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"steps": a.steps, "warmup": a.warmup, "profile_steps": a.profile_steps, "top": a.top,
                "train_args": a.train_args}
    # a row's ds_config and arguments are part of its key: editing a profile reruns its row
    store = ResultLog(out.with_suffix(".jsonl"), key=lambda r: (r["row"], json.dumps(r["settings"], sort_keys=True),
                                                                json.dumps(r.get("config"), sort_keys=True)))
    command = "python launch/bench/profile_phases.py " + shlex.join(argv)
    records = []
    for name in rows:
        config = list(row_config(name))
        key = (name, json.dumps(settings, sort_keys=True), json.dumps(config, sort_keys=True))
        records.append(store.get(key, lambda name=name, config=config: {**_run_child(name, a), "settings": settings,
                                                                        "config": config},
                                 lambda r: f"{r['row']}: {r['step_ms']:.1f} ms/step"))
        write_table(records, out, command)
    print(out.with_suffix(".md").read_text())
    return records


if __name__ == "__main__":
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    main()
