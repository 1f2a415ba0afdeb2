"""Ops one optimizer step dispatches, counted on the ``meta`` device: on a GPU in eager mode each is one kernel
launch, so this is the launch count of a step, measured without a GPU.

    python launch/bench/op_count.py --out results/op_count

A GPT-2-shaped parameter set (52 tensors, 38.9M values at GPT-2's vocabulary of 50304 rows: :func:`gpt_params`)
on ``meta``; each shipped optimizer section (``ds_configs/<name>.json``'s ``titan.optimizer``) and torch AdamW
``foreach=True`` step twice, and the ops of the second step are counted by a ``TorchDispatchMode``. Fast: nothing
is computed. Each row is recorded in ``OUT.jsonl`` (the suite's store); ``OUT.md`` is rewritten from it.
``tests/optim/test_core_triton.py`` asserts the budget (at most 3x foreach AdamW) with these functions.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from launch.bench.store import Store  # noqa: E402

SECTIONS = ("titan_balanced", "titan_memory", "titan_lean", "hf_asdt_8bit")
SUITE = "op-count"


class OpCount(TorchDispatchMode):
    """Every aten (and custom) op dispatched inside the block, by name."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def gpt_params(dtype: torch.dtype, vocab: int = 50304, d: int = 512, layers: int = 4, ctx: int = 1024) -> nn.Module:
    """A GPT-2-shaped parameter set on meta: 52 tensors, 38.9M values (at the default vocabulary)."""
    shapes = {"wte": (vocab, d), "wpe": (ctx, d), "lnf_w": (d,), "lnf_b": (d,)}
    for i in range(layers):
        shapes.update({f"h{i}_ln1_w": (d,), f"h{i}_ln1_b": (d,), f"h{i}_qkv_w": (3 * d, d), f"h{i}_qkv_b": (3 * d,),
                       f"h{i}_proj_w": (d, d), f"h{i}_proj_b": (d,), f"h{i}_ln2_w": (d,), f"h{i}_ln2_b": (d,),
                       f"h{i}_fc_w": (4 * d, d), f"h{i}_fc_b": (4 * d,), f"h{i}_out_w": (d, 4 * d),
                       f"h{i}_out_b": (d,)})
    m = nn.Module()
    for name, s in shapes.items():
        m.register_parameter(name, nn.Parameter(torch.empty(s, device="meta", dtype=dtype)))
    return m


def ops_of_second_step(opt, params) -> collections.Counter:
    for _ in range(2):
        for p in params:
            p.grad = torch.empty_like(p)
        with OpCount() as mode:
            opt.step()
    return mode.ops


def ops_per_step(section: str, vocab: int = 50304) -> tuple[int, int, collections.Counter]:
    """(ops of one steady-state step of ``section``'s optimizer, of torch AdamW(foreach=True), the former's ops by
    name) on :func:`gpt_params` on meta. ASDT's stochastic rounding needs a generator; meta has none, so the caller
    supplies a CPU one (``titan_ds.optim.asdt._device_generator``)."""
    from titan_ds.config import TitanConfig
    from titan_ds.optim.install import build_optimizer
    cfg = TitanConfig.from_ds_config(json.loads((ROOT / "ds_configs" / f"{section}.json").read_text())).optimizer
    model = gpt_params(torch.bfloat16 if cfg.weight_dtype == "bf16" else torch.float32, vocab)
    ops = ops_of_second_step(build_optimizer(model, cfg), list(model.parameters()))
    ref = gpt_params(torch.float32, vocab)
    adamw = ops_of_second_step(torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=True), list(ref.parameters()))
    return sum(ops.values()), sum(adamw.values()), ops


def table(store: Store) -> str:
    settings = store.newest_settings()
    lines = ["### Ops one optimizer step dispatches (kernel launches on a GPU in eager mode), counted on meta", "",
             f"Command: `python launch/bench/op_count.py --out {settings['out']}"
             f"{' --eager' if settings.get('eager') else ''}`",
             f"Parameters: a GPT-2-shaped set of 52 tensors, vocabulary {settings['vocab']}, on the meta device; the "
             f"second step counted. torch {torch.__version__}.", "",
             "| optimizer | ops per step | vs foreach AdamW | titan fused ops | most frequent others |",
             "|---|---|---|---|---|"]
    for rec in store.latest(settings=settings):
        r = rec["result"]
        others = ", ".join(f"{k} {v}" for k, v in r["top"] if not k.startswith("titan."))
        lines.append(f"| {rec['row']} | {r['ops']} | {r['ops'] / r['adamw']:.2f}x | {r['fused']} | {others} |")
    adamw = store.latest(settings=settings)[0]["result"]["adamw"]
    lines.append(f"| torch AdamW, `foreach=True` | {adamw} | 1.00x | - | - |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/op_count")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--eager", action="store_true",
                   help="also each section on the eager loop (TITAN_KERNELS=reference: the path before the fused op)")
    args = p.parse_args(argv)
    import titan_ds.optim.asdt as asdt_mod
    asdt_mod._device_generator = lambda device, seed: torch.Generator().manual_seed(seed)  # meta has none
    store = Store(Path(args.out).with_suffix(".jsonl"), SUITE, code_paths=("titan_ds/optim", "launch/bench/op_count.py"))
    settings = {"out": args.out, "vocab": args.vocab, "eager": args.eager}
    runs = [(s, None) for s in args.sections.split(",")]
    runs += [(s, "reference") for s in args.sections.split(",")] if args.eager else []
    for section, kernels in runs:
        if kernels:
            os.environ["TITAN_KERNELS"] = kernels
        else:
            os.environ.pop("TITAN_KERNELS", None)
        ours, adamw, ops = ops_per_step(section, args.vocab)
        row = section if kernels is None else f"{section} (eager loop, TITAN_KERNELS={kernels})"
        store.append(row, config={"section": section, "kernels": kernels}, settings=settings,
                     result={"ops": ours, "adamw": adamw, "fused": ops.get("titan.asdt_adaptive_step.default", 0),
                             "top": ops.most_common(5)})
        print(f"{row}: {ours} ops ({ours / adamw:.2f}x foreach AdamW's {adamw})", flush=True)
    Path(args.out).with_suffix(".md").write_text(table(store))


if __name__ == "__main__":
    main()
