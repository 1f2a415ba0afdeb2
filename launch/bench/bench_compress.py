"""Gradient compression on DeepSpeed's reduce path: dense all-reduce vs topk, DGC, tgss, hge, PowerSGD; 2 ranks.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python launch/bench/bench_compress.py --steps 200 \
        --ratios 10,100 --methods topk,dgc,tgss,hge,powersgd --ranks 1,2,4 --out results/compress

Every row trains the reference GPT (6 layers, width 256, context 128, micro-batch 16 per rank) on the same
data, seed and tokens with 2 data-parallel ranks (`deepspeed --num_gpus 2`), ZeRO stage 0 (the gradient
all-reduce goes through ``DeepSpeedEngine.allreduce_bucket``). The first row is plain DeepSpeed (dense
all-reduce). Compressed rows run ``warmup_steps`` dense steps first (``--warmup``, default 10), then compress
with error feedback.

Methods: ``topk``, ``tgss``, ``hge`` at each of ``--ratios`` (or ``name@r1/r2`` for its own ratios); ``dgc`` is ``topk`` with DGC's options
(``--dgc-momentum``, masking, ``--dgc-clip``, the ratio ramp ``--dgc-ramp-steps`` from ``--dgc-ramp-start``;
with momentum its rows train with AdamW ``--beta1 --dgc-beta1``, default 0, because the compressor's velocity
already is the momentum); ``powersgd`` at each of ``--ranks`` (its bytes follow from the rank, not ``--ratios``);
``rms`` is ``topk`` with ``precondition: "rms"`` (each rank's gradient divided by the RMS of its own gradients;
titan turns the client AdamW into SGD; no dense warm-up and no global clipping, which it refuses; ``--rms-lr``
gives its rows their own lr); ``rms_sketch`` is ``ds_configs/compress_rms_sketch.json``'s section (sharded 2-bit
``qtopk``, ``precondition: "rms_sketch"``) at each ratio, with the rms rows' lr and clipping.
Columns added to the standard table: ``wire_x`` (last step, dense bytes / bytes handed to the collective per
rank), ``wire_x_run`` (whole run, warm-up and ramp included), ``step_time_ratio``, ``peak_rss_ratio``. With
``--train-args --count-wire``, a second table: the bytes each rank sent and received over the whole run as the
network sees them (ring costs of every collective, titan_ds/comm/wire.py) and ``x_recv``, dense's / the row's.
Resumable: each finished row is recorded in ``<out>.jsonl`` at once (``launch/bench/store.py``); a rerun reuses
it under the store's rule (same row, config, settings, seed and code; ``--reuse-stale``: any code). The tables
are regenerated from the jsonl without running anything by ``python -m launch.bench table compression --out OUT``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launch.bench.harness import add_dgc_args, baseline_config, compare, seed_verdict  # noqa: E402


def dgc_section(ratio: float, warmup: int, a: argparse.Namespace) -> dict:
    """``titan.compression`` for a DGC row: topk plus the options given (only those that are switched on)."""
    comp: dict = {"method": "topk", "ratio": ratio, "error_feedback": True, "warmup_steps": warmup}
    if a.dgc_momentum > 0:
        comp.update(momentum=a.dgc_momentum, momentum_masking=not a.dgc_no_masking)
    if a.dgc_clip is not None:
        comp["local_clip"] = a.dgc_clip
    if a.dgc_ramp_steps > 0:
        comp.update(ratio_warmup_steps=a.dgc_ramp_steps, ratio_warmup_start=a.dgc_ramp_start)
    return comp


def rows(methods: list[str], ratios: list[float], warmup: int, stage: int, ranks: list[int] = (1,),
         a: argparse.Namespace | None = None) -> list[tuple]:
    """The dense row, then ``powersgd`` at each rank, then every other method at each ratio (ratio-major).

    A method written ``name@r1/r2`` runs at those ratios instead of ``ratios`` (e.g. ``topk@120,dgc@300``: the
    same whole-run bytes when DGC ramps up from a denser start)."""
    out: list[tuple] = [("dense_allreduce", baseline_config(stage=stage))]
    own: dict[str, list[float]] = {}
    for spec in methods:
        name, _, at = spec.partition("@")
        own[name] = [float(x) for x in at.split("/")] if at else list(ratios)
    if "powersgd" in own:
        for r in ranks:
            comp = {"method": "powersgd", "rank": r, "error_feedback": True, "warmup_steps": warmup}
            out.append((f"powersgd_r{r}", baseline_config(stage=stage, titan={"compression": comp})))
    every = sorted({x for m, rs in own.items() if m != "powersgd" for x in rs})
    for ratio in every:
        for m, rs in own.items():
            if m == "powersgd" or ratio not in rs:
                continue
            elif m in ("rms", "rms_sketch"):
                comp = ({"method": "topk", "ratio": ratio, "error_feedback": True, "precondition": "rms"}
                        if m == "rms" else  # ds_configs/compress_rms_sketch.json's section at this ratio
                        {**json.loads((ROOT / "ds_configs" / "compress_rms_sketch.json").read_text())["titan"][
                            "compression"], "ratio": ratio})
                lrs = a.rms_lr.split(",") if a is not None and a.rms_lr else [None]
                for lr in lrs:
                    out.append((f"{m}_{ratio:g}x" + (f"_lr{lr}" if len(lrs) > 1 else ""),
                                baseline_config(stage=stage, gradient_clipping=0.0, titan={"compression": comp}),
                                ["--lr", lr] if lr is not None else []))
            elif m == "dgc":
                if a is None:
                    raise ValueError("dgc rows need the parsed --dgc-* options")
                comp = dgc_section(ratio, warmup, a)
                row_args = ["--beta1", str(a.dgc_beta1)] if a.dgc_momentum > 0 else []
                out.append((f"dgc_{ratio:g}x", baseline_config(stage=stage, titan={"compression": comp}), row_args))
            else:
                comp = {"method": m, "ratio": ratio, "error_feedback": True, "warmup_steps": warmup}
                out.append((f"{m}_{ratio:g}x", baseline_config(stage=stage, titan={"compression": comp})))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ratios", default="10,100")
    p.add_argument("--methods", default="topk,tgss,hge")
    p.add_argument("--ranks", default="1,2,4", help="PowerSGD ranks (one row each)")
    p.add_argument("--warmup", type=int, default=10, help="dense steps before compressing (every method)")
    add_dgc_args(p)
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--out", default="results/compress")
    p.add_argument("--train-args", default="", help="extra launch/train.py flags (every row), e.g. '--seed 1'")
    p.add_argument("--rms-lr", default="", help="lr(s) of the rms rows, comma list: one row per lr (default: the "
                   "--train-args' lr or 1e-3)")
    p.add_argument("--no-resume", action="store_true",
                   help="run every row again (default: rows recorded in <out>.jsonl by an earlier run are reused)")
    p.add_argument("--reuse-stale", action="store_true",
                   help="reuse rows recorded by other code too (the table marks them '(stale)')")
    p.add_argument("--seeds", default="", help="comma list: every row once per seed (train.py --seed), each seed "
                   "in <out>_s<seed>.{md,jsonl}, then <out>.md: the mean over the seeds, delta vs dense with the "
                   "seed-to-seed spread and its verdict")
    a = p.parse_args(argv)
    r = rows(a.methods.split(","), [float(x) for x in a.ratios.split(",")], a.warmup, a.stage,
             [int(x) for x in a.ranks.split(",")], a)
    command = "python launch/bench/bench_compress.py " + " ".join(argv if argv is not None else sys.argv[1:])
    seeds = [int(x) for x in a.seeds.split(",")] if a.seeds else [None]
    per_seed = {}
    for seed in seeds:
        out = a.out if seed is None else f"{a.out}_s{seed}"
        extra = a.train_args.split() + ([] if seed is None else ["--seed", str(seed)])
        per_seed[seed] = compare(r, steps=a.steps, out=out, num_ranks=2, extra_args=extra,
                                 title=f"gradient compression, 2 ranks, ZeRO-{a.stage}, {a.steps} steps"
                                       + ("" if seed is None else f", seed {seed}"),
                                 command=command, resume=not a.no_resume, reuse_stale=a.reuse_stale)
        append_step_time(per_seed[seed], Path(out))
        print(Path(out).with_suffix(".md").read_text())
    if seeds != [None]:
        print(seeds_summary(per_seed, Path(a.out), command, a.steps))


def table(out: str) -> None:
    """Regenerate ``<out>.md`` from the store without running anything: ``<out>.jsonl``'s table, or, where the
    run had ``--seeds``, each ``<out>_s<seed>`` table and the summary over them."""
    import re
    from launch.bench.harness import compare_table
    out_p = Path(out)
    per_seed = {int(m.group(1)): m.string for m in (re.match(rf"{re.escape(out_p.name)}_s(\d+)\.jsonl$", f.name)
                                                   for f in out_p.parent.glob(out_p.name + "_s*.jsonl")) if m}
    if out_p.with_suffix(".jsonl").exists() or not per_seed:
        append_step_time(compare_table(out_p), out_p)
        return
    results = {}
    for seed in sorted(per_seed):
        s_out = out_p.with_name(f"{out_p.name}_s{seed}")
        results[seed] = compare_table(s_out)
        append_step_time(results[seed], s_out)
    old = out_p.with_suffix(".md").read_text() if out_p.with_suffix(".md").exists() else ""
    c = re.search(r"Command: `([^`]*)`", old)
    steps = json.loads(out_p.with_name(f"{out_p.name}_s{min(per_seed)}.jsonl").read_text().splitlines()[-1])
    steps = steps["settings"]["steps"] if "settings" in steps else json.loads(steps["row_key"])[2]
    seeds_summary(results, out_p, c.group(1) if c else "", steps)


def seeds_summary(per_seed: dict[int, list[dict]], out: Path, command: str, steps: int) -> str:
    """``<out>.md``: each config's mean validation loss over the seeds against the dense row's mean, the spread
    (max - min over the seeds, the larger of the config's and dense's) and the verdict; step time and peak RSS
    as ratios to the same seed's dense row (mean and largest over the seeds); the whole-run wire ratio."""
    seeds = sorted(per_seed)
    names = [r["name"] for r in per_seed[seeds[0]]]
    by = {s: {r["name"]: r for r in per_seed[s]} for s in seeds}
    ok = [n for n in names if all(by[s].get(n, {}).get("status") == "ok" for s in seeds)]
    if not ok or ok[0] != names[0]:
        return "(no complete dense row over every seed: no summary)"
    dense = [by[s][names[0]]["val_loss"] for s in seeds]
    lines = [f"### gradient compression, 2 ranks, {steps} steps, seeds {','.join(map(str, seeds))}", "",
             f"Command: `{command}` (each seed's own table: `{out.name}_s<seed>.md`). Delta: mean over the seeds "
             f"minus dense all-reduce's mean; spread: max - min over the seeds, the larger of the config's and "
             f"dense's; a delta inside the spread is no difference. Step time and peak RSS are ratios to the same "
             f"seed's dense row (mean, and the largest over the seeds).", "",
             "| config | val_loss (mean) | per seed | delta vs dense | spread | verdict | step_time_ratio | "
             "peak_rss_ratio (mean / max) | wire_x (whole run) |", "|---|---|---|---|---|---|---|---|---|"]
    for n in ok:
        vals = [by[s][n]["val_loss"] for s in seeds]
        mean, spread = sum(vals) / len(vals), max(max(vals) - min(vals), max(dense) - min(dense))
        delta = mean - sum(dense) / len(dense)
        verdict = "reference" if n == names[0] else "one seed: no spread" if len(seeds) < 2 else \
            seed_verdict(delta, spread)
        st = [by[s][n]["step_s"] / by[s][names[0]]["step_s"] for s in seeds]
        rss = [by[s][n]["peak_rss"] / by[s][names[0]]["peak_rss"] for s in seeds]
        wire = by[seeds[0]][n].get("titan_metrics", {}).get("wire_compression_ratio_run") or 1.0
        lines.append(f"| {n} | {mean:.4f} | {' / '.join(f'{v:.4f}' for v in vals)} | {delta:+.4f} | {spread:.4f} | "
                     f"{verdict} | {sum(st) / len(st):.2f} | {sum(rss) / len(rss):.2f} / {max(rss):.2f} | {wire:.1f} |")
    missing = [n for n in names if n not in ok]
    if missing:
        lines += ["", f"Not finished for every seed: {', '.join(missing)}."]
    md = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(md)
    return md


