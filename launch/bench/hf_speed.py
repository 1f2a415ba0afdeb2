"""SmolLM2-135M under the HF Trainer: training speed (tokens/s) and where a step's time goes, plain ``Trainer`` +
AdamW beside ``Trainer`` + titan's ``hf_asdt_8bit`` and torchao's AdamW8bit (the HF row's speed).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 flock /tmp/titan_timed.lock \\
        python launch/bench/hf_speed.py --what speed --steps 100 --warmup 5 --repeats 3     # results/hf_speed.md
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 flock /tmp/titan_timed.lock \\
        python launch/bench/hf_speed.py --what profile --steps 10 --warmup 3              # results/hf_speed_phases.md
    python launch/bench/hf_speed.py --what speed --model tiny-llama --steps 2 --warmup 1 --repeats 1 \\
        --out results/tmp/hf_speed                                                         # a smoke run

Each (row, repeat) is one fresh process running ``examples/hf_trainer.py``'s training (one rank, no launcher:
``titan_ds.install()`` makes the Trainer's ``deepspeed.initialize`` apply the row's ``titan`` section), same model
(``hf_finetune.fetch_smollm2``), data, seed and arguments as ``launch/bench/hf_finetune.py``; only the ds_config (and
for the torchao row the Trainer's ``optim``) differs:

- ``plain``: ``ds_configs/hf_plain.json``, the Trainer's torch AdamW under DeepSpeed (what a user has);
- ``titan_asdt_8bit``: ``ds_configs/hf_asdt_8bit.json`` (MLME + ASDT adaptive, 8-bit momentum, step in backward);
- ``torchao_adamw8bit``: ``hf_plain.json`` with ``--optim adamw_torch_8bit`` (torchao's AdamW8bit, the peer at
  about the same optimizer-state bytes; torch.compile'd on its first steps, inside the warm-up);
- ``plain_gc``: ``plain`` with the Trainer's ``gradient_checkpointing`` (HF's recompute of each decoder layer: what
  ``hf_asdt_8bit``'s ``mlme.recompute_blocks`` does, the peer a user would turn on for the same activation saving);
- ``titan_asdt_8bit_compiled``: ``hf_asdt_8bit.json`` with ``"compile": true`` in its optimizer section (the
  update's chunks as compiled fused graphs, bit for bit the eager loop; compiled within the warm-up steps).

**speed**: ``--warmup`` + ``--steps`` optimizer steps; tokens/s = tokens of the timed steps / the wall time from the
end of step ``--warmup`` to the end of the last step (``TrainerCallback.on_step_end``: everything the Trainer does
in a step counts: data, forward, backward, optimizer, logging). Rows alternate within a repeat (A B C, A B C...);
per row the median over ``--repeats`` and its min-max, and the ratio of medians to ``plain``.

**profile**: the same runs with the phases of each timed step summed (time.perf_counter around them): ``forward``
(the model call, loss excluded), ``loss`` (LM head + cross-entropy: HF's ``lm_head`` and ``ForCausalLMLoss``, or
titan's chunked loss), ``backward`` (``engine.backward`` without the optimizer work done inside it),
``optimizer`` (``engine.step``, plus titan's updates in the gradient hooks when it steps in backward) and ``rest``
(the step's wall time minus these: data, the Trainer's bookkeeping, logging).

Finished (row, repeat) runs are recorded at once in ``<out>.jsonl`` (``launch/bench/store.py``; a rerun with the
same settings skips them when the code is unchanged, or with ``--reuse-stale``); ``<out>.md`` is rebuilt from it
(``python -m launch.bench table hf-speed --out <out>.md`` rebuilds it without running anything).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import logging
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from launch.bench.store import CODE_PATHS, Store, add_store_args  # noqa: E402

__all__ = ["ROWS", "PHASES", "summarise", "main", "table"]

log = logging.getLogger("titan_ds.bench.hf_speed")

ROWS: dict[str, tuple[str, list[str]]] = {  # row -> (ds_config, extra example arguments)
    "plain": ("hf_plain.json", []),
    "titan_asdt_8bit": ("hf_asdt_8bit.json", []),
    "torchao_adamw8bit": ("hf_plain.json", ["--optim", "adamw_torch_8bit"]),
    "plain_gc": ("hf_plain.json", ["--gradient-checkpointing"]),
    "titan_asdt_8bit_compiled": ("hf_asdt_8bit.json", []),
}
# rows whose ds_config is the file above with these keys of its "titan.optimizer" section changed
OPTIMIZER_OVERRIDES: dict[str, dict[str, Any]] = {"titan_asdt_8bit_compiled": {"compile": True}}
PHASES = ("forward", "loss", "backward", "optimizer", "rest")


# ------------------------------------------------------------------------------------------ worker (one run)
class _Clock:
    """Sums of seconds per phase, counted only while ``on``; nested phases subtract from their parent."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)
        self.on = False
        self._stack: list[list] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        frame = [name, time.perf_counter(), 0.0]  # name, start, seconds of nested phases
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            dt = time.perf_counter() - frame[1]
            if self._stack:
                self._stack[-1][2] += dt
            if self.on:
                self.total[name] += dt - frame[2]

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **kw):
            with self.phase(name):
                return fn(*a, **kw)
        setattr(obj, attr, timed)


