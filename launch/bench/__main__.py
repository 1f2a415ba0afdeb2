"""One entry point for the maintained benchmarks, and the generated index of their results.

    python -m launch.bench list                     # the suites, their scripts and results files
    python -m launch.bench SUITE [ARGS...]          # run the suite's script with ARGS (its own --help lists them)
    python -m launch.bench index                    # rewrite results/INDEX.md from the committed results files
    python -m launch.bench table SUITE [--out OUT]  # rewrite SUITE's tables from its results store; run nothing

Each suite is the script that already produced its results (the command each results file records is the one
to reproduce it; ``python -m launch.bench frontier --steps 1000`` is ``python launch/bench/frontier.py --steps
1000``). The index reads, for every maintained result, what its file records: the command, the date, the git
SHA of the commit that last changed the file, and one headline figure taken from its table. One-off probes
are in launch/experiments/ and are not indexed.

Every maintained suite records its finished rows in one results store (``launch/bench/store.py``: one jsonl per
output, one resume rule) and makes its tables from it only: ``table`` rewrites them from the jsonl without
running anything (all of the suite's committed tables, ``TABLES``, or the one at ``--out``).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

ROOT = Path(__file__).resolve().parents[2]
__all__ = ["SUITES", "RESULTS", "TABLES", "table_rows", "build_index", "regenerate", "main"]

SUITES: dict[str, tuple[str, str]] = {  # name -> (script, what it measures)
    "frontier": ("launch/bench/frontier.py", "quality vs training-state memory: titan profiles, AdamW lr grid, peers"),
    "seed-table": ("launch/bench/seed_table.py", "the seed's figures (35x / 100x / 1/10) with quality, 2 ranks"),
    "compression": ("launch/bench/bench_compress.py", "gradient compression on DeepSpeed's reduce path, 2 ranks"),
    "compression-scale": ("launch/bench/compress_scale.py", "gradient compression at W simulated workers"),
    "rms-variants": ("launch/bench/rms_variants.py", "per-worker RMS preconditioning at W workers, uncompressed or "
                     "compressed: which denominator and momentum match dense AdamW"),
    "local-updates": ("launch/bench/bench_diloco.py", "local updates (DiLoCo) with a compressed outer step at W workers"),
    "many-workers": ("launch/bench/many_workers.py", "loss vs bytes received per worker, W = 2..128, every method "
                     "(reads the compression-scale and local-updates stores; runs nothing)"),
    "hms-scale": ("launch/bench/hms_scale.py", "largest GPT trained under a memory cap, HMS vs ZeRO-3 CPU offload"),
    "hms-timeline": ("launch/bench/hms_timeline.py", "an HMS step's phases under a cap, pipelined optimizer step off vs on"),
    "hms": ("launch/bench/bench_hms.py", "HMS store streaming vs dd, prefetch hit rate"),
    "plan-accuracy": ("launch/bench/plan_accuracy.py", "`titan-ds plan`: predicted vs measured peak DRAM"),
    "hf-finetune": ("launch/bench/hf_finetune.py", "SmolLM2-135M under the HF Trainer: AdamW vs titan profiles"),
    "hf-speed": ("launch/bench/hf_speed.py", "SmolLM2-135M under the HF Trainer: tokens/s and step phases, AdamW vs "
                 "hf_asdt_8bit vs torchao AdamW8bit; alternated repeats"),
    "hf-trd-ranks": ("launch/bench/hf_trd_ranks.py", "TR-SVD of a pretrained model by rank"),
    "soak": ("launch/bench/soak.py", "3000 steps, every pillar, 2 ranks: leaks and bit-exact resume"),
    "gpu-check": ("titan_ds/gpu_check.py", "`titan-ds gpu-check`: each shipped profile on the device beside a CPU "
                  "reference, peak memory, the optimizer step against fused AdamW (on a CPU: Triton's interpreter)"),
    "op-count": ("launch/bench/op_count.py", "ops one optimizer step dispatches on meta (a GPU's kernel launches): "
                 "shipped sections vs foreach AdamW"),
    "optimizer-step": ("launch/bench/optim_step.py", "one optimizer step: elements/s, temporaries, state by optimizer, "
                       "size, dtype (titan_ds/step_temp.json)"),
    "trd": ("launch/bench/bench_trd.py", "TRD ranks vs dense AdamW"),
    "mlme": ("launch/bench/bench_mlme.py", "MLME activation memory and time"),
    "mlme-speed": ("launch/bench/mlme_speed.py", "MLME parts vs plain PyTorch: fwd+bwd time and saved bytes, seed shapes"),
    "profile": ("launch/bench/profile_phases.py", "a training step's phases (fwd/loss/bwd/optimizer/rest): plain and profiles"),
    "speed": ("launch/bench/speed.py", "tokens/s and MFU: titan profiles, plain AdamW, fair peers; alternated repeats"),
    "asdt": ("launch/bench/bench_asdt.py", "ASDT / BSPS vs AdamW"),
    "tgss-sketch": ("launch/bench/bench_asdt_sketch.py", "TGSS sketch error on real gradients (ASDT's importance)"),
    "baseline": ("launch/bench/compare.py", "any ds_configs side by side (plain DeepSpeed baseline)"),
    "demo": ("launch/demo.py", "`make demo`: titan_memory beside plain DeepSpeed"),
}


# suite -> (the module whose table(out) rewrites a table from its store, the committed tables it made). Tables
# that cannot be regenerated are not listed: hms-scale (its table measures the machine's GFLOP/s when written),
# results/frontier_300*.md (their titan_balanced and titan_memory rows ran earlier versions of those profiles,
# whose configs the records do not keep), results/compress_scale.md (written by an older script, other columns)
# and the suites whose tables predate any jsonl (baseline, trd, mlme, asdt, seed-table).
TABLES: dict[str, tuple[str, list[str]]] = {
    "frontier": ("launch.bench.frontier", ["results/frontier_1000"]),
    "compression": ("launch.bench.bench_compress", ["results/compress_rms", "results/compress_rms_500",
                                                     "results/compress_rms_rss300", "results/compress_rms_1000",
                                                     "results/compress_rms_1000_rss",
                                                     "results/compress_w2_follow_1000",
                                                     "results/compress_w2_sketch_g6_1000",
                                                     "results/compress_w2_sketch_rss_300",
                                                     "results/compress_w2_sketch_rss_300_ws"]),
    "compression-scale": ("launch.bench.compress_scale", ["results/compress_w2_300", "results/compress_w2_1000",
                                                           "results/compress_scale_w", "results/compress_cltk_w8_200",
                                                           "results/compress_cltk_w32_200",
                                                           "results/compress_cltk_w8_1000",
                                                           "results/compress_qtopk_w8_grid",
                                                           "results/compress_rms_ratio1_w8",
                                                           "results/compress_qtopk_w32_1000",
                                                           "results/compress_qtopk_sharded_w8_lr",
                                                           "results/compress_qtopk_w32_ag",
                                                           "results/compress_rms_mean_w32",
                                                           "results/compress_sketch_w8_1000",
                                                           "results/compress_sketch_w32_1000",
                                                           "results/compress_w2_cos_follow",
                                                           "results/compress_sketch_w8_schedule",
                                                           "results/compress_sketch_w32_schedule"]),
    "rms-variants": ("launch.bench.rms_variants", ["results/rms_variants_w32", "results/rms_compressed_w32_300",
                                                   "results/rms_compressed_w32_1000"]),
    "local-updates": ("launch.bench.bench_diloco", ["results/diloco", "results/diloco_long", "results/diloco_cltk"]),
    "many-workers": ("launch.bench.many_workers", ["results/many_workers"]),
    "plan-accuracy": ("launch.bench.plan_accuracy", ["results/plan_accuracy"]),
    "hf-finetune": ("launch.bench.hf_finetune", ["results/hf_finetune.md", "results/hf_finetune_s1.md",
                                                  "results/hf_finetune_memory.md"]),
    "hf-speed": ("launch.bench.hf_speed", ["results/hf_speed.md", "results/hf_speed_phases.md"]),
    "hf-trd-ranks": ("launch.bench.hf_trd_ranks", ["results/hf_trd_ranks.md"]),
    "demo": ("launch.demo", ["results/demo"]),
}


def regenerate(suite: str, out: Optional[str] = None) -> list[str]:
    """Rewrite ``suite``'s table at ``out`` (default: every committed one) from its store; return the outs."""
    import importlib
    if suite not in TABLES:
        raise SystemExit(f"table: no regenerable tables for suite {suite!r}; choose one of {sorted(TABLES)}")
    module, outs = TABLES[suite]
    fn = importlib.import_module(module).table
    with _chdir(ROOT):  # the outs as the commands name them (relative to the checkout)
        for o in [out] if out else outs:
            fn(str(o))
    return [out] if out else outs


