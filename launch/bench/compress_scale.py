"""Gradient compression at W workers, simulated in one process: quality and bytes sent/received per worker.

The full table (resumable: every finished (method, ratio, W) row is recorded in ``<out>.jsonl`` at once
(``launch/bench/store.py``: a rerun skips it if the package's and this script's code are unchanged, or with
``--reuse-stale``); ``python -m launch.bench table compression-scale --out OUT`` rewrites the table from it
without running anything; run it on a quiet machine, it is CPU-bound)::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python launch/bench/compress_scale.py --workers 2,8,32,128 \\
        --methods none,topk,tgss,hge,dgc,powersgd --ratios 30,100 --ranks 1,2 --steps 200 --out results/compress_scale

Why: HGE's and TGSS's messages are fixed-length vectors that a ring **all-reduce** sums in the network, while
top-k's (index, value) pairs differ per rank and must be **all-gathered**, so top-k's received bytes grow with
the number of workers ``W``. Two ranks cannot show it; this harness can, with the exact compressor code.

How: ``W`` virtual workers share one model copy. Each step every worker computes the gradient of its own
micro-batch (``Batcher(rank=w)``: its own stream of windows), then each worker's ``GradientReducer(method,
ratio)`` (its own residuals, the package's code unchanged) reduces it through :class:`SimCollective`. The
summed gradient every worker decodes is checked to be bit-identical across workers (so one model copy is
exact data parallelism), divided by ``W`` and applied once with AdamW. ``none`` is the dense all-reduce
through the same path, the row each method is compared with at the same ``W``. ``dgc`` is ``topk`` with DGC's
options (``--dgc-*``; with momentum correction its AdamW runs at ``beta1 = --dgc-beta1``, default 0, since the
compressor's velocity is the momentum); ``powersgd`` runs at each of ``--ranks`` instead of ``--ratios`` (two
all-reduces, of ``P`` with the dense tensors and of ``Q``). ``rms*`` methods apply the sum with SGD (the update is
already Adam-scaled): ``rms_mean*`` is ``precondition: "rms_mean"`` (SGD with momentum 0.9, dampening 0.9), and
``rms_rho*`` (a probe of this simulator only, not in the package) is ``rms*``'s message with the mean
update rescaled after the reduction by ``1 / sqrt(r^2 + (1 - r^2) / W)``, ``r`` the clamped bias-corrected EMA
(0.99) of the mean update itself (the same on every worker), then SGD with momentum 0.9: Adam's denominator of the
*mean* gradient expressed through the rms update's signal-to-noise ratio.

Bytes per worker come from the collective each call uses (:class:`titan_ds.comm.wire.SimCollective`, the same
costs :func:`titan_ds.comm.wire.count_collectives` counts on real ranks), both rounds of
the sketch methods included. ``wire_x_recv`` is the dense ring all-reduce's received bytes over the method's,
per worker, over the whole run (no warm-up by default). Top-k is also run at ``ratio * W / 2``, where each
worker receives as many bytes as an all-reduce method at ``ratio`` (``--no-match-recv`` drops those rows):
the comparison that decides whether HGE's fixed-length message pays for its recovery loss.

Cost: about ``46 * steps`` seconds for the default grid on a busy 2-core machine (0.02-0.04 s per worker and
step for the 2x64 GPT), i.e. 1-2.5 hours at 200 steps; a rerun skips finished rows.
"""
from __future__ import annotations

import argparse
import logging
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch import train  # noqa: E402
from launch.bench.harness import add_dgc_args, seed_verdict  # noqa: E402
from launch.bench.store import CODE_PATHS, Store, add_store_args, fields_identity  # noqa: E402
from titan_ds.comm import GradientReducer  # noqa: E402
from titan_ds.comm.base import Segment  # noqa: E402
from titan_ds.comm.dgc import DGCOptions  # noqa: E402
from titan_ds.comm.precondition import RMSOptions  # noqa: E402
from titan_ds.comm.wire import SimCollective, ring_allgather_bytes, ring_allreduce_bytes, ring_rounds  # noqa: E402,F401
from titan_ds.data import Batcher, load_corpus, val_batches  # noqa: E402
from titan_ds.models import GPT  # noqa: E402

__all__ = ["SimCollective", "ring_allreduce_bytes", "ring_allgather_bytes", "ring_rounds", "section_settings", "shipped_method", "train_row", "main"]

log = logging.getLogger("titan_ds.bench.compress_scale")


# ----------------------------------------------------------------------------------------- training
def _layout(model: torch.nn.Module) -> tuple[list[Segment], list[torch.nn.Parameter]]:
    segs, params, off = [], [], 0
    for name, p in model.named_parameters():
        segs.append(Segment(name, 0, off, p.numel(), p.numel(), tuple(p.shape)))
        params.append(p)
        off += p.numel()
    return segs, params


