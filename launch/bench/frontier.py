"""Quality frontier: titan's profiles beside dense AdamW at its best lr and the low-memory optimizers a user would
pick instead, on the seed workload, over seeds, resumable.

    python launch/bench/frontier.py --steps 1000 --seeds 0,1                       # the full table (hours)
    python launch/bench/frontier.py --steps 3 --seeds 0 --rows 'adamw_lr1e-3,lion_lr1e-4,titan_exact' \\
        --out results/tmp/frontier                                                  # a smoke run

Rows (``--rows`` keeps those matching its comma-separated names or shell patterns, e.g. ``'adamw_*,titan_*'``):

- ``adamw_lr<lr>``: dense torch AdamW (betas 0.9/0.95, weight decay 0.1 on matrices) at each lr of
  ``--adamw-lrs``. The best lr is the lowest validation loss averaged over the seeds; its row is the reference
  of every delta, marked ``(best lr)``.
- peers, each through ``launch/train.py --optimizer``: ``adafactor_lr<lr>`` (torch.optim.Adafactor; its lr caps
  the relative step, grid ``--adafactor-lrs``, weight decay ``--adafactor-wd``); ``lion_lr<lr>`` (Lion from the
  lion-pytorch package, the paper's betas 0.9/0.99; Lion's rules: an lr grid ``--lion-lrs`` 3-10x below AdamW's
  and a weight decay ``--lion-wd`` 3-10x above it); ``adamw8bit`` and ``adamw4bit`` (torchao's quantized-state
  AdamW, run on the CPU through torch.compile) at the best AdamW lr, as drop-in replacements of AdamW;
  ``adamw4bit_bf16`` (torchao's recipe for bf16 training: the model in bf16 with no fp32 copy, ``AdamW4bit`` with
  ``bf16_stochastic_round=True``), the peer of ``titan_memory``'s bf16 weights. Fair peers, given what titan's
  exact pillars give titan (each built from the shipped profile file, so it follows it: the profile's
  ``titan.mlme`` section and its micro-batch and gradient accumulation, no titan optimizer), at the best AdamW lr:
  ``adamw_mlme_memory`` (torch AdamW + ``titan_memory``'s), ``adamw4bit_bf16_mlme_memory`` (the ``adamw4bit_bf16``
  peer + ``titan_memory``'s) and ``adamw8bit_mlme_balanced`` (torchao AdamW8bit + ``titan_balanced``'s).
- titan profiles: every ``ds_configs/titan_*.json`` as shipped (``titan_exact``, ``titan_balanced``,
  ``titan_memory``, ``titan_full`` first). A profile without ``titan.optimizer`` or a ds_config ``optimizer``
  section trains with AdamW at the best AdamW lr. A profile with gradient compression needs 2 ranks: it runs on 2 ranks at half the micro-batch each
  (the same 16 sequences per step), validated on the same batches (``--val-micro-batch``); its memory columns are
  one rank's.

Each (row, seed) runs ``launch/train.py`` in its own process (``launch.bench.harness.run_row``: same model, data, token
budget and schedule as every other benchmark) and is recorded in ``<out>.jsonl`` as soon as it finishes
(``launch/bench/store.py``). A rerun reuses a finished pair under the store's one rule: same row, config (its
ds_config, arguments, ranks and lr: editing a profile, or a change of the best AdamW lr for the rows that take
it, reruns that row), settings (steps, train args), seed and code (``--reuse-stale``: any code, marked
"(stale)" in the table). ``python -m launch.bench table frontier --out OUT`` (or ``--table-only``) rewrites the
table from ``<out>.jsonl`` without running anything. All AdamW rows run first (the best lr must be known), then the others seed by
seed, so a partial table is a whole frontier at the first seed. ``<out>.md``, ``.csv`` and ``.png`` are rebuilt
after every finished pair.

Per row: mean validation loss over the seeds; delta vs the best-lr AdamW row; the spread (max - min over the
seeds) beside it, and "no difference" where |delta| is below the larger of the row's and the reference's spread;
optimizer bytes per trainable parameter, measured from the optimizer's state tensors (all ranks;
``titan_ds.metrics.optimizer_state_bytes``); training-state MiB (params + grads + optimizer + activations, as
``titan_ds.metrics.accounted_memory`` counts them; peak over steps) and its fraction of the reference's; peak
RSS; tokens/s as a ratio to the reference (a noisy 2-core machine: ratios only); seconds per run.
"""
from __future__ import annotations