@contextlib.contextmanager
def _chdir(path: Path) -> Iterator[None]:
    """``contextlib.chdir`` of Python 3.11, here where the package supports 3.10."""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def table_rows(path: Path) -> list[dict[str, str]]:
    """Every row of every markdown table in ``path``, as {header: cell} (the header row of its table)."""
    rows, header = [], None
    for line in path.read_text().splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:  # a repeated header ("vs plain" twice) gets "#2", "#3" after its second use
            header = [h if cells[:i].count(h) == 0 else f"{h}#{cells[:i].count(h) + 1}" for i, h in enumerate(cells)]
        elif not all(set(c) <= set("-: ") for c in cells):
            rows.append(dict(zip(header, cells)))
    return rows


def _row(path: str, key: str, value: str) -> dict[str, str]:
    for r in table_rows(ROOT / path):
        if r.get(key, "").strip("*`").startswith(value):
            return r
    raise KeyError(f"{path}: no row with {key} = {value!r}")


def _demo(path: str) -> str:
    c = {r["figure"]: r["value"] for r in table_rows(ROOT / path)}
    return (f"titan_memory {c['val_loss_delta']} nats vs plain, training state {c['train_state_vs_plain']}x, "
            f"tokens/s {c['tokens_per_s_vs_plain']}x")


