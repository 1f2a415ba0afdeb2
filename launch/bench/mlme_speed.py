"""MLME's parts against plain PyTorch on the seed GPT's shapes: forward+backward time and saved bytes: the
measurement behind the CPU attention kernel and the StripeFFN / chunked-loss auto rules (stripe_ffn "budget").

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 flock /tmp/titan_timed.lock \\
        python launch/bench/mlme_speed.py --reps 7 --out results/mlme_speed

Shapes: micro-batch ``--batch`` (16) x context ``--context`` (128) tokens, width 256, 8 heads of 32, vocab 256, fp32
and bf16 (``--dtypes``). One process, no DeepSpeed. Per part:

* attention core (q, k, v of (B, 8, T, 32), causal): torch SDPA (what the plain GPT runs), the pure-PyTorch tiled
  reference at each ``--tiles``, and ``tiled_attention`` as dispatched here (what ``mlme.attention="tiled"`` runs);
* MLP (256 -> 1024 -> 256, GELU): eager, and StripeFFN at each ``--stripes`` (tokens per stripe; the MLME module
  with ``stripe="budget"`` is listed too), each with ``saves="input"`` and ``saves="pre_activation"``;
* LM loss (head 256 -> 256 + cross-entropy): eager (logits, fp32 CE), and the chunked loss at each ``--chunks``;
* one transformer block (titan_ds.models.gpt.Block): eager forward+backward, the same block under
  ``recompute_blocks``, and the eager forward alone: recompute_blocks should cost about one extra forward,
  i.e. (recomputed - eager) / forward near 1.

saved MiB: distinct storages autograd keeps for backward (``titan_ds.kernels.saved.SavedTensorMeter``; parameters
excluded). time: median of ``--reps`` forward+backward wall times (after one warm-up), as a ratio to the plain
implementation of the part measured in the same invocation (a shared 2-core machine: ratios).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launch.bench.bench_mlme import median_time  # noqa: E402
from titan_ds.config import MLMEConfig  # noqa: E402
from titan_ds.inject.mlme import apply_mlme  # noqa: E402
from titan_ds.kernels.attention import attention_kernel, tiled_attention, tiled_attention_reference  # noqa: E402
from titan_ds.kernels.chunked_ce import chunked_linear_cross_entropy  # noqa: E402
from titan_ds.kernels.saved import SavedTensorMeter  # noqa: E402
from titan_ds.kernels.stripe_ffn import SAVES, StripeFFN  # noqa: E402
from titan_ds.models.gpt import Block, GPTConfig  # noqa: E402

__all__ = ["measure_parts", "main"]

WIDTH, HEADS, VOCAB = 256, 8, 256


def _measure(make: Callable[[], tuple], forward: Callable, exclude=(), reps: int = 5) -> dict:
    """Saved bytes of one forward and the median time of forward+backward; ``make()`` gives fresh leaf inputs."""
    def step():
        out = forward(*make())
        out.backward(torch.ones_like(out))
    inputs = make()
    with SavedTensorMeter(exclude=exclude) as meter:
        out = forward(*inputs)
    del out
    return {"saved_bytes": meter.bytes, "time_s": median_time(step, reps)}


def _block_rows(B: int, T: int, dtype: torch.dtype, reps: int) -> list[dict]:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_embd=WIDTH, n_head=HEADS, block_size=T)
    eager = Block(cfg).to(dtype)
    holder = nn.Module()
    holder.blocks = nn.ModuleList([copy.deepcopy(eager)])
    apply_mlme(holder, MLMEConfig(attention="off", stripe_ffn=None, chunked_loss=False, recompute_blocks=True))
    x = lambda: (torch.randn(B, T, WIDTH, dtype=dtype, requires_grad=True),)  # noqa: E731
    rows = [{"part": "block", "impl": "eager", **_measure(x, eager, eager.parameters(), reps)},
            {"part": "block", "impl": "recompute_blocks", **_measure(x, holder.blocks[0], eager.parameters(), reps)}]
    for saves in SAVES:  # the block recomputed with its MLP as StripeFFN: the replay, and the MLP's own recompute
        striped = nn.Module()
        striped.blocks = nn.ModuleList([copy.deepcopy(eager)])
        apply_mlme(striped, MLMEConfig(attention="off", stripe_ffn="budget", stripe_ffn_saves=saves,
                                       chunked_loss=False, recompute_blocks=True))
        rows.append({"part": "block", "impl": f"recompute_blocks + StripeFFN saves {saves}",
                     **_measure(x, striped.blocks[0], eager.parameters(), reps)})
    with torch.no_grad():
        fwd = median_time(lambda: eager(*x()), reps)
    rows.append({"part": "block", "impl": "forward only (no grad)", "saved_bytes": 0, "time_s": fwd})
    for r in rows[1:-1]:
        r["extra_over_eager_in_forwards"] = (r["time_s"] - rows[0]["time_s"]) / fwd
    return rows


def measure_parts(B: int, T: int, dtype: torch.dtype, reps: int, tiles: Sequence[int], stripes: Sequence[int],
                  chunks: Sequence[int]) -> list[dict]:
    """Every (part, impl) row for one dtype (module docstring)."""
    torch.manual_seed(0)
    dh = WIDTH // HEADS
    qkv = lambda: tuple(torch.randn(B, HEADS, T, dh, dtype=dtype, requires_grad=True) for _ in range(3))  # noqa
    rows = [{"part": "attention", "impl": "torch SDPA (plain)",
             **_measure(qkv, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps=reps)}]
    for tile in tiles:
        rows.append({"part": "attention", "impl": f"tiled reference, tile {tile}", **_measure(
            qkv, lambda q, k, v, tile=tile: tiled_attention_reference(q, k, v, causal=True, tile=tile), reps=reps)})
    kernel = attention_kernel(*qkv())
    rows.append({"part": "attention", "impl": f"mlme tiled as dispatched ({kernel})", **_measure(
        qkv, lambda q, k, v: tiled_attention(q, k, v, causal=True, tile=128), reps=reps)})

    fc, out = nn.Linear(WIDTH, 4 * WIDTH).to(dtype), nn.Linear(4 * WIDTH, WIDTH).to(dtype)
    x = lambda: (torch.randn(B, T, WIDTH, dtype=dtype, requires_grad=True),)  # noqa: E731
    eager_mlp = nn.Sequential(fc, nn.GELU(), out)
    rows.append({"part": "mlp", "impl": "eager", **_measure(x, eager_mlp, eager_mlp.parameters(), reps)})
    for s in [*stripes, "budget"]:
        ffn = StripeFFN.plain(fc, nn.GELU(), out, stripe=s)
        label = f"StripeFFN, stripe {s}" + (f" ({ffn.stripe_for(dtype)} tokens)" if s == "budget" else "")
        rows.append({"part": "mlp", "impl": label, **_measure(x, ffn, ffn.parameters(), reps)})
        pre = StripeFFN.plain(fc, nn.GELU(), out, stripe=s, saves="pre_activation")
        rows.append({"part": "mlp", "impl": label + ", saves pre_activation", **_measure(x, pre, pre.parameters(),
                                                                                         reps)})

    head = nn.Linear(WIDTH, VOCAB, bias=False).to(dtype)
    ht = lambda: (torch.randn(B, T, WIDTH, dtype=dtype, requires_grad=True),  # noqa: E731
                  torch.randint(0, VOCAB, (B, T)))
    rows.append({"part": "loss", "impl": "eager", **_measure(
        ht, lambda h, t: F.cross_entropy(head(h).reshape(-1, VOCAB).float(), t.reshape(-1)), head.parameters(),
        reps)})
    for c in chunks:
        rows.append({"part": "loss", "impl": f"chunked, chunk {c}", **_measure(
            ht, lambda h, t, c=c: chunked_linear_cross_entropy(h, head.weight, t, chunk=c, out_dtype=torch.float32),
            head.parameters(), reps)})
    rows += _block_rows(B, T, dtype, reps)
    base = {}
    for r in rows:
        base.setdefault(r["part"], r["time_s"])  # the first row of a part is its plain implementation
        r.update(dtype=str(dtype).replace("torch.", ""), time_ratio=r["time_s"] / base[r["part"]])
    return rows


def write_table(rows: list[dict], out: Path, command: str, a: argparse.Namespace) -> str:
    lines = [f"### MLME parts vs plain PyTorch, seed GPT shapes ({a.batch} x {a.context} tokens, width {WIDTH}, "
             f"{HEADS} heads, vocab {VOCAB})", "", f"Command: `{command}`",
             f"Machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
             f"{torch.get_num_threads()} intra-op thread(s); {datetime.date.today().isoformat()}. time: median of "
             f"{a.reps} forward+backward, ratio to the first (plain) row of its part and dtype. saved: bytes autograd "
             "keeps for backward (parameters excluded). block: (recomputed - eager) / forward-only = the extra "
             "forwards recompute_blocks costs.", "",
             "| dtype | part | impl | saved MiB | fwd+bwd ms | time vs plain | extra forwards |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        extra = r.get("extra_over_eager_in_forwards")
        lines.append(f"| {r['dtype']} | {r['part']} | {r['impl']} | {r['saved_bytes'] / 2**20:.2f} | "
                     f"{1e3 * r['time_s']:.2f} | {r['time_ratio']:.2f} | {'-' if extra is None else f'{extra:.2f}'} |")
    md = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return md


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tiles", default="32,64,128")
    p.add_argument("--stripes", default="256,512,1024,2048")
    p.add_argument("--chunks", default="512,1024,2048,4096")
    p.add_argument("--out", default=str(ROOT / "results" / "mlme_speed"))
    a = p.parse_args(argv)
    rows = []
    for name in a.dtypes.split(","):
        rows += measure_parts(a.batch, a.context, getattr(torch, name.strip()), a.reps, _ints(a.tiles),
                              _ints(a.stripes), _ints(a.chunks))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = write_table(rows, out, "python launch/bench/mlme_speed.py " + shlex.join(argv), a)
    print(md)
    return rows


if __name__ == "__main__":
    main()
