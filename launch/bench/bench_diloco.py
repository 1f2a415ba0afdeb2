"""Local updates (DiLoCo) with a compressed outer step at W workers, simulated: loss against bytes *received*.

Command (resumable: each finished row is recorded in ``<out>/rows.jsonl`` at once, ``launch/bench/store.py``, and a
rerun skips it if the code is unchanged, or with ``--reuse-stale``; ``python -m launch.bench table local-updates
--out <out>`` rewrites the table from it without running anything)::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python launch/bench/bench_diloco.py --workers 8,32 --steps 200 \\
        --lrs 1e-3,3e-3 --seeds 0 --out results/diloco

Rows at equal tokens (every worker sees ``micro_batch x context`` tokens per step, ``steps`` steps):

* ``dense``: data-parallel AdamW, a dense all-reduce every step (``compress_scale.train_row("none")``);
* ``rms``: top-k of each worker's RMS-normalized gradient at ratio 100, all-gathered (today's default;
  ``compress_scale.train_row("rms")``);
* ``diloco``: each worker its own GPT copy and AdamW (the inner lr is the row's lr), ``H`` inner steps, then
  :class:`titan_ds.comm.diloco.OuterStep` (the package's code) with method ``none``: a dense all-reduce of the
  outer gradient every ``H`` steps; outer Nesterov lr 0.7, momentum 0.9;
* ``diloco+<method>``: the same with the outer gradient compressed (``randk``/``hge``/``tgss`` all-reduced; ``topk``
  and ``qtopk<bits>[c<chunk>]`` (chunked top-k, ``bits``-bit values, in-chunk indices; titan_ds/comm/qtopk.py)
  all-gathered at the ratio whose *received* bytes match the all-reduce rows').

All collectives go through :class:`titan_ds.comm.wire.SimCollective`, whose bytes per worker are the costs of
:func:`titan_ds.comm.wire.ring_bytes` (the same that :func:`~titan_ds.comm.wire.count_collectives` counts on
real ranks). ``x_recv`` = a dense ring all-reduce every step's received bytes / the row's, over the whole run.
The validation loss is the final model's (after the last outer step: ``steps`` is a multiple of ``H``).
"""
from __future__ import annotations

import argparse
import copy
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch.bench import compress_scale as cs  # noqa: E402
from launch.bench.store import CODE_PATHS, Store, add_store_args, fields_identity  # noqa: E402
from titan_ds.comm import GradientReducer  # noqa: E402
from titan_ds.comm.diloco import OuterStep  # noqa: E402
from titan_ds.comm.wire import SimCollective, ring_allreduce_bytes  # noqa: E402
from titan_ds.data import Batcher, load_corpus  # noqa: E402
from titan_ds.models import GPT  # noqa: E402

log = logging.getLogger("titan_ds.bench.diloco")

_KEY = ("method", "ratio", "sync_every", "world", "steps", "lr", "seed", "outer_lr", "outer_momentum")
_OPTIONAL = ("betas", "weight_decay", "schedule")  # settings a row written before them lacks (None: left out)


