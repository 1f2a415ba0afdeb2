"""Many workers: loss against bytes *received* per worker, W = 2 to 128, every method in one table and one plot.

Runs nothing: it reads the simulator's stores that ``compression-scale`` (``launch/bench/compress_scale.py``: dense,
per-step top-k / top-k + rms / rand-k / HGE / cltk) and ``local-updates`` (``launch/bench/bench_diloco.py``: DiLoCo
with and without a compressed outer step) wrote, on the same tiny GPT (2x64, context 64, micro-batch 4 per worker,
the same data and seeds, equal tokens per worker), and puts each method at its best setting per W beside dense
data-parallel AdamW at its best lr::

    python -m launch.bench table many-workers            # = python launch/bench/many_workers.py

Per (W, steps, seed): dense's lowest validation loss over the stores and lrs is the reference; each method's row is its best (lowest validation
loss) over lr and, for DiLoCo, over H and the outer step, among its rows that receive at least ``--min-x`` times
fewer bytes than dense (default 90: the 100x point) -- plus the uncompressed methods at whatever they receive.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch.bench import bench_diloco as bd  # noqa: E402
from launch.bench import compress_scale as cs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCALE = ["results/compress_w2_1000.jsonl", "results/compress_scale_w.jsonl", "results/compress_cltk_w8_200.jsonl",
         "results/compress_cltk_w32_200.jsonl", "results/compress_cltk_w8_1000.jsonl",
         "results/compress_qtopk_sweep.jsonl", "results/compress_qtopk_w8_1000.jsonl",
         "results/compress_qtopk_sharded.jsonl", "results/compress_qtopk_sharded_1000.jsonl",
         "results/compress_qtopk_w8_grid.jsonl", "results/compress_qtopk_w32_1000.jsonl",
         "results/compress_qtopk_sharded_w8_lr.jsonl", "results/compress_qtopk_w32_ag.jsonl",
         "results/compress_rms_mean_w32.jsonl", "results/compress_sketch_w32_1000.jsonl",
         "results/compress_sketch_w8_1000.jsonl", "results/compress_sketch_w128.jsonl"]  # compress_scale stores
DILOCO = ["results/diloco/rows.jsonl", "results/diloco_long/rows.jsonl", "results/diloco_cltk/rows.jsonl"]  # bench_diloco stores
NAMES = {"none": "dense", "rms": "top-k + rms", "topk": "top-k", "hge": "HGE", "tgss": "TGSS",
         "rms_randk": "rand-k + rms", "rms_cltk": "cltk + rms"}
__all__ = ["collect", "render", "plot", "main", "table"]


def _family(method: str) -> str:
    """A DiLoCo row's method without its compressor's settings (``diloco+qtopk2c256`` -> ``DiLoCo + qtopk``)."""
    if method == "dense":
        return "dense"
    if method == "rms":
        return "top-k + rms"
    if method == "diloco":
        return "DiLoCo (uncompressed outer)"
    comp = method.split("+", 1)[1]
    return "DiLoCo + " + ("qtopk" if comp.startswith("qtopk") else comp)


def collect(root: Path = ROOT) -> list[dict[str, Any]]:
    """Every simulator row as ``{source, family, setting, world, steps, seed, lr, val_loss, x_recv, recv_mib}``."""
    out = []
    for rel in SCALE:
        if not (root / rel).exists():
            continue
        for r in cs.load_rows(cs.open_store(root / rel, reuse_stale=True)):
            family, q = NAMES.get(r["method"]), cs.qtopk_options(r["method"])
            if q is not None:
                family = ("qtopk + rms_mean" if r["method"].startswith("rms_mean") else "qtopk + rms_sketch"
                          if r["method"].startswith("rms_sketch") else "qtopk + rms") + (
                    ", sharded" if q["exchange"] == "sharded" else "")
            if family is None or r.get("rank") or r.get("dgc"):
                continue
            setting = f"ratio {r['ratio']:g}" + (f", {q['bits']}-bit, chunk {q['chunk']}" if q else "") + (
                f", gather_share {q['gather_share']:g}" if q and "gather_share" in q else "") + (
                ", bf16 scales" if q and q.get("scale_dtype") == "bf16" else "")
            out.append({"source": rel, "family": family, "setting": setting,
                        "world": r["world"], "steps": r["steps"], "seed": r["seed"], "lr": r["lr"],
                        "val_loss": r["val_loss"], "x_recv": r["wire_x_recv"],
                        "recv_mib": r["recv_per_worker_step"] * r["steps"] / 2**20})
    for rel in DILOCO:
        if not (root / rel).exists():
            continue
        for r in bd.load_rows(bd.open_store(root / rel, reuse_stale=True)):
            setting = (f"H={r['sync_every']} outer {r['outer_lr']:g}/{r['outer_momentum']:g} ratio {r['ratio']:g}"
                       if r["sync_every"] > 1 else f"ratio {r['ratio']:g}")
            out.append({"source": rel, "family": _family(r["method"]), "setting": setting, "world": r["world"],
                        "steps": r["steps"], "seed": r["seed"], "lr": r["lr"], "val_loss": r["val_loss"],
                        "x_recv": r["x_recv"], "recv_mib": r["recv_per_worker"] / 2**20,
                        "compute_s": r.get("compute_s_per_worker_step")})
    return out


def compute_by_world(rows: list[dict]) -> dict[int, float]:
    """Per W: the median measured compute seconds per worker-step of the dense rows that recorded it
    (``bench_diloco.py`` measures it; every method runs the same model and micro-batch per worker)."""
    import statistics
    by: dict[int, list[float]] = {}
    for r in rows:
        if r["family"] == "dense" and r.get("compute_s"):
            by.setdefault(r["world"], []).append(r["compute_s"])
    return {w: statistics.median(v) for w, v in by.items()}


def step_seconds(r: dict, compute_s: float, link_bytes_per_s: float) -> float:
    """Wall-clock model of one worker-step: ``compute_s`` + the row's received bytes per step / link bandwidth
    (the same model as ``bench_diloco.step_seconds``: no overlap of compute and communication; a ring or a
    gather sends about what it receives, full duplex; latency and the sharded exchange's second round not
    counted)."""
    return compute_s + r["recv_mib"] * 2**20 / r["steps"] / link_bytes_per_s


def best(rows: list[dict], min_x: float) -> list[dict]:
    """Per (steps, W, seed): dense at its best lr, and each family's best row (at ``>= min_x`` for the compressed
    ones; DiLoCo uncompressed and top-k + rms at any x_recv), with ``delta`` against that dense."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["steps"], r["world"], r["seed"]), []).append(r)
    out = []
    for (steps, world, seed), rs in sorted(groups.items()):
        dense = min((r for r in rs if r["family"] == "dense"), key=lambda r: r["val_loss"], default=None)
        if dense is None:
            continue
        fams: dict[str, dict] = {}
        for r in rs:
            if r["family"] == "dense":
                continue
            uncompressed = r["family"] in ("DiLoCo (uncompressed outer)", "top-k + rms")
            if not uncompressed and r["x_recv"] < min_x:
                continue
            key = r["family"] + ("" if not uncompressed else f" @{r['x_recv']:.0f}x" if r["x_recv"] >= 1
                                 else f" @{r['x_recv']:.2g}x")  # uncompressed top-k: 8 bytes a coordinate
            if key not in fams or r["val_loss"] < fams[key]["val_loss"]:
                fams[key] = r
        out.append({**dense, "delta": 0.0, "label": "dense"})
        out += [{**r, "delta": r["val_loss"] - dense["val_loss"], "label": k} for k, r in sorted(fams.items())]
    return out


