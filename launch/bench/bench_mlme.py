"""MLME benchmark: activation memory and time of tiled attention / StripeFFN / chunked loss, and whole-model training.

Exact command (from the repository root; what produced results/mlme_kernels.* and results/mlme.*):

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=$PWD/.cache/torch_extensions \
        python launch/bench/bench_mlme.py --steps 200

Part 1 (kernels, one process, no DeepSpeed): for sequence lengths 256..4096 on the seed model's shapes (width 256,
8 heads of 32; batch 1 so that eager attention at 4096 fits), one forward+backward of the attention core (eager
math / torch SDPA / titan tiled) and of the MLP (eager / StripeFFN) and of the LM loss (eager head + CE / chunked):
* saved-activation bytes: distinct storages autograd keeps for backward (``titan_ds.kernels.saved``);
* accounted peak: the peak of bytes allocated during forward+backward above what existed before, from the PyTorch
  profiler's memory timeline (CPU allocator events; a private profiler API, ``prof._memory_profile()``);
* time: median of ``--reps`` forward+backward wall times, as a ratio to SDPA (attention) or eager (MLP, loss).
  CPU timings on a shared 2-core machine are ratios only.

Part 2 (whole model): the seed workload (6 layers, width 256, context 128, micro-batch 16, seed 0) trained through
``launch.bench.harness.compare`` with plain DeepSpeed as the baseline row and the same config plus ``"titan": {"mlme":
{...}}``; validation loss, tokens/s and memory side by side.
"""
from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from titan_ds.kernels.attention import eager_attention, tiled_attention
from titan_ds.kernels.chunked_ce import chunked_linear_cross_entropy
from titan_ds.kernels.saved import SavedTensorMeter
from titan_ds.kernels.stripe_ffn import StripeFFN

WIDTH, HEADS, VOCAB = 256, 8, 256  # the seed model (GPTConfig defaults)
MLME = {"attention": "tiled", "tile": 128, "stripe_ffn": 256, "chunked_loss": True}


def _peak_bytes(fn: Callable[[], None]) -> int:
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    cur = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            cur += size
        elif action == Action.DESTROY:
            cur -= size
        peak = max(peak, cur)
    return peak


