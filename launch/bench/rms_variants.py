"""Per-worker RMS preconditioning at W workers, **uncompressed**: which denominator and momentum match dense AdamW.

Issue 30 at W = 32: ``precondition: "rms"`` (each worker divides its gradient by the RMS of its own gradients; the
sum is applied by SGD without momentum) was +0.26 nats behind dense AdamW after 1000 steps even with no
compression at all (``results/compress_qtopk_w32_ag.md``, its ``rms`` ratio-1 row). This harness isolates the
optimizer from the compressor: ``W`` workers' gradients of one shared model (``torch.func.vmap`` over the workers'
micro-batches, the same ``Batcher(rank=w)`` streams and tiny GPT 2x64 as ``compress_scale.py``), each normalized
by its own denominator, averaged (no compression, no error feedback) and applied by SGD (``--post-momentum``:
SGD's momentum and dampening, an EMA of the averaged updates) or, for ``dense``, AdamW on the mean gradient.

Variants (per worker ``w``, step ``t`` from 1; ``v``, ``m``: that worker's EMA of ``g^2`` (0.999) and ``g``
(``--beta1``), bias-corrected as ``v_hat``, ``m_hat``):

- ``dense``: AdamW (0.9, 0.999) on the mean gradient, the reference;
- ``rms``: ``g / sqrt(v_hat)`` (``precondition: "rms"``);
- ``nc``: ``g / sqrt(m_hat^2 + max(v_hat - m_hat^2, 0) / W)``, the mean gradient's second moment with ``mu^2``
  estimated by this step's ``m_hat^2`` (no smoothing);
- ``ncs``: the same with ``m_hat^2`` smoothed like ``v`` (``s``: EMA 0.999 of ``m_hat^2``):
  ``g / sqrt(s_hat + max(v_hat - s_hat, 0) / W)``;
- ``ncd``: ``ncs`` without the clamp, one state ``d``: EMA 0.999 of ``(1 - 1/W) m_hat^2 + g^2 / W`` -- the
  formula of ``precondition: "rms_mean"`` (``titan_ds/comm/precondition.py``, whose reference-loop test checks it);
- ``ncx``: ``mu^2`` from the cross term ``g_t m_hat_{t-1}`` (unbiased, noisier);
- ``oracle``: every worker divides by the RMS of the *mean* gradient (dense Adam's ``v``, not available without
  a dense exchange): the best any local estimate could do;
- ``rho``: ``rms``'s per-worker update, and the *average* rescaled by ``1 / sqrt(r^2 + (1 - r^2) / W)``, ``r`` the
  clamped, bias-corrected EMA (``--rho-beta``) of the average itself (its signal-to-noise ratio, the same on every
  worker): the mean-gradient denominator applied after the reduction (``compress_scale.py``'s ``rms_rho``).

Rows are appended to ``<out>.jsonl`` as they finish (``--table-only`` rewrites ``<out>.md`` from it)::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python launch/bench/rms_variants.py --variant ncd --lr 1e-3 \\
        --post-momentum 0.9 --steps 1000 --out results/rms_variants_w32
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from torch.func import functional_call, grad, vmap

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from titan_ds.data import Batcher, load_corpus, val_batches  # noqa: E402
from titan_ds.models import GPT  # noqa: E402

VARIANTS = ("dense", "rms", "nc", "ncs", "ncd", "ncx", "oracle", "rho")


def train(variant: str, lr: float, world: int, steps: int, seed: int, beta1: float, post_momentum: float,
          rho_beta: float = 0.99) -> dict:
    if variant not in VARIANTS:
        raise SystemExit(f"--variant must be one of {VARIANTS}, got {variant!r}")
    corpus = load_corpus()
    torch.manual_seed(seed)
    model = GPT(n_layer=2, n_embd=64, n_head=4, block_size=64)
    names = [k for k, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    W = world
    batchers = [Batcher(corpus.train, 4, 64, seed=seed, rank=w, world=W) for w in range(W)]
    g_fn = vmap(grad(lambda ps, x, y: functional_call(model, ps, (x, y))), in_dims=(None, 0, 0))
    n = sum(p.numel() for p in params.values())
    b2, eps = 0.999, 1e-8
    v, m, s2, rho = torch.zeros(W, n), torch.zeros(W, n), torch.zeros(W, n), torch.zeros(n)
    if variant == "dense":
        opt: torch.optim.Optimizer = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=0.0, betas=(0.9, 0.999))
    else:
        opt = torch.optim.SGD(list(params.values()), lr=lr, momentum=post_momentum, dampening=post_momentum)
    t0 = time.perf_counter()
    for step in range(steps):
        xs, ys = zip(*[batchers[w].get(step) for w in range(W)])
        grads = g_fn({k: p.detach() for k, p in params.items()}, torch.stack(xs), torch.stack(ys))
        G = torch.cat([grads[k].reshape(W, -1) for k in names], 1)  # (W, n): one row per worker
        t = step + 1
        if variant == "dense":
            upd = G.mean(0)
        else:
            v.mul_(b2).addcmul_(G, G, value=1 - b2)
            vh = v / (1 - b2 ** t)
            if variant in ("rms", "rho"):
                den = vh.sqrt() + eps
            elif variant == "nc":
                m.mul_(beta1).add_(G, alpha=1 - beta1)
                mh = m / (1 - beta1 ** t)
                den = (mh * mh + (vh - mh * mh).clamp_min(0) / W).sqrt() + eps
            elif variant == "ncs":
                m.mul_(beta1).add_(G, alpha=1 - beta1)
                mh = m / (1 - beta1 ** t)
                s2.mul_(b2).addcmul_(mh, mh, value=1 - b2)
                sh = s2 / (1 - b2 ** t)
                den = (sh + (vh - sh).clamp_min(0) / W).sqrt() + eps
            elif variant == "ncx":
                mprev = m / (1 - beta1 ** (t - 1)) if t > 1 else torch.zeros_like(m)
                s2.mul_(b2).add_(G * mprev, alpha=1 - b2)
                sh = s2 / (1 - b2 ** t)
                m.mul_(beta1).add_(G, alpha=1 - beta1)
                den = (sh.clamp_min(0) * (1 - 1 / W) + vh / W).sqrt() + eps
            elif variant == "oracle":
                Gm = G.mean(0)
                s2[0].mul_(b2).addcmul_(Gm, Gm, value=1 - b2)
                den = (s2[0] / (1 - b2 ** t)).sqrt() + eps
            else:  # ncd
                m.mul_(beta1).add_(G, alpha=1 - beta1)
                mh = m / (1 - beta1 ** t)
                s2.mul_(b2).add_(mh * mh * (1 - 1 / W) + G * G / W, alpha=1 - b2)
                den = (s2 / (1 - b2 ** t)).sqrt() + eps
            upd = (G / den).mean(0)
            if variant == "rho":
                rho.mul_(rho_beta).add_(upd, alpha=1 - rho_beta)
                rh = (rho / (1 - rho_beta ** t)).clamp(-1, 1)
                upd = upd / (rh * rh + (1 - rh * rh) / W).sqrt()
        off = 0
        for k in names:
            p = params[k]
            p.grad = upd[off:off + p.numel()].view_as(p).clone()
            off += p.numel()
        opt.step()
    model.eval()
    with torch.no_grad():  # compress_scale.py's validation: 8 batches of 16 x 64 tokens
        val = sum(float(model(x, y)) for x, y in val_batches(corpus.val, 8, 16, 64)) / 8
    row = {"variant": variant, "post_momentum": post_momentum, "lr": lr, "world": W, "steps": steps, "seed": seed,
           "beta1": beta1, "val_loss": val, "seconds": time.perf_counter() - t0}
    return {**row, "rho_beta": rho_beta} if variant == "rho" else row


def render(rows: list[dict], command: str) -> str:
    """One line per row, sorted by (world, steps, variant, momentum, lr, seed); delta to the same seed's best
    dense row."""
    dense = {}
    for r in rows:
        if r["variant"] == "dense":
            k = (r["world"], r["steps"], r["seed"])
            dense[k] = min(dense.get(k, float("inf")), r["val_loss"])
    out = ["# Per-worker RMS preconditioning, uncompressed, at W workers (launch/bench/rms_variants.py)", "",
           f"`{command}` (one invocation per row; the variants are in the script's docstring). Tiny GPT 2x64, "
           "micro-batch 4 x 64 tokens per worker, constant lr, no compression. `delta` is to the same seed's best "
           "`dense` (AdamW) row of any lr.", "",
           "| variant | W | steps | post momentum | lr | seed | val_loss | delta vs dense | seconds |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["world"], r["steps"], VARIANTS.index(r["variant"]), r["post_momentum"],
                                         r["lr"], r["seed"])):
        d = dense.get((r["world"], r["steps"], r["seed"]))
        delta = f"{r['val_loss'] - d:+.4f}" if d is not None else "n/a"
        out.append(f"| {r['variant']} | {r['world']} | {r['steps']} | {r['post_momentum']:g} | {r['lr']:g} | "
                   f"{r['seed']} | {r['val_loss']:.4f} | {delta} | {r['seconds']:.0f} |")
    return "\n".join(out) + "\n"


COMMAND = ("PYTHONPATH=$PWD OMP_NUM_THREADS=1 python launch/bench/rms_variants.py --variant V --lr LR "
           "[--post-momentum 0.9] --steps 1000 --out OUT")


def table(out: str) -> None:
    path = Path(out)
    rows = [json.loads(line) for line in path.with_suffix(".jsonl").read_text().splitlines() if line.strip()]
    path.with_suffix(".md").write_text(render(rows, COMMAND.replace("OUT", out)))


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="dense", choices=VARIANTS)
    p.add_argument("--post-momentum", type=float, default=0.0, help="SGD momentum = dampening on the averaged update")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--world", type=int, default=32)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--beta1", type=float, default=0.9, help="the workers' first-moment EMA (nc*, ncd)")
    p.add_argument("--rho-beta", type=float, default=0.99, help="rho: the EMA of the average's SNR estimate")
    p.add_argument("--out", default="results/rms_variants_w32")
    p.add_argument("--table-only", action="store_true")
    a = p.parse_args(argv)
    if not a.table_only:
        row = train(a.variant, a.lr, a.world, a.steps, a.seed, a.beta1, a.post_momentum, a.rho_beta)
        print(json.dumps(row))
        with Path(a.out).with_suffix(".jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
    table(a.out)


if __name__ == "__main__":
    main()