def render(rows: list[dict], min_x: float, compute: Optional[dict[int, float]] = None) -> str:
    compute = compute or {}
    lines = ["### Many workers: validation loss against bytes received per worker (simulator, tiny GPT 2x64)", "",
             "Command: `python -m launch.bench table many-workers` (runs nothing; reads "
             + ", ".join(f"`{s}`" for s in SCALE + DILOCO) + ", made by the commands recorded beside them).", "",
             "Equal tokens per worker (micro-batch 4 x context 64 per step). delta: validation loss - dense "
             "data-parallel AdamW's at its best lr, same W, steps and seed (one seed per row: no spread). x_recv: "
             "dense ring all-reduce every step's received bytes / the row's, over the whole run. Compressed rows: "
             f"the best setting (lr; H and outer step for DiLoCo) among those at x_recv >= {min_x:g}; "
             "the uncompressed DiLoCo and top-k + rms rows at the x_recv they reach. "
             "ms/step @ link: the wall-clock model, compute per worker-step (dense's measured one at that W on this "
             "2-core CPU, median of the rows of `bench_diloco.py` that recorded it: "
             + (", ".join(f"W={w}: {c * 1e3:.1f} ms" for w, c in sorted(compute.items())) or "none") +
             ") + the row's received bytes per worker per step / the link's bandwidth; no overlap of compute and "
             "communication, no latency (the sharded exchange's second round is not priced).", "",
             "| steps | W | seed | method | setting | lr | val_loss | delta | x_recv | MiB received/worker "
             + "".join(f"| ms/step @{k} " for k in bd.LINKS) + "|",
             "|---" * (10 + len(bd.LINKS)) + "|"]
    for r in rows:
        c = compute.get(r["world"])
        wall = "".join(f"| {step_seconds(r, c, bw) * 1e3:.1f} " if c is not None else "| - "
                       for bw in bd.LINKS.values())
        lines.append(f"| {r['steps']} | {r['world']} | {r['seed']} | {r['label']} | {r['setting']} | {r['lr']:g} | "
                     f"{r['val_loss']:.4f} | {r['delta']:+.4f} | {r['x_recv']:.1f} | {r['recv_mib']:.2f} {wall}|")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, min_x: float) -> bool:
    """One panel per run length: delta against W, one line per method, every point at >= ``min_x`` fewer bytes
    received per worker than dense (the uncompressed rows, which receive more, are in the table only)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps_all = sorted({r["steps"] for r in rows})
    fig, axes = plt.subplots(1, len(steps_all), figsize=(6.5 * len(steps_all), 5), squeeze=False)
    pts_all = [r for r in rows if r["label"] != "dense" and r["x_recv"] >= min_x]
    fams = sorted({r["label"].split(" @")[0] for r in pts_all})
    colors = {f: plt.get_cmap("tab20")(i % 20) for i, f in enumerate(fams)}
    for ax, steps in zip(axes[0], steps_all):
        seed = min(x["seed"] for x in rows if x["steps"] == steps)
        sel = [r for r in pts_all if r["steps"] == steps and r["seed"] == seed]
        for fam in fams:
            pts = sorted((r["world"], r["delta"]) for r in sel if r["label"].split(" @")[0] == fam)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[fam], label=fam, ms=5)
        ax.axhline(0.0, color="k", lw=0.8, label="dense AdamW (every step, 1x)")
        ax.axhspan(-0.05, 0.05, color="green", alpha=0.1, label="within 0.05 nats (the target)")
        ax.set_xscale("log", base=2)
        ax.set_xticks([2, 8, 32, 128])
        ax.set_xticklabels(["2", "8", "32", "128"])
        ax.set_xlabel("workers W")
        ax.set_ylabel("validation loss - dense AdamW's (nats)")
        ax.set_title(f"at >= {min_x:g}x fewer bytes received per worker than dense; {steps} steps, seed {seed}",
                     fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-x", type=float, default=90.0, help="x_recv a compressed row must reach")
    p.add_argument("--out", default="results/many_workers")
    a = p.parse_args(argv)
    everything = collect()
    rows = best(everything, a.min_x)
    out = ROOT / a.out if not Path(a.out).is_absolute() else Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(render(rows, a.min_x, compute_by_world(everything)))
    plot(rows, out.with_suffix(".png"), a.min_x)
    print(out.with_suffix(".md").read_text())


def table(out: str) -> None:
    """``python -m launch.bench table many-workers --out OUT``."""
    main(["--out", out])


if __name__ == "__main__":
    main()