def median_time(fn: Callable[[], None], reps: int) -> float:
    """Median wall time of ``reps`` calls of ``fn`` after one warm-up call."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(make: Callable[[], tuple], forward: Callable, exclude=(), reps: int = 3) -> dict:
    """saved bytes, peak bytes and time of forward+backward; ``make()`` builds fresh leaf inputs."""
    def step():
        inputs = make()
        out = forward(*inputs)
        out.backward(torch.ones_like(out))
    inputs = make()
    with SavedTensorMeter(exclude=exclude) as meter:
        out = forward(*inputs)
    del out
    return {"saved_bytes": meter.bytes, "peak_bytes": _peak_bytes(step), "time_s": median_time(step, reps)}


def kernel_rows(lengths: list[int], reps: int, tile: int, stripe: int, loss_chunk: int) -> list[dict]:
    torch.manual_seed(0)
    dh = WIDTH // HEADS
    fc, out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
    mlps = {"eager": nn.Sequential(fc, nn.GELU(), out), "stripe_ffn": StripeFFN.plain(fc, nn.GELU(), out, stripe)}
    head = nn.Linear(WIDTH, VOCAB, bias=False)
    attns = {
        "eager": lambda q, k, v: eager_attention(q, k, v, causal=True),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "tiled": lambda q, k, v: tiled_attention(q, k, v, causal=True, tile=tile),
    }
    losses = {
        "eager": lambda h, t: F.cross_entropy(head(h).reshape(-1, VOCAB), t.reshape(-1)),
        "chunked": lambda h, t: chunked_linear_cross_entropy(h, head.weight, t, chunk=loss_chunk),
    }
    rows = []
    for L in lengths:
        qkv = lambda: tuple(torch.randn(1, HEADS, L, dh, requires_grad=True) for _ in range(3))  # noqa: E731
        x = lambda: (torch.randn(1, L, WIDTH, requires_grad=True),)  # noqa: E731
        ht = lambda: (torch.randn(1, L, WIDTH, requires_grad=True), torch.randint(0, VOCAB, (1, L)))  # noqa: E731
        for name, fn in attns.items():
            rows.append({"part": "attention", "impl": name, "L": L, **_measure(qkv, fn, reps=reps)})
        for name, mod in mlps.items():
            rows.append({"part": "mlp", "impl": name, "L": L, **_measure(x, mod, mod.parameters(), reps)})
        for name, fn in losses.items():
            rows.append({"part": "loss", "impl": name, "L": L, **_measure(ht, fn, head.parameters(), reps)})
        print(f"L={L} done", file=sys.stderr, flush=True)
    base = {("attention", r["L"]): r["time_s"] for r in rows if r["part"] == "attention" and r["impl"] == "sdpa"}
    base.update({(r["part"], r["L"]): r["time_s"] for r in rows if r["part"] != "attention" and r["impl"] == "eager"})
    eager_attn = {r["L"]: r for r in rows if r["part"] == "attention" and r["impl"] == "eager"}
    for r in rows:
        r["time_ratio"] = r["time_s"] / base[(r["part"], r["L"])]
        r["saved_vs_eager_attention"] = r["saved_bytes"] / eager_attn[r["L"]]["saved_bytes"]
    return rows


def write_kernel_tables(rows: list[dict], out: Path, args: argparse.Namespace) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    keys = ["part", "impl", "L", "saved_bytes", "peak_bytes", "time_s", "time_ratio", "saved_vs_eager_attention"]
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows({k: r[k] for k in keys} for r in rows)
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    lines = [f"# MLME kernels: saved activations, accounted peak, time (batch 1, width {WIDTH}, {HEADS} heads of "
             f"{WIDTH // HEADS}, vocab {VOCAB}, causal)", "",
             f"Machine: {platform.machine()} CPU ({torch.get_num_threads()} threads), shared and noisy: time ratios only. "
             f"torch {torch.__version__}; tile {args.tile}, stripe {args.stripe}, loss chunk {args.loss_chunk}; "
             f"median of {args.reps} fwd+bwd. Time ratio is vs SDPA for attention, vs eager for MLP and loss.", "",
             "| part | impl | L | saved MiB | peak MiB | time ratio | saved / eager attention |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['part']} | {r['impl']} | {r['L']} | {mib(r['saved_bytes'])} | {mib(r['peak_bytes'])} | "
                     f"{r['time_ratio']:.2f} | {r['saved_vs_eager_attention']:.4f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def train_rows(steps: int, out: Path, args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # launch.bench.harness lives in the checkout
    from launch.bench.harness import baseline_config, compare
    base = baseline_config()
    mlme = dict(baseline_config(), titan={"mlme": dict(MLME, tile=args.tile, stripe_ffn=args.stripe,
                                                       loss_chunk=args.loss_chunk)})
    compare([("deepspeed", base), ("mlme", mlme)], steps=steps, out=str(out),
            title=f"MLME on vs off, seed workload, {steps} steps",
            command="python launch/bench/bench_mlme.py " + " ".join(sys.argv[1:]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tile", type=int, default=MLME["tile"])
    p.add_argument("--stripe", type=int, default=MLME["stripe_ffn"])
    p.add_argument("--loss-chunk", type=int, default=4096)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default="results/mlme")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-train", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    if not args.skip_kernels:
        rows = kernel_rows(args.lengths, args.reps, args.tile, args.stripe, args.loss_chunk)
        write_kernel_tables(rows, out.with_name(out.name + "_kernels"), args)
    if not args.skip_train:
        train_rows(args.steps, out, args)


if __name__ == "__main__":
    main()
