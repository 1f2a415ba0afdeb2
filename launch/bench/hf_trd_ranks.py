"""What TRD's TR-SVD init does to a pretrained model, by rank: SmolLM2-135M's held-out loss before fine-tuning.

    python launch/bench/hf_trd_ranks.py                          # ranks 8,16,32,64,128 (about 10 min on 2 cores)
    python launch/bench/hf_trd_ranks.py --ranks 16 --eval-blocks 4 --out results/tmp/trd_ranks.md   # smoke

For each rank, the dense pretrained model (``hf_finetune.py``'s SmolLM2-135M-Instruct folder) gets titan's TRD with
its default ``include`` (the block linears ``q/k/v/o_proj``, ``gate/up/down_proj``) and ``init: "tr_svd"``, the
same code ``titan_ds.initialize`` runs for ``launch/experiments/configs/hf_trd.json``; the row reports the weight compression on the
replaced linears (dense weights / ring weights, counted from the modules), the whole model's parameters, the
relative reconstruction error ``||W - W_tr|| / ||W||`` by projection (mean over the 30 layers), and the held-out
loss on the same corpus and blocks as ``hf_finetune.py`` (``examples/hf_trainer.py``'s data: transformers'
docstrings, every tenth module held out). Row ``dense`` is the model without TRD. No training here: what the rings
recover with fine-tuning is ``hf_finetune.py --rows titan_trd_r<R>``. Each finished row is recorded at once in
``<out>.jsonl`` (``launch/bench/store.py``: a rerun with the same settings and code skips it, ``--reuse-stale``
whatever the code); ``<out>`` (markdown) and ``<out>.png`` are rebuilt from it (``python -m launch.bench table
hf-trd-ranks --out <out>`` without running anything).
Run by hand, never in CI (the model file is not in CI; tests/inject/test_trd.py tests the code on small layers).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from launch.bench.store import CODE_PATHS, Store, add_store_args  # noqa: E402
from titan_ds.utils import get_logger  # noqa: E402

log = get_logger("titan_ds.bench.hf_trd_ranks")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _example():
    import importlib.util
    spec = importlib.util.spec_from_file_location("hf_trainer_example", ROOT / "examples" / "hf_trainer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def measure(model_dir: Path, rank: Optional[int], held_out: torch.Tensor, batch: int) -> dict[str, Any]:
    """One row: TRD at ``rank`` (None: the dense model) on a freshly loaded model, then the held-out loss."""
    from titan_ds.inject.trd import TensorRingLinear, TRDPolicy, apply_trd, init_errors
    ex = _example()
    model, _ = ex.build_model(str(model_dir), held_out.shape[1])
    row: dict[str, Any] = {"rank": rank, "params": sum(p.numel() for p in model.parameters())}
    if rank is not None:
        t0 = time.perf_counter()
        report = apply_trd(model, TRDPolicy(rank=rank, init="tr_svd"))
        row["tr_svd_s"] = time.perf_counter() - t0
        trs = [m for m in model.modules() if isinstance(m, TensorRingLinear)]
        dense = sum(m.in_features * m.out_features for m in trs)
        ring = sum(g.numel() for m in trs for g in m.cores)
        by_proj: dict[str, list[float]] = defaultdict(list)
        for name, err in init_errors(report).items():
            by_proj[name.rsplit(".", 1)[-1]].append(err)
        row.update(layers=len(trs), dense_weights=dense, ring_weights=ring, compression=dense / ring,
                   params=sum(p.numel() for p in model.parameters()),
                   error={k: sum(v) / len(v) for k, v in sorted(by_proj.items())},
                   error_max=max(max(v) for v in by_proj.values()), error_min=min(min(v) for v in by_proj.values()))
    t0 = time.perf_counter()
    row["eval_loss"] = ex.eval_loss(model, held_out, batch)
    row["eval_s"] = time.perf_counter() - t0
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    dense = next((r for r in rows if r["rank"] is None), None)
    head = ("| rank | compression (block linears) | params (M) | " + " | ".join(f"err {p}" for p in PROJECTIONS)
            + " | eval loss | vs dense |")
    lines = [head, "|" + "---|" * (len(PROJECTIONS) + 5)]
    for r in sorted(rows, key=lambda r: -1 if r["rank"] is None else r["rank"]):
        if r["rank"] is None:
            cells = ["dense", "1.0", f"{r['params'] / 1e6:.1f}"] + ["-"] * len(PROJECTIONS)
        else:
            cells = [str(r["rank"]), f"{r['compression']:.2f}x", f"{r['params'] / 1e6:.1f}"]
            cells += [f"{r['error'].get(p, float('nan')):.3f}" for p in PROJECTIONS]
        delta = f"{r['eval_loss'] - dense['eval_loss']:+.3f}" if dense and r is not dense else ""
        lines.append("| " + " | ".join(cells + [f"{r['eval_loss']:.4f}", delta]) + " |")
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    trd = sorted((r for r in rows if r["rank"] is not None), key=lambda r: r["rank"])
    dense = next((r for r in rows if r["rank"] is None), None)
    if not trd:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["compression"] for r in trd], [r["eval_loss"] for r in trd], "o-", label="TR-SVD init, no training")
    for r in trd:
        ax.annotate(f"r{r['rank']}", (r["compression"], r["eval_loss"]), textcoords="offset points", xytext=(4, 4))
    if dense:
        ax.axhline(dense["eval_loss"], color="k", ls="--", label="dense pretrained")
    ax.set_xscale("log")
    ax.set_xlabel("weight compression on the block linears (x)")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title("SmolLM2-135M: TRD's TR-SVD of pretrained weights")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="8,16,32,64,128")
    p.add_argument("--model", default=None, help="a local HF folder (default: SmolLM2-135M, fetched by hf_finetune)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--eval-blocks", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "results" / "hf_trd_ranks.md"))
    add_store_args(p)
    args = p.parse_args(argv)
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.model:
        model_dir = Path(args.model)
    else:
        import importlib.util
        spec = importlib.util.spec_from_file_location("hf_finetune", ROOT / "launch" / "bench" / "hf_finetune.py")
        hf = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(hf)
        model_dir = hf.fetch_smollm2()
    ex = _example()
    _, tokenizer = ex.build_model(str(model_dir), args.seq)
    train_texts, eval_texts = ex.corpus_texts()
    held_out = ex.token_blocks(eval_texts, tokenizer, args.seq)[: args.eval_blocks]
    settings = {"model": model_dir.name, "seq": args.seq, "batch": args.batch, "eval_blocks": len(held_out),
                "corpus": ex.corpus_digest(train_texts, eval_texts)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    store = open_store(out.with_suffix(".jsonl"), args.reuse_stale)
    for rank in [None] + [int(r) for r in args.ranks.split(",") if r]:
        if store.find(**_identity(rank, settings)) is not None:
            log.info("rank %s: already in %s, skipped", rank, store.path)
            continue
        row = measure(model_dir, rank, held_out, args.batch)
        log.info("rank %s: %s", rank, row)
        store.append(**_identity(rank, settings), result=row)  # at once: a rerun skips it
    _write(out, store, settings)
    log.info("table: %s\n%s", out, out.read_text())


def _identity(rank: Optional[int], settings: dict[str, Any]) -> dict[str, Any]:
    """A row's store key: its rank (None: dense) under the settings; no seed (nothing random: TR-SVD, eval)."""
    return {"row": "dense" if rank is None else f"rank{rank}", "config": {"rank": rank}, "settings": settings,
            "seed": 0}