@torch.no_grad()
def _val_loss(model: torch.nn.Module, tokens, n: int, micro_batch: int, context: int) -> float:
    model.eval()
    losses = [float(model(x, y)) for x, y in val_batches(tokens, n, micro_batch, context)]
    model.train()
    return sum(losses) / len(losses)


def make_reducer(method: str, ratio: float, *, warmup: int, seed: int, rank: Optional[int] = None,
                 dgc: Optional[dict] = None, beta2: Optional[float] = None) -> GradientReducer:
    """The worker's reducer: ``dgc`` is ``topk`` with DGC's options (``dgc``: momentum, masking, clip, ramp_steps,
    ramp_start), ``powersgd`` needs ``rank``; the others are built from ``ratio``. A preconditioned method's name
    ending in ``_gradres`` keeps its residuals in gradient units (``residuals_follow_lr: false``; the same run as
    without the suffix under a constant lr). ``beta2``: the preconditioner's (None: :class:`RMSOptions`'s default)."""
    follow = not method.endswith("_gradres")
    method = method.removesuffix("_gradres")
    if method == "dgc":
        if dgc is None:
            raise ValueError("method 'dgc' needs its options (momentum, masking, clip, ramp_steps, ramp_start)")
        opts = DGCOptions(momentum=dgc["momentum"], momentum_masking=dgc["masking"], local_clip=dgc["clip"])
        return GradientReducer("topk", ratio, warmup_steps=warmup, seed=seed, dgc=opts,
                               ratio_warmup_steps=dgc["ramp_steps"], ratio_warmup_start=dgc["ramp_start"])
    elif method in ("rms", "rms_randk", "rms_cltk", "rms_mean", "rms_sketch"):  # topk / randk / cltk of each worker's normalized gradient
        return GradientReducer({"rms": "topk", "rms_randk": "randk", "rms_cltk": "cltk", "rms_mean": "topk",
                                "rms_sketch": "topk"}[method],
                               ratio, warmup_steps=warmup, seed=seed, precondition=_rms_options(method, beta2),
                               residuals_follow_lr=follow)
    elif (m := re.fullmatch(r"rms(?:_mean|_sketch)?_(hge|tgss)", method)) is not None:  # the all-reducible
        # sketches with the same local preconditioner (``titan.compression`` method hge/tgss + ``precondition``)
        return GradientReducer(m.group(1), ratio, warmup_steps=warmup, seed=seed,
                               precondition=_rms_options(method, beta2), residuals_follow_lr=follow)
    elif (q := qtopk_options(method)) is not None:  # rms[_mean]_qtopk<bits>[c<chunk>]: chunked low-bit top-k of the same
        return GradientReducer("qtopk", ratio, warmup_steps=warmup, seed=seed, precondition=_rms_options(method, beta2),
                               residuals_follow_lr=follow, **q)
    elif method == "powersgd":
        if rank is None:
            raise ValueError("method 'powersgd' needs a rank")
        return GradientReducer("powersgd", 1.0, warmup_steps=warmup, seed=seed, rank=rank)
    else:
        return GradientReducer(method, ratio, warmup_steps=warmup, seed=seed)


def _rms_options(method: str, beta2: Optional[float] = None) -> RMSOptions:
    """``rms_mean...``: ``precondition: "rms_mean"`` (the ranks' mean gradient's RMS; SGD with momentum 0.9 applies
    the sum); ``rms_sketch...``: ``precondition: "rms_sketch"`` (rms's shape at the mean gradient's level per tensor,
    from an all-reduced projection; SGD without momentum); else ``"rms"``."""
    extra = {} if beta2 is None else {"beta2": beta2}
    for kind in ("rms_mean", "rms_sketch"):
        if method.startswith(kind):
            return RMSOptions(kind=kind, **extra)
    return RMSOptions(**extra)


def qtopk_options(method: str) -> Optional[dict]:
    """``rms[_mean|_sketch]_qtopk<bits>[c<chunk>][_sharded[_g<share>]][_bf16]`` (``titan.compression`` with ``method: "qtopk"``,
    ``bits``, ``chunk``, ``precondition: "rms"`` (or ``rms_mean`` / ``rms_sketch``) and, with ``_sharded``, ``exchange: "sharded"`` and ``gather_share``; chunk
    4096 unless given; ``_bf16``: ``scale_dtype: "bf16"``): ``{bits, chunk, exchange[, gather_share, scale_dtype]}``;
    ``None`` for other methods."""
    m = re.fullmatch(r"rms(?:_mean|_sketch)?_qtopk(\d)(?:c(\d+))?(_sharded(?:_g([0-9.]+))?)?(_bf16)?", method)
    if m is None:
        return None
    out = {"bits": int(m.group(1)), "chunk": int(m.group(2) or 4096),
           "exchange": "sharded" if m.group(3) else "all_gather"}
    if m.group(5):
        out["scale_dtype"] = "bf16"
    return out if m.group(4) is None else {**out, "gather_share": float(m.group(4))}