def _instrument(trainer, clock: _Clock) -> None:
    """Time the phases (module docstring) of the engine and model the Trainer drives."""
    from transformers.modeling_utils import LOSS_MAPPING
    engine = trainer.model_wrapped
    clock.wrap(engine, "forward", "forward")
    clock.wrap(engine, "backward", "backward")
    clock.wrap(engine, "step", "optimizer")
    model = engine.module
    head = model.get_output_embeddings()
    clock.wrap(head, "forward", "loss")  # plain: the full logits (titan: a stand-in, its loss computes them)
    LOSS_MAPPING["ForCausalLM"] = _timed_fn(clock, LOSS_MAPPING["ForCausalLM"], "loss")
    import titan_ds.inject.hf_loss as hf_loss
    hf_loss._causal_lm_loss = _timed_fn(clock, hf_loss._causal_lm_loss, "loss")
    opt = getattr(engine, "basic_optimizer", None) or getattr(engine, "optimizer", None)
    inner = getattr(opt, "optimizer", opt)
    for o in {id(x): x for x in (opt, inner) if x is not None}.values():
        if hasattr(o, "_backward_step"):  # titan's ASDT stepping in backward: its updates are optimizer time
            clock.wrap(o, "_backward_step", "optimizer")


def _timed_fn(clock: _Clock, fn, name: str):
    def timed(*a, **kw):
        with clock.phase(name):
            return fn(*a, **kw)
    return timed