def append_step_time(results: list[dict], out: Path) -> None:
    """Add the step-time and peak-RSS ratios (vs the dense row) and both wire ratios to the markdown."""
    base, base_rss = results[0].get("step_s"), results[0].get("peak_rss")
    lines = ["", "| config | step_time_ratio | peak_rss_ratio | val_loss | delta_vs_dense | wire_x (last step) "
             "| wire_x (whole run) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("status") != "ok":
            lines.append(f"| {r['name']} | {r.get('status')} | | | | | |")
            continue
        tm = r.get("titan_metrics", {})
        ratio = r["step_s"] / base if base else float("nan")
        rss = r["peak_rss"] / base_rss if base_rss and r.get("peak_rss") else float("nan")
        wire = tm.get("wire_compression_ratio") or 1.0
        total = tm.get("wire_compression_ratio_run") or 1.0
        lines.append(f"| {r['name']} | {ratio:.2f} | {rss:.2f} | {r['val_loss']:.3f} | "
                     f"{r['val_loss'] - results[0].get('val_loss', float('nan')):+.3f} | {wire:.1f} | {total:.1f} |")
    lines += received_table(results)
    md = out.with_suffix(".md")
    md.write_text(md.read_text() + "\n".join(lines) + "\n")


def received_table(results: list[dict]) -> list[str]:
    """Rows run with ``--train-args --count-wire``: the bytes each rank *received* over the whole run, every
    collective of the training steps at ring costs (titan_ds/comm/wire.py), and ``x_recv`` = the dense row's / the
    row's (the larger rank of each). ``wire_x`` above counts the bytes a rank hands to the compressor's collectives
    (a sharded exchange hands its whole all-to-all buffer, its own piece included), not what the network delivers."""
    base = results[0]
    if "wire_per_rank" not in base:
        return []
    lines = ["", "| config | received MiB per rank (0 / 1) | sent MiB per rank (0 / 1) | x_recv (whole run) |",
             "|---|---|---|---|"]
    dense = max(w["received"] for w in base["wire_per_rank"])
    for r in results:
        if r.get("status") != "ok" or "wire_per_rank" not in r:
            continue
        recv = [w["received"] for w in r["wire_per_rank"]]
        sent = [w["sent"] for w in r["wire_per_rank"]]
        lines.append(f"| {r['name']} | {' / '.join(f'{b / 2**20:.2f}' for b in recv)} | "
                     f"{' / '.join(f'{b / 2**20:.2f}' for b in sent)} | {dense / max(recv):.1f} |")
    return lines


if __name__ == "__main__":
    main()