def train_row(method: str, ratio: float, world: int, steps: int, *, corpus, micro_batch: int = 4,
              context: int = 64, n_layer: int = 2, n_embd: int = 64, lr: float = 1e-3, seed: int = 0,
              warmup: int = 0, val_batches_n: int = 8, rank: Optional[int] = None,
              dgc: Optional[dict] = None, curve_every: int = 0, schedule: Optional[str] = None,
              betas: Optional[str] = None, weight_decay: Optional[float] = None) -> dict[str, Any]:
    """Train the tiny GPT data-parallel over ``world`` virtual workers with ``method``; one result row.

    ``rank``: PowerSGD's; ``dgc``: DGC's options plus ``beta1``, the AdamW beta1 of this row; ``curve_every``: also
    record the validation loss every that many steps (``curve``: ``[step, val_loss]`` pairs; 0: only the last);
    ``schedule``: None, a constant lr; ``"warmup_cosine"``, launch/train.py's (:func:`lr_factor`). ``betas``
    (``"b1,b2"``) and ``weight_decay``: a shipped optimizer section's (:func:`section_settings`), as the engine uses
    them: dense AdamW's betas and decoupled decay; under ``rms*`` the preconditioner's ``beta2`` (``rms_options``)
    and SGD's decay of the update (AdamW's decoupled one). None: the settings every row had before (AdamW (0.9,
    0.999), no decay; the preconditioner's defaults)."""
    torch.manual_seed(seed)
    model = GPT(n_layer=n_layer, n_embd=n_embd, n_head=4, block_size=context)
    layout, params = _layout(model)
    n = sum(p.numel() for p in params)
    beta1 = dgc["beta1"] if dgc is not None and dgc["momentum"] > 0 else 0.9
    beta2, wd = 0.999, 0.0
    if betas is not None:
        beta1, beta2 = (float(b) for b in betas.split(","))
    if weight_decay is not None:
        wd = float(weight_decay)
    rms_beta2 = beta2 if betas is not None else None
    method_reducer = method
    if (pb := re.search(r"_pb(0\.[0-9]+)$", method)) is not None:  # ``..._pb<b2>``: the section's own
        # ``precondition_beta2`` (set, it wins over the optimizer section's beta2: titan_ds.comm.hooks.rms_options)
        if not method.startswith("rms"):
            raise ValueError(f"method {method!r}: _pb<beta2> is the rms preconditioner's beta2; the method has none")
        rms_beta2, method_reducer = float(pb.group(1)), method[:pb.start()]
    rho = None
    if method.startswith("rms_rho"):  # the workers' reducers are rms's; the rescale is applied to their sum below
        rho = torch.zeros(n)
        method_reducer = method_reducer.replace("rms_rho", "rms", 1)
    if method.startswith("rms_mean") or method.startswith("rms_rho"):  # rms_mean: Adam's first moment after the reduction (precondition.py)
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=lr, weight_decay=wd, momentum=beta1,
                                                     dampening=beta1)
    elif method.startswith("rms"):  # the reduced sum is already an Adam-scaled update (titan_ds/comm/precondition.py)
        opt = torch.optim.SGD(params, lr=lr, weight_decay=wd)
    else:
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd, betas=(beta1, beta2))
    train = np.asarray(corpus.train, dtype=np.int64)  # one copy shared by every worker's Batcher (each would make its own)
    batchers = [Batcher(train, micro_batch, context, seed=seed, rank=w, world=world) for w in range(world)]
    reducers = [make_reducer(method_reducer, ratio, warmup=warmup, seed=seed, rank=rank, dgc=dgc, beta2=rms_beta2)
                for _ in range(world)]
    sim = SimCollective(world)
    curve: list[list[float]] = []
    compute_cpu = 0.0  # CPU seconds of the workers' forward + backward (time model: launch/bench/wallclock.py)
    t0 = time.perf_counter()
    for step in range(steps):
        flats = []
        c0 = time.thread_time()
        for w in range(world):
            model.zero_grad(set_to_none=True)
            x, y = batchers[w].get(step)
            model(x, y).backward()
            flats.append(torch.cat([p.grad.reshape(-1) for p in params]))
        compute_cpu += time.thread_time() - c0
        lr_t = lr * lr_factor(schedule, step, steps)  # what the optimizer applies this step's sum with
        outs = sim.run(lambda w, comm: reducers[w].reduce(flats[w], layout, comm, step, lr=lr_t))
        for w in range(1, world):
            if not torch.equal(outs[w], outs[0]):
                raise RuntimeError(f"worker {w} decoded a different sum than worker 0 at step {step}: "
                                   f"one model copy would not be data parallelism")
        grad = outs[0] / world
        if rho is not None:  # rms_rho (module docstring): the mean rms update rescaled by its SNR estimate
            rho.mul_(0.99).add_(grad, alpha=0.01)
            rh = (rho / (1 - 0.99 ** (step + 1))).clamp(-1, 1)
            grad = grad / (rh * rh + (1 - rh * rh) / world).sqrt()
        for p, seg in zip(params, layout):
            p.grad = grad[seg.flat_offset:seg.flat_offset + seg.numel].view_as(p).clone()
        for g in opt.param_groups:
            g["lr"] = lr_t
        opt.step()
        for r in reducers:
            r.end_step()
        if curve_every and (step + 1) % curve_every == 0 and step + 1 < steps:
            curve.append([step + 1, _val_loss(model, corpus.val, val_batches_n, micro_batch * 4, context)])
    dense = ring_allreduce_bytes(4 * n, world) * steps
    sent, recv = sum(sim.sent) / world, sum(sim.received) / world
    val = _val_loss(model, corpus.val, val_batches_n, micro_batch * 4, context)
    extra = {"curve": curve + [[steps, val]]} if curve_every else {}
    return {"method": method, "ratio": ratio, "world": world, "steps": steps, "micro_batch": micro_batch,
            "context": context, "n_layer": n_layer, "n_embd": n_embd, "lr": lr, "seed": seed, "warmup": warmup,
            "rank": rank, "dgc": _dgc_label(dgc), "schedule": schedule, "betas": betas, "weight_decay": weight_decay,
            "params": n, "val_loss": val,
            "sent_per_worker_step": sent / steps, "recv_per_worker_step": recv / steps,
            "dense_ring_per_worker_step": dense / steps,
            "wire_x_sent": dense / sent if sent else math.inf, "wire_x_recv": dense / recv if recv else math.inf,
            "handed_x": reducers[0].total_dense / reducers[0].total_wire if reducers[0].total_wire else math.inf,
            "collectives_per_step": sim.calls / steps, "seconds": time.perf_counter() - t0,
            # the time model's inputs (launch/bench/wallclock.py): per worker and step, CPU seconds of its forward +
            # backward and of its encode/decode (SimCollective.cpu_seconds), and the message rounds it waits through
            "compute_per_worker_step": compute_cpu / (world * steps),
            "codec_per_worker_step": sum(sim.cpu_seconds) / (world * steps),
            "rounds_per_worker_step": sim.wire[0].rounds / steps, **extra}


