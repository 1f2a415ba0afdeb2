"""HMS benchmark: (a) raw streaming vs dd, (b) prefetch hit rate and stall, (c) largest trainable model.

Command (from the repository root; PATH is a folder on the disk to measure, not inside the repository)::

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python launch/bench/bench_hms.py --path /work/hms_bench --parts a,b,c

(a) ``results/hms_streaming.{csv,md}``: GB/s of ``dd`` with ``iflag/oflag=direct`` against HMS's I/O handle
    (raw, O_DIRECT where the filesystem allows) and HMS's store (header, CRC32 per 4 MiB, atomic rename,
    fsync) on the same folder, best of ``--repeats``. Target: store read >= 80% of dd's direct read.
(b) ``results/hms_prefetch.{csv,md}``: the reference GPT (6x256, context 128, micro-batch 16) trained
    ``--prefetch-steps`` steps under ZeRO-3 without offload (baseline) and with HMS at ``dram_cache_mb 0`` (no
    DRAM cache, so only prefetching can hit) for prefetch none / trace / lstm: parameter hit rate over the steps
    after the first, stall seconds per step, bytes per step, tokens/s ratio, and equality of the losses. Also
    ``results/hms_trace_replay.md``: the recorded ZeRO-3 access trace scored offline (none / trace / lstm /
    oracle with Belady eviction).
(c) ``results/hms_scale.{csv,md}``: a bounded scale test: GPT sizes trained 3 steps (micro-batch 1, context
    128) with plain ZeRO-3 without offload and with HMS, each under a wall-clock cap; peak RSS, disk bytes and
    s/step against the I/O bound (bytes moved per step / measured disk speed) and the compute bound (training
    FLOPs per step / measured matmul speed). The machine is shared (2 cores, 24 GB): the largest sizes of the
    20 GB / 60 GB envelope are projected from the measured bytes per parameter, not run; the table says which.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from launch.bench.harness import baseline_config, run_row  # noqa: E402
from titan_ds.hms.io import HUGE_PAGES, AsyncIOHandle, aligned_empty, probe_direct_io  # noqa: E402
from titan_ds.hms.prefetch import LSTMPredictor, NonePredictor, OraclePredictor, TracePredictor, replay  # noqa: E402
from titan_ds.hms.store import Tier, TensorStore  # noqa: E402

RESULTS = ROOT / "results"
MiB = 1 << 20


def _md_table(rows: list[dict], keys: list[str]) -> str:
    def f(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] +
                     ["| " + " | ".join(f(r.get(k, "-")) for k in keys) + " |" for r in rows]) + "\n"


def _write(name: str, title: str, rows: list[dict], keys: list[str], notes: list[str]) -> str:
    import csv
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    md = f"### {title}\n\n" + "\n".join(notes) + "\n\n" + _md_table(rows, keys)
    (RESULTS / f"{name}.md").write_text(md)
    print(md)
    return md


def _machine() -> str:
    return (f"Machine: {os.cpu_count()} CPU cores (shared), {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} "
            f"GiB RAM; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}")


# ---------------------------------------------------------------------------------------------- (a)
def _dd(args: list[str]) -> float:
    p = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    line = [ln for ln in p.stderr.splitlines() if "copied" in ln][-1]
    nbytes = int(line.split()[0])
    secs = float(line.split(",")[2].split()[0])
    return nbytes / secs / 1e9


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def part_a(path: str, mb: int, repeats: int, threads: int, hash_name: str = "xxh3_64",
           out_name: str = "hms_streaming") -> None:
    import titan_ds.hms.store_format as store_format
    store_format.HASH, store_format.FORMAT_VERSION = hash_name, (2 if hash_name == "xxh3_64" else 1)
    os.makedirs(path, exist_ok=True)
    direct = probe_direct_io(path)
    ddfile = os.path.join(path, "dd.bin")
    nbytes = mb * MiB
    best: dict[str, list[float]] = {k: [] for k in ("dd_write", "dd_read", "hms_raw_write", "hms_raw_read",
                                                    "hms_store_write", "hms_store_read", "hms_store_read_into",
                                                    "hms_store_read_into_4k")}
    io = AsyncIOHandle(block_size=8 * MiB, intra_op_parallelism=threads, direct="detect")
    buf = aligned_empty(nbytes, huge=True)  # as the swappers' reused buffers (titan_ds.hms.io.io_empty)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    x = buf.view(torch.float32)
    into = aligned_empty(nbytes, huge=True).view(torch.float32)
    into.zero_()  # touched once, as a reused buffer would be
    into4k = aligned_empty(nbytes).view(torch.float32)  # the same on ordinary 4 KiB pages: the A/B of huge pages
    into4k.zero_()
    store = TensorStore([Tier(os.path.join(path, "store"))], io=io, durable=True)
    raw = os.path.join(path, "raw.bin")
    def read_raw() -> None:
        _drop(raw)
        t = time.perf_counter()
        io.sync_pread(buf, raw, 0)
        best["hms_raw_read"].append(nbytes / (time.perf_counter() - t) / 1e9)

    def read_dd() -> None:  # the store's own file: the same random bytes in the same place on disk
        best["dd_read"].append(_dd([f"if={store.path('x')}", "of=/dev/null", "bs=8M", "iflag=direct"]))

    def read_store() -> None:
        _drop(store.path("x"))
        t = time.perf_counter()
        y = store.get("x")
        best["hms_store_read"].append(nbytes / (time.perf_counter() - t) / 1e9)
        assert torch.equal(y.view(torch.uint8), buf)  # bytes: random bits include NaNs

    def reader_into(name: str, dest: torch.Tensor):
        def read() -> None:  # into a caller's buffer, as DeepSpeed's swappers read into their pinned pool
            _drop(store.path("x"))
            t = time.perf_counter()
            store.get("x", out=dest)
            best[name].append(nbytes / (time.perf_counter() - t) / 1e9)
            assert torch.equal(dest.view(torch.uint8), buf)
        return read

    reads = [read_dd, read_raw, read_store, reader_into("hms_store_read_into", into),
             reader_into("hms_store_read_into_4k", into4k)]
    for i in range(repeats):
        best["dd_write"].append(_dd(["if=/dev/zero", f"of={ddfile}", "bs=8M", f"count={mb // 8}", "oflag=direct",
                                     "conv=fsync"]))
        t = time.perf_counter()
        io.sync_pwrite(buf, raw, 0)
        fd = os.open(raw, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        best["hms_raw_write"].append(nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        store.put("x", x)
        best["hms_store_write"].append(nbytes / (time.perf_counter() - t) / 1e9)
        # the reads in a rotating order: this virtual disk's speed drifts within seconds and depends on what was
        # read just before, so a fixed order would favour one method
        for read in reads[i % len(reads):] + reads[:i % len(reads)]:
            read()
    for f in (ddfile, raw):
        os.remove(f)
    shutil.rmtree(os.path.join(path, "store"))
    dd_read = max(best["dd_read"])
    med = {k: sorted(v)[len(v) // 2] for k, v in best.items()}
    rows = [{"method": k, "best_GBps": max(v), "median_GBps": med[k],
             "vs_dd_direct": max(v) / max(best["dd_read" if "read" in k else "dd_write"]),
             "median_vs_dd": med[k] / med["dd_read" if "read" in k else "dd_write"]} for k, v in best.items()]
    notes = [f"Command: `{' '.join(sys.argv)}`", _machine(),
             f"Folder {path} (O_DIRECT accepted: {direct}); {mb} MiB per transfer, best and median of {repeats}; "
             f"HMS uses {threads} I/O threads, 8 MiB blocks; the store adds a 4 KiB header, an {'XXH3-64' if hash_name == 'xxh3_64' else 'CRC32 (format 1)'} checksum of every 4 MiB "
             f"(computed and checked on the I/O threads), tmp + fsync + rename. `vs_dd_direct` compares with dd's "
             f"direct write (writes, of zeros) or with dd's direct read of the store's own file, the reads in a rotating order "
             f"(reads); `median_vs_dd` compares medians. `hms_store_read` returns a freshly allocated tensor "
             f"(first-touch page faults included); `hms_store_read_into` reads into a reused buffer, `hms_store_read_into_4k` into one on 4 KiB pages. The reused buffers "
             f"(as the swappers' own, from 2 MiB up) are on transparent huge pages: {'yes' if HUGE_PAGES else 'no'} in this run "
             f"(`TITAN_HMS_HUGE_PAGES=0` turns them off).",
             f"Target store read >= 80% of dd direct read: into a buffer "
             f"{max(best['hms_store_read_into']) / dd_read:.0%} (medians: {med['hms_store_read_into'] / med['dd_read']:.0%}), "
             f"fresh tensor {max(best['hms_store_read']) / dd_read:.0%} (medians: {med['hms_store_read'] / med['dd_read']:.0%})."]
    _write(out_name, "HMS (a): raw streaming vs dd (direct I/O, same folder)", rows,
           ["method", "best_GBps", "median_GBps", "vs_dd_direct", "median_vs_dd"], notes)


# ---------------------------------------------------------------------------------------------- (b)
def _hms_cfg(path: str, **hms) -> dict:
    cfg = baseline_config(stage=3, zero_force_ds_cpu_optimizer=False)
    cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0})
    cfg["titan"] = {"hms": {"nvme_path": path, **hms}}
    return cfg


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def part_b(path: str, steps: int, predictors: str = "none,trace,lstm", depth: int = 4,
           workers: int = 2, out_name: str = "hms_prefetch") -> None:
    rows, logs = [], RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    base_cfg = baseline_config(stage=3, zero_force_ds_cpu_optimizer=False)
    base_cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0})
    cpu_cfg = json.loads(json.dumps(base_cfg))
    cpu_cfg["zero_optimization"].update({"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}})
    configs = [("hmsb_zero3_no_offload", base_cfg), ("hmsb_zero3_cpu_offload", cpu_cfg)] + [
        (f"hmsb_hms_{p}" + (f"_d{d}" if d != depth else ""),
         _hms_cfg(os.path.join(path, f"b_{p}"), dram_cache_mb=0, prefetch=p, prefetch_depth=d, prefetch_workers=workers))
        for p, d in ((item.split("@")[0], int(item.split("@")[1]) if "@" in item else depth)
                     for item in predictors.split(","))]
    base = cpu = None
    for name, cfg in configs:
        mfile = logs / f"{name}.jsonl"
        r = run_row(name, cfg, steps=steps, extra_args=["--val-batches", "8", "--metrics-out", str(mfile)],
                    log_dir=logs, timeout=3600)
        if r.get("status") != "ok":
            rows.append({"config": name, "status": r.get("status")})
            continue
        hist = _metrics(mfile)
        losses = [h["loss"] for h in hist]
        base = base or {"losses": losses, "tps": r["tokens_per_s"]}
        if "cpu_offload" in name:
            cpu = losses
        row = {"config": name, "status": "ok", "val_loss": r["val_loss"],
               "max_loss_diff_vs_no_offload": max(abs(a - b) for a, b in zip(losses, base["losses"])),
               "losses_equal_cpu_offload": (losses == cpu) if cpu is not None else "-",
               "tokens_per_s_ratio": r["tokens_per_s"] / base["tps"], "peak_rss_MiB": r["peak_rss"] / MiB}
        if "hms" in hist[-1]:
            first, last = hist[0]["hms"], hist[-1]["hms"]
            h = [x["hms"] for x in hist[1:]]
            row.update({"param_hit_rate": _after_first(first, last, "param"),
                        "opt_hit_rate": _after_first(first, last, "opt"),
                        "param_misses": _count_after_first(first, last, "param_misses"),
                        "param_misses_inflight": _count_after_first(first, last, "param_misses_inflight"),
                        "staged_writes_per_step": _count_after_first(first, last, "staged_writes") / max(1, len(h)),
                        "param_hit_rate_cum": last.get("param_hit_rate", 0.0),
                        "stall_s_per_step": sum(x["stall_s"] for x in h) / len(h),
                        "MiB_read_per_step": sum(x["bytes_read"] for x in h) / len(h) / MiB,
                        "MiB_prefetched_per_step": sum(x["bytes_prefetched"] for x in h) / len(h) / MiB,
                        "MiB_written_per_step": sum(x["bytes_written"] for x in h) / len(h) / MiB})
        rows.append(row)
    notes = [f"Command: `{' '.join(sys.argv)}`", _machine(),
             f"Reference GPT 6x256 (context 128, micro-batch 16), {steps} steps, seed 0; HMS with dram_cache_mb 0 "
             f"(nothing cached: a hit is a read that a prefetch finished before ZeRO-3 asked for it), "
             f"prefetch_depth {depth}, prefetch_workers {workers}. `param_hit_rate`: parameter-partition reads after the first step (`opt_hit_rate`: optimizer "
             f"state and gradient pieces); `param_misses` after the first step, of which `param_misses_inflight` had been "
             f"prefetched but were not read yet (the others were never prefetched); `staged_writes_per_step`: partitions the optimizer step wrote that "
             f"the predictor expected next, kept in DRAM as finished prefetches (not read back from disk); stall and bytes are per step after the first.",
             "Losses are compared step by step: bitwise with DeepSpeed's CPU offload (same gradient-norm path), and "
             "as the largest difference from ZeRO-3 without offload, whose clip-norm summation order differs "
             "(gradient_clipping 1.0)."]
    _write(out_name, "HMS (b): prefetch hit rate and stall (reference GPT, ZeRO-3)", rows,
           ["config", "status", "val_loss", "losses_equal_cpu_offload", "max_loss_diff_vs_no_offload",
            "tokens_per_s_ratio", "param_hit_rate", "param_hit_rate_cum", "param_misses", "param_misses_inflight", "staged_writes_per_step", "opt_hit_rate", "stall_s_per_step", "MiB_read_per_step", "MiB_prefetched_per_step",
            "MiB_written_per_step", "peak_rss_MiB"], notes)


def _count_after_first(first: dict, last: dict, key: str) -> int:
    return last.get(key, 0) - first.get(key, 0)


def _after_first(first: dict, last: dict, kind: str) -> float:
    """Hit rate of ``kind`` reads after the first step (the metrics carry cumulative hits and misses)."""
    h = last.get(f"{kind}_hits", 0) - first.get(f"{kind}_hits", 0)
    m = last.get(f"{kind}_misses", 0) - first.get(f"{kind}_misses", 0)
    return h / (h + m) if h + m else float("nan")


def part_b_replay(trace_path: Path) -> None:
    steps = json.loads(trace_path.read_text())["steps"]
    flat = [k for s in steps for k in s]
    n = len(set(flat))
    rows = []
    for cap_frac in (0.25, 0.5):
        cap = max(4, int(n * cap_frac))
        for depth in (1, 4):
            for name, pred in (("none", NonePredictor()), ("trace", TracePredictor()), ("lstm", LSTMPredictor()),
                               ("oracle+belady", OraclePredictor(flat))):
                r = replay(steps, pred, capacity=cap, depth=depth, evict="belady" if name.startswith("oracle") else "lru")
                r2 = replay(steps, type(pred)(flat) if name.startswith("oracle") else type(pred)(), capacity=cap,
                            depth=depth, evict="belady" if name.startswith("oracle") else "lru", warmup_steps=2)
                rows.append({"buffer_keys": cap, "depth": depth, "predictor": name, "hit_rate": r.hit_rate,
                             "after_step1": r.hit_rate_after_first, "after_step2": r2.hit_rate_after_first,
                             "prefetched": r.prefetched, "wasted": r.wasted})
    notes = [f"Command: `{' '.join(sys.argv)}`", f"Trace {trace_path.relative_to(ROOT)}: {len(steps)} steps, "
             f"{len(flat)} accesses to {n} parameter partitions (recorded from HMS's parameter swapper on the "
             f"reference GPT). Buffer of `buffer_keys` partitions, LRU eviction (Belady for the oracle)."]
    _write("hms_trace_replay", "HMS (b): predictors scored on a recorded ZeRO-3 trace", rows,
           ["buffer_keys", "depth", "predictor", "hit_rate", "after_step1", "after_step2", "prefetched", "wasted"],
           notes)


def record_trace(out: Path, nvme: str, steps: int = 6) -> None:
    """Train the reference GPT a few steps with HMS in this process and save the parameter access trace."""
    from titan_ds.engine import initialize
    from titan_ds.models.gpt import GPT, GPTConfig
    from titan_ds.utils import ensure_dist_env
    ensure_dist_env()
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    engine, *_ = initialize(model=model, optimizer=opt, config=_hms_cfg(nvme, dram_cache_mb=0, prefetch="none"))
    swapper = engine.titan.reports["hms"].param_swapper
    swapper.access_log = [[]]
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 128), generator=g)
        engine.backward(engine(x, x))
        engine.step()
    trace = [s for s in swapper.access_log if s]
    out.write_text(json.dumps({"source": "launch/bench/bench_hms.py --parts t (reference GPT 6x256, ZeRO-3 + HMS, "
                                         "micro-batch 4)", "steps": trace}))
    print(f"recorded {len(trace)} steps, {sum(map(len, trace))} accesses -> {out}")


# ---------------------------------------------------------------------------------------------- (c)
def _matmul_gflops() -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    return 10 * 2 * 1024**3 / (time.perf_counter() - t) / 1e9


def _gpt_params(layers: int, width: int, vocab: int = 256, ctx: int = 128) -> int:
    return layers * (12 * width * width + 13 * width) + 2 * vocab * width + ctx * width + 2 * width


def part_c(path: str, sizes: list[tuple[str, int, int]], cap_s: int, disk_GBps: float) -> None:
    logs = RESULTS / "logs"
    gflops = _matmul_gflops()
    rows = []
    for mode, layers, width in sizes:
        name = f"hmsc_{mode}_{layers}x{width}"
        if mode == "zero3":
            cfg = baseline_config(stage=3, zero_force_ds_cpu_optimizer=False)
            cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0})
        else:
            cfg = _hms_cfg(os.path.join(path, f"c_{name}"), dram_cache_mb=256, prefetch="trace", prefetch_depth=4)
            cfg["zero_optimization"]["sub_group_size"] = 50_000_000  # bounds the optimizer step's DRAM
        cfg["train_micro_batch_size_per_gpu"] = 1
        mfile = logs / f"{name}.jsonl"
        t0 = time.perf_counter()
        try:
            r = run_row(name, cfg, steps=3, extra_args=["--layers", str(layers), "--width", str(width), "--heads",
                                                        str(max(1, width // 64)), "--val-batches", "1",
                                                        "--micro-batch", "1", "--metrics-out", str(mfile)],
                        log_dir=logs, timeout=cap_s)
        except subprocess.TimeoutExpired:
            r = {"status": f"not finished within the {cap_s} s cap"}
        wall = time.perf_counter() - t0
        params = _gpt_params(layers, width)
        row = {"config": name, "params_M": params / 1e6, "status": r.get("status", "?"), "wall_s": wall}
        if r.get("status") == "ok":
            hist = _metrics(mfile)
            step_s = sum(h["step_s"] for h in hist[1:]) / max(1, len(hist) - 1)
            flops = 6 * params * 128  # training FLOPs per step: micro-batch 1 x context 128 tokens
            moved = sum(h["hms"]["bytes_read"] + h["hms"]["bytes_written"] for h in hist[1:]) / max(1, len(hist) - 1) \
                if "hms" in hist[-1] else 0
            disk = hist[-1].get("hms", {}).get("disk_bytes", 0)
            row.update({"trainable_M": r["trainable_params"] / 1e6, "peak_rss_GiB": r["peak_rss"] / 2**30,
                        "disk_GiB": disk / 2**30, "s_per_step": step_s,
                        "io_bound_s": moved / (disk_GBps * 1e9), "compute_bound_s": flops / (gflops * 1e9),
                        "GiB_moved_per_step": moved / 2**30})
        rows.append(row)
        shutil.rmtree(os.path.join(path, f"c_{name}"), ignore_errors=True)
    notes = [f"Command: `{' '.join(sys.argv)}`", _machine(),
             f"3 steps, micro-batch 1, context 128, AdamW client optimizer, wall-clock cap {cap_s} s per row. "
             f"s/step averages steps 2-3. Bounds: io_bound_s = bytes HMS moved per step / {disk_GBps:.2f} GB/s "
             f"(dd direct read, part a); compute_bound_s = 6 x params x 128 tokens / {gflops:.1f} GFLOP/s "
             f"(measured fp32 1024^3 matmul)."]
    _write("hms_scale", "HMS (c): largest reference GPT trained 3 steps (bounded run)", rows,
           ["config", "params_M", "trainable_M", "status", "peak_rss_GiB", "disk_GiB", "s_per_step", "io_bound_s",
            "compute_bound_s", "GiB_moved_per_step", "wall_s"], notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", required=True, help="folder on the disk to measure (outside the repository)")
    ap.add_argument("--parts", default="a,b,c", help="a, b, c, and t (record the GPT access trace for b)")
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--hash", default="xxh3_64", choices=["xxh3_64", "crc32"],
                    help="part a: the store's payload checksum (crc32: format 1, what the store wrote before XXH3)")
    ap.add_argument("--out-name", default="hms_streaming", help="part a: results/<name>.{csv,md}")
    ap.add_argument("--prefetch-steps", type=int, default=20)
    ap.add_argument("--predictors", default="none,trace,lstm", help="part b: the HMS rows' titan.hms.prefetch values; name@D for its own prefetch_depth")
    ap.add_argument("--prefetch-depth", type=int, default=4, help="part b: titan.hms.prefetch_depth")
    ap.add_argument("--prefetch-workers", type=int, default=2, help="part b: titan.hms.prefetch_workers")
    ap.add_argument("--b-out-name", default="hms_prefetch", help="part b: results/<name>.{csv,md}")
    ap.add_argument("--trace", default=str(ROOT / "tests" / "hms" / "data" / "zero3_trace_gpt.json"))
    ap.add_argument("--scale", default="zero3:12x1024,hms:12x1024,hms:24x1536",
                    help="comma list of mode:layersxwidth (mode zero3 or hms)")
    ap.add_argument("--cap-s", type=int, default=900, help="wall-clock cap per scale row")
    ap.add_argument("--disk-GBps", type=float, default=None, help="disk read speed for the I/O bound (default: part a)")
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    if "t" in parts:
        record_trace(Path(a.trace), os.path.join(a.path, "trace"))
    if "a" in parts:
        part_a(a.path, a.mb, a.repeats, a.threads, a.hash, a.out_name)
    if "b" in parts:
        part_b(a.path, a.prefetch_steps, a.predictors, a.prefetch_depth, a.prefetch_workers, a.b_out_name)
        if Path(a.trace).exists():
            part_b_replay(Path(a.trace))
    if "c" in parts:
        disk = a.disk_GBps
        if disk is None:
            rows = (RESULTS / "hms_streaming.csv").read_text().splitlines()
            disk = next(float(r.split(",")[1]) for r in rows if r.startswith("dd_read"))
        sizes = []
        for item in a.scale.split(","):
            mode, shape = item.split(":")
            layers, width = shape.split("x")
            sizes.append((mode, int(layers), int(width)))
        part_c(a.path, sizes, a.cap_s, disk)


if __name__ == "__main__":
    main()
