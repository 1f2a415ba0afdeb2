"""TRD benchmark: dense AdamW vs tensor-ring linears at several ranks, on the seed workload.

    python launch/bench/bench_trd.py --steps 200                  # -> results/trd.{csv,md,json}
    python launch/bench/bench_trd.py --paths                      # -> results/trd_paths.{csv,md}
    python launch/bench/bench_trd.py --lr-probe --steps 200 --lrs 1e-3,3e-3 --scales 1,3,10
                                                                  # -> results/trd_lr_scale.{csv,md,json}

The first form runs, through launch.bench.harness.compare (same GPT 6x256, context 128, micro-batch 16, data, seed
and token budget for every row): the plain-DeepSpeed AdamW baseline, then TRD (``"titan": {"trd": ...}``, random
init, default include = every block linear qkv/proj/fc/out, modes of about 4) at ranks 4, 8, 12, 16, 32 and one
row with modes of about 16 (``mode_size`` 16) at rank 8. Same optimizer, lr and schedule for every row: nothing
is tuned per row.

The second form measures the forward+backward wall time of the two associations of TensorRingLinear
(``factored`` = (x Am) Cm, ``dense`` = x (Am Cm)) over the block-linear shapes, ranks and token counts, and
checks how often the multiply-add rule of ``path="cheapest"`` picks the faster one (docs/trd.md). On this shared
2-core machine timings are noisy: medians of repeated runs, ratios only.
"""
from __future__ import annotations

import argparse
import csv
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch.bench.harness import baseline_config, compare  # noqa: E402

RANKS = (4, 8, 12, 16, 32)


def rows() -> list[tuple[str, dict]]:
    out = [("dense_adamw", baseline_config())]
    for r in RANKS:
        out.append((f"trd_r{r}", baseline_config(titan={"trd": {"rank": r}})))
    out.append(("trd_r8_modes16", baseline_config(titan={"trd": {"rank": 8, "mode_size": 16}})))
    return out


def lr_probe_rows(rank: int = 12, lrs: tuple[float, ...] = (1e-3, 3e-3),
                  scales: tuple[float, ...] = (1.0, 3.0)) -> list[tuple]:
    """A grid at the rank-12 (35x) point: dense at every lr in ``lrs``, then TRD at every (lr, core_lr_scale).

    Dense gets the same lrs as TRD, so each delta can be read against dense at its own best lr (the first row is
    the base of the table's deltas: dense at ``lrs[0]``)."""
    out = []
    for lr in lrs:
        out.append((f"dense_adamw_lr{lr:g}", baseline_config(), ["--lr", f"{lr:g}"]))
    for lr in lrs:
        for c in scales:
            trd = {"rank": rank} if c == 1.0 else {"rank": rank, "core_lr_scale": c}
            out.append((f"trd_r{rank}_lr{lr:g}_core_x{c:g}", baseline_config(titan={"trd": trd}), ["--lr", f"{lr:g}"]))
    return out