# ----------------------------------------------------------------------------------------- table
_KEY = ("method", "ratio", "world", "steps", "micro_batch", "context", "n_layer", "n_embd", "lr", "seed", "warmup",
        "rank", "dgc", "schedule", "betas", "weight_decay")
_OPTIONAL = ("schedule", "betas", "weight_decay")  # key fields a row written before them lacks (None: left out)


def _key(row: dict) -> tuple:
    return tuple(row.get(k) for k in _KEY)  # rows written before rank/dgc/schedule existed have none: None


def section_settings(path: str) -> dict[str, Any]:
    """``{betas: "b1,b2", weight_decay}`` of a ds_config's ``Adam``/``AdamW`` optimizer section (torch's defaults
    where it leaves them out): what the engine runs dense AdamW with, and what ``titan.compression``'s ``rms*``
    preconditioners take their ``beta2`` and SGD its decay from (``titan_ds.comm.hooks.rms_options``)."""
    import json
    section = json.loads(Path(path).read_text()).get("optimizer") or {}
    if str(section.get("type", "")).lower() not in ("adam", "adamw"):
        raise SystemExit(f"--section {path}: its optimizer section is {section.get('type')!r}, not Adam/AdamW; "
                         "give a config whose optimizer section is AdamW")
    params = section.get("params", {}) or {}
    b1, b2 = params.get("betas", (0.9, 0.999))
    return {"betas": f"{float(b1):g},{float(b2):g}", "weight_decay": float(params.get("weight_decay", 0.01))}


def shipped_method(path: str) -> str:
    """The simulator's method name of a shipped ds_config's ``qtopk`` section with the sketch preconditioner and the
    sharded exchange (``rms_sketch_qtopk<bits>c<chunk>_sharded_g<share>[_bf16]``): what the held-out rows and the time
    model run as "the shipped section" (:func:`qtopk_options` reads it back)."""
    import json
    from titan_ds.config import TitanConfig
    comp = TitanConfig.from_ds_config(json.loads(Path(path).read_text())).compression
    if comp is None or comp.method != "qtopk" or comp.exchange != "sharded" or comp.precondition != "rms_sketch":
        raise SystemExit(f"{path}: its titan.compression is not qtopk with exchange 'sharded' and precondition "
                         "'rms_sketch'; the simulator names only that section")
    return (f"rms_sketch_qtopk{comp.bits}c{comp.chunk}_sharded_g{comp.gather_share:g}"
            f"{'_bf16' if comp.scale_dtype == 'bf16' else ''}")


