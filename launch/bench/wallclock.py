"""Time, not only bytes: validation loss against modelled wall-clock for many workers on a slow network.

Runs nothing: it reads simulator rows that recorded a loss curve and the time model's inputs (``compress_scale.py``
and ``bench_diloco.py`` with ``--curve-every``, code from 2026-12-07 on) and models each worker's step as::

    t_step = compute + codec + rounds x alpha + received bytes / bandwidth

* ``compute``: the worker's forward + backward (+ DiLoCo's inner AdamW), CPU seconds measured in the simulator;
* ``codec``: its encode / decode / error-feedback / preconditioner work, CPU seconds measured in the simulator
  (``SimCollective.cpu_seconds``: the thread's own CPU time, less the sums a network would do);
* ``rounds``: the message rounds of every collective the step calls (``titan_ds.comm.wire.ring_rounds``: a ring
  all-reduce ``2 (W - 1)``, an all-gather or all-to-all ``W - 1``), the sharded exchange's two rounds and the
  sketch's all-reduce included, each one link latency ``alpha``;
* received bytes over the link's bandwidth (ring collectives: what a worker receives is on its link).

No overlap of communication with compute is assumed (a bound on what overlap can hide is ``max`` instead of
``+``). The figures are for the simulated model (the tiny GPT: 2x64, ~137K parameters) with its compute and codec
measured on this machine's CPU, one core a worker; ``--project-params`` adds a table that scales the bytes and the
codec time linearly to a larger model and takes its compute per step as given. Command::

    python launch/bench/wallclock.py --stores results/compress_heldout/heldout.jsonl \\
        --diloco results/compress_heldout/diloco/rows.jsonl --out results/compress_heldout/wallclock
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch.bench import bench_diloco as bd  # noqa: E402
from launch.bench import compress_scale as cs  # noqa: E402

LINKS = {"1 Gbit/s": 1e9 / 8, "10 Gbit/s": 10e9 / 8}  # bytes per second
ALPHA = 50e-6  # seconds a message round: a TCP socket through one switch, as NCCL's socket transport sees it
RECOMMENDED = cs.shipped_method(str(Path(__file__).resolve().parents[2] / "ds_configs" / "compress_rms_sketch.json"))
__all__ = ["step_seconds", "codec_seconds", "collect", "render", "plot", "main"]
CODEC_METHODS = {"dense DDP (AdamW, all-reduce)": "none", "compress_rms_sketch.json (shipped)": RECOMMENDED}


def codec_seconds(method: str, n: int, world: int, *, steps: int = 3, piece: int = 1 << 20) -> float:
    """One worker's encode / decode CPU seconds per step for an ``n``-element gradient (tensor pieces of
    ``piece`` elements), through ``compress_scale.make_reducer(method)`` at ``world`` simulated workers at the
    shipped section's beta2: the mean of ``steps`` steps after one untimed (``SimCollective.cpu_seconds``, so
    the network's sums are not in it)."""
    import torch
    from titan_ds.comm.base import Segment
    layout = [Segment(f"p{i}", 0, off, min(piece, n - off), min(piece, n - off), (min(piece, n - off),))
              for i, off in enumerate(range(0, n, piece))]
    reducers = [cs.make_reducer(method, 1.0 if method == "none" else 100.0, warmup=0, seed=0, beta2=0.95)
                for _ in range(world)]
    gen = torch.Generator().manual_seed(0)
    spent = []
    for step in range(steps + 1):
        grads = [torch.randn(n, generator=gen) for _ in range(world)]
        sim = cs.SimCollective(world)
        sim.run(lambda w, comm: reducers[w].reduce(grads[w], layout, comm, step, lr=1e-3))
        for r in reducers:
            r.end_step()
        if step:
            spent.append(sum(sim.cpu_seconds) / world)
    return mean(spent)