@dataclass(frozen=True)
class Result:
    suite: str
    path: str
    headline: Callable[[str], str]
    command: str = ""  # for a file that does not record its command: the one the README gave for it


def _f(fmt: str, key: str, value: str) -> Callable[[str], str]:
    def name(header: str) -> str:  # a table header as a format field: "s/step" -> s_step, "rel. L2" -> rel__L2
        return header.replace(" ", "_").replace("/", "_").replace(".", "_")
    return lambda p: fmt.format(**{name(k): v for k, v in _row(p, key, value).items()})


RESULTS: list[Result] = [
    Result("frontier", "results/frontier_1000.md", _f(
        "titan_memory {delta} nats vs AdamW (spread {spread}: {verdict}) at {mem_vs_adamw} of its training state",
        "config", "titan_memory")),
    Result("frontier", "results/frontier_1000.md", _f(
        "titan_balanced {delta} nats vs AdamW ({verdict}) at {optim_B_per_param} optimizer B/param",
        "config", "titan_balanced")),
    Result("seed-table", "results/seed_table.md", _f(
        "titan_full: TRD {trd_x_linears}x, wire {wire_x_run}x, {train_state_MiB} MiB state, {delta_vs_base} nats",
        "config", "titan_full")),
    Result("compression", "results/compress_rms_1000.md", _f(
        "top-k 100x + rms: {delta_vs_dense} nats vs dense (spread {spread}: {verdict}), wire {wire_x_(whole_run)}x",
        "config", "rms_100x")),
    Result("compression-scale", "results/compress_w2_1000.md", _f(
        "W=2, 1000 steps: dense AdamW {val_loss} (the other rows are deltas to it)", "method", "none")),
    Result("compression-scale", "results/compress_qtopk_w8_grid.md", _f(
        "W=8, 1000 steps, {wire_x_recv}x received: qtopk + rms {delta_vs_dense} nats vs dense (spread {spread}: "
        "{verdict}) at lr {best_lr}", "method", "rms_qtopk4c4096")),
    Result("compression-scale", "results/compress_qtopk_w32_ag.md", _f(
        "W=32, 1000 steps, {wire_x_recv}x received: qtopk + rms {delta_vs_dense} nats vs dense at lr {best_lr} "
        "(seed 0; target 0.05: missed)", "ratio", "1600")),
    Result("compression-scale", "results/compress_rms_mean_w32.md", _f(
        "W=32, 1000 steps, {wire_x_recv}x received: qtopk + rms_mean {delta_vs_dense} nats vs dense at lr {best_lr} "
        "(target 0.05: missed)", "method", "rms_mean_qtopk4c4096")),
    Result("rms-variants", "results/rms_variants_w32.md", _f(
        "W=32, uncompressed, 1000 steps: rms_mean's formula (ncd) {delta_vs_dense} nats vs dense AdamW (seed 0)",
        "variant", "ncd")),
    Result("rms-variants", "results/rms_compressed_w32_1000.md", _f(
        "W=32, 100x sharded, 1000 steps: the exact mean-gradient RMS (oracle) {delta_vs_dense} nats vs dense AdamW "
        "(seed 0; the denominator no longer the limit)", "variant", "oracle")),
    Result("local-updates", "results/diloco/table.md", _f(
        "W={W}, {x_recv}x received: DiLoCo + top-k outer {delta_vs_dense} nats vs dense (target 0.05: missed)", "method",
        "diloco+topk H=20"), "python launch/bench/bench_diloco.py --workers 8,32 --steps 200 --lrs 1e-3 --seeds 1 "
        "--syncs 20 --outer 0.7:0.5 --compressors topk --out results/diloco (every invocation: "
        "results/diloco/commands.txt)"),
    Result("local-updates", "results/diloco_long/table.md", _f(
        "W=8, 1000 steps, {x_recv}x received: DiLoCo + qtopk (2-bit) outer {delta_vs_dense} nats vs dense (target "
        "0.05: missed)", "method", "diloco+qtopk2c256 H=20"), "python launch/bench/bench_diloco.py --workers 8 "
        "--steps 1000 --lrs 1e-3 --seeds 0 --syncs 20 --outer 0.7:0.5 --compressors qtopk2c256 --no-baselines "
        "--reuse-stale --out results/diloco_long (every invocation: results/diloco_long/commands.txt)"),
    Result("hms-scale", "results/hms_scale_zinf.md", _f(
        "2 GiB cap: ZeRO-Infinity (optimizer on NVMe) trains {params_M}M params, {x_zero3_cpu}x ZeRO-3 CPU offload",
        "mode", "zero_inf")),
    Result("hms-scale", "results/hms_scale_zinf.speed.md", _f(
        "12x768 under 4 GiB: HMS + AdamW at {x_zero_inf}x ZeRO-Infinity's s/step (one run, shared machine)",
        "mode", "hms")),
    Result("hms-scale", "results/hms_speed_ram.speed.md", _f(
        "12x768 under 4 GiB, 3 alternated runs: HMS dram + DeepSpeedCPUAdam at {x_zero_inf}x ZeRO-Infinity's s/step "
        "(master read from the partitions in RAM)", "mode", "hms_dram_cpuadam")),
    Result("hms-scale", "results/hms_speed_res.speed.md", _f(
        "12x768 under 4 GiB: HMS dram + optimizer_dram_mb 512 at {x_zero_inf}x ZeRO-Infinity's s/step, peak "
        "{peak_anon_GiB} GiB", "mode", "hms_dram_cpuadam_res")),
    Result("hms-scale", "results/hms_speed_balanced.speed.md", _f(
        "12x768 under 4 GiB, 3 alternated runs, 2026-12-05: HMS dram + DeepSpeedCPUAdam at {x_zero_inf}x "
        "ZeRO-Infinity's s/step", "mode", "hms_dram_cpuadam")),
    Result("hms-scale", "results/hms_speed_balanced.speed.md", _f(
        "12x768 under 4 GiB, 2026-12-05: HMS dram + titan_balanced's optimizer at {x_zero_inf}x ZeRO-Infinity's "
        "s/step, peak {peak_anon_GiB} GiB", "mode", "hms_dram_balanced")),
    Result("hms-scale", "results/hms_900m_avx512.speed.md", _f(
        "907.7M under 4 GiB, titan_balanced's optimizer, 2026-12-05: {step_s} s/step, {x_bound}x the larger bound",
        "mode", "hms_balanced")),
    Result("hms-scale", "results/hms_900m_1206_t1.speed.md", _f(
        "907.7M under 4 GiB, titan_balanced's optimizer, 2026-12-06, 1 thread, timeline: {step_s} s/step, {x_bound}x "
        "the larger bound", "mode", "hms_balanced")),
    Result("hms-scale", "results/hms_900m_1206_t2.speed.md", _f(
        "907.7M under 4 GiB, the same with 2 threads: {step_s} s/step, {x_bound}x the larger bound (the compute "
        "bound at 2 threads)", "mode", "hms_balanced")),
    Result("hms-scale", "results/hms_5b_balanced_1206.speed.md", _f(
        "5.04B under 8 GiB, titan_balanced's optimizer, 2026-12-06, timeline: {step_s} s/step, {x_bound}x the larger "
        "bound", "mode", "hms_balanced")),
    Result("hms-scale", "results/hms_5b_advise.speed.md", _f(
        "5.04B under 8 GiB with the gradient read-ahead (madvise), 5 timed steps: {step_s} s/step", "mode",
        "hms_balanced")),
    Result("hms-scale", "results/hms_900m_wb.speed.md", _f(
        "907.7M under 4 GiB, titan_balanced's optimizer, param_write_behind: {step_s} s/step (1 run)", "mode",
        "hms_balanced_wb")),
    Result("hms-scale", "results/hms_900m_wb2.speed.md", _f(
        "907.7M under 4 GiB, the order reversed: param_write_behind {step_s} s/step, {x_bound}x the larger bound at "
        "the disk probed that day", "mode", "hms_balanced_wb")),
    Result("hms-scale", "results/hms_scale_cap2.md", _f(
        "2 GiB cap: HMS+ASDT trains {params_M}M params, {x_zero3_cpu}x ZeRO-3 CPU offload", "mode", "hms_asdt")),
    Result("hms-scale", "results/hms_scale_cap8.md", _f(
        "8 GiB cap: {params_M}M params, {x_zero3_cpu}x ZeRO-3 CPU offload, peak anon {peak_anon_GiB} GiB, "
        "{step_s} s/step", "mode", "hms_asdt_bf16")),
    Result("hms-timeline", "results/hms_timeline/table.md", lambda p: next(
        f"12x768 under 4 GiB: HMS (param writes synchronous) {off['all runs']} s/step vs ZeRO-Infinity {zi['all runs']}"
        for off in table_rows(ROOT / p) if off.get("mode") == "hms_pw_off" and "all runs" in off
        for zi in table_rows(ROOT / p) if zi.get("mode") == "zero_inf" and "all runs" in zi)),
    Result("hms", "results/hms_prefetch.md", _f("trace prefetch: parameter hit rate {param_hit_rate} after step 1",
                                                "config", "hmsb_hms_trace")),
    Result("hms", "results/hms_streaming.md", _f("checked store read into a buffer: {vs_dd_direct} of dd direct's best, "
                                                 "{median_vs_dd} of its median", "method", "hms_store_read_into")),
    Result("plan-accuracy", "results/plan_accuracy.md", lambda p: re.search(r"Largest \|error\|[^\n]*",
           (ROOT / p).read_text()).group(0)),
    Result("hf-finetune", "results/hf_finetune.md", _f(
        "titan_asdt_8bit: eval {eval_after}, accounted {accounted_MiB} MiB ({vs_plain}x plain)", "row",
        "titan_asdt_8bit"), "OMP_NUM_THREADS=1 python launch/bench/hf_finetune.py --steps 200 --seq 128 --batch 2 "
        "--rows plain,titan_asdt,titan_asdt_backward,titan_asdt_8bit"),
    Result("hf-finetune", "results/hf_finetune_s1.md", _f(
        "seed 1: titan_asdt_8bit eval {eval_after}, accounted {accounted_MiB} MiB ({vs_plain}x plain)", "row",
        "titan_asdt_8bit"), "OMP_NUM_THREADS=1 python launch/bench/hf_finetune.py --steps 200 --seq 128 --batch 2 "
        "--rows plain,titan_asdt_8bit --seed 1 --out results/hf_finetune_s1.md"),
    Result("hf-finetune", "results/hf_finetune_memory.md", _f(
        "titan_asdt_backward: accounted {accounted_MiB} MiB ({vs_plain}x plain), peak RSS {vs_plain#2}x", "row",
        "titan_asdt_backward"), "python launch/bench/hf_finetune.py --steps 2 --eval-blocks 8 "
        "--out results/hf_finetune_memory.md"),
    Result("hf-trd-ranks", "results/hf_trd_ranks.md", _f("rank 16: {compression_(block_linears)} at {vs_dense} nats "
                                                         "before training", "rank", "16"), "python launch/bench/hf_trd_ranks.py"),
    Result("soak", "results/soak/soak.md", lambda p: f"{sum(r.get('result') == 'ok' for r in table_rows(ROOT / p))}"
           f" of {sum('result' in r for r in table_rows(ROOT / p))} checks ok"),
    Result("gpu-check", "results/gpu_check/gpu_check.md", lambda p: (lambda r: (
        f"{'GPU' if r['gpu'] else 'no GPU'}: {sum(x['ok'] for x in r['profiles'])} of {len(r['profiles'])} profiles within "
        f"tolerance of the CPU reference"))(json.loads((ROOT / p).with_suffix('.json').read_text())),
        "titan-ds gpu-check --out results/gpu_check/gpu_check.json"),
    Result("op-count", "results/op_count.md", _f(
        "titan_balanced: {ops_per_step} ops a step on meta, {vs_foreach_AdamW} foreach AdamW's", "optimizer",
        "titan_balanced")),
    Result("optimizer-step", "results/optim_step.md", _f(
        "titan_balanced, fp32: {M_s_2^24} M elements/s at 2^24 (x torchao AdamW8bit {x_torchao_2^24}), "
        "temporaries {temp_B_el_2^26} B/element at 2^26, state {state_B_el_2^26} B/element", "optimizer",
        "titan_balanced")),
    Result("optimizer-step", "results/optim_step_ieee/step.md", _f(
        "C++ kernel, titan_balanced, fp32: {M_s_2^24} M elements/s at 2^24, {x_DS_2^24}x DeepSpeedCPUAdam (AVX2 "
        "machine)", "optimizer", "titan_balanced")),
    Result("optimizer-step", "results/optim_step_linear4/step.md", _f(
        "C++ kernel, 4-bit second moment encoded without a lookup, titan_balanced, fp32: {M_s_2^24} M elements/s at "
        "2^24, {x_DS_2^24}x DeepSpeedCPUAdam (AVX2 machine)", "optimizer", "titan_balanced")),
    Result("optimizer-step", "results/optim_step_sr/step.md", _f(
        "C++ kernel with bf16 weights' stochastic rounding moved into it, titan_memory, fp32 table: {M_s_2^24} M "
        "elements/s at 2^24, {x_DS_2^24}x DeepSpeedCPUAdam (AVX-512 machine; bf16 rows in the file)", "optimizer",
        "titan_memory")),
    Result("optimizer-step", "results/optim_step_keyed/step.md", _f(
        "C++ kernel built per CPU (flags-keyed name), titan_balanced, fp32: {M_s_2^24} M elements/s at 2^24, "
        "{x_DS_2^24}x DeepSpeedCPUAdam (AVX-512 machine)", "optimizer", "titan_balanced")),
    Result("optimizer-step", "results/optim_step_avx512/step.md", _f(
        "C++ kernel with AVX-512 paths, titan_balanced, fp32: {M_s_2^24} M elements/s at 2^24, {x_DS_2^24}x "
        "DeepSpeedCPUAdam (AVX-512 machine)", "optimizer", "titan_balanced")),
    Result("optimizer-step", "results/optim_step_compiled/README.md", _f(
        "compiled core (TITAN_CORE_COMPILE=1): titan_balanced {compiled_M_s} M/s, {compiled___eager} the eager loop",
        "optimizer", "titan_balanced"), "TITAN_CORE_COMPILE=1 python launch/bench/optim_step.py --what speed --sizes "
        "16777216 --dtypes fp32 --rows titan_balanced,titan_memory,ds_cpu_adam,torchao_adamw8bit --repeats 2 "
        "--steps 10 (and TITAN_CORE_COMPILE=0 for the eager column)"),
    Result("optimizer-step", "results/optim_step_sparse/after.md", _f(
        "ASDT sparse strategy, density 0.1, 8-bit: {M_s_2^24} M elements/s at 2^24, temporaries {temp_B_el_2^24} "
        "B/element", "optimizer", "asdt_adaptive_8bit_d0.1"), "bash launch/experiments/optim_step_sparse.sh"),
    Result("speed", "results/speed.md", _f(
        "titan_balanced {tokens_s} tokens/s, {vs_plain} plain's (100 steps, median of 3 alternated repeats)", "row",
        "titan_balanced")),
    Result("speed", "results/speed_replay.md", _f(
        "titan_exact {tokens_s} tokens/s, {vs_plain} plain's with a recomputed block's replay skipping the MLP's "
        "forward (recompute_ffn in_backward)", "row", "titan_exact")),
    Result("speed", "results/speed_replay_balanced.md", _f(
        "titan_balanced {tokens_s} tokens/s, {vs_plain} plain's (recompute_ffn in_backward)", "row",
        "titan_balanced")),
    Result("speed", "results/speed_kernel_sr.md", _f(
        "titan_memory {tokens_s} tokens/s, {vs_plain} plain's with the AVX-512 kernel rounding bf16 weights in "
        "the kernel", "row", "titan_memory")),
    Result("speed", "results/speed_fused.md", _f(
        "titan_memory {tokens_s} tokens/s, {vs_plain} plain's after the fused GPU op, the per-CPU kernel build and "
        "the metrics read per logging window (titan_balanced in the file)", "row", "titan_memory")),
    Result("speed", "results/speed_peer_memory.md", _f(
        "titan_memory {tokens_s} tokens/s, {vs_plain} plain's, beside torchao AdamW4bit bf16 + the same MLME in "
        "one invocation", "row", "titan_memory")),
    Result("speed", "results/speed_norecompute.md", _f(
        "titan_exact without recompute, pre_activation: {tokens_s} tokens/s, {vs_plain} plain's", "row",
        "titan_exact_no_recompute_pre")),
    Result("profile", "results/profile_phases_replay.md", _f(
        "titan_exact step {step_ms} ms, {vs_plain} plain's time (backward {backward_ms} ms)", "row", "titan_exact")),
    Result("local-updates", "results/diloco_w2/rows.md", lambda p: next(
        f"2 real ranks, 300 steps: DiLoCo + qtopk {r['x_recv']}x received, {r['delta_vs_dense']} nats vs dense, "
        f"peak RSS {r['rss_x']}x" for r in table_rows(ROOT / p) if r.get("config") == "diloco_qtopk" and "x_recv" in r),
        "python launch/bench/bench_diloco_w2.py --steps 300 --reuse-stale --out "
        "results/diloco_w2/rows"),
    Result("profile", "results/profile_phases.md", _f(
        "titan_balanced step {step_ms} ms, {vs_plain} plain's (optimizer {optimizer_ms} ms)", "row", "titan_balanced")),
    Result("mlme-speed", "results/mlme_speed.md", lambda p: "MLME parts' forward+backward time vs plain PyTorch"),
    Result("trd", "results/trd.md", _f("rank 12: {trd_x_linears}x on the block linears at {delta_vs_base} nats",
                                       "config", "trd_r12")),
    Result("mlme", "results/mlme.md", _f("MLME: activations {activ_MiB} MiB (eager 198.6), {delta_vs_base} nats",
                                         "config", "mlme")),
    Result("asdt", "results/asdt.md", _f("ASDT d0.25 bf16 + BSPS: {delta_vs_base} nats, optimizer {optim_MiB} MiB",
                                         "config", "asdt_d0.25_bf16+bsps")),
    Result("tgss-sketch", "results/asdt_sketch.md", _f("count sketch w=n/16: rel. L2 error {rel__L2_error_vs_exact_EMA} "
                                                       "at {table_bytes___model_bytes} of the model's bytes", "sketch",
                                                       "count g w=n/16")),
    Result("baseline", "results/baseline.md", _f("AdamW ZeRO-0: val {val_loss}, {train_state_MiB} MiB state",
                                                 "config", "baseline_adamw")),
    Result("demo", "results/demo/demo.md", _demo),
]


