"""Training speed: tokens/s of titan's profiles beside plain DeepSpeed + AdamW and the fair peers, with MFU, on the
seed GPT.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 flock /tmp/titan_timed.lock \\
        python launch/bench/speed.py --steps 100 --repeats 3                          # the table (the lead runs it)
    python launch/bench/speed.py --steps 5 --repeats 1 --out results/tmp/speed         # a smoke run

Each (row, repeat) trains through ``launch/train.py`` in a fresh process (``launch.bench.harness.run_row``, as the
frontier runs its rows) for ``--steps`` + 3 steps; train.py's tokens/s leaves out its first 3 steps (one-off
allocations, torch.compile of torchao's optimizers), so ``--steps`` steps are timed. Rows alternate within a repeat
(A B C, A B C, ...) so that a slow spell of the shared machine falls on every row. Per row: the median tokens/s over
the repeats, its min and max, and the ratio of the medians to ``plain``'s.

MFU = model FLOPs per token x tokens/s / the machine's matmul peak. FLOPs per token = 6 N + 12 L T d (N the
trainable parameters, embeddings included; L layers, T the context, d the width: the attention scores and their
product with the values, forward and backward, as in PaLM's appendix B); recomputation is not counted (model FLOPs,
not hardware FLOPs). The peak is measured in the same invocation before the rows: the best of ``--peak-reps``
``torch.mm`` of two ``--peak-n`` square matrices, fp32 and bf16, at this process's intra-op thread count (the
children get the same ``OMP_NUM_THREADS``); a row whose weights are bf16 (titan_memory, adamw4bit_bf16) is divided by
the bf16 peak where that is the faster one (a GPU), else by the fp32 one (this CPU has no bf16 instructions, and
MLME's attention and loss accumulate in fp32); the others by the fp32 peak.

Rows (``--rows``: comma-separated names or shell patterns):

- ``plain``: ds_configs/baseline_adamw.json, torch AdamW at lr 1e-3 (16 sequences of 128 per step);
- ``titan_exact``, ``titan_balanced``, ``titan_memory``: the shipped profiles (titan_exact trains with AdamW, lr 1e-3);
- ``titan_exact_no_recompute``: titan_exact with ``mlme.recompute_blocks`` false;
- ``titan_exact_replay``, ``titan_balanced_replay``, ``titan_memory_replay``: the profile with ``mlme.recompute_ffn``
  ``"replay"`` (a recomputed block's replay runs StripeFFN's forward again; the shipped ``"in_backward"`` skips it);
- ``titan_exact_pre``, ``titan_exact_no_recompute_pre``: the same two with ``mlme.stripe_ffn_saves``
  ``"pre_activation"`` (StripeFFN keeps its input projections' outputs and recomputes no matmul in backward);
- the fair peers, what the exact pillars give any optimizer: ``adamw+memory_mlme`` (plain AdamW with titan_memory's
  ``mlme`` section and its 4 micro-batches of 4), ``adamw4bit_bf16+memory_mlme`` (torchao AdamW4bit with
  bf16_stochastic_round over bf16 weights, as the frontier's ``adamw4bit_bf16`` row, + the same) and
  ``adamw8bit+balanced_mlme`` (torchao AdamW8bit + titan_balanced's ``mlme`` section).

Every finished (row, repeat) is appended to ``<out>.jsonl`` at once, keyed by the row's config and arguments and
the settings; a rerun skips it. ``<out>.md`` and ``<out>.png`` are rebuilt after each.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import fnmatch
import hashlib
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from launch.bench.harness import ResultLog, baseline_config, run_row  # noqa: E402

__all__ = ["Row", "build_rows", "flops_per_token", "matmul_peak", "summarise", "main"]

WARM = 3  # launch/train.py leaves its first 3 steps out of tokens_per_s
BF16_ROWS_OPTIMIZERS = ("adamw4bit_bf16",)  # launch/train.py casts the model to bf16 for these


@dataclass
class Row:
    name: str
    cfg: dict[str, Any]
    args: list[str] = field(default_factory=list)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps([self.cfg, self.args], sort_keys=True).encode()).hexdigest()[:16]

    @property
    def bf16_weights(self) -> bool:
        opt = (self.cfg.get("titan") or {}).get("optimizer") or {}
        return opt.get("weight_dtype") == "bf16" or any(o in self.args for o in BF16_ROWS_OPTIMIZERS)


def _profile(name: str) -> dict[str, Any]:
    return json.loads((ROOT / "ds_configs" / f"{name}.json").read_text())


def _with_mlme_of(profile: str) -> dict[str, Any]:
    """The plain config with ``profile``'s ``titan.mlme`` section, micro-batch and gradient accumulation."""
    src = _profile(profile)
    keys = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    return baseline_config(0, titan={"mlme": copy.deepcopy(src["titan"]["mlme"])}, **{k: src[k] for k in keys})