import argparse
import copy
import csv
import datetime
import fnmatch
import importlib.metadata
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

from launch.bench.harness import baseline_config, localise_paths, run_row, seed_verdict  # noqa: E402
from launch.bench.store import STALE_MARK, STALE_NOTE, Store, add_store_args, digest, stale_flags  # noqa: E402
from titan_ds.config import TitanConfig  # noqa: E402
from titan_ds.utils import get_logger  # noqa: E402

__all__ = ["Row", "build_rows", "summarise", "open_store", "table", "main"]

log = get_logger("titan_ds.bench.frontier")
MiB = 2**20
PROFILE_ORDER = ["titan_exact", "titan_balanced", "titan_memory", "titan_full"]  # then the other titan_*.json
# the fields of a run's summary (launch/train.py --summary-out) kept in the jsonl
KEEP = ("val_loss", "train_loss_last10", "tokens_per_s", "step_s", "memory", "peak_rss", "optimizer",
        "optimizer_state_bytes", "optimizer_bytes_per_param", "trainable_params", "world_size", "micro_batch",
        "model", "pillars", "skipped_steps", "val_history", "command")


@dataclass
class Row:
    """One configuration of the table. ``inherit_lr``: trains with ``--lr`` = the best AdamW lr."""
    name: str
    family: str  # "adamw", "peer" or "titan" (the plot's legend)
    cfg: dict[str, Any]
    args: list[str] = field(default_factory=list)
    ranks: int = 1
    inherit_lr: bool = False
    lr: Optional[float] = None  # the lr this row trains with, where the row fixes it

    def config(self, lr: Optional[float]) -> dict[str, Any]:
        """What makes this row's result: the store's config (its hash was the row's ``fingerprint`` before it)."""
        return {"cfg": self.cfg, "args": self.args, "ranks": self.ranks, "lr": lr}

    def fingerprint(self, lr: Optional[float]) -> str:
        return digest(self.config(lr))