def step_seconds(row: dict[str, Any], bandwidth: float, alpha: float = ALPHA, *, scale: float = 1.0,
                 compute: Optional[float] = None) -> float:
    """One worker's modelled step: ``compute + codec + rounds x alpha + received / bandwidth``. ``scale``
    multiplies the bytes and the codec time (a model ``scale`` times larger); ``compute`` replaces the
    measured compute (a projection's)."""
    c = row["compute_per_worker_step"] if compute is None else compute
    return c + scale * row["codec_per_worker_step"] + row["rounds_per_worker_step"] * alpha + \
        scale * row["recv_step"] / bandwidth


def _family(method: str, row: dict[str, Any]) -> Optional[str]:
    if method == "none":
        return "dense DDP (AdamW, all-reduce)"
    if method == RECOMMENDED:
        return "compress_rms_sketch.json (shipped)"
    if method == "diloco":
        return f"DiLoCo (H={row['sync_every']}, dense outer)"
    if method.startswith("diloco+"):
        return f"DiLoCo (H={row['sync_every']}) + {method.split('+', 1)[1]}"
    return None


def collect(stores: list[str], diloco: list[str]) -> list[dict[str, Any]]:
    """Rows with a curve and the time model's inputs: ``{family, world, seed, steps, lr, curve, val_loss,
    compute_per_worker_step, codec_per_worker_step, rounds_per_worker_step, recv_step, x_recv}``."""
    out = []
    for path in stores:
        for r in cs.load_rows(cs.open_store(Path(path), reuse_stale=True)):
            fam = _family(r["method"], r)
            if fam and "curve" in r and "codec_per_worker_step" in r:
                out.append({**r, "family": fam, "recv_step": r["recv_per_worker_step"], "x_recv": r["wire_x_recv"]})
    for path in diloco:
        for r in bd.load_rows(bd.open_store(Path(path), reuse_stale=True)):
            fam = _family(r["method"], r)
            if fam and "curve" in r and "codec_per_worker_step" in r:
                out.append({**r, "family": fam, "recv_step": r["recv_per_worker"] / r["steps"]})
    return out


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[int, str], list[dict[str, Any]]]:
    """(W, family) -> its rows at its best lr (lowest mean final loss over the seeds that lr has)."""
    by: dict[tuple[int, str, float], list[dict]] = defaultdict(list)
    for r in rows:
        by[(r["world"], r["family"], r["lr"])].append(r)
    best: dict[tuple[int, str], list[dict]] = {}
    for (w, fam, _), rs in sorted(by.items()):
        seeds = {r["seed"] for r in rs}
        if (w, fam) not in best or (len(seeds) >= len({r["seed"] for r in best[(w, fam)]})
                                    and mean(r["val_loss"] for r in rs) < mean(r["val_loss"] for r in best[(w, fam)])):
            best[(w, fam)] = rs
    return best