def lr_factor(schedule: Optional[str], step: int, steps: int) -> float:
    """The lr multiplier at 0-based ``step`` of ``steps``: None, 1 (constant: the rows
    measured before the schedule was added); ``"warmup_cosine"``, the schedule ``launch/train.py`` gives the real DeepSpeed ranks (its
    ``lr_lambda``: :data:`launch.train.DEFAULT_WARMUP` steps of linear warm-up, then half a cosine to 10%), the same
    for every method of a run."""
    if schedule is None:
        return 1.0
    if schedule == "warmup_cosine":
        return train.lr_lambda(train.DEFAULT_WARMUP, steps)(step)
    raise ValueError(f"unknown lr schedule {schedule!r}: use None (constant) or 'warmup_cosine'")


def _dgc_label(dgc: Optional[dict]) -> Optional[str]:
    """DGC's settings as one string (part of a row's key): momentum, masking, clip, ramp, AdamW beta1."""
    if dgc is None:
        return None
    return (f"m{dgc['momentum']:g}{'+mask' if dgc['masking'] and dgc['momentum'] > 0 else ''}"
            f"/clip{dgc['clip'] if dgc['clip'] is not None else '-'}/ramp{dgc['ramp_steps']}@{dgc['ramp_start']:g}"
            f"/b1={dgc['beta1'] if dgc['momentum'] > 0 else 0.9:g}")


_CONFIG = ("method", "ratio", "rank", "dgc", "world", "lr")  # the row; the other key fields but seed: settings


def _identity(row: dict) -> dict:
    # a constant-lr row keeps the settings (and hash) it had before ``schedule`` (``betas``, ...) existed
    return fields_identity(row, _CONFIG, [k for k in _KEY if k not in _CONFIG and k != "seed"
                                          and (k not in _OPTIONAL or row.get(k) is not None)])


def open_store(path: Path, reuse_stale: bool = False) -> Store:
    """``<out>.jsonl`` (``launch/bench/store.py``); rows from before the store read as code unknown. The code is
    the package's and this script's (``train_row`` is here)."""
    return Store(path, suite="compression-scale", reuse_stale=reuse_stale,
                 legacy=lambda raw: {**_identity(raw), "result": raw},
                 code_paths=(*CODE_PATHS, "launch/bench/compress_scale.py", "launch/train.py"))


def load_rows(store: Store) -> list[dict]:
    """Every row's result: the newest record of each."""
    return [rec["result"] for rec in store.latest()]


def render(rows: list[dict], wanted: list[tuple], command: str, label: str = "") -> str:
    """The markdown table: every row next to ``none`` at the same W and settings."""
    done = {_key(r) for r in rows}
    missing = [k for k in wanted if k not in done]
    dense = {_key({**r, "method": "none", "ratio": 1.0, "rank": None, "dgc": None}): r
             for r in rows if r["method"] == "none"}
    status = f"PARTIAL: {len(missing)} of {len(wanted)} rows missing" if missing else "all rows asked for"
    lines = [f"# Gradient compression at W virtual workers ({status})", "", f"`{command}`", ""]
    if label:
        lines += [f"**{label}**", ""]
    if len({k[_KEY.index("lr")] for k in wanted}) > 1 or len({k[_KEY.index("seed")] for k in wanted}) > 1:
        lines += summarize(rows, wanted) + ["## Every run", ""]
    lines += ["Bytes per worker per step from ring all-reduce `2(W-1)/W B` / ring all-gather `(W-1) b` "
              "(launch/bench/compress_scale.py). `wire_x_recv`: dense ring all-reduce bytes received / the "
              "method's. `handed_x`: dense / bytes handed to the collectives (the 2-rank benchmark's ratio).", "",
              "| method | ratio | W | steps | lr | seed | val_loss | delta_vs_dense | sent KiB/step | recv KiB/step "
              "| wire_x_recv | handed_x | seconds |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["steps"], r["world"], r["seed"], r["lr"], r["method"] != "none", r["ratio"],
                                         r["method"])):
        base = dense.get(_key({**r, "method": "none", "ratio": 1.0, "rank": None, "dgc": None}))
        delta = f"{r['val_loss'] - base['val_loss']:+.4f}" if base else "n/a"
        label = r["method"] + (f" r={r['rank']}" if r.get("rank") else "") + (f" ({r['dgc']})" if r.get("dgc") else "")
        ratio = "-" if r["method"] == "powersgd" else f"{r['ratio']:g}"
        lines.append(f"| {label} | {ratio} | {r['world']} | {r['steps']} | {r['lr']:g} | {r['seed']} | {r['val_loss']:.4f} | {delta} "
                     f"| {r['sent_per_worker_step'] / 1024:.1f} | {r['recv_per_worker_step'] / 1024:.1f} "
                     f"| {r['wire_x_recv']:.1f} | {r['handed_x']:.1f} | {r['seconds']:.0f} |")
    if missing:
        lines += ["", "Missing rows (method, ratio, W): " + ", ".join(
            f"({k[0]}{f' r={r}' if (r := dict(zip(_KEY, k)).get('rank')) else ''}, {k[1]:g}, {k[2]})" for k in missing)]
    return "\n".join(lines) + "\n"

