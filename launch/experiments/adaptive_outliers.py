"""Answered: the row second moment moves single coordinates of SmolLM2's down_proj by up to 38.8x the lr, hence `update_clip`; in results/adaptive_outliers.md and docs/asdt.md, docs/integrations.md.

How far ASDT's adaptive step (one second moment per row) moves single coordinates on a pretrained model.

    python launch/experiments/adaptive_outliers.py                 # SmolLM2-135M (fetched by hf_finetune.py)

At the first step (bias-corrected) Adam's update is sign(g): every coordinate moves by lr. ASDT's adaptive
update with ``granularity: "row"`` is c = g / RMS_row(g): the row's RMS step is lr, but a coordinate whose
gradient is far above its row's RMS moves by |c| x lr. This prints, per weight matrix, the largest |c|, the
0.999 quantile and the fractions above 3 and 10 on one batch of the example's corpus (``examples/hf_trainer.py``;
2 blocks of 128 tokens), and writes ``results/adaptive_outliers.md``. No training; about a minute on CPU.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a local HF folder (default: SmolLM2-135M, fetched)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "results" / "adaptive_outliers.md"))
    a = p.parse_args()
    spec = importlib.util.spec_from_file_location("hf_example", ROOT / "examples" / "hf_trainer.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    if a.model is None:
        spec = importlib.util.spec_from_file_location("hf_finetune", ROOT / "launch" / "bench" / "hf_finetune.py")
        hf = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(hf)
        a.model = str(hf.fetch_smollm2())
    torch.manual_seed(0)
    model, tok = ex.build_model(a.model, a.seq)
    train, _ = ex.corpus_texts()
    x = ex.token_blocks(train, tok, a.seq)[: a.blocks]
    model(input_ids=x, labels=x).loss.backward()
    rows = []
    for name, w in model.named_parameters():
        if w.grad is None or w.dim() < 2:
            continue
        g = w.grad.float()
        c = (g / (g.pow(2).mean(dim=1, keepdim=True).sqrt() + 1e-8)).abs().flatten()
        sample = c[torch.randperm(c.numel(), generator=torch.Generator().manual_seed(0))[:2_000_000]]
        rows.append((name, float(c.max()), float(torch.quantile(sample, 0.999)), float((c > 3).float().mean()),
                     float((c > 10).float().mean())))
    rows.sort(key=lambda r: -r[1])
    lines = [f"First adaptive step on `{Path(a.model).name}`: |c| = |g| / RMS_row(g) per coordinate (Adam's first "
             f"step: 1 everywhere). {a.blocks} blocks of {a.seq} tokens. Command: "
             f"`python launch/experiments/adaptive_outliers.py`", "",
             f"Over the {len(rows)} weight matrices: median of the largest |c| {statistics.median(r[1] for r in rows):.1f}; "
             f"median fraction above 3: {statistics.median(r[3] for r in rows):.4f}.", "",
             "| matrix (the 12 largest) | max abs c | 0.999 quantile | above 3 | above 10 |", "|---|---|---|---|---|"]
    lines += [f"| {n} | {m:.1f} | {q:.1f} | {f3:.4f} | {f10:.5f} |" for n, m, q, f3, f10 in rows[:12]]
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