def diloco_row(method: str, ratio: float, sync_every: int, world: int, steps: int, *, corpus, lr: float, seed: int,
               outer_lr: float = 0.7, outer_momentum: float = 0.9, micro_batch: int = 4, context: int = 64,
               n_layer: int = 2, n_embd: int = 64, betas: Optional[str] = None, weight_decay: Optional[float] = None,
               schedule: Optional[str] = None, curve_every: int = 0) -> dict[str, Any]:
    """One DiLoCo row. ``betas``/``weight_decay``: the inner AdamW's (a shipped section's, as
    ``compress_scale.section_settings`` reads it; None: (0.9, 0.999) and no decay, the rows before); ``schedule``:
    the inner lr's (``compress_scale.lr_factor``); ``curve_every``: the validation loss after every outer step
    that ends a multiple of it (a multiple of ``sync_every``) as ``curve`` ``[step, loss]`` pairs. The time
    model's inputs (launch/bench/wallclock.py) are recorded as in ``compress_scale.train_row``."""
    if steps % sync_every or (curve_every and curve_every % sync_every):
        raise ValueError(f"steps={steps} and curve_every={curve_every} must be multiples of sync_every={sync_every}")
    torch.manual_seed(seed)
    base = GPT(n_layer=n_layer, n_embd=n_embd, n_head=4, block_size=context)  # the same init as compress_scale
    models = [copy.deepcopy(base) for _ in range(world)]
    b1, b2 = (float(b) for b in betas.split(",")) if betas is not None else (0.9, 0.999)
    opts = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=weight_decay or 0.0, betas=(b1, b2)) for m in models]
    outers = [OuterStep(list(m.named_parameters()), _reducer(method, ratio, seed),
                        outer_lr=outer_lr, outer_momentum=outer_momentum) for m in models]
    batchers = [Batcher(corpus.train, micro_batch, context, seed=seed, rank=w, world=world) for w in range(world)]
    sim = SimCollective(world)
    n = sum(p.numel() for p in base.parameters())
    t0, compute, compute_cpu, curve = time.perf_counter(), 0.0, 0.0, []
    for step in range(steps):
        c0, cpu0 = time.perf_counter(), time.thread_time()
        lr_t = lr * cs.lr_factor(schedule, step, steps)
        for w in range(world):
            x, y = batchers[w].get(step)
            opts[w].zero_grad(set_to_none=True)
            models[w](x, y).backward()
            for g in opts[w].param_groups:
                g["lr"] = lr_t
            opts[w].step()
        compute += time.perf_counter() - c0
        compute_cpu += time.thread_time() - cpu0
        if (step + 1) % sync_every == 0:
            sim.run(lambda w, comm: outers[w].sync(comm))
            if curve_every and (step + 1) % curve_every == 0 and step + 1 < steps:
                curve.append([step + 1, cs._val_loss(models[0], corpus.val, 8, micro_batch * 4, context)])
    for m in models[1:]:
        for a, b in zip(models[0].parameters(), m.parameters()):
            if not torch.equal(a, b):
                raise RuntimeError("workers hold different parameters after the last outer step")
    dense = ring_allreduce_bytes(4 * n, world) * steps
    sent, recv = sum(sim.sent) / world, sum(sim.received) / world
    val = cs._val_loss(models[0], corpus.val, 8, micro_batch * 4, context)
    return {"method": "diloco" if method == "none" else f"diloco+{method}", "ratio": ratio, "sync_every": sync_every,
            "world": world, "steps": steps, "lr": lr, "seed": seed, "outer_lr": outer_lr,
            "outer_momentum": outer_momentum, "micro_batch": micro_batch, "context": context, "params": n,
            "betas": betas, "weight_decay": weight_decay, "schedule": schedule, "val_loss": val,
            **({"curve": curve + [[steps, val]]} if curve_every else {}),
            "compute_per_worker_step": compute_cpu / (world * steps),
            "codec_per_worker_step": sum(sim.cpu_seconds) / (world * steps),
            "rounds_per_worker_step": sim.wire[0].rounds / steps, "sent_per_worker": sent, "recv_per_worker": recv, "dense_ring_per_worker": dense,
            "x_sent": dense / sent, "x_recv": dense / recv, "compute_s_per_worker_step": compute / (steps * world),
            "seconds": time.perf_counter() - t0}


def baseline_row(method: str, world: int, steps: int, *, corpus, lr: float, seed: int) -> dict[str, Any]:
    ratio = 1.0 if method == "dense" else 100.0
    r = cs.train_row("none" if method == "dense" else "rms", ratio, world, steps, corpus=corpus, lr=lr, seed=seed)
    return {"method": method, "ratio": ratio, "sync_every": 1, "world": world, "steps": steps, "lr": lr, "seed": seed,
            "outer_lr": None, "outer_momentum": None, "micro_batch": r["micro_batch"], "context": r["context"],
            "params": r["params"], "val_loss": r["val_loss"], "sent_per_worker": r["sent_per_worker_step"] * steps,
            "recv_per_worker": r["recv_per_worker_step"] * steps,
            "dense_ring_per_worker": r["dense_ring_per_worker_step"] * steps, "x_sent": r["wire_x_sent"],
            "x_recv": r["wire_x_recv"], "compute_s_per_worker_step": r["seconds"] / (steps * world),
            "seconds": r["seconds"]}