_VARIANT = ("method", "ratio", "world", "steps", "micro_batch", "context", "n_layer", "n_embd", "warmup", "rank", "dgc",
            "schedule")


def best_rows(rows: list[dict], wanted: list[tuple]) -> list[dict]:
    """Each variant at its best lr (lowest mean over the seeds, among lrs with every seed done) against dense
    (``none``) at its own best lr, same W and settings: dicts with ``label``, ``method``, ``ratio``, ``world``,
    ``steps``, ``lr``, ``mean``, ``delta`` (None without a dense row), ``spread`` (the larger of the two rows'
    max - min over seeds), ``verdict`` (|delta| below the spread is 'no difference'), ``per_seed``,
    ``wire_x_recv``, ``handed_x``."""
    want = set(wanted)
    seeds = sorted({dict(zip(_KEY, k))["seed"] for k in wanted})
    runs: dict[tuple, dict[float, dict[int, dict]]] = {}
    for r in rows:
        if _key(r) in want:
            runs.setdefault(tuple(r.get(k) for k in _VARIANT), {}).setdefault(r["lr"], {})[r["seed"]] = r

    def best(variant: tuple) -> Optional[tuple[float, list[dict]]]:
        done = {lr: [by[s] for s in seeds] for lr, by in runs.get(variant, {}).items() if all(s in by for s in seeds)}
        if not done:
            return None
        lr = min(done, key=lambda x: sum(r["val_loss"] for r in done[x]) / len(seeds))
        return lr, done[lr]

    out = []
    for variant in sorted(runs, key=lambda v: (v[3], v[2], v[0] != "none", v[1], v[0], v[9] or 0)):
        b = best(variant)
        if b is None:
            continue
        d = best(tuple(("none" if k == "method" else 1.0 if k == "ratio" else None if k in ("rank", "dgc") else v)
                       for k, v in zip(_VARIANT, variant)))
        lr, rs = b
        mean = sum(r["val_loss"] for r in rs) / len(rs)
        spread = max(r["val_loss"] for r in rs) - min(r["val_loss"] for r in rs)
        delta = None
        if d is not None:
            dmean = sum(r["val_loss"] for r in d[1]) / len(d[1])
            spread = max(spread, max(r["val_loss"] for r in d[1]) - min(r["val_loss"] for r in d[1]))
            delta = mean - dmean
            verdict = ("reference" if variant[0] == "none" else "one seed: no spread" if len(seeds) < 2 else
                       seed_verdict(delta, spread))
        else:
            verdict = "no dense row"
        r0 = rs[0]
        out.append({"label": r0["method"] + (f" r={r0['rank']}" if r0.get("rank") else "")
                    + (f" ({r0['dgc']})" if r0.get("dgc") else ""), "method": r0["method"], "ratio": r0["ratio"],
                    "rank": r0.get("rank"), "world": r0["world"], "steps": r0["steps"], "lr": lr, "mean": mean,
                    "delta": delta, "spread": spread, "verdict": verdict, "per_seed": [r["val_loss"] for r in rs],
                    "wire_x_recv": r0["wire_x_recv"], "handed_x": r0["handed_x"]})
    return out