def _time(fn, reps: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def paths(out: Path, reps: int) -> str:
    """Time both associations; report the rule's choice against the measured faster one."""
    import torch
    from titan_ds.inject.trd import TensorRingLinear, path_flops
    torch.manual_seed(0)
    shapes = [(256, 256), (256, 768), (256, 1024), (1024, 256)]
    table = []
    for fin, fout in shapes:
        for r in (4, 8, 12, 16, 24, 32):
            for tokens in (128, 2048):
                m = TensorRingLinear(fin, fout, r)
                x = torch.randn(tokens, fin)
                t = {}
                for path in ("factored", "dense"):
                    m.path = path

                    def step():
                        m.zero_grad(set_to_none=True)
                        m(x).sum().backward()
                    t[path] = _time(step, reps)
                lin = torch.nn.Linear(fin, fout)

                def dense_step():
                    lin.zero_grad(set_to_none=True)
                    lin(x).sum().backward()
                t_lin = _time(dense_step, reps)
                m.path = "cheapest"
                rule = m.choose_path(tokens)
                fast = min(t, key=t.get)
                f = path_flops(tokens, fin, fout, m.boundary)
                table.append({"in": fin, "out": fout, "rank": r, "R": m.boundary, "tokens": tokens,
                              "flops_factored_M": f["factored"] / 1e6, "flops_dense_M": f["dense"] / 1e6,
                              "ms_factored": t["factored"] * 1e3, "ms_dense": t["dense"] * 1e3,
                              "rule": rule, "faster": fast, "chosen_over_best": t[rule] / t[fast],
                              "ms_nn_linear": t_lin * 1e3, "chosen_over_nn_linear": t[rule] / t_lin})
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    agree = sum(r["rule"] == r["faster"] for r in table)
    worst = max(r["chosen_over_best"] for r in table)
    lines = [f"### TensorRingLinear: factored vs dense association (forward+backward, median of {reps})", "",
             f"Command: `python launch/bench/bench_trd.py --paths --reps {reps}`; torch {torch.__version__}, "
             f"{torch.get_num_threads()} thread(s), shared 2-core CPU (noisy).", "",
             f"Rule picks the measured faster path in {agree}/{len(table)} cases; worst chosen/best time "
             f"{worst:.2f}x; geometric-mean chosen/best "
             f"{statistics.geometric_mean([r['chosen_over_best'] for r in table]):.3f}x.", "",
             "Cost against the nn.Linear it replaces, 2048 tokens (geometric mean over the four shapes): " + ", ".join(
                 f"rank {rk} {statistics.geometric_mean([r['chosen_over_nn_linear'] for r in table if r['rank'] == rk and r['tokens'] == 2048]):.2f}x"
                 for rk in (4, 8, 12, 16, 24, 32)) + ".", "",
             "| in | out | rank | R | tokens | Mflop factored | Mflop dense | ms factored | ms dense | rule | faster | chosen/best | ms nn.Linear | chosen/nn.Linear |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['in']} | {r['out']} | {r['rank']} | {r['R']} | {r['tokens']} | {r['flops_factored_M']:.0f} | "
                     f"{r['flops_dense_M']:.0f} | {r['ms_factored']:.2f} | {r['ms_dense']:.2f} | {r['rule']} | "
                     f"{r['faster']} | {r['chosen_over_best']:.2f} | {r['ms_nn_linear']:.2f} | {r['chosen_over_nn_linear']:.2f} |")
    md = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(md)
    return md


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default="results/trd")
    p.add_argument("--paths", action="store_true", help="measure the contraction-path rule instead")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--lr-probe", action="store_true", help="rank 12: dense and TRD over --lrs x --scales")
    p.add_argument("--lrs", default="1e-3,3e-3", help="--lr-probe: learning rates (the first is the base row)")
    p.add_argument("--scales", default="1,3", help="--lr-probe: trd.core_lr_scale values")
    p.add_argument("--train-args", default="", help="extra launch/train.py flags")
    a = p.parse_args(argv)
    cmd = "python launch/bench/bench_trd.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    if a.paths:
        print(paths(Path("results/trd_paths"), a.reps))
        return
    if a.lr_probe:
        out = a.out if a.out != "results/trd" else "results/trd_lr_scale"
        grid = lr_probe_rows(lrs=tuple(float(x) for x in a.lrs.split(",")),
                             scales=tuple(float(x) for x in a.scales.split(",")))
        compare(grid, steps=a.steps, out=out, extra_args=a.train_args.split(),
                title="TRD rank 12 (35x): learning rate x trd.core_lr_scale, against dense at the same lrs",
                command=cmd)
        print(Path(out).with_suffix(".md").read_text())
        return
    compare(rows(), steps=a.steps, out=a.out, extra_args=a.train_args.split(),
            title="TRD: tensor-ring block linears vs dense AdamW", command=cmd,
            columns=())
    print(Path(a.out).with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