def _curve(rs: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """The seeds' mean loss at the steps every seed recorded."""
    steps = set.intersection(*({s for s, _ in r["curve"]} for r in rs))
    return [(s, mean(dict((int(a), b) for a, b in r["curve"])[s] for r in rs)) for s in sorted(steps)]


def render(rows: list[dict[str, Any]], command: str, alpha: float = ALPHA, project_params: float = 0.0,
           project_compute: float = 0.0, codec: Optional[dict[str, Any]] = None) -> str:
    groups = _groups(rows)
    lines = ["# Validation loss against modelled wall-clock (simulator, held-out seeds)", "", f"`{command}`", "",
             f"Per worker step: `compute + codec + rounds x alpha + received / bandwidth`, alpha = "
             f"{alpha * 1e6:g} us, no overlap (launch/bench/wallclock.py). compute and codec are CPU seconds "
             "measured in the simulator (one core a worker, this machine); each row at its best lr, seeds averaged.",
             "", "| W | method | lr | seeds | val_loss (spread) | x fewer bytes received | compute ms | codec ms "
             "| rounds | KiB received | step ms at 1 Gbit/s | step ms at 10 Gbit/s | run s at 1 Gbit/s "
             "| run s at 10 Gbit/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (w, fam), rs in sorted(groups.items()):
        vals = [r["val_loss"] for r in rs]
        t = {k: mean(step_seconds(r, bw, alpha) for r in rs) for k, bw in LINKS.items()}
        steps = rs[0]["steps"]
        lines.append(f"| {w} | {fam} | {rs[0]['lr']:g} | {','.join(str(r['seed']) for r in rs)} "
                     f"| {mean(vals):.4f} ({max(vals) - min(vals):.4f}) | {mean(r['x_recv'] for r in rs):.1f} "
                     f"| {mean(r['compute_per_worker_step'] for r in rs) * 1e3:.2f} "
                     f"| {mean(r['codec_per_worker_step'] for r in rs) * 1e3:.2f} "
                     f"| {mean(r['rounds_per_worker_step'] for r in rs):.1f} "
                     f"| {mean(r['recv_step'] for r in rs) / 1024:.1f} "
                     f"| {t['1 Gbit/s'] * 1e3:.2f} | {t['10 Gbit/s'] * 1e3:.2f} "
                     f"| {t['1 Gbit/s'] * steps:.1f} | {t['10 Gbit/s'] * steps:.1f} |")
    if codec:
        lines += ["", f"## Encode / decode at {codec['n']:,} elements", "",
                  f"`codec_seconds` (one worker's CPU seconds a step, {codec['world']} simulated workers, "
                  f"{codec['steps']} steps after one untimed, tensor pieces of 2^20, OMP_NUM_THREADS=1, this "
                  "machine's CPU; the tiny model's per-step figures above carry its fixed per-call costs):", "",
                  "| method | codec s a step | elements/s |", "|---|---|---|"]
        for fam, sec in codec["seconds"].items():
            lines.append(f"| {fam} | {sec:.3f} | {codec['n'] / sec / 1e6:.1f} M |")
    if project_params:
        n = rows[0]["params"]
        scale = project_params / n
        rate = {fam: sec / codec["n"] for fam, sec in codec["seconds"].items()} if codec else {}
        lines += ["", f"## Projected to {project_params / 1e9:g}B parameters", "",
                  f"Bytes scaled by {scale:.0f} (parameters {project_params:.3g} / {n}); rounds as measured; "
                  f"compute taken as {project_compute:g} s a step (an assumption, not a measurement: about a 1B "
                  "model's 6 N x 8K tokens at 160 TFLOP/s). Encode / decode twice: at the per-element rate of the "
                  "table above (one CPU core a worker: where the codec would run beside a CPU-bound step), and at 0 "
                  "(a bound for a codec on the accelerator, which this project has not measured). Dense DDP's "
                  "all-reduce has no codec in either (the simulator's copies for it are left out). The loss is not "
                  "projected: what a step would cost, not what it would reach.",
                  "", "| W | method | codec s (CPU) | step s at 1 Gbit/s (CPU codec) | step s at 10 Gbit/s (CPU codec) "
                  "| step s at 1 Gbit/s (no codec) | step s at 10 Gbit/s (no codec) | x dense at 1 Gbit/s (no codec) "
                  "| x dense at 10 Gbit/s (no codec) |", "|---|---|---|---|---|---|---|---|---|"]

        def codec_rate(r: dict[str, Any]) -> float:
            if r["family"].startswith("dense"):
                return 0.0
            if r["family"].startswith("DiLoCo") and "dense outer" in r["family"]:  # a dense reduce every H steps
                return rate.get("dense DDP (AdamW, all-reduce)", 0.0) / r["sync_every"]
            return rate.get(r["family"], 0.0)

        def proj(r: dict[str, Any], bw: float, with_codec: bool) -> float:
            c = codec_rate(r) * project_params if with_codec else 0.0
            return project_compute + c + r["rounds_per_worker_step"] * alpha + scale * r["recv_step"] / bw

        for (w, fam), rs in sorted(groups.items()):
            dense = groups.get((w, "dense DDP (AdamW, all-reduce)"))
            t = {(k, c): mean(proj(r, bw, c) for r in rs) for k, bw in LINKS.items() for c in (True, False)}
            d = {k: mean(proj(r, bw, False) for r in dense) for k, bw in LINKS.items()} if dense else None
            lines.append(f"| {w} | {fam} | {mean(codec_rate(r) for r in rs) * project_params:.2f} "
                         f"| {t[('1 Gbit/s', True)]:.2f} | {t[('10 Gbit/s', True)]:.2f} "
                         f"| {t[('1 Gbit/s', False)]:.2f} | {t[('10 Gbit/s', False)]:.2f} "
                         + (f"| {t[('1 Gbit/s', False)] / d['1 Gbit/s']:.3f} "
                            f"| {t[('10 Gbit/s', False)] / d['10 Gbit/s']:.3f} |" if d else "| n/a | n/a |"))
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, alpha: float = ALPHA) -> bool:
    """A 2 x 2 grid (W x link): each method's seed-mean loss curve against its modelled wall-clock."""
    groups = _groups(rows)
    worlds = sorted({w for w, _ in groups})
    if not worlds:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(worlds), len(LINKS), figsize=(5.5 * len(LINKS), 3.6 * len(worlds)), squeeze=False)
    for i, w in enumerate(worlds):
        for j, (link, bw) in enumerate(LINKS.items()):
            ax = axes[i][j]
            for (w2, fam), rs in sorted(groups.items()):
                if w2 != w:
                    continue
                t = mean(step_seconds(r, bw, alpha) for r in rs)
                pts = _curve(rs)
                ax.plot([s * t for s, _ in pts], [v for _, v in pts], marker=".", label=fam)
            ax.set_title(f"W = {w}, {link}, alpha {alpha * 1e6:g} us")
            ax.set_xlabel("modelled wall-clock (s)")
            ax.set_ylabel("validation loss (nats)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stores", default="", help="compress_scale.py stores (comma list)")
    p.add_argument("--diloco", default="", help="bench_diloco.py stores (comma list of rows.jsonl)")
    p.add_argument("--alpha", type=float, default=ALPHA, help="seconds a message round (link latency)")
    p.add_argument("--project-params", type=float, default=0.0, help="also project the step to this many parameters")
    p.add_argument("--project-compute", type=float, default=0.3, help="the projected model's compute s a step")
    p.add_argument("--codec-n", type=int, default=0, help="also measure encode / decode at this many elements "
                   "(codec_seconds; kept in <out>.codec.json, reused unless --remeasure)")
    p.add_argument("--codec-world", type=int, default=8)
    p.add_argument("--remeasure", action="store_true")
    p.add_argument("--out", default="results/compress_heldout/wallclock")
    a = p.parse_args(argv)
    rows = collect([s for s in a.stores.split(",") if s], [s for s in a.diloco.split(",") if s])
    if not rows:
        raise SystemExit("no row with a curve and the time model's inputs in the stores given: run compress_scale.py "
                         "/ bench_diloco.py with --curve-every (code from 2026-12-07 on)")
    command = "python launch/bench/wallclock.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    codec = None
    cj = out.with_suffix(".codec.json")
    if a.codec_n:
        import json
        codec = json.loads(cj.read_text()) if cj.exists() and not a.remeasure else None
        if codec is None or codec["n"] != a.codec_n or codec["world"] != a.codec_world:
            codec = {"n": a.codec_n, "world": a.codec_world, "steps": 3,
                     "seconds": {fam: codec_seconds(m, a.codec_n, a.codec_world) for fam, m in CODEC_METHODS.items()}}
            cj.write_text(json.dumps(codec, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(rows, command, a.alpha, a.project_params, a.project_compute, codec)
                                      + f"\n![loss against modelled wall-clock]({out.name}.png)\n")
    plot(rows, out.with_suffix(".png"), a.alpha)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