def build_rows() -> list[Row]:
    """Every row, in run order (module docstring)."""
    adamw = ["--optimizer", "adamw", "--lr", "1e-3"]
    no_rec = _profile("titan_exact")
    no_rec["titan"]["mlme"]["recompute_blocks"] = False
    pre = _profile("titan_exact")
    pre["titan"]["mlme"]["stripe_ffn_saves"] = "pre_activation"
    no_rec_pre = copy.deepcopy(no_rec)
    no_rec_pre["titan"]["mlme"]["stripe_ffn_saves"] = "pre_activation"
    def replay(name: str) -> dict[str, Any]:
        cfg = _profile(name)
        cfg["titan"]["mlme"]["recompute_ffn"] = "replay"
        return cfg
    return [Row("plain", baseline_config(0), adamw),
            Row("titan_exact", _profile("titan_exact"), adamw),
            Row("titan_exact_replay", replay("titan_exact"), adamw),
            Row("titan_exact_no_recompute", no_rec, adamw),
            Row("titan_exact_pre", pre, adamw),
            Row("titan_exact_no_recompute_pre", no_rec_pre, adamw),
            Row("titan_balanced", _profile("titan_balanced")),
            Row("titan_balanced_replay", replay("titan_balanced")),
            Row("titan_memory", _profile("titan_memory")),
            Row("titan_memory_replay", replay("titan_memory")),
            Row("adamw+memory_mlme", _with_mlme_of("titan_memory"), adamw),
            Row("adamw4bit_bf16+memory_mlme", _with_mlme_of("titan_memory"),
                ["--optimizer", "adamw4bit_bf16", "--lr", "1e-3"]),
            Row("adamw8bit+balanced_mlme", _with_mlme_of("titan_balanced"),
                ["--optimizer", "adamw8bit", "--lr", "1e-3"])]


def _select(rows: list[Row], patterns: str) -> list[Row]:
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    for p in pats:
        if not any(fnmatch.fnmatchcase(r.name, p) for r in rows):
            raise SystemExit(f"--rows: {p!r} matches no row; the rows are {[r.name for r in rows]}")
    return [r for r in rows if not pats or any(fnmatch.fnmatchcase(r.name, p) for p in pats)]


def flops_per_token(params: int, layers: int, context: int, width: int) -> float:
    """Model training FLOPs per token: 6 N + 12 L T d (module docstring)."""
    return 6.0 * params + 12.0 * layers * context * width


def matmul_peak(n: int, reps: int) -> dict[str, float]:
    """Best FLOP/s of ``torch.mm`` of two n x n matrices, fp32 and bf16, at this process's thread count."""
    import torch
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)  # warm-up
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        out[name] = 2.0 * n ** 3 / best
    return out


def summarise(rows: list[Row], done: dict[tuple, dict], peak: dict[str, float]) -> list[dict[str, Any]]:
    """One dict per row with finished repeats: median/min/max tokens/s, ratio to plain, MFU."""
    table = []
    for row in rows:
        recs = [r for (name, fp, _), r in sorted(done.items(), key=lambda kv: kv[0][2])
                if name == row.name and fp == row.fingerprint()]
        if not recs:
            continue
        tps = [r["tokens_per_s"] for r in recs]
        m = recs[0]["model"]
        fpt = flops_per_token(recs[0]["trainable_params"], m["n_layer"], m["block_size"], m["n_embd"])
        # a bf16-weight row may run parts in fp32 (MLME's fp32 accumulation): its peak is the faster of the two
        dtype = "bf16" if row.bf16_weights and peak["bf16"] > peak["fp32"] else "fp32"
        table.append({"row": row.name, "repeats": len(recs), "tokens_per_s": statistics.median(tps),
                      "min": min(tps), "max": max(tps), "flops_per_token": fpt, "peak": dtype,
                      "mfu": fpt * statistics.median(tps) / peak[dtype],
                      "micro_batch": recs[0]["micro_batch"], "optimizer": recs[0].get("optimizer"), "model": m,
                      "activations_mib": max((r["memory"]["activations"] / 2**20 for r in recs
                                              if (r.get("memory") or {}).get("activations") is not None),
                                             default=None)})
    base = next((t for t in table if t["row"] == "plain"), None)
    for t in table:
        t["vs_plain"] = t["tokens_per_s"] / base["tokens_per_s"] if base else None
    return table


