"""Answered: the 4-5 unexplained bytes/param of HMS were prefetched partitions held twice (fixed); in results/hms_memprofile/ and docs/hms.md.

Where an HMS run's memory goes over time: RssAnon sampled every 5 ms, with the code running at each sample.

    python launch/experiments/hms_memprofile.py --label after                      # a 171M-param hms_asdt run, 2 steps
    python launch/experiments/hms_memprofile.py --plot before,after                # the curves of saved labels, one plot

``--label L`` runs ``launch/train.py`` in this process (1 rank, the config ``titan-ds plan`` writes for ``--mode``,
a reference GPT of ``--layers`` x ``--width`` built under ``zero_init``) while a thread reads ``RssAnon`` from
``/proc/self/status`` every 5 ms and notes the innermost frame of titan, DeepSpeed or the script that the main
thread is in. It saves ``results/hms_memprofile/L.json``: the peak, the main thread's stack at the peak, and
the samples (thinned to one per 50 ms). ``--plot`` draws saved labels into ``results/hms_memprofile/rss.png``.
This is how the ~4 bytes/param that an HMS run held beyond its accounting was found: in the second
step's forward, RssAnon grew by a full fp32 copy of the model, in ``TensorStore.get`` (a cache hit left the
staged copy of a finished prefetch in place until the key's next write).
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "results" / "hms_memprofile"


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _where(stack) -> str:
    for f in reversed(stack):
        if any(s in f.filename for s in ("titan_ds", "deepspeed", "train.py")):
            return f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
    return "?"


def profile(label: str, mode: str, layers: int, width: int, steps: int, nvme: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from titan_ds.plan import candidate_config
    from titan_ds.utils import ensure_dist_env
    cfg = Path(nvme) / f"{label}.json"
    Path(nvme).mkdir(parents=True, exist_ok=True)
    cfg.write_text(json.dumps(candidate_config(mode, nvme_path=str(Path(nvme) / "store"), micro_batch=1)))
    ensure_dist_env()
    main_id, t0 = threading.get_ident(), time.time()
    samples: list = []
    peak = {"rss": 0, "t": 0.0, "stack": []}
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            r = _rss_anon()
            frame = sys._current_frames().get(main_id)
            stack = traceback.extract_stack(frame) if frame is not None else []
            samples.append((round(time.time() - t0, 3), r, _where(stack)))
            if r > peak["rss"]:
                peak.update(rss=r, t=time.time() - t0, stack=traceback.format_list(stack[-25:]))
            time.sleep(0.005)

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    argv = sys.argv
    sys.argv = ["launch/train.py", "--deepspeed_config", str(cfg), "--steps", str(steps), "--layers", str(layers),
                "--width", str(width), "--heads", str(max(1, width // 64)), "--micro-batch", "1", "--val-batches",
                "1", "--warmup", "1", "--no-progress", "--zero-init"]
    try:
        runpy.run_path(str(ROOT / "launch" / "train.py"), run_name="__main__")
    finally:
        sys.argv = argv
        stop.set()
        th.join()
    thin, last = [], -1.0
    for s in samples:
        if s[0] - last >= 0.05:
            thin.append(s)
            last = s[0]
    return {"label": label, "mode": mode, "shape": f"{layers}x{width}", "steps": steps,
            "peak_rss_anon": peak["rss"], "peak_t": peak["t"], "peak_stack": peak["stack"], "samples": thin}


def plot(labels: list[str]) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    for label in labels:
        d = json.loads((OUT / f"{label}.json").read_text())
        ax.plot([s[0] for s in d["samples"]], [s[1] / 2**30 for s in d["samples"]],
                label=f"{label}: peak {d['peak_rss_anon'] / 2**30:.2f} GiB")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RssAnon (GiB)")
    ax.set_title(f"HMS {d['mode']}, GPT {d['shape']}, {d['steps']} steps")
    ax.legend()
    fig.tight_layout()
    png = OUT / "rss.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label")
    ap.add_argument("--mode", default="hms_asdt")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--nvme", default="/tmp/titan_hms_memprofile", help="folder for HMS's files (outside the repo)")
    ap.add_argument("--plot", default=None, help="comma list of saved labels to draw")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if a.label:
        d = profile(a.label, a.mode, a.layers, a.width, a.steps, a.nvme)
        d["command"] = "python launch/experiments/hms_memprofile.py " + " ".join(sys.argv[1:])
        (OUT / f"{a.label}.json").write_text(json.dumps(d))
        print(f"peak RssAnon {d['peak_rss_anon'] / 2**30:.3f} GiB at {d['peak_t']:.1f} s, in:\n"
              + "".join(d["peak_stack"][-8:]))
    if a.plot:
        print(plot(a.plot.split(",")))


if __name__ == "__main__":
    main()