def specs(workers: list[int], lrs: list[float], seeds: list[int], steps: int, target: float, *,
          syncs: list[int], outer: list[tuple[float, float]], compressors: list[str],
          baselines: tuple[str, ...] = ("dense", "rms"), uncompressed: bool = True) -> list[dict]:
    """The grid, baselines first. ``target``: the received-bytes reduction the compressed rows aim at (``H`` gives
    ``H``x, the compressor the rest: all-reduced methods at ratio ``target / H``, the all-gathered ones (``topk``,
    ``qtopk...``) at ``target / H * W / 2``). ``baselines``: which of ``dense`` (every lr) and ``rms`` to add;
    ``uncompressed``: the ``none`` row at each H."""
    out = []
    for seed in seeds:
        for world in workers:
            if "dense" in baselines:
                out += [dict(method="dense", ratio=1.0, sync_every=1, world=world, lr=lr, seed=seed) for lr in lrs]
            if "rms" in baselines:
                out.append(dict(method="rms", ratio=100.0, sync_every=1, world=world, lr=3e-3, seed=seed))
            for lr in lrs:
                for h in syncs:
                    for olr, mu in outer:
                        common = dict(sync_every=h, world=world, lr=lr, seed=seed, outer_lr=olr, outer_momentum=mu)
                        if uncompressed:
                            out.append(dict(method="none", ratio=1.0, **common))
                        for c in compressors:
                            ratio = target / h * (world / 2 if _gathered(c) else 1)
                            if ratio > 1:
                                out.append(dict(method=c, ratio=ratio, **common))
    for s in out:
        s.update(steps=steps)
        s.setdefault("outer_lr", None)
        s.setdefault("outer_momentum", None)
    return out


def _gathered(method: str) -> bool:
    """All-gathered messages (received bytes grow with W): ``topk`` and ``qtopk<bits>[c<chunk>]``."""
    return method == "topk" or _qtopk(method) is not None


def _qtopk(method: str) -> Optional[dict]:
    """``qtopk<bits>`` or ``qtopk<bits>c<chunk>`` (titan_ds/comm/qtopk.py; chunk 4096 unless given): its options."""
    m = re.fullmatch(r"qtopk(\d)(?:c(\d+))?", method)
    return None if m is None else {"bits": int(m.group(1)), "chunk": int(m.group(2) or 4096)}


def _reducer(method: str, ratio: float, seed: int) -> GradientReducer:
    """The package's reducer, built as ``titan.compression`` builds it (``qtopk<bits>[c<chunk>]``: method ``qtopk``
    with those ``bits`` and ``chunk``)."""
    q = _qtopk(method)
    name, opts = ("qtopk", q) if q is not None else (method, {})
    return GradientReducer(name, ratio, seed=seed, **opts, **({} if method == "none" else {"error_feedback": True}))


def _key(row: dict) -> tuple:
    return tuple(row.get(k) for k in _KEY)


def _identity(row: dict) -> dict:
    return fields_identity(row, [k for k in _KEY if k not in ("steps", "seed")],
                           ["steps"] + [k for k in _OPTIONAL if row.get(k) is not None])


def open_store(path: Path, reuse_stale: bool = False) -> Store:
    """``<out>/rows.jsonl`` (``launch/bench/store.py``); rows from before the store read as code unknown. The
    code is the package's, this script's and compress_scale.py's (the rows' training loops)."""
    return Store(path, suite="local-updates", reuse_stale=reuse_stale,
                 legacy=lambda raw: {**_identity(raw), "result": raw},
                 code_paths=(*CODE_PATHS, "launch/bench/bench_diloco.py", "launch/bench/compress_scale.py"))


def load_rows(store: Store) -> list[dict]:
    """Every row's result: the newest record of each."""
    return [rec["result"] for rec in store.latest()]


def _label(spec: dict) -> str:
    return "diloco" if spec["method"] == "none" and spec["sync_every"] > 1 else (
        spec["method"] if spec["sync_every"] == 1 else f"diloco+{spec['method']}")


LINKS = {"1 Gbit/s": 1e9 / 8, "10 Gbit/s": 10e9 / 8}  # bytes per second


def _name(r: dict) -> str:
    if r["sync_every"] == 1:
        return r["method"] if r["method"] == "dense" else "topk+rms"
    return f"{r['method']} H={r['sync_every']} outer={r['outer_lr']:g}/{r['outer_momentum']:g}"


