"""Per-worker RMS preconditioning at W workers, uncompressed or compressed: which denominator and momentum match
dense AdamW.

At W = 32: ``precondition: "rms"`` (each worker divides its gradient by the RMS of its own gradients; the
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
- ``ofac``: the oracle's second moment Adafactor-factored (per matrix an EMA of row and column sums of squares of
  the mean gradient; ``--all-scalar``: one number per tensor), shaped by each worker's own ``v`` where a tensor is
  one number; ``--clamp`` bounds it to ``[v_hat / W, v_hat]``;
- ``osk``: ``ofac`` with the sums estimated from random sign projections of the mean gradient (linear, so the
  workers' projections are all-reducible: ``precondition: "rms_sketch"`` with ``--all-scalar --clamp``);
- ``rho``: ``rms``'s per-worker update, and the *average* rescaled by ``1 / sqrt(r^2 + (1 - r^2) / W)``, ``r`` the
  clamped, bias-corrected EMA (``--rho-beta``) of the average itself (its signal-to-noise ratio, the same on every
  worker): the mean-gradient denominator applied after the reduction (``compress_scale.py``'s ``rms_rho``).

``--ratio R`` compresses each worker's normalized update (error feedback, per chunk the top ``k`` at ``--bits``
bits, ``k`` from qtopk's budget at ``R``; ``--exchange sharded``: the sum compressed again with one residual, at
``sharded_budgets``' ``k2``), a batched sketch of ``titan_ds/comm/qtopk.py`` for quick sweeps; the package's own
compressor runs in ``compress_scale.py``.

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
from titan_ds.comm.qtopk import qtopk_budget, sharded_budgets  # noqa: E402
from titan_ds.models import GPT  # noqa: E402

VARIANTS = ("dense", "rms", "nc", "ncs", "ncd", "ncx", "oracle", "ofac", "osk", "rho")


class FactoredMeanRMS:
    """The mean gradient's second moment, Adafactor-factored: per matrix an EMA of its row and column sums of
    squares, ``v_rc = R_r C_c / sum(R)``; vectors keep an EMA of their squares. Updated every ``every`` steps (EMA
    ``beta ** every``, bias-corrected by the number of updates). ``sketch``: a matrix's row sums of squares of the
    mean gradient are estimated as ``(sum_c s_c G_rc)^2`` with a fresh Rademacher ``s`` (linear in ``G``, so each
    worker can project its own gradient and the projections are all-reduced: ``rows + cols`` floats a matrix),
    columns likewise; ``sketch=False`` uses the exact sums (the bound of the factored form)."""

    def __init__(self, shapes: list[tuple[int, ...]], beta: float, every: int, sketch: int, seed: int,
                 vec_scalar: bool = False) -> None:
        self.shapes, self.every, self.sketch, self.vec_scalar = shapes, every, sketch, vec_scalar
        self.beta = beta ** every
        self.count = 0
        self.state = [(torch.zeros(sh[0]), torch.zeros(sh[1])) if len(sh) == 2
                      else (torch.zeros(1 if vec_scalar else sh[0]),) for sh in shapes]
        self.gen = torch.Generator().manual_seed(10_007 + seed)

    def floats_per_update(self) -> int:
        dims = max(1, self.sketch)
        return sum((sh[0] + sh[1]) * dims if len(sh) == 2 else (dims if self.vec_scalar else sh[0])
                   for sh in self.shapes)

    def update(self, t: int, mean_grad: torch.Tensor) -> None:
        if (t - 1) % self.every:
            return
        self.count += 1
        off, b = 0, self.beta
        for sh, st in zip(self.shapes, self.state):
            size = 1
            for d in sh:
                size *= d
            g = mean_grad[off:off + size].view(sh)
            off += size
            if len(sh) == 2:
                if self.sketch:
                    sc = torch.randint(0, 2, (sh[1], self.sketch), generator=self.gen).float().mul_(2).sub_(1)
                    sr = torch.randint(0, 2, (self.sketch, sh[0]), generator=self.gen).float().mul_(2).sub_(1)
                    rows, cols = ((g @ sc) ** 2).mean(1), ((sr @ g) ** 2).mean(0)
                else:
                    rows, cols = (g * g).sum(1), (g * g).sum(0)
                st[0].mul_(b).add_(rows, alpha=1 - b)
                st[1].mul_(b).add_(cols, alpha=1 - b)
            elif self.vec_scalar:  # one number: the vector's mean square, sketched
                sv = torch.randint(0, 2, (sh[0], max(1, self.sketch)), generator=self.gen).float().mul_(2).sub_(1)
                st[0].mul_(b).add_(((g @ sv) ** 2).mean() / sh[0], alpha=1 - b)
            else:
                st[0].mul_(b).addcmul_(g, g, value=1 - b)

    def denominator(self, eps: float, own: torch.Tensor) -> torch.Tensor:
        """``own``: each worker's own second moment (W, n): a vector kept as one number takes its shape from it."""
        corr = 1 - self.beta ** self.count
        parts, off = [], 0
        for sh, st in zip(self.shapes, self.state):
            size = sh[0] * (sh[1] if len(sh) == 2 else 1)
            if len(sh) == 2:
                r, c = st[0] / corr, st[1] / corr
                parts.append((r[:, None] * c[None, :] / r.sum().clamp_min(1e-30)).reshape(1, -1).expand(len(own), -1))
            elif self.vec_scalar:
                o = own[:, off:off + size]
                parts.append(o * (st[0] / corr) / o.mean(1, keepdim=True).clamp_min(1e-30))
            else:
                parts.append((st[0] / corr).reshape(1, -1).expand(len(own), -1))
            off += size
        return torch.cat(parts, 1).sqrt_().add_(eps)


