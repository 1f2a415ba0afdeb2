"""`titan-ds plan`'s ZeRO-Infinity candidate: listed, its config the one hms_scale.py measured and
one DeepSpeed accepts (and trains, where its async_io op builds), ranked by the committed s/step measurements; and
the peak model: phases that are never held together, checked against the committed width-4096 runs."""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from titan_ds.plan import MODES, candidate_config, candidates, load_calibration, model_spec, plan, predict

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
# the committed speed runs that rank the candidates (launch/bench/hms_scale.py --speed-shape 12x768 --speed-cap 4), of
# the code that runs today; superseded: hms_scale_zinf (one run on a loaded machine: zero_inf 19.934, zero3_cpu 20.521)
# and hms_speed_inplace (HMS before the one-rank fixes: hms_dram 1.09x zero_inf)
SPEED = ["results/hms_scale_zinf_pipelined.speed.jsonl", "results/hms_speed_onerank.speed.jsonl",
         "results/hms_speed_rank.speed.jsonl"]


def _records(path):
    for line in (ROOT / path).read_text().splitlines():
        rec = json.loads(line)
        yield rec, rec.get("result", rec)


def test_zero_inf_is_a_candidate_with_the_config_hms_scale_measured_and_deepspeed_accepts(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    from launch.bench.hms_scale import ds_config
    m = model_spec("gpt:12x768")
    cands = candidates(m, seq=128, micro=1, cpu_mem=4 * GiB, disk=20 * GiB)
    zinf = {c.mode: c for c in cands}["zero_inf"]
    assert zinf.fits and zinf.calibrated and zinf.disk["optimizer"] == 12 * m.params  # master + 2 moments
    aio = {"block_size": 262144, "queue_depth": 32, "intra_op_parallelism": 1, "single_submit": False,
           "overlap_events": True}
    nvme = str(tmp_path / "nvme")
    cfg = candidate_config("zero_inf", nvme_path=nvme, aio=aio)
    assert cfg == ds_config("zero_inf", nvme, aio)  # the keys the committed zero_inf trials ran with
    ds = DeepSpeedConfig(cfg)  # DeepSpeed's own parser and validators
    z = ds.zero_config
    assert (ds.zero_optimization_stage, z.offload_optimizer.device, z.offload_param.device) == (3, "nvme", "cpu")
    assert str(z.offload_optimizer.nvme_path) == nvme and z.offload_optimizer.buffer_count == 4
    assert ds.optimizer_name == "adamw" and ds.aio_config["block_size"] == 262144


def test_zero_inf_ranks_by_the_measured_step_time():
    """MODES is fastest first: every pair of plan modes measured in the same speed run keeps that order by its
    median s/step; and plan picks HMS with the parameters in RAM where it and ZeRO-Infinity fit (faster and
    smaller: 4.050 vs 4.473 s/step, 1.69 vs 2.14 GiB, results/hms_speed_rank.speed.md; ZeRO-3 + CPU offload,
    2.532 s/step at 3.24 GiB, comes before both), HMS streaming where only it fits (as measured: 2 GiB trains 10x768
    with ZeRO-Infinity and 32x768 with HMS, results/hms_scale_zinf.md, hms_scale_cap2.md)."""
    pairs = 0
    for f in SPEED:
        steps: dict[str, list[float]] = {}
        for _, r in _records(f):
            if r.get("mode") in MODES and r.get("fits"):
                steps.setdefault(r["mode"], []).append(r["step_s_median"])
        med = {mo: statistics.median(v) for mo, v in steps.items()}
        ranked = sorted(med, key=MODES.index)
        assert ranked == sorted(med, key=med.get), (f, med)
        pairs += len(med) * (len(med) - 1) // 2
    assert pairs >= 10  # zero3_cpu, hms_dram, zero_inf and hms in one run; three of them in another
    assert MODES.index("zero3_cpu") < MODES.index("hms_dram") < MODES.index("zero_inf") < MODES.index("hms")
    # 12x768 under 2.4 GiB (2.16 of it usable: plan's 10% headroom): ZeRO-Infinity (2.06-2.15 GiB measured), HMS
    # dram (1.63-1.69) and HMS fit, ZeRO-3 + CPU offload (3.24) does not: HMS dram is written
    cands, best = plan(model_spec("gpt:12x768"), seq=128, micro=1, cpu_mem=2.4 * GiB, disk=20 * GiB)
    fits = {c.mode for c in cands if c.fits}
    assert {"zero_inf", "hms_dram", "hms"} <= fits and "zero3_cpu" not in fits, [(c.mode, c.why) for c in cands]
    assert best.mode == "hms_dram"
    # 32x768 under 2 GiB: only HMS modes fit (ZeRO-Infinity was OOM-killed above 10x768 under 2 GiB); HMS with
    # AdamW and its gradients in DRAM peaked at 1.95 GiB there (plan_accuracy's calibration run), inside plan's
    # headroom; with the gradients in a file mapping, AdamW (hms_gdisk, 41x768 measured 1.13 GiB under 2 GiB) and
    # titan_balanced (hms_balanced, 0.98 GiB measured here) fit: the faster, hms_balanced, is written
    cands, best = plan(model_spec("gpt:32x768"), seq=128, micro=1, cpu_mem=2 * GiB, disk=20 * GiB)
    by = {c.mode: c for c in cands}
    assert not by["zero_inf"].fits and not by["hms"].fits and by["hms_gdisk"].fits
    assert best.mode == "hms_balanced"


def test_hms_dram_candidate_is_hms_scale_s_config_and_predicted_within_15_percent(tmp_path):
    """HMS with the parameters in CPU memory (titan.hms.param_tier "dram"): the config hms_scale.py measured, valid
    for titan and DeepSpeed, and its peak within 15% of the measured one (its process baseline borrowed from
    "hms", so it says calibrated: no)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from launch.bench.hms_scale import ds_config
    from titan_ds.config import TitanConfig
    from titan_ds.hms.install import configure_ds_config
    nvme = str(tmp_path / "nvme")
    cfg = candidate_config("hms_dram", nvme_path=nvme)
    assert cfg == ds_config("hms_dram", nvme) and cfg["titan"]["hms"]["param_tier"] == "dram"
    TitanConfig.from_ds_config(cfg)
    plain = {k: v for k, v in cfg.items() if k != "titan"}
    configure_ds_config(plain, nvme, "dram")
    z = DeepSpeedConfig(plain).zero_config
    assert (z.offload_param.device, z.offload_optimizer.device) == ("cpu", "nvme")
    m = model_spec("gpt:12x768")
    c = predict("hms_dram", m, calibration=load_calibration())
    assert c.calibrated and "parameters" not in c.disk and c.dram["parameters"] >= 4 * m.params
    peaks = [r["peak_anon_GiB"] for _, r in _records("results/hms_speed_inplace.speed.jsonl")
             if r.get("mode") == "hms_dram" and r.get("fits")]
    assert len(peaks) == 3
    measured = statistics.median(peaks) * GiB
    assert abs(c.dram_peak / measured - 1) <= 0.15, (c.dram_peak / GiB, measured / GiB)


def test_the_peak_counts_the_larger_phase_not_both():
    """Forward/backward (activations, backward's gradient working set) and an HMS optimizer step's sub-group are
    never held together."""
    cal = load_calibration()
    wide = predict("hms", model_spec("gpt:4x2048"), calibration=cal)
    deep = predict("hms_asdt", model_spec("gpt:128x768"), calibration=cal)
    for c, larger in ((wide, "optimizer"), (deep, "forward/backward")):
        fb = c.dram["activations"] + c.dram["backward"]
        opt = c.dram["optimizer"]
        assert min(fb, opt) > 0 and (opt > fb) == (larger == "optimizer")
        assert c.dram_peak == pytest.approx(sum(c.dram.values()) - min(fb, opt))
    zinf = predict("zero_inf", model_spec("gpt:12x768"), calibration=cal)  # its swap buffers are resident
    assert zinf.dram_peak == pytest.approx(sum(zinf.dram.values()))


def test_backward_counts_the_largest_gradient_where_the_optimizer_is_offloaded():
    """The gradient of the largest parameter in backward: itself, its fp32 partition (bf16 models) and the fp64
    copy ZeRO-3 takes its norm of with the optimizer offloaded (measured at gpt:2x4096, docs in plan.py)."""
    m = model_spec("gpt:2x4096")
    assert predict("hms_asdt_bf16", m).dram["backward"] == m.largest * (2 + 4 + 8)
    assert predict("zero3_cpu", m).dram["backward"] == m.largest * (4 + 8)
    assert "backward" not in predict("zero3", m).dram and "backward" not in predict("zero2", m).dram


# the width-4096 runs (hms_asdt_bf16, 8 GiB cap; peak anonymous GiB), on the code of that day
WIDE = {"gpt:2x4096": 3.288, "gpt:4x4096": 3.242, "gpt:25x4096": 3.331}


@pytest.mark.parametrize("spec", WIDE)
def test_wide_runs_are_predicted_within_15_percent(spec):
    """The 5B run (25x4096) and its probes, predicted for the code they ran (launch/bench/plan_accuracy.py's
    EARLIER_CODE: the optimizer temporaries then, no pipelined step). Was +68% at 5B (a per-parameter fit of
    0.49 bytes/param times 5B, and the activations added to the optimizer step's sub-group)."""
    from launch.bench.plan_accuracy import EARLIER_CODE, WIDE_TRIALS, hms_scale_trials
    measured = {f"gpt:{t['shape']}": t["measured_GiB"] for t in hms_scale_trials(WIDE_TRIALS, "hms_asdt_bf16")}
    assert measured[spec] == pytest.approx(WIDE[spec], abs=1e-3)
    pred = predict("hms_asdt_bf16", model_spec(spec), **EARLIER_CODE).dram_peak / GiB
    assert abs(pred - measured[spec]) / measured[spec] < 0.15, (spec, pred, measured[spec])


def _async_io_missing():
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        return not AsyncIOBuilder().is_compatible(verbose=False)
    except Exception:
        return True


@pytest.mark.slow
@pytest.mark.skipif(_async_io_missing(), reason="DeepSpeed's async_io op needs libaio-dev")
def test_zero_inf_config_trains(tmp_path):
    """The config plan writes for zero_inf trains 2 steps of a small GPT with DeepSpeedCPUAdam and a finite loss."""
    cfg_path, summary = tmp_path / "zinf.json", tmp_path / "summary.json"
    cfg_path.write_text(json.dumps(candidate_config("zero_inf", nvme_path=str(tmp_path / "nvme"))))
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--deepspeed_config", str(cfg_path), "--steps", "2",
           *model_spec("gpt:2x128").gpt_args, "--micro-batch", "1", "--val-batches", "1", "--warmup", "1",
           "--no-progress", "--zero-init", "--summary-out", str(summary)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29500 + os.getpid() % 1000))
    p = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["optimizer"] == "DeepSpeedCPUAdam" and math.isfinite(s["val_loss"])


def test_zero_inf_is_refused_where_the_aio_op_does_not_build():
    """Without DeepSpeed's async_io op (no libaio), plan does not recommend ZeRO-Infinity and says how to get it;
    the HMS candidates (titan's own I/O, no libaio) are unaffected."""
    m = model_spec("gpt:12x768")
    kw = dict(seq=128, micro=1, cpu_mem=2.4 * GiB, disk=20 * GiB)
    cands, best = plan(m, aio=False, **kw)
    zinf = {c.mode: c for c in cands}["zero_inf"]
    assert not zinf.fits and "libaio-dev" in zinf.why and best.mode == "hms_dram"  # the next that fits
    for aio in (True, None):  # None: not checked
        assert {c.mode: c for c in plan(m, aio=aio, **kw)[0]}["zero_inf"].fits