def _floats(text: str, flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    for x in items:
        try:
            float(x)
        except ValueError:
            raise SystemExit(f"{flag}: {x!r} is not a number; give a comma-separated list such as 3e-4,1e-3")
    return items


def _profiles() -> list[Path]:
    found = {p.stem: p for d in ("ds_configs", "launch/experiments/configs") for p in (ROOT / d).glob("titan_*.json")}
    return [found[n] for n in PROFILE_ORDER if n in found] + sorted(p for n, p in found.items()
                                                                    if n not in PROFILE_ORDER)


def build_rows(a: argparse.Namespace) -> list[Row]:
    """Every row the options define, in run order within each family (before ``--rows`` filters them)."""
    base = baseline_config(0)
    rows = [Row(f"adamw_lr{lr}", "adamw", base, ["--optimizer", "adamw", "--lr", lr, "--weight-decay", "0.1"],
                lr=float(lr)) for lr in _floats(a.adamw_lrs, "--adamw-lrs")]
    rows += [Row(f"adafactor_lr{lr}", "peer", base,
                 ["--optimizer", "adafactor", "--lr", lr, "--weight-decay", str(a.adafactor_wd)], lr=float(lr))
             for lr in _floats(a.adafactor_lrs, "--adafactor-lrs")]
    rows += [Row(f"lion_lr{lr}", "peer", base, ["--optimizer", "lion", "--lr", lr, "--weight-decay", str(a.lion_wd)],
                 lr=float(lr)) for lr in _floats(a.lion_lrs, "--lion-lrs")]
    rows += [Row(n, "peer", base, ["--optimizer", n, "--weight-decay", "0.1"], inherit_lr=True)
             for n in ("adamw8bit", "adamw4bit", "adamw4bit_bf16")]
    rows += [Row(name, "peer", _with_exact_pillars(base, profile), ["--optimizer", opt, "--weight-decay", "0.1"],
                 inherit_lr=True) for name, (opt, profile) in FAIR_PEERS.items()
             if (ROOT / "ds_configs" / f"{profile}.json").exists()]
    for path in _profiles():
        cfg = json.loads(path.read_text())
        titan = TitanConfig.from_ds_config(cfg)
        own_opt = titan is not None and titan.optimizer is not None
        ds_opt = cfg.get("optimizer")  # e.g. titan_full: AdamW at its own lr (turned into SGD by precondition=rms)
        ranks = 2 if titan is not None and titan.compression is not None else 1
        lr = titan.optimizer.lr if own_opt else float(ds_opt["params"]["lr"]) if ds_opt else None
        rows.append(Row(path.stem, "titan", cfg, ranks=ranks, inherit_lr=not (own_opt or ds_opt), lr=lr))
    return rows


# fair peers: a peer optimizer given what a titan profile's exact pillars give titan
FAIR_PEERS = {"adamw_mlme_memory": ("adamw", "titan_memory"),
              "adamw4bit_bf16_mlme_memory": ("adamw4bit_bf16", "titan_memory"),
              "adamw8bit_mlme_balanced": ("adamw8bit", "titan_balanced")}
EXACT_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")  # the micro-batch/accumulation


def _with_exact_pillars(base: dict[str, Any], profile: str) -> dict[str, Any]:
    """``base`` (plain DeepSpeed) plus the shipped profile's exact pillars, read from its file so the row follows
    it: its ``titan.mlme`` section (nothing else of ``titan``: no titan optimizer) and its micro-batch and
    gradient accumulation (the same sequences per step)."""
    cfg = json.loads((ROOT / "ds_configs" / f"{profile}.json").read_text())
    mlme = (cfg.get("titan") or {}).get("mlme")
    if mlme is None:
        raise SystemExit(f"ds_configs/{profile}.json has no titan.mlme section: the fair peer rows take theirs from it")
    out = copy.deepcopy(base)
    out.update({k: cfg[k] for k in EXACT_KEYS if k in cfg})
    out["titan"] = {"mlme": copy.deepcopy(mlme)}
    return out


def _select(rows: list[Row], patterns: str) -> list[Row]:
    if not patterns:
        return rows
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    for p in pats:
        if not any(fnmatch.fnmatchcase(r.name, p) for r in rows):
            raise SystemExit(f"--rows: {p!r} matches no row; the rows are {[r.name for r in rows]}")
    return [r for r in rows if any(fnmatch.fnmatchcase(r.name, p) for p in pats)]


# ------------------------------------------------------------------------------------------ the store
_RECORD = ("row", "seed", "settings", "fingerprint")  # the store's keys, in the flat records summarise reads


def open_store(path: Path, reuse_stale: bool = False) -> Store:
    """``<out>.jsonl``; its lines from before the store (flat, keyed by row, settings, fingerprint and seed) read
    as code unknown."""
    def legacy(raw: dict) -> dict:
        return {"row": raw["row"], "config_hash": raw["fingerprint"], "settings": raw["settings"], "seed": raw["seed"],
                "result": {k: v for k, v in raw.items() if k not in _RECORD}}
    return Store(path, suite="frontier", reuse_stale=reuse_stale, legacy=legacy)


def _load(store: Store) -> list[dict[str, Any]]:
    """The store's records as the flat dicts :func:`summarise` reads (the record under ``_store``)."""
    return [{**rec["result"], "row": rec["row"], "seed": rec["seed"], "settings": rec["settings"],
             "fingerprint": rec["config_hash"], "_store": rec} for rec in store.latest()]


def _records(done: list[dict], row: Row, lr: Optional[float], settings: dict, seeds: Sequence[int]) -> dict[int, dict]:
    """This row's finished runs under these settings, by seed (the last one where a seed was run twice)."""
    fp = row.fingerprint(lr)
    return {r["seed"]: r for r in done
            if r["row"] == row.name and r["settings"] == settings and r["fingerprint"] == fp and r["seed"] in seeds}


def _best_adamw(rows: list[Row], done: list[dict], settings: dict, seeds: Sequence[int]) -> Optional[Row]:
    """The AdamW row with the lowest mean validation loss, among those with the most seeds finished."""
    have = [(r, _records(done, r, r.lr, settings, seeds)) for r in rows if r.family == "adamw"]
    have = [(r, recs) for r, recs in have if recs]
    if not have:
        return None
    most = max(len(recs) for _, recs in have)
    return min((r for r, recs in have if len(recs) == most),
               key=lambda r: statistics.fmean(x["val_loss"] for x in _records(done, r, r.lr, settings, seeds).values()))


def _row_lr(row: Row, best: Optional[Row], fallback: float) -> Optional[float]:
    if not row.inherit_lr:
        return row.lr
    return best.lr if best is not None else fallback


# ------------------------------------------------------------------------------------------ running
def _train_args(row: Row, lr: Optional[float], seed: int, common: list[str]) -> list[str]:
    args = [*common, *row.args, "--seed", str(seed)]
    if row.inherit_lr:
        args += ["--lr", repr(lr)]
    if row.ranks > 1:  # the same sequences per step, split over the ranks; validated on the same batches
        mb = _micro_batch(row.cfg, common)
        if mb % row.ranks:
            raise SystemExit(f"row {row.name} runs on {row.ranks} ranks: the micro-batch {mb} must divide by it")
        args += ["--micro-batch", str(mb // row.ranks), "--val-micro-batch", str(mb)]
    return args


def _micro_batch(cfg: dict, common: list[str]) -> int:
    if "--micro-batch" in common:
        return int(common[common.index("--micro-batch") + 1])
    return int(cfg.get("train_micro_batch_size_per_gpu", 16))


def _run_pair(row: Row, seed: int, lr: Optional[float], a: argparse.Namespace, settings: dict, work: Path,
              log_dir: Path) -> dict[str, Any]:
    name = f"{row.name}_s{seed}"
    rdir = work / name
    rdir.mkdir(parents=True, exist_ok=True)
    cfg = localise_paths(copy.deepcopy(row.cfg), rdir)
    args = _train_args(row, lr, seed, shlex.split(a.train_args))
    log.info("run %s (seed %d, %d rank(s), lr %s)", row.name, seed, row.ranks, lr)
    t0 = time.perf_counter()
    res = run_row(name, cfg, steps=a.steps, num_ranks=row.ranks, extra_args=args, workdir=rdir,
                  timeout=a.row_timeout, log_dir=log_dir)
    rec = {"row": row.name, "seed": seed, "family": row.family, "settings": settings, "lr": lr,
           "ranks": row.ranks, "fingerprint": row.fingerprint(lr), "wall_s": time.perf_counter() - t0,
           "status": res["status"]}
    if res["status"] == "ok":
        rec.update({k: res.get(k) for k in KEEP})
        rec["offload_bytes"] = sum(f.stat().st_size for d in set(_offload_dirs(cfg)) if d.is_dir()
                                   for f in d.rglob("*") if f.is_file())
    else:
        rec["log_tail"] = res.get("log_tail", "")
    return rec


def _offload_dirs(cfg: Any) -> list[Path]:
    """The folders a (localised) ds_config offloads to: every ``nvme_path`` and HMS spill-tier ``path``."""
    if isinstance(cfg, dict):
        found = [Path(v) for k, v in cfg.items() if k == "nvme_path"]
        found += [Path(t["path"]) for t in cfg.get("spill_tiers", [])]
        return found + [d for v in cfg.values() for d in _offload_dirs(v)]
    if isinstance(cfg, list):
        return [d for v in cfg for d in _offload_dirs(v)]
    return []


# ------------------------------------------------------------------------------------------ the table
def _spread(xs: list[float]) -> Optional[float]:
    return max(xs) - min(xs) if len(xs) > 1 else None


def summarise(rows: list[Row], done: list[dict], failed: dict[str, dict], settings: dict, seeds: Sequence[int],
              fallback_lr: float, show: Optional[set[str]] = None) -> list[dict[str, Any]]:
    """One dict per row: means over the finished seeds, deltas against the best-lr AdamW row, a verdict. The
    rows listed are those in ``show`` (default: all) and every row with a finished seed under these settings."""
    best = _best_adamw(rows, done, settings, seeds)
    ref = None
    if best is not None:
        rr = list(_records(done, best, best.lr, settings, seeds).values())
        ref = {"val": statistics.fmean(r["val_loss"] for r in rr), "spread": _spread([r["val_loss"] for r in rr]),
               "mem": statistics.fmean(r["memory"]["training_state"] for r in rr),
               "tps": statistics.fmean(r["tokens_per_s"] for r in rr)}
    newest = [max((r["_store"] for r in done if "_store" in r), key=lambda x: x.get("date") or "", default=None)]
    newest = [n for n in newest if n is not None]
    out = []
    for row in rows:
        lr = _row_lr(row, best, fallback_lr)
        recs = [r for _, r in sorted(_records(done, row, lr, settings, seeds).items())]
        if not recs and show is not None and row.name not in show:
            continue
        stale = any(stale_flags([*(r["_store"] for r in recs if "_store" in r), *newest])[:len(recs)])
        t: dict[str, Any] = {"config": row.name + (" (best lr)" if row is best else "") + (STALE_MARK if stale else ""),
                             "family": row.family,
                             "lr": lr, "ranks": row.ranks, "seeds": f"{len(recs)}/{len(seeds)}"}
        if not recs:
            t["status"] = failed[row.name]["status"] if row.name in failed else "pending"
            out.append(t)
            continue
        vals = [r["val_loss"] for r in recs]
        t.update(val_loss=statistics.fmean(vals), val_per_seed="/".join(f"{v:.3f}" for v in vals),
                 spread=_spread(vals))
        if ref is not None:
            t["delta"] = t["val_loss"] - ref["val"]
            t["verdict"] = _verdict(row is best, t["delta"], t["spread"], ref["spread"])
        mem = [r["memory"] for r in recs]
        t.update(optim_B_per_param=statistics.fmean(r["optimizer_bytes_per_param"] for r in recs),
                 optim_state_MiB=statistics.fmean(r["optimizer_state_bytes"] for r in recs) / MiB,
                 train_state_MiB=statistics.fmean(m["training_state"] for m in mem) / MiB,
                 params_MiB=statistics.fmean(m["parameters"] for m in mem) / MiB,
                 grads_MiB=statistics.fmean(m["gradients"] for m in mem) / MiB,
                 optim_MiB=statistics.fmean(m["optimizer_state"] for m in mem) / MiB,
                 activ_MiB=statistics.fmean(m["activations"] for m in mem) / MiB,
                 offload_MiB=statistics.fmean(r.get("offload_bytes", 0) for r in recs) / MiB,
                 peak_rss_MiB=max(r["peak_rss"] for r in recs) / MiB,
                 trainable_params=recs[0]["trainable_params"],
                 wall_s=statistics.fmean(r["wall_s"] for r in recs))
        if ref is not None:
            t["mem_vs_adamw"] = t["train_state_MiB"] * MiB / ref["mem"]
            t["tokens_per_s_ratio"] = statistics.fmean(r["tokens_per_s"] for r in recs) / ref["tps"]
        t["status"] = "ok" if len(recs) == len(seeds) else "partial"
        if row.name in failed:
            t["status"] = f"partial; {failed[row.name]['status']}"
        out.append(t)
    return out


def _verdict(is_ref: bool, delta: float, spread: Optional[float], ref_spread: Optional[float]) -> str:
    if is_ref:
        return "reference"
    if spread is None or ref_spread is None:
        return "one seed: no spread"
    return seed_verdict(delta, max(spread, ref_spread))


COLUMNS = ["config", "family", "lr", "ranks", "seeds", "val_loss", "delta", "spread", "verdict", "val_per_seed",
           "optim_B_per_param", "optim_state_MiB", "train_state_MiB", "mem_vs_adamw", "params_MiB", "grads_MiB",
           "optim_MiB", "activ_MiB", "offload_MiB", "peak_rss_MiB", "tokens_per_s_ratio", "wall_s", "trainable_params", "status"]
FORMATS = {"val_loss": ".4f", "delta": "+.4f", "spread": ".4f", "optim_B_per_param": ".2f", "mem_vs_adamw": ".3f",
           "tokens_per_s_ratio": ".2f", "wall_s": ".0f", "trainable_params": ",d", "lr": "g", "ranks": "d"}


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, FORMATS.get(key, ".1f"))
    return str(v)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _write(out: Path, table: list[dict], a: argparse.Namespace, command: str, failed: dict[str, dict],
           date: str = "") -> None:
    import torch
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(table)
    best = next((t for t in table if t.get("verdict") == "reference"), None)
    model = "GPT 6x256" if not a.train_args else f"GPT (train args {a.train_args!r})"
    head = [
        "### Quality frontier: titan profiles, dense AdamW (best lr of a grid) and low-memory peers", "",
        f"Command: `{command}`",
        f"Machine: {platform.machine()} {os.cpu_count()} cores, "
        f"{'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU only'}; torch "
        f"{torch.__version__}, deepspeed {_version('deepspeed')}, lion-pytorch {_version('lion-pytorch')}, torchao "
        f"{_version('torchao')}; {date or datetime.date.today().isoformat()}",
        f"Workload: {model}, seed workload data, {a.steps} steps, seeds {a.seeds}, 16 sequences of 128 bytes per "
        "step, warm-up 50 + cosine, clipping 1.0, validation on the fixed held-out batches.",
        f"Reference: {best['config'] if best else 'none yet (no AdamW row finished)'}. delta = mean val loss - the "
        "reference's; spread = max - min over the seeds; 'no difference' where |delta| < the larger of the row's "
        "and the reference's spread. optim_B_per_param: bytes of the optimizer's state tensors (all ranks) per "
        "trainable parameter, measured. train_state_MiB: params + grads + optimizer (ZeRO's fp32 masters "
        "included) + activations, accounted, peak over steps; one rank's for 2-rank rows; what a row offloads to "
        "NVMe is not in it but in offload_MiB (the files in its nvme paths at the end). Timings are ratios.", ""]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(k, t.get(k)) for k in COLUMNS) + " |" for t in table]
    notes = [f"- {name}: {f['status']}; last log lines: `{_last_error(f.get('log_tail', ''))}`"
             for name, f in failed.items()]
    md = "\n".join(head + lines) + "\n" + (("\nFailed in this invocation:\n" + "\n".join(notes) + "\n") if notes else "")
    if any(STALE_MARK in str(t["config"]) for t in table):
        md += "\n" + STALE_NOTE + "\n"
    out.with_suffix(".md").write_text(md)
    _plot(out.with_suffix(".png"), table, a)