def _command(text: str) -> str:
    m = re.search(r"Command:\s*`([^`]+)`", text) or re.search(r"`((?:[A-Z_]+=\S+ )*(?:python|launch/)[^`]+)`", text)
    return m.group(1) if m else "-"


def _git(path: str, fmt: str) -> str:
    out = subprocess.run(["git", "log", "-1", f"--format={fmt}", "--", path], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    return out or "(uncommitted)"


def _sha(path: str) -> str:
    """Eight hex digits, whatever the clone: git's own ``%h`` grows with the object count (7 in a small clone)."""
    full = _git(path, "%H")
    return full[:8] if full != "(uncommitted)" else full


def build_index() -> str:
    lines = ["# Results index", "",
             "Generated by `python -m launch.bench index` (launch/bench/__main__.py): one row per maintained result.",
             "Command and date are what each file records (date: the file's own, else its last commit's); SHA: the",
             "commit that last changed the file. Run a suite with `python -m launch.bench SUITE ARGS`; one-off",
             "probes are in launch/experiments/.", "",
             "| suite | result | command | date | git SHA | headline |", "|---|---|---|---|---|---|"]
    for r in RESULTS:
        p = ROOT / r.path
        if not p.exists():
            lines.append(f"| {r.suite} | {r.path} | - | - | - | missing |")
            continue
        text = p.read_text()
        dated = re.search(r"\b(20\d\d-\d\d-\d\d)\b", "\n".join(text.splitlines()[:8]))
        date = dated.group(1) if dated else _git(r.path, "%cs")
        cmd = (r.command or _command(text)).replace("|", "\\|")
        lines.append(f"| {r.suite} | [{r.path}]({Path(r.path).relative_to('results')}) | `{cmd}` | {date} | "
                     f"{_sha(r.path)} | {r.headline(r.path)} |")
    from launch.bench.results_tree import doc_links, index_section
    roots = [r.path for r in RESULTS] + [o for _, outs in TABLES.values() for o in outs] + sorted(doc_links())
    lines += index_section(roots)
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(__doc__)
        for name, (script, what) in SUITES.items():
            print(f"  {name:18s} {script:36s} {what}")
        return 0
    if argv[0] == "index":
        (ROOT / "results" / "INDEX.md").write_text(build_index())
        print(ROOT / "results" / "INDEX.md")
        return 0
    if argv[0] == "table":
        import argparse
        p = argparse.ArgumentParser(prog="python -m launch.bench table")
        p.add_argument("suite", choices=sorted(TABLES))
        p.add_argument("--out", default=None, help="one table (the suite's --out); default: its committed ones")
        a = p.parse_args(argv[1:])
        print("\n".join(regenerate(a.suite, a.out)))
        return 0
    if argv[0] not in SUITES:
        raise SystemExit(f"unknown suite {argv[0]!r}; choose one of {sorted(SUITES)} (or list, index, table)")
    return subprocess.call([sys.executable, str(ROOT / SUITES[argv[0]][0]), *argv[1:]], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