def train(variant: str, lr: float, world: int, steps: int, seed: int, beta1: float, post_momentum: float,
          rho_beta: float = 0.99, ratio: float = 0.0, select: str = "value", bits: int = 4, chunk: int = 4096,
          exchange: str = "all_gather", stat_every: int = 1, sketch_dims: int = 1, clamp: bool = False,
          vec_scalar: bool = False, all_scalar: bool = False, gather_share: float = 0.5) -> dict:
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
    fac = (FactoredMeanRMS([(params[k].numel(),) if all_scalar else tuple(params[k].shape) for k in names], b2, stat_every,
                           sketch_dims if variant == "osk" else 0, seed, vec_scalar or all_scalar)
           if variant in ("ofac", "osk") else None)
    if ratio and variant in ("dense", "rho"):
        raise SystemExit("--ratio compresses the workers' normalized updates: not with dense or rho")
    resid = torch.zeros(W, n) if ratio else None
    k_chunk = qtopk_budget(n, ratio, bits=bits, chunk=chunk) if ratio else 0
    k2 = 0
    if ratio and exchange == "sharded":  # the owners' second compression keeps its own residual of the sum
        k_chunk, k2 = sharded_budgets(n, ratio, bits=bits, chunk=chunk, gather_share=gather_share)
        kept = torch.zeros(1, n)
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
            elif fac is not None:
                fac.update(t, G.mean(0))
                den = fac.denominator(eps, vh)
                if clamp:  # mu^2 + s^2 / W lies in [v_own / W, v_own] (v_own = mu^2 + s^2, each worker's own)
                    den = torch.minimum(torch.maximum(den, (vh / W).sqrt() + eps), vh.sqrt() + eps)
            elif variant == "oracle":
                Gm = G.mean(0)
                s2[0].mul_(b2).addcmul_(Gm, Gm, value=1 - b2)
                den = (s2[0] / (1 - b2 ** t)).sqrt() + eps
            else:  # ncd
                m.mul_(beta1).add_(G, alpha=1 - beta1)
                mh = m / (1 - beta1 ** t)
                s2.mul_(b2).add_(mh * mh * (1 - 1 / W) + G * G / W, alpha=1 - b2)
                den = (s2 / (1 - b2 ** t)).sqrt() + eps
            if resid is None:
                upd = (G / den).mean(0)
            else:  # error feedback + chunked top-k with low-bit values, each worker's own message; all summed
                resid.add_(G / den)
                score = resid.abs() if select == "value" else resid.abs() * den / (vh.sqrt() + eps)
                upd = chunked_topk_(resid, score, k_chunk, chunk, bits).sum(0, keepdim=True)
                if k2:  # sharded: the sum (plus the owners' residual) compressed again
                    kept.add_(upd)
                    upd = chunked_topk_(kept, kept.abs(), k2, chunk, bits)
                upd = upd[0] / W
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
    if fac is not None:
        row.update(stat_every=stat_every, stat_floats=fac.floats_per_update(), n=n, clamp=clamp,
                   sketch_dims=sketch_dims if variant == "osk" else 0, vec_scalar=vec_scalar, all_scalar=all_scalar)
    if ratio:
        row.update(ratio=ratio, select=select, bits=bits, chunk=chunk, k_chunk=k_chunk)
        if k2:
            row.update(exchange=exchange, k2=k2, gather_share=gather_share)
    return {**row, "rho_beta": rho_beta} if variant == "rho" else row


def chunked_topk_(resid: torch.Tensor, score: torch.Tensor, k: int, chunk: int, bits: int) -> torch.Tensor:
    """Each row of ``resid`` (one worker's error-fed update) sends, per chunk of ``chunk`` entries, the ``k`` entries
    of largest ``score`` at ``bits`` bits (qtopk's quantizer: per-chunk scale max |selected|, sign + level, decoded
    to the level's middle); returns the decoded messages (W, n) and leaves in ``resid`` what was not sent (the
    quantization error included). A batched sketch of ``titan_ds/comm/qtopk.py`` for this harness."""
    W, n = resid.shape
    pad = -n % chunk
    r = torch.nn.functional.pad(resid, (0, pad)).view(W, -1, chunk)
    sc = torch.nn.functional.pad(score, (0, pad), value=-1.0).view(W, -1, chunk)
    idx = sc.topk(k, dim=-1).indices
    val = r.gather(-1, idx)
    scale = val.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    levels = 2 ** (bits - 1)
    q = ((val.abs() / scale * levels).floor().clamp(0, levels - 1) + 0.5) * (scale / levels) * val.sign()
    sent = torch.zeros_like(r).scatter_(-1, idx, q).view(W, -1)[:, :n]
    resid.sub_(sent)
    return sent