def _last_error(tail: str) -> str:
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    errs = [ln for ln in lines if "Error" in ln or "error" in ln or "SystemExit" in ln]
    return (errs or lines or ["-"])[-1][:300].replace("`", "'")


def _plot(path: Path, table: list[dict], a: argparse.Namespace) -> None:
    from titan_ds.plot import plot_frontier
    pts = []
    for t in table:
        if t.get("val_loss") is None:
            continue
        recs = [float(x) for x in t["val_per_seed"].split("/")]
        label = t["config"] + (" (2 ranks)" if t["ranks"] > 1 else "") + \
            (f" (+{t['offload_MiB']:.0f} MiB on disk)" if t.get("offload_MiB") else "")
        pts.append({"label": label, "family": t["family"], "x": t["train_state_MiB"], "y": t["val_loss"],
                    "ylo": min(recs) if len(recs) > 1 else None, "yhi": max(recs) if len(recs) > 1 else None,
                    "best": t.get("verdict") == "reference"})
    if pts:
        plot_frontier(pts, str(path), title=f"seed workload, {a.steps} steps, seeds {a.seeds} (bars: min-max)")


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seeds", default="0,1", help="comma-separated training seeds")
    p.add_argument("--rows", default="", help="comma-separated row names or shell patterns (default: all)")
    p.add_argument("--out", default=str(ROOT / "results" / "frontier"), help="writes <out>.md/.csv/.jsonl/.png")
    p.add_argument("--adamw-lrs", default="3e-4,1e-3,3e-3")
    p.add_argument("--lion-lrs", default="3e-5,1e-4,3e-4", help="Lion: 3-10x below AdamW's grid")
    p.add_argument("--lion-wd", type=float, default=1.0, help="Lion: 3-10x AdamW's 0.1 (lr x wd kept)")
    p.add_argument("--adafactor-lrs", default="3e-3,1e-2,3e-2", help="Adafactor: the cap of its relative step")
    p.add_argument("--adafactor-wd", type=float, default=0.01, help="torch's default; lr x wd near AdamW's")
    p.add_argument("--fallback-lr", type=float, default=1e-3,
                   help="lr of the rows that take the best AdamW lr while no AdamW row has finished")
    p.add_argument("--train-args", default="", help="extra launch/train.py flags for every row (smoke runs)")
    p.add_argument("--row-timeout", type=float, default=None, help="seconds per (row, seed) run")
    p.add_argument("--table-only", action="store_true",
                   help="rewrite <out>.md/.csv/.png from <out>.jsonl and run nothing (the same options select rows)")
    add_store_args(p)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds: {a.seeds!r} is not a comma-separated list of integers")
    rows = build_rows(a)
    selected = _select(rows, a.rows)
    show = {r.name for r in selected}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    store, log_dir = open_store(out.with_suffix(".jsonl"), a.reuse_stale), out.parent / "logs" / out.stem
    log_dir.mkdir(parents=True, exist_ok=True)
    settings = {"steps": a.steps, "train_args": a.train_args}
    command = "python launch/bench/frontier.py " + shlex.join(argv)
    done, failed = _load(store), {}
    if a.table_only:
        return _table(out, rows, done, failed, settings, seeds, a, show)
    order = [(r, s) for r in selected if r.family == "adamw" for s in seeds] + \
            [(r, s) for s in seeds for r in selected if r.family != "adamw"]
    with tempfile.TemporaryDirectory(prefix="titan_frontier_") as work:
        for row, seed in order:
            lr = _row_lr(row, _best_adamw(rows, done, settings, seeds), a.fallback_lr)
            if store.find(row.name, config=row.config(lr), settings=settings, seed=seed) is not None:
                log.info("skip %s seed %d: finished, in %s", row.name, seed, store.path)
                continue
            if row.inherit_lr and _best_adamw(rows, done, settings, seeds) is None:
                log.warning("%s takes the best AdamW lr, but no AdamW row has finished: lr %g (--fallback-lr)",
                            row.name, lr)
            rec = _run_pair(row, seed, lr, a, settings, Path(work), log_dir)
            if rec["status"] == "ok":  # recorded at once: a rerun skips it
                store.append(row.name, config=row.config(lr), settings=settings, seed=seed,
                             result={k: v for k, v in rec.items() if k not in _RECORD})
                done = _load(store)
            else:
                log.error("%s seed %d: %s", row.name, seed, rec["status"])
                failed[row.name] = rec
            _write(out, summarise(rows, done, failed, settings, seeds, a.fallback_lr, show), a, command, failed)
    return _table(out, rows, done, failed, settings, seeds, a, show, command)