def summarize(rows: list[dict], wanted: list[tuple]) -> list[str]:
    """Markdown lines of :func:`best_rows`."""
    seeds = sorted({dict(zip(_KEY, k))["seed"] for k in wanted})
    lines = ["## Each method at its best lr against dense at its best lr", "",
             f"Seeds {','.join(map(str, seeds))}; mean validation loss over the seeds; spread = max - min over the "
             "seeds, the larger of the row's and dense's; |delta| < spread is 'no difference'. lr: the best of the "
             "grid (every lr with all seeds done).", "",
             "| method | ratio | W | steps | best lr | val_loss | delta_vs_dense | spread | verdict | per seed "
             "| wire_x_recv | handed_x |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in best_rows(rows, wanted):
        ratio = "-" if b["method"] == "powersgd" else f"{b['ratio']:g}"
        dtxt = "n/a" if b["delta"] is None else f"{b['delta']:+.4f}"
        per_seed = "/".join(f"{v:.3f}" for v in b["per_seed"])
        lines.append(f"| {b['label']} | {ratio} | {b['world']} | {b['steps']} | {b['lr']:g} | {b['mean']:.4f} | {dtxt} "
                     f"| {b['spread']:.4f} | {b['verdict']} | {per_seed} "
                     f"| {b['wire_x_recv']:.1f} | {b['handed_x']:.1f} |")
    return lines + [""]


def plot(rows: list[dict], wanted: list[tuple], path: Path, title: str) -> bool:
    """Loss delta vs dense (best lrs, bars: the spread) against the received-bytes ratio, one line per method
    and W; ``False`` (no file) when there is nothing to draw."""
    pts = [b for b in best_rows(rows, wanted) if b["method"] != "none" and b["delta"] is not None]
    if not pts:
        return False
    curves: dict[str, list[tuple[float, float, float]]] = {}
    styles: dict[str, dict] = {}
    methods = sorted({b["method"] for b in pts})
    worlds = sorted({b["world"] for b in pts})
    for b in pts:
        name = (b["method"] if b["method"] != "powersgd" else "powersgd (rank 4, 2, 1)") + f", W={b['world']}"
        curves.setdefault(name, []).append((b["wire_x_recv"], b["delta"], b["spread"]))
        w = worlds.index(b["world"])  # one colour per method, one marker and dash per W
        styles[name] = dict(color=f"C{methods.index(b['method']) % 10}", marker="osD^v"[w % 5],
                            ls=["-", "--", ":", "-."][w % 4])
    from titan_ds.plot import plot_curves
    plot_curves(curves, str(path), title=title, xlabel="dense ring all-reduce bytes received / the method's (log)",
                ylabel="validation loss - dense AdamW's (nats/byte; both at their best lr)", style=styles.get)
    return True


def plot_steps(rows: list[dict], path: Path, title: str) -> bool:
    """Validation loss against step for every row that recorded a ``curve`` (``--curve-every``), one line per
    method, ratio, W, lr and seed; ``False`` (no file) when none did."""
    series = {f"{r['method']} {r['ratio']:g}x, W={r['world']}, lr {r['lr']:g}, seed {r['seed']}"
              f" ({r['wire_x_recv']:.1f}x fewer bytes received)": [tuple(p) for p in r["curve"]]
              for r in rows if r.get("curve")}
    if not series:
        return False
    from titan_ds.plot import plot_lines
    plot_lines(series, str(path), title=title, xlabel="step", ylabel="validation loss (nats)")
    return True


def _ratios(method: str, ratios: list[float], world: int, match_recv: bool) -> list[float]:
    """The ratios to run ``method`` at: top-k (and dgc) also at ``ratio * W / 2`` (with ``match_recv``), where each worker
    receives ``(W - 1) * 8 k = 2 (W - 1) / W * 4 n / ratio`` bytes, as much as an all-reduce method at ``ratio``."""
    if method not in ("topk", "dgc", "rms") or not match_recv or world <= 2:
        return ratios
    return ratios + [r * world / 2 for r in ratios if r * world / 2 not in ratios]


def main(argv: Optional[list[str]] = None, command: Optional[str] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="2,8,32,128")
    p.add_argument("--methods", default="none,topk,tgss,hge")
    p.add_argument("--ratios", default="30,100")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lrs", default="", help="an lr grid (comma list; overrides --lr): each method's best lr is "
                   "compared with dense's best lr in the summary table")
    p.add_argument("--seeds", default="", help="seeds (comma list; overrides --seed): the summary prints the spread")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--no-match-recv", dest="match_recv", action="store_false",
                   help="do not add the top-k rows whose received bytes match the all-reduce methods' (ratio x W / 2)")
    p.add_argument("--warmup", type=int, default=0, help="dense steps before compressing")
    p.add_argument("--schedule", choices=("constant", "warmup_cosine"), default="constant",
                   help="the lr schedule of every row (lr_factor): constant, or launch/train.py's (linear warm-up, "
                        "cosine decay to 10%%)")
    p.add_argument("--section", default="",
                   help="a shipped ds_config (e.g. ds_configs/compress_rms_sketch.json): every row runs its optimizer "
                        "section's betas and weight decay as the engine would (section_settings); default: AdamW "
                        "(0.9, 0.999), no decay, as the rows before")
    p.add_argument("--ranks", default="1,2", help="PowerSGD ranks (method powersgd: one row per rank, no ratio)")
    add_dgc_args(p)
    p.add_argument("--out", default="results/compress_scale")
    p.add_argument("--label", default="", help="a note printed under the table's title (e.g. why it is partial)")
    p.add_argument("--table-only", action="store_true", help="rewrite <out>.md/.png from <out>.jsonl; run nothing")
    p.add_argument("--curve-every", type=int, default=0,
                   help="also store the validation loss every N steps (the row's `curve`; not part of its key)")
    add_store_args(p)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    corpus = None if a.table_only else load_corpus()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    jsonl = out.with_suffix(".jsonl")
    command = command or "python launch/bench/compress_scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lrs = [float(x) for x in (a.lrs or str(a.lr)).split(",")]
    seeds = [int(x) for x in (a.seeds or str(a.seed)).split(",")]
    ratios = [float(x) for x in a.ratios.split(",")]
    dgc = dict(momentum=a.dgc_momentum, masking=not a.dgc_no_masking, clip=a.dgc_clip, ramp_steps=a.dgc_ramp_steps,
               ramp_start=a.dgc_ramp_start, beta1=a.dgc_beta1)
    shipped = section_settings(a.section) if a.section else {"betas": None, "weight_decay": None}
    wanted, specs = [], {}
    for seed in seeds:
        for lr in lrs:
            settings = dict(steps=a.steps, micro_batch=a.micro_batch, context=a.context, n_layer=a.n_layer,
                            n_embd=a.n_embd, lr=lr, seed=seed, warmup=a.warmup,
                            schedule=None if a.schedule == "constant" else a.schedule, **shipped)
            for world in (int(x) for x in a.workers.split(",")):
                for m in a.methods.split(","):
                    if m == "powersgd":
                        variants = [(0.0, int(r), None) for r in a.ranks.split(",")]
                    else:
                        variants = [(ratio, None, dgc if m == "dgc" else None)
                                    for ratio in ([1.0] if m == "none" else _ratios(m, ratios, world, a.match_recv))]
                    for ratio, rank, opts in variants:
                        key = _key({"method": m, "ratio": ratio, "world": world, "rank": rank,
                                    "dgc": _dgc_label(opts), **settings})
                        wanted.append(key)
                        specs[key] = (rank, opts, settings)
    store = open_store(jsonl, a.reuse_stale)
    for key in ([] if a.table_only else wanted):
        if store.find(**_identity(dict(zip(_KEY, key)))) is not None:
            log.info("skip %s (done)", key[:3])
            continue
        rank, opts, settings = specs[key]
        row = train_row(key[0], key[1], key[2], corpus=corpus, rank=rank, dgc=opts, curve_every=a.curve_every,
                        **settings)
        store.append(**_identity(row), result=row)  # at once: a rerun skips it
        log.info("%s W=%d: val %.4f, recv %.1f KiB/step/worker, %.0fs",
                 f"{key[0]} r={rank}" if rank else f"{key[0]} {key[1]:g}x", key[2], row["val_loss"],
                 row["recv_per_worker_step"] / 1024, row["seconds"])
        out.with_suffix(".md").write_text(render(load_rows(store), wanted, command, a.label))
    out.with_suffix(".md").write_text(render(load_rows(store), wanted, command, a.label))
    if plot(load_rows(store), wanted, out.with_suffix(".png"),
            f"compression at W virtual workers, tiny GPT {a.n_layer}x{a.n_embd}, {a.steps} steps, seeds {a.seeds or a.seed}"):
        log.info("plot: %s", out.with_suffix(".png"))
    if plot_steps([r for r in load_rows(store) if _key(r) in set(wanted)], out.with_suffix(".curves.png"),
                  f"validation loss by step, tiny GPT {a.n_layer}x{a.n_embd}"):
        log.info("plot: %s", out.with_suffix(".curves.png"))
    print(out.with_suffix(".md").read_text())


def table(out: str) -> None:
    """``python -m launch.bench table compression-scale --out OUT``: ``<out>.md`` from ``<out>.jsonl`` with the
    options of the command the existing ``<out>.md`` records (its rows asked for, its label)."""
    import shlex
    m = re.search(r"`python launch/bench/compress_scale.py ([^`]*)`", Path(out).with_suffix(".md").read_text())
    if m is None:
        raise SystemExit(f"{Path(out).with_suffix('.md')} records no compress_scale.py command; run "
                         "compress_scale.py --table-only with the options of the run")
    head, _, label = m.group(1).partition(" --label ")  # the label is the rest of the line, unquoted
    argv = shlex.split(head) + (["--label", label] if label else [])
    argv = [x for i, x in enumerate(argv) if x != "--out" and (i == 0 or argv[i - 1] != "--out")]
    main([*argv, "--out", str(out), "--table-only"], command=m.group(0).strip("`"))


if __name__ == "__main__":
    main()