def render(rows: list[dict], command: str) -> str:
    """One line per row, sorted by (world, steps, variant, momentum, lr, seed); delta to the same seed's best
    dense row."""
    dense = {}
    for r in rows:
        if r["variant"] == "dense":
            k = (r["world"], r["steps"], r["seed"])
            dense[k] = min(dense.get(k, float("inf")), r["val_loss"])
    out = ["# Per-worker RMS preconditioning at W workers, uncompressed or compressed (launch/bench/rms_variants.py)", "",
           f"`{command}` (one invocation per row; the variants are in the script's docstring). Tiny GPT 2x64, "
           "micro-batch 4 x 64 tokens per worker, constant lr. `ratio`: `-` uncompressed, else each worker's update "
           "error-fed and compressed by the harness's batched qtopk (`chunked_topk_`; sharded: the sum compressed "
           "again with one residual, the owners'). `delta` is to the same seed's best `dense` (AdamW) row of any lr.",
           "",
           "| variant | W | steps | post momentum | ratio (select) | lr | seed | val_loss | delta vs dense | seconds |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["world"], r["steps"], VARIANTS.index(r["variant"]), r["post_momentum"],
                                         r.get("ratio", 0), r.get("select", ""), r["lr"], r["seed"])):
        d = dense.get((r["world"], r["steps"], r["seed"]))
        delta = f"{r['val_loss'] - d:+.4f}" if d is not None else "n/a"
        comp = (f"{r['ratio']:g} ({r['select']}, {r['bits']}-bit, chunk {r['chunk']}"
                f"{', sharded' if r.get('exchange') == 'sharded' else ''}"
                f"{', share %g' % r['gather_share'] if r.get('gather_share', 0.5) != 0.5 else ''})" if r.get("ratio") else "-")
        name = r["variant"] + (f" (beta1 {r['beta1']:g})" if r.get("beta1", 0.9) != 0.9 else "") + (f" (every {r['stat_every']}{', s=%d' % r['sketch_dims'] if r.get('sketch_dims') else ''}"
                               f"{', clamped' if r.get('clamp') else ''}{', vec scalar' if r.get('vec_scalar') else ''}{', all scalar' if r.get('all_scalar') else ''})" if "stat_every" in r else "")
        out.append(f"| {name} | {r['world']} | {r['steps']} | {r['post_momentum']:g} | {comp} | {r['lr']:g} | "
                   f"{r['seed']} | {r['val_loss']:.4f} | {delta} | {r['seconds']:.0f} |")
    return "\n".join(out) + "\n"


COMMAND = ("PYTHONPATH=$PWD OMP_NUM_THREADS=1 python launch/bench/rms_variants.py --variant V --lr LR "
           "[--post-momentum 0.9] [--ratio R --exchange sharded --bits B --chunk C [--all-scalar --clamp ...]] "
           "--steps S [--seed N] --out OUT")


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
    p.add_argument("--ratio", type=float, default=0.0, help="compress each worker's update: qtopk's budget at this "
                   "ratio (0: uncompressed)")
    p.add_argument("--select", default="value", choices=("value", "rms"),
                   help="top-k by the residual's magnitude, or by it in units of the worker's own RMS")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--exchange", default="all_gather", choices=("all_gather", "sharded"))
    p.add_argument("--gather-share", type=float, default=0.5, help="sharded: the owners' share of the bytes")
    p.add_argument("--stat-every", type=int, default=1, help="ofac/osk: steps between updates of the factored RMS")
    p.add_argument("--sketch-dims", type=int, default=1, help="osk: Rademacher projections per side of a matrix")
    p.add_argument("--clamp", action="store_true", help="ofac/osk: clamp the estimate to [v_own / W, v_own]")
    p.add_argument("--all-scalar", action="store_true", help="ofac/osk: every tensor's estimate is one number times "
                   "the shape of the worker's own second moment")
    p.add_argument("--vec-scalar", action="store_true", help="ofac/osk: a vector's estimate is one number (its mean "
                   "square) times the shape of the worker's own second moment")
    p.add_argument("--out", default="results/rms_variants_w32")
    p.add_argument("--table-only", action="store_true")
    a = p.parse_args(argv)
    if not a.table_only:
        row = train(a.variant, a.lr, a.world, a.steps, a.seed, a.beta1, a.post_momentum, a.rho_beta, a.ratio,
                    a.select, a.bits, a.chunk, a.exchange, a.stat_every, a.sketch_dims, a.clamp,
                    a.vec_scalar, a.all_scalar, a.gather_share)
        print(json.dumps(row))
        with Path(a.out).with_suffix(".jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
    table(a.out)


if __name__ == "__main__":
    main()