def _write(out: Path, table: list[dict], peak: dict[str, float], a: argparse.Namespace, command: str) -> None:
    import torch
    head = ["### Training speed on the seed GPT: titan profiles, plain AdamW and the fair peers", "",
            f"Command: `{command}`",
            f"Machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} intra-op thread(s); {datetime.date.today().isoformat()}. Matmul peak "
            f"(torch.mm {a.peak_n}x{a.peak_n}, best of {a.peak_reps}, this invocation): fp32 "
            f"{peak['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peak['bf16'] / 1e9:.1f} GFLOP/s.",
            f"Workload: GPT {_shape(table)}, 16 sequences per step; {a.steps} timed steps per run after {WARM} "
            f"warm-up steps, {a.repeats} repeat(s), rows alternated. tokens/s: median over the repeats (min-max "
            "beside it); vs plain: ratio of medians. MFU = (6 N + 12 L T d) x tokens/s / the matmul peak of the "
            "row's weight dtype, or fp32's where that is faster (N trainable parameters with embeddings, L layers, T context, d width). "
            "activations MiB: launch/train.py's accounted peak of saved activations, the largest over the repeats "
            "('-': not recorded).", ""]
    cols = ["row", "tokens/s", "min-max", "vs plain", "MFU %", "peak", "micro-batch", "optimizer", "repeats",
            "activations MiB"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for t in table:
        vs = "-" if t["vs_plain"] is None else f"{t['vs_plain']:.2f}"
        act = "-" if t.get("activations_mib") is None else f"{t['activations_mib']:.1f}"
        lines.append(f"| {t['row']} | {t['tokens_per_s']:.0f} | {t['min']:.0f}-{t['max']:.0f} | {vs} | "
                     f"{100 * t['mfu']:.1f} | {t['peak']} | {t['micro_batch']} | {t['optimizer']} | {t['repeats']} "
                     f"| {act} |")
    out.with_suffix(".md").write_text("\n".join(head + lines) + "\n")
    _plot(out.with_suffix(".png"), table)


def _shape(table: list[dict]) -> str:
    m = table[0]["model"] if table else {}
    return f"{m.get('n_layer')}x{m.get('n_embd')}, context {m.get('block_size')}"


def _plot(path: Path, table: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if not table:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    names = [t["row"] for t in table]
    med = [t["tokens_per_s"] for t in table]
    err = [[m - t["min"] for m, t in zip(med, table)], [t["max"] - m for m, t in zip(med, table)]]
    ax.bar(names, med, yerr=err, capsize=3, color=["gray" if n == "plain" else "tab:blue" for n in names])
    ax.set_ylabel("tokens/s (median; bars: min-max)")
    ax.tick_params(axis="x", rotation=30)
    for lbl in ax.get_xticklabels():
        lbl.set_ha("right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="timed steps per run (3 warm-up steps are added)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default="", help="comma-separated row names or shell patterns (default: all)")
    p.add_argument("--out", default=str(ROOT / "results" / "speed"), help="writes <out>.md/.jsonl/.png")
    p.add_argument("--peak-n", type=int, default=2048, help="matrix size of the matmul peak")
    p.add_argument("--peak-reps", type=int, default=5)
    p.add_argument("--train-args", default="--val-batches 1",
                   help="extra launch/train.py flags for every row (the end-of-run validation is not timed)")
    p.add_argument("--row-timeout", type=float, default=None, help="seconds per run")
    return p.parse_args(argv)


def _finished(store: ResultLog, settings: str, repeats: int) -> dict[tuple, dict]:
    """(row, fingerprint, repeat) -> record, for the runs under these settings and the first ``repeats`` repeats."""
    return {k[:3]: v for k, v in store.rows.items() if k[3] == settings and k[2] < repeats}


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.steps < 1 or a.repeats < 1:
        raise SystemExit(f"--steps and --repeats must be >= 1, got {a.steps} and {a.repeats}")
    rows = _select(build_rows(), a.rows)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = out.parent / "logs" / out.stem
    log_dir.mkdir(parents=True, exist_ok=True)
    settings = json.dumps({"steps": a.steps, "train_args": a.train_args}, sort_keys=True)
    store = ResultLog(out.with_suffix(".jsonl"), key=lambda r: (r["row"], r["fingerprint"], r["repeat"], r["settings"]))
    peak = matmul_peak(a.peak_n, a.peak_reps)
    command = "python launch/bench/speed.py " + shlex.join(argv)
    extra = shlex.split(a.train_args)
    with tempfile.TemporaryDirectory(prefix="titan_speed_") as work:
        for rep in range(a.repeats):
            for row in rows:
                def run(row=row, rep=rep) -> dict[str, Any]:
                    res = run_row(f"{row.name}_r{rep}", row.cfg, steps=a.steps + WARM, extra_args=[*row.args, *extra],
                                  workdir=Path(work), timeout=a.row_timeout, log_dir=log_dir)
                    if res["status"] != "ok":
                        raise SystemExit(f"{row.name} repeat {rep}: {res['status']}\n{res.get('log_tail', '')}")
                    keep = ("tokens_per_s", "step_s", "trainable_params", "model", "micro_batch", "optimizer",
                            "command", "memory")
                    return {"row": row.name, "fingerprint": row.fingerprint(), "repeat": rep, "settings": settings,
                            "date": datetime.date.today().isoformat(), **{k: res.get(k) for k in keep}}
                store.get((row.name, row.fingerprint(), rep, settings), run,
                          lambda r: f"{r['row']} repeat {r['repeat']}: {r['tokens_per_s']:.0f} tokens/s")
                _write(out, summarise(rows, _finished(store, settings, a.repeats), peak), peak, a, command)
    table = summarise(rows, _finished(store, settings, a.repeats), peak)
    _write(out, table, peak, a, command)
    print(out.with_suffix(".md").read_text())
    return table


if __name__ == "__main__":
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    main()
