"""Ops one rank's sharded exchange dispatches per bucket, by number of ranks, counted on the ``meta`` device: on a
GPU in eager mode each is one kernel launch (as ``op_count.py`` counts an optimizer step).

    python launch/bench/exchange_ops.py --out results/exchange_ops

The shipped section's compressor (``ds_configs/compress_rms_sketch.json``: ``qtopk``, 2 bits, chunks of 256,
``exchange: "sharded"``, ``gather_share`` from the file, bf16 scales) reduces one bucket of ``--numel`` fp32 values on ``meta``
with ``W`` virtual ranks (:class:`titan_ds.comm.wire.SimCollective`); rank 1's second reduce is counted (the first
builds the message layouts), its own thread only. The collectives' work (the simulator's sums and copies) runs on
the last rank's thread and is not rank 1's. Fast: nothing is computed. Writes ``OUT.md`` and ``OUT.json``.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SECTION = ROOT / "ds_configs" / "compress_rms_sketch.json"
# ops that make a view (no kernel on a GPU): the launches are the other ops
VIEW_OPS = ("view", "select", "slice", "detach", "unsqueeze", "squeeze", "expand", "as_strided", "alias", "permute",
            "unbind", "split", "_reshape_alias", "t.default", "transpose", "unfold")


def is_view(name: str) -> bool:
    op = name.split("aten.", 1)[-1]
    return any(op == v or op.startswith(v + ".") for v in VIEW_OPS)


class ThreadOpCount(TorchDispatchMode):
    """The ops the entering thread dispatches inside the block (the mode stack is not per thread: the other
    virtual ranks' ops pass through it and are not counted)."""

    def __init__(self):
        super().__init__()
        self.thread = threading.get_ident()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if threading.get_ident() == self.thread:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count(world: int, numel: int) -> collections.Counter:
    """Rank 1's ops in its second ``reduce`` of a ``numel``-value bucket among ``world`` ranks."""
    from titan_ds.comm import Segment
    from titan_ds.comm.qtopk import QTopKCompressor
    from titan_ds.comm.wire import SimCollective
    comp = json.loads(SECTION.read_text())["titan"]["compression"]
    opts = {k: comp[k] for k in ("bits", "chunk", "exchange", "gather_share", "scale_dtype")}
    comps = [QTopKCompressor(float(comp["ratio"]), **opts) for _ in range(world)]
    accs = [torch.empty(numel, device="meta") for _ in range(world)]
    layout = [Segment("w", 0, 0, numel, numel, (numel,))]
    seen: dict[int, collections.Counter] = {}

    def step(w, comm):
        comps[w].reduce(accs[w], comm, 0, layout=layout)  # builds the layouts
        if w == 1:
            with ThreadOpCount() as c:
                comps[w].reduce(accs[w], comm, 0, layout=layout)
            seen[w] = c.ops
        else:
            comps[w].reduce(accs[w], comm, 0, layout=layout)
    SimCollective(world).run(step)
    return seen[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,8,32,128")
    ap.add_argument("--numel", type=int, default=1 << 22)
    ap.add_argument("--out", default=str(ROOT / "results" / "exchange_ops"))
    a = ap.parse_args(argv)
    rows = []
    for w in (int(x) for x in a.worlds.split(",")):
        ops = count(w, a.numel)
        launches = collections.Counter({k: v for k, v in ops.items() if not is_view(k)})
        rows.append({"world": w, "ops": sum(ops.values()), "launches": sum(launches.values()),
                     "top": launches.most_common(4)})
        print(f"W={w}: {rows[-1]['ops']} ops, {rows[-1]['launches']} not views", flush=True)
    cmd = "python launch/bench/exchange_ops.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = ["### Ops one rank's sharded exchange dispatches per bucket (kernel launches on a GPU), counted on meta",
             "", f"Command: `{cmd}`", f"A bucket of {a.numel} fp32 values; the section of `ds_configs/compress_rms_"
             f"sketch.json`; rank 1's second reduce, its own thread. torch {torch.__version__}.", "",
             "| ranks | ops per reduce | of which not views (kernel launches) | most frequent launches |",
             "|---|---|---|---|"]
    lines += [f"| {r['world']} | {r['ops']} | {r['launches']} | {', '.join(f'{n} {c}' for n, c in r['top'])} |"
              for r in rows]
    out = Path(a.out)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"command": cmd, "numel": a.numel, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
