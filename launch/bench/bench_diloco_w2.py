"""Local updates on 2 real DeepSpeed ranks: dense all-reduce vs DiLoCo with a ``qtopk`` (and ``topk``) outer message.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python launch/bench/bench_diloco_w2.py --steps 300 --out results/diloco_w2/rows

Every row trains the reference GPT (6 layers, width 256, context 128, micro-batch 16 per rank) with
``launch/train.py --count-wire`` under ``deepspeed --num_gpus 2`` (ZeRO-0, fp32, torch AdamW at the default lr
schedule, seed 0), so the bytes are those :func:`titan_ds.comm.wire.count_collectives` counts on
``torch.distributed`` (ring costs: a 2-rank all-reduce of ``B`` bytes receives ``B``, an all-gather of ``b``
bytes per rank receives ``b``), every collective of the training steps included, per rank:

* ``dense_allreduce``: plain DeepSpeed (ds_configs/baseline_adamw.json), a gradient all-reduce every step;
* ``diloco_qtopk``: ``titan.compression`` of ``launch/experiments/configs/compress_diloco_qtopk.json`` (H = 20, ``qtopk`` 2 bits,
  chunk 256, ratio 5: 20 x 5 = 100x fewer bytes received than the dense rows at W = 2, as
  ``bench_diloco.py --target 100`` sets it for an all-gathered message: ``target / H * W / 2``);
* ``diloco_topk``: the same with ``topk`` at ratio 5 (``--topk``).

The DiLoCo rows run without gradient clipping (local updates refuse it); the dense row keeps the baseline's 1.0.
Each finished row goes to ``<out>.jsonl`` at once (``launch/bench/store.py``; a rerun reuses it);
``<out>.md`` is the table with received bytes and peak RSS per rank.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch.bench.harness import ROOT, baseline_config, compare  # noqa: E402

MiB = 2.0 ** 20


def diloco_section(method: str) -> dict:
    """The shipped qtopk DiLoCo section; ``topk``: the same H, ratio and outer step with plain top-k."""
    comp = json.loads((ROOT / "launch" / "experiments" / "configs" / "compress_diloco_qtopk.json").read_text())["titan"]["compression"]
    if method == "topk":
        comp = {k: v for k, v in comp.items() if k not in ("bits", "chunk")} | {"method": "topk"}
    return comp


def rows(topk: bool) -> list[tuple]:
    out = [("dense_allreduce", baseline_config(stage=0))]
    for method in ["qtopk"] + (["topk"] if topk else []):
        out.append((f"diloco_{method}", baseline_config(stage=0, gradient_clipping=0.0,
                                                        titan={"compression": diloco_section(method)})))
    return out


def render(results: list[dict], command: str, steps: int) -> str:
    base = results[0]
    lines = [f"### DiLoCo on 2 real ranks, reference GPT, {steps} steps", "", f"Command: `{command}`", "",
             "Received: bytes per rank over the whole run (every collective of the training steps, ring costs, "
             "titan_ds/comm/wire.py); x_recv: dense's / the row's (per rank); peak RSS: each rank's ru_maxrss at the "
             "end; rss_x: the larger rank's / dense's larger rank's.", "",
             "| config | val_loss | delta_vs_dense | received MiB (rank 0 / 1) | x_recv | peak RSS MiB (rank 0 / 1) "
             "| rss_x | step_s |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("status") != "ok":
            lines.append(f"| {r['name']} | {r.get('status')} | | | | | | |")
            continue
        recv = [w["received"] for w in r["wire_per_rank"]]
        rss = r["peak_rss_per_rank"]
        x = max(w["received"] for w in base["wire_per_rank"]) / max(recv)
        lines.append(f"| {r['name']} | {r['val_loss']:.4f} | {r['val_loss'] - base['val_loss']:+.4f} | "
                     f"{recv[0] / MiB:.2f} / {recv[1] / MiB:.2f} | {x:.1f} | {rss[0] / MiB:.0f} / {rss[1] / MiB:.0f} | "
                     f"{max(rss) / max(base['peak_rss_per_rank']):.3f} | {r['step_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--topk", action="store_true", help="add the DiLoCo + topk row")
    p.add_argument("--out", default="results/diloco_w2/rows")
    p.add_argument("--reuse-stale", action="store_true", help="reuse rows recorded by other code too")
    a = p.parse_args(argv)
    command = "python launch/bench/bench_diloco_w2.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results = compare(rows(a.topk), steps=a.steps, out=a.out, num_ranks=2, extra_args=["--count-wire"],
                      title=f"DiLoCo, 2 ranks, {a.steps} steps", command=command, resume=True,
                      reuse_stale=a.reuse_stale)
    md = Path(a.out).with_suffix(".md")
    md.write_text(md.read_text() + "\n" + render(results, command, a.steps))
    print(md.read_text())


if __name__ == "__main__":
    main()