def open_store(path: Path, reuse_stale: bool = False) -> Store:
    """``<out>.jsonl`` (``launch/bench/store.py``); rows from before the store read as code unknown."""
    def legacy(raw: dict) -> dict:
        return {**_identity(raw["rank"], raw["settings"]), "result": {k: v for k, v in raw.items() if k != "settings"}}
    return Store(path, suite="hf-trd-ranks", reuse_stale=reuse_stale, legacy=legacy,
                 code_paths=(*CODE_PATHS, "examples/hf_trainer.py", "launch/bench/hf_trd_ranks.py"))


def _write(out: Path, store: Store, settings: dict[str, Any]) -> None:
    mine = [rec["result"] for rec in store.latest(settings=settings)]
    out.write_text(f"Machine: {platform.machine()} {os.cpu_count()} cores; torch {torch.__version__}; settings "
                   f"{json.dumps(settings)}\n\n" + _table(mine) + "\n")
    _plot(mine, out.with_suffix(".png"))


def table(out: str) -> None:
    """``python -m launch.bench table hf-trd-ranks --out OUT.md``: the table and plot from ``OUT.jsonl``, running
    nothing, under the settings the existing ``OUT.md`` records."""
    import re
    m = re.search(r"settings (\{.*\})$", Path(out).read_text(), re.M)
    if m is None:
        raise SystemExit(f"{out}: no 'settings {{...}}' line to regenerate the table under")
    _write(Path(out), open_store(Path(out).with_suffix(".jsonl")), json.loads(m.group(1)))


if __name__ == "__main__":
    main()