def _worker(argv: list[str]) -> None:
    """``--worker --result FILE --warmup W --profile 0|1`` and the example's own arguments."""
    import transformers
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--result", required=True)
    p.add_argument("--warm", type=int, required=True)
    p.add_argument("--profile", type=int, default=0)
    args, example_argv = p.parse_known_args(argv)
    from launch.bench.hf_finetune import _example
    example = _example()
    clock = _Clock()
    ends: list[float] = []
    steps_ms: list[float] = []

    class Timing(transformers.TrainerCallback):
        def on_train_begin(self, targs, state, control, **kw):
            if args.profile:
                _instrument(self.trainer, clock)

        def on_step_begin(self, targs, state, control, **kw):
            self._t0 = time.perf_counter()

        def on_step_end(self, targs, state, control, **kw):
            now = time.perf_counter()
            ends.append(now)
            if len(ends) > args.warm:
                steps_ms.append((now - self._t0) * 1e3)
            clock.on = len(ends) >= args.warm  # from the end of the warm-up on

        def on_train_end(self, targs, state, control, **kw):
            clock.on = False  # the example's eval after training is not a step

    timing = Timing()

    class Trainer(transformers.Trainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            timing.trainer = self

    res = example.main(example_argv, trainer_cls=Trainer, callbacks=[timing])
    trainer = res["trainer"]
    timed = len(ends) - args.warm
    if timed < 1:
        raise SystemExit(f"{len(ends)} steps ran, {args.warm} of them warm-up: nothing timed")
    tokens = trainer.args.per_device_train_batch_size * trainer.train_dataset.blocks.shape[1] * timed
    seconds = ends[-1] - ends[args.warm - 1] if args.warm else ends[-1] - ends[0]
    out = {"tokens_per_s": tokens / seconds, "seconds": seconds, "timed_steps": timed,
           "tokens_per_step": tokens // timed, "step_ms_median": statistics.median(steps_ms),
           "eval_after": res["eval_after"], "titan": res["titan"]}
    if args.profile:
        per = {k: v / timed * 1e3 for k, v in clock.total.items()}
        step_ms = seconds / timed * 1e3
        ms = {k: per.get(k, 0.0) for k in PHASES[:-1]}
        ms["rest"] = step_ms - sum(ms.values())
        out.update(step_ms=step_ms, ms=ms)
    Path(args.result).write_text(json.dumps(out))


# ------------------------------------------------------------------------------------------ driver
def _settings(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    return {"what": a.what, "model": model.name, "steps": a.steps, "warmup": a.warmup, "seq": a.seq,
            "batch": a.batch, "lr": a.lr, "seed": a.seed, "threads": os.environ.get("OMP_NUM_THREADS")}


def _run(a: argparse.Namespace, name: str, model: str, work: Path) -> dict[str, Any]:
    config, extra = ROWS[name]
    config_path = ROOT / "ds_configs" / config
    if name in OPTIMIZER_OVERRIDES:
        ds = json.loads(config_path.read_text())
        ds["titan"]["optimizer"].update(OPTIMIZER_OVERRIDES[name])
        config_path = work / f"{name}.ds_config.json"
        config_path.write_text(json.dumps(ds, indent=1))
    result = work / f"{name}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--result", str(result),
           "--warm", str(a.warmup), "--profile", str(int(a.what == "profile")),
           "--deepspeed", str(config_path), "--model", model,
           "--steps", str(a.warmup + a.steps), "--seq", str(a.seq), "--batch", str(a.batch), "--lr", str(a.lr),
           "--warmup", "0", "--seed", str(a.seed), "--eval-blocks", str(a.eval_blocks),
           "--output-dir", str(work / name), *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    log.info("row %s: %s", name, shlex.join(cmd))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"row {name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(result.read_text())


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row (in ROWS order): the median tokens/s over its repeats, min, max, ratio of medians to plain, and
    (profile) the mean ms of each phase over the repeats."""
    by: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by[r["config"]["row"]].append(r["result"])
    out = []
    for name in [n for n in ROWS if n in by] + sorted(n for n in by if n not in ROWS):
        res = by[name]
        tps = [r["tokens_per_s"] for r in res]
        row = {"row": name, "repeats": len(res), "tokens_per_s": statistics.median(tps), "min": min(tps),
               "max": max(tps), "tokens_per_step": res[0]["tokens_per_step"],
               "step_ms_median": statistics.median(r["step_ms_median"] for r in res)}
        if all("ms" in r for r in res):
            row["ms"] = {p: statistics.mean(r["ms"][p] for r in res) for p in PHASES}
            row["step_ms"] = statistics.mean(r["step_ms"] for r in res)
        out.append(row)
    base = next((t for t in out if t["row"] == "plain"), None)
    for t in out:
        t["vs_plain"] = t["tokens_per_s"] / base["tokens_per_s"] if base else None
    return out


def _write(out: Path, records: list[dict], settings: dict[str, Any], command: str) -> str:
    import torch
    rows = summarise(records)
    dates = sorted({r.get("date") or "" for r in records})
    head = [f"### SmolLM2-135M under the HF Trainer: {'phases of a step' if settings['what'] == 'profile' else 'tokens/s'}"
            f", plain AdamW, titan hf_asdt_8bit, torchao AdamW8bit", "",
            f"Command: `{command}`", "",
            f"Machine: {platform.machine()} {os.cpu_count()} cores, "
            f"{'CUDA' if torch.cuda.is_available() else 'CPU'}, OMP_NUM_THREADS={settings['threads']}; torch "
            f"{torch.__version__}, transformers {importlib.metadata.version('transformers')}, deepspeed "
            f"{importlib.metadata.version('deepspeed')}; {', '.join(dates)}. Settings {json.dumps(settings)}.", "",
            f"Workload: {settings['batch']} sequences of {settings['seq']} tokens per step (one micro-batch, one rank), "
            f"{settings['steps']} timed steps after {settings['warmup']} warm-up steps per run, one fresh process per "
            "run, rows alternated; tokens/s: median over the repeats (min-max beside it), vs plain: ratio of medians "
            "(launch/bench/hf_speed.py's docstring).", ""]
    if settings["what"] == "profile":
        cols = ["row", "step ms", *[f"{p} ms" for p in PHASES], "vs plain (tokens/s)", "repeats"]
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for t in rows:
            ms = t.get("ms", {})
            lines.append(f"| {t['row']} | {t.get('step_ms', 0):.0f} | "
                         + " | ".join(f"{ms.get(p, 0):.0f} ({100 * ms.get(p, 0) / t.get('step_ms', 1):.0f}%)"
                                      for p in PHASES)
                         + f" | {'-' if t['vs_plain'] is None else format(t['vs_plain'], '.2f')} | {t['repeats']} |")
    else:
        cols = ["row", "tokens/s", "min-max", "vs plain", "median step ms", "repeats"]
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for t in rows:
            lines.append(f"| {t['row']} | {t['tokens_per_s']:.1f} | {t['min']:.1f}-{t['max']:.1f} | "
                         f"{'-' if t['vs_plain'] is None else format(t['vs_plain'], '.2f')} | "
                         f"{t['step_ms_median']:.0f} | {t['repeats']} |")
    md = "\n".join(head + lines) + "\n"
    out.with_suffix(".md").write_text(md)
    return md


def open_store(path: Path, reuse_stale: bool = False) -> Store:
    return Store(path, suite="hf-speed", reuse_stale=reuse_stale,
                 code_paths=(*CODE_PATHS, "examples/hf_trainer.py", "launch/bench/hf_speed.py", "ds_configs"))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--what", choices=("speed", "profile"), default="speed")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {list(ROWS)}")
    p.add_argument("--model", default=None, help="a local HF folder, or tiny-llama (default: SmolLM2-135M)")
    p.add_argument("--steps", type=int, default=100, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (the LR schedule has no warm-up)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-blocks", type=int, default=2, help="held-out blocks of the (untimed) evals")
    p.add_argument("--out", default=None, help="<out>.md and <out>.jsonl (default: results/hf_speed, "
                                               "results/hf_speed_phases for --what profile)")
    add_store_args(p)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in argv:
        _worker(argv)
        return []
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    names = [r.strip() for r in a.rows.split(",") if r.strip()]
    unknown = [r for r in names if r not in ROWS]
    if unknown or a.steps < 1 or a.repeats < 1 or a.warmup < 1:
        raise SystemExit(f"unknown rows {unknown} (choose from {list(ROWS)}), or --steps/--repeats/--warmup < 1")
    from launch.bench.hf_finetune import fetch_smollm2
    model = Path(a.model) if a.model else fetch_smollm2()
    out = Path(a.out or ROOT / "results" / ("hf_speed_phases" if a.what == "profile" else "hf_speed"))
    out.parent.mkdir(parents=True, exist_ok=True)
    store = open_store(out.with_suffix(".jsonl"), a.reuse_stale)
    settings = _settings(a, model)
    command = "python launch/bench/hf_speed.py " + shlex.join(argv)
    with tempfile.TemporaryDirectory(prefix="titan_hf_speed_") as work:
        for rep in range(a.repeats):
            for name in names:
                config = {"row": name, "repeat": rep}
                rec = store.find(name, config=config, settings=settings)
                if rec is None:
                    res = _run(a, name, str(model), Path(work))
                    store.append(name, config=config, settings=settings, result=res)
                    log.info("%s repeat %d: %.1f tokens/s", name, rep, res["tokens_per_s"])
                _write(out, _records(store, settings, names, a.repeats), settings, command)
    md = _write(out, _records(store, settings, names, a.repeats), settings, command)
    print(md)
    return summarise(_records(store, settings, names, a.repeats))


def _records(store: Store, settings: dict, names: Sequence[str], repeats: int) -> list[dict]:
    return [r for r in store.latest(settings=settings) if r["row"] in names and r["config"]["repeat"] < repeats]


def table(out: str) -> None:
    """``python -m launch.bench table hf-speed --out OUT.md``: the table from ``OUT.jsonl``, running nothing, under
    the settings and command the existing ``OUT.md`` records."""
    md = Path(out)
    text = md.read_text()
    m = re.search(r"Settings (\{.*?\})\.\n", text)
    if m is None:
        raise SystemExit(f"{md}: no 'Settings {{...}}.' line to regenerate the table under")
    c = re.search(r"Command: `([^`]*)`", text)
    settings = json.loads(m.group(1))
    store = open_store(md.with_suffix(".jsonl"))
    _write(md, store.latest(settings=settings), settings, c.group(1) if c else "")


if __name__ == "__main__":
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    main()