def _table(out: Path, rows: list[Row], done: list[dict], failed: dict, settings: dict, seeds: Sequence[int],
           a: argparse.Namespace, show: set[str], command: Optional[str] = None) -> list[dict[str, Any]]:
    """Write the table from the records (``command`` None: the one the existing ``<out>.md`` shows)."""
    if command is None:
        import re
        old = out.with_suffix(".md").read_text() if out.with_suffix(".md").exists() else ""
        m = re.search(r"Command: `([^`]*)`", old)
        command = m.group(1) if m else "python launch/bench/frontier.py " + shlex.join(sys.argv[1:])
    table = summarise(rows, done, failed, settings, seeds, a.fallback_lr, show)
    _write(out, table, a, command, failed, date=max((r["_store"].get("date") or "" for r in done), default=""))
    print(out.with_suffix(".md").read_text())
    return table


def table(out: str, argv: Sequence[str] = ()) -> list[dict[str, Any]]:
    """``python -m launch.bench table frontier --out OUT [frontier options]``: the table from the store only.
    Without options, those of the command the existing ``<out>.md`` records."""
    import re
    md = Path(out).with_suffix(".md")
    if not argv and md.exists():
        m = re.search(r"Command: `python launch/bench/frontier.py ([^`]*)`", md.read_text())
        argv = [x for x in shlex.split(m.group(1)) if x] if m else []
        argv = [x for i, x in enumerate(argv) if x != "--out" and (i == 0 or argv[i - 1] != "--out")]
    return main([*argv, "--out", str(out), "--table-only"])


if __name__ == "__main__":
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    main()