def best(rows: list[dict]) -> list[dict]:
    """Per (name, ratio, W, seed): the row at its best inner lr (lowest validation loss over the lr grid)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        k = (_name(r), round(r["ratio"], 3), r["world"], r["seed"])
        if k not in out or r["val_loss"] < out[k]["val_loss"]:
            out[k] = r
    return sorted(out.values(), key=lambda r: (r["world"], r["seed"], r["sync_every"] > 1, _name(r)))


def step_seconds(r: dict, link: float) -> float:
    """Wall-clock model of one step of one worker: measured compute + this row's received bytes per step / link
    bandwidth (no overlap of compute and communication; a ring sends as much as it receives, full duplex)."""
    return r["compute_s_per_worker_step"] + r["recv_per_worker"] / r["steps"] / link


def render(rows: list[dict], command: str) -> str:
    rows = best(rows)
    lines = ["# Local updates (DiLoCo) against dense AdamW and top-k + rms at W workers (simulator)", "",
             "Made by (each invocation added rows; a rerun skips finished rows):", "", "```",
             command.strip(), "```", "",
             "Each row at its best inner lr of the grid; delta against dense at its best lr at the same W and seed; "
             "x_recv = dense ring all-reduce every step / the row, received bytes per worker over the whole run.", "",
             "| method | ratio | W | seed | lr | val_loss | delta_vs_dense | recv MiB/worker | x_recv |"
             + "".join(f" step s @{k} |" for k in LINKS), "|---" * (9 + len(LINKS)) + "|"]
    dense = {(r["world"], r["seed"]): r for r in rows if r["method"] == "dense"}
    for r in rows:
        d = dense.get((r["world"], r["seed"]))
        delta = f"{r['val_loss'] - d['val_loss']:+.4f}" if d else "n/a"
        # the wall-clock model uses dense's measured compute for every row (same model and micro-batch per worker)
        base = dict(r, compute_s_per_worker_step=d["compute_s_per_worker_step"]) if d else r
        lines.append(f"| {_name(r)} | {r['ratio']:g} | {r['world']} | {r['seed']} | {r['lr']:g} | {r['val_loss']:.4f} "
                     f"| {delta} | {r['recv_per_worker'] / 2**20:.2f} | {r['x_recv']:.1f} |"
                     + "".join(f" {step_seconds(base, bw):.4f} |" for bw in LINKS.values()))
    lines += ["", "Wall-clock model: step time = compute per worker-step (dense's measured one on this CPU, the same "
              "for every row at a W) + received bytes per worker per step / link bandwidth; no overlap."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in best(rows) if r["seed"] == min(x["seed"] for x in rows)]
    if not rows:
        return False
    family = {}  # one line per method: its best row (H, outer step, inner lr) at each W
    for r in rows:
        k = (_name(r).split(" H=")[0], r["world"])
        if k not in family or r["val_loss"] < family[k]["val_loss"]:
            family[k] = r
    markers = {2: "s", 8: "o", 32: "^", 128: "D"}
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, name in enumerate(sorted({k[0] for k in family})):
        pts = sorted((r["recv_per_worker"] / 2**20, r["val_loss"], w) for (n, w), r in family.items() if n == name)
        color = plt.get_cmap("tab10")(i)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", alpha=0.5, color=color, label=name)
        for x, y, w in pts:
            ax.plot(x, y, markers.get(w, "x"), color=color)
    ax.set_xscale("log")
    ax.set_xlabel("MiB received per worker over the run (markers: square W=2, circle 8, triangle 32)")
    ax.set_ylabel("validation loss")
    steps = "/".join(str(x) for x in sorted({r["steps"] for r in rows}))
    ax.set_title(f"each method at its best H / outer step / inner lr per W (seed {rows[0]['seed']}, {steps} steps)",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="8,32")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lrs", default="1e-3,3e-3")
    p.add_argument("--seeds", default="0")
    p.add_argument("--target", type=float, default=100.0, help="received-bytes reduction the compressed rows aim at")
    p.add_argument("--syncs", default="20", help="sync_every values (H)")
    p.add_argument("--outer", default="0.7:0.9", help="outer_lr:outer_momentum pairs, comma-separated")
    p.add_argument("--compressors", default="randk,topk,hge", help="outer-gradient compressors besides none")
    p.add_argument("--baselines", default="dense,rms", help="baseline rows to add: dense (every lr), rms")
    p.add_argument("--no-baselines", dest="baselines", action="store_const", const="",
                   help="skip the dense and rms rows")
    p.add_argument("--no-uncompressed", dest="uncompressed", action="store_false",
                   help="skip the uncompressed-outer (method none) row at each H")
    p.add_argument("--only-baselines", action="store_true", help="the baseline rows alone, no local-update rows")
    p.add_argument("--section", default="", help="a shipped ds_config: the inner AdamW's betas and weight decay "
                   "(compress_scale.section_settings); default (0.9, 0.999), no decay, as the rows before")
    p.add_argument("--schedule", choices=("constant", "warmup_cosine"), default="constant",
                   help="the inner lr's schedule (compress_scale.lr_factor)")
    p.add_argument("--curve-every", type=int, default=0, help="also record the validation loss every N steps "
                   "(a multiple of H; the row's `curve`, used by launch/bench/wallclock.py)")
    p.add_argument("--out", default="results/diloco")
    add_store_args(p)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "rows.jsonl"
    command = ("PYTHONPATH=$PWD OMP_NUM_THREADS=1 python launch/bench/bench_diloco.py " +
               " ".join(argv if argv is not None else sys.argv[1:]))
    done = (out / "commands.txt").read_text().splitlines() if (out / "commands.txt").exists() else []
    if command not in done:  # every invocation that added rows to this folder, in order
        (out / "commands.txt").write_text("\n".join(done + [command]) + "\n")
    corpus = load_corpus()
    grid = specs([int(x) for x in a.workers.split(",")], [float(x) for x in a.lrs.split(",")],
                 [int(x) for x in a.seeds.split(",")], a.steps, a.target, syncs=[int(x) for x in a.syncs.split(",")],
                 outer=[(float(x.split(":")[0]), float(x.split(":")[1])) for x in a.outer.split(",")],
                 compressors=[c for c in a.compressors.split(",") if c],
                 baselines=tuple(b for b in a.baselines.split(",") if b), uncompressed=a.uncompressed)
    if a.only_baselines:
        grid = [s for s in grid if s["sync_every"] == 1]
    store = open_store(jsonl, a.reuse_stale)
    shipped = cs.section_settings(a.section) if a.section else {"betas": None, "weight_decay": None}
    shipped["schedule"] = None if a.schedule == "constant" else a.schedule
    if a.section or shipped["schedule"]:
        grid = [s for s in grid if s["sync_every"] > 1]  # dense / rms rows with these settings: compress_scale.py
    for spec in grid:
        spec = {**spec, **shipped}
        want = {**spec, "method": _label(spec)}
        if store.find(**_identity(want)) is not None:
            continue
        if spec["sync_every"] == 1:
            row = baseline_row(spec["method"], spec["world"], a.steps, corpus=corpus, lr=spec["lr"], seed=spec["seed"])
        else:
            row = diloco_row(spec["method"], spec["ratio"], spec["sync_every"], spec["world"], a.steps, corpus=corpus,
                             lr=spec["lr"], seed=spec["seed"], outer_lr=spec["outer_lr"],
                             outer_momentum=spec["outer_momentum"], curve_every=a.curve_every, **shipped)
        store.append(**_identity(row), result=row)  # at once: a rerun skips it
        write_report(out, store)
        log.info("%s H=%s ratio=%g W=%d lr=%g outer=%s/%s: val %.4f, x_recv %.1f, %.0fs", row["method"], row["sync_every"],
                 row["ratio"], row["world"], row["lr"], row["outer_lr"], row["outer_momentum"], row["val_loss"], row["x_recv"], row["seconds"])


def table(out: str) -> None:
    """``python -m launch.bench table local-updates --out OUT``: ``OUT/table.md`` and the plot from
    ``OUT/rows.jsonl``, running nothing."""
    write_report(Path(out), open_store(Path(out) / "rows.jsonl"))


def write_report(out: Path, store: Store) -> None:
    rows = load_rows(store)
    (out / "table.md").write_text(render(rows, (out / "commands.txt").read_text()))
    plot(rows, out / "loss_vs_recv.png")


if __name__ == "__main__":
    main()
