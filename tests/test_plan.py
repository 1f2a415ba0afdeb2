"""`titan-ds plan`: the model spec, the byte model's structure checked against the bytes a real ZeRO-2 engine and
a real forward hold and for the monotonicity it must have, the CLI, and (as root) the config it writes trained
under the cap it was given."""
from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.deps import require
from titan_ds.config import TitanConfig
from titan_ds.memcap import cgroup_available, run_capped
from titan_ds.models import GPT, GPTConfig
from titan_ds.plan import (MODES, balanced_optimizer, candidate_config, candidates, load_calibration, model_spec,
                           parse_size, plan, predict)

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def test_gpt_spec_counts_the_real_model():
    m = model_spec("gpt:3x192")
    real = GPT(GPTConfig(n_layer=3, n_embd=192, n_head=3))
    assert m.params == sum(p.numel() for p in real.parameters())
    assert (m.layers, m.hidden, m.heads) == (3, 192, 3)
    with pytest.raises(ValueError, match="gpt:LAYERSxWIDTH"):
        model_spec("gpt:12by768")
    with pytest.raises(ValueError, match="hf:PATH_OR_CONFIG"):
        model_spec("llama-7b")


def test_hf_spec_counts_on_the_meta_device(tmp_path):
    transformers = require("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    cfg.save_pretrained(tmp_path)
    real = transformers.AutoModelForCausalLM.from_config(cfg)
    for spec in (f"hf:{tmp_path}", f"hf:{tmp_path}/config.json"):
        m = model_spec(spec)
        assert m.params == sum(p.numel() for p in real.parameters()) and m.layers == 2 and m.vocab == 300


def test_structure_orders_the_candidates_and_scales_with_ranks():
    m = model_spec("gpt:24x1024")
    cal = load_calibration()
    peak = {mode: predict(mode, m, calibration=cal).dram_peak for mode in MODES}
    # on the CPU accelerator the "device" is DRAM, so offloading to CPU saves nothing there: only HMS's disk
    # does; with its gradient partitions mapped to a file and a 2-byte optimizer state, hms_asdt holds least
    assert peak["hms_asdt"] < peak["hms"] < min(peak["zero2"], peak["zero3"], peak["zero3_cpu"])
    assert peak["zero3_cpu"] > peak["zero3"]  # + the fp32 gradient copy the CPU optimizer reads
    assert predict("hms_asdt", m, calibration=cal).disk_total < predict("hms", m, calibration=cal).disk_total
    one = predict("zero3", m, ranks=1, calibration=cal).dram
    two = predict("zero3", m, ranks=2, calibration=cal).dram
    assert two["gradients"] == pytest.approx(one["gradients"] / 2)  # ZeRO-3 partitions over ranks
    assert predict("zero2", m, ranks=2, calibration=cal).dram["parameters"] == \
        predict("zero2", m, ranks=1, calibration=cal).dram["parameters"]  # ZeRO-2 replicates parameters


def test_a_parameter_larger_than_a_sub_group_is_stepped_whole_and_bf16_halves_the_partitions():
    from titan_ds.plan import PIPELINE_DEPTH, load_step_temp
    temp = load_step_temp()["asdt_8bit"]  # the measured temporaries (titan_ds/step_temp.json)
    wide, narrow = model_spec("gpt:2x4096"), model_spec("gpt:24x1024")
    assert wide.largest == 4 * 4096 * 4096 and narrow.largest == 4 * 1024 * 1024
    opt = _structure_dram("hms_asdt_bf16", wide)["optimizer"]
    # the 67M MLP matrix, not 1e7; the previous sub-group's master and state while its write is in flight, and
    # the next one's, read ahead
    assert opt == wide.largest * (4 + 4 + 1 + temp) + wide.largest * (4 + 1) * (PIPELINE_DEPTH + 1)
    assert _structure_dram("hms_asdt_bf16", narrow)["optimizer"] == \
        10_000_000 * (4 + 4 + 1 + temp) + 10_000_000 * (4 + 1) * (PIPELINE_DEPTH + 1)
    bf, fp = predict("hms_asdt_bf16", wide, calibration={"modes": {}}), predict("hms_asdt", wide, calibration={"modes": {}})
    assert bf.disk["parameters"] == fp.disk["parameters"] / 2 and bf.disk_total / wide.params == pytest.approx(11)
    assert fp.disk_total / wide.params == pytest.approx(14)  # fp32 partition, master, bf16 state, one gradient
    # every mode is calibrated, or borrows a named mode's baseline (and says calibrated: no)
    from titan_ds.plan import CALIBRATION_OF
    assert set(load_calibration()["modes"]) | set(CALIBRATION_OF) == set(MODES)
    assert set(CALIBRATION_OF.values()) <= set(load_calibration()["modes"])


def test_zero2_prediction_is_the_bytes_a_real_engine_holds(dist_env):
    """The oracle for the structure: a 1-rank ZeRO-2 engine of gpt:2x64 built from plan's own zero2 config, after
    one step. Parameters: the module's fp32 tensors (4 P); optimizer: DeepSpeed's fp32 master partition (4 P) +
    AdamW's exp_avg and exp_avg_sq (8 P), exactly (the 0-dim `step` tensors aside)."""
    import deepspeed
    import torch
    m = model_spec("gpt:2x64")
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=1, block_size=128, vocab_size=256))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=candidate_config("zero2"))
    x = torch.randint(0, 256, (1, 128))
    engine.backward(engine(x, x))
    engine.step()
    zero = engine.optimizer
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    state = [t for s in zero.optimizer.state.values() for t in s.values() if t.dim() > 0]
    dram = predict("zero2", m, calibration={"modes": {}}).dram
    assert dram["parameters"] == nbytes(engine.module.parameters()) == 4 * m.params
    assert dram["optimizer"] == nbytes(zero.single_partition_of_fp32_groups) + nbytes(state) == 12 * m.params


@pytest.mark.parametrize("spec,seq,micro", [("gpt:2x64", 128, 1), ("gpt:2x64", 128, 2), ("gpt:4x64", 128, 1),
                                            ("gpt:2x128", 128, 1), ("gpt:2x64", 256, 1)])
def test_activation_prediction_bounds_the_saved_tensors_of_the_real_model(spec, seq, micro):
    """What autograd saves in a forward of the reference GPT (titan's SavedTensorMeter, parameters excluded):
    measured 0.62-0.75 of plan's Korthikanti estimate at these shapes; the prediction must stay an upper bound
    within 2x (a missing layer factor, micro-batch factor or the logits term falls out of that band)."""
    import torch
    from titan_ds.metrics import ActivationCounter
    from titan_ds.plan import activation_bytes
    m = model_spec(spec, seq=seq)
    model = GPT(GPTConfig(n_layer=m.layers, n_embd=m.hidden, n_head=m.heads, block_size=max(seq, 128),
                          vocab_size=m.vocab))
    counter = ActivationCounter(model)
    x = torch.randint(0, m.vocab, (micro, seq))
    with counter.track():
        model(x, x)
    predicted = activation_bytes(m, seq, micro)
    assert counter.bytes <= predicted <= 2 * counter.bytes, counter.bytes / predicted


def test_predictions_are_monotone():
    """More layers, width, sequence or micro-batch never predict fewer bytes on any tier; more ranks never more
    per rank; a candidate that fits keeps fitting with more DRAM or disk, and plan() picks the first that fits."""
    cal = load_calibration()
    peaks = lambda c: (c.dram_peak, c.disk_total)  # noqa: E731
    specs = {(s, q): model_spec(s, seq=q) for s, q in [("gpt:4x256", 128), ("gpt:8x256", 128), ("gpt:4x512", 128),
                                                         ("gpt:4x256", 256)]}  # each built once, on the meta device
    # calibrated, and the structure alone (the calibration's per-parameter term shrinks with ranks by itself)
    for mode, calibration in itertools.product(MODES, (cal, {"modes": {}})):
        def at(spec="gpt:4x256", ranks=1, seq=128, micro=1):
            return peaks(predict(mode, specs[spec, seq], ranks=ranks, seq=seq, micro=micro,
                                 calibration=calibration))
        base = at()
        for bigger in (at("gpt:8x256"), at("gpt:4x512")):
            assert all(b >= a for a, b in zip(base, bigger)) and bigger != base, (mode, base, bigger)
        # a longer sequence or a larger micro-batch grows the forward/backward phase; the peak grows with it
        # unless another phase (an HMS optimizer step's sub-group) is larger
        for kw in ({"seq": 256}, {"micro": 4}):
            assert all(b >= a for a, b in zip(base, at(**kw))), (mode, kw)
            one = predict(mode, specs["gpt:4x256", 128], calibration=calibration)
            more = predict(mode, specs["gpt:4x256", kw.get("seq", 128)], calibration=calibration, **kw)
            assert more.dram["activations"] > one.dram["activations"], (mode, kw)
        per_rank = [at(ranks=n) for n in (1, 2, 4, 8)]
        assert all(b[0] < a[0] and b[1] <= a[1] for a, b in zip(per_rank, per_rank[1:])), (mode, per_rank)
    m = model_spec("gpt:24x1024")
    fits = {(cpu, disk): {c.mode for c in candidates(m, seq=128, micro=1, cpu_mem=cpu * GiB, disk=disk * GiB,
                                                     calibration=cal) if c.fits}
            for cpu in (1, 2, 4, 8, 64) for disk in (0, 10, 100)}
    for (cpu, disk), modes in fits.items():
        assert all(modes <= fits[c, d] for c, d in fits if c >= cpu and d >= disk), (cpu, disk)
    assert 0 < len(fits[2, 100]) < len(MODES)  # the grid crosses the boundary
    for kw in ({"cpu_mem": 2 * GiB, "disk": 100 * GiB}, {"cpu_mem": 64 * GiB, "disk": 0}):
        cands, best = plan(m, seq=128, micro=1, calibration=cal, **kw)
        assert best is next(c for c in cands if c.fits)


def _structure_dram(mode, m):
    from titan_ds.plan import _structure
    return _structure(mode, m, 1, 128, 1, False)["dram"]


def test_fits_names_the_tier_that_does_not():
    m = model_spec("gpt:24x1024")
    cands = candidates(m, seq=128, micro=1, cpu_mem=2 * GiB, disk=100 * GiB)
    by = {c.mode: c for c in cands}
    assert not by["zero2"].fits and "DRAM" in by["zero2"].why
    cands = candidates(m, seq=128, micro=1, cpu_mem=64 * GiB, disk=0)
    assert not {c.mode: c for c in cands}["hms"].fits and "disk" in {c.mode: c for c in cands}["hms"].why
    assert {c.mode: c for c in cands}["zero2"].fits


def test_parse_size():
    assert parse_size("24G") == 24 * GiB and parse_size("512M") == 512 * 2**20 and parse_size("2.5GiB") == 2.5 * GiB
    assert parse_size("8") == 8 * GiB
    with pytest.raises(ValueError, match="24G"):
        parse_size("lots")


def test_optimizer_dram_budget_is_half_the_spare_of_hms_candidates_only():
    from titan_ds.plan import optimizer_dram_budget, usable_dram
    m = model_spec("gpt:24x1024")
    by = {c.mode: c for c in candidates(m, seq=128, micro=1, cpu_mem=8 * GiB, disk=100 * GiB)}
    assert optimizer_dram_budget(by["zero3_cpu"], 8 * GiB) == 0 and optimizer_dram_budget(by["zero_inf"], 8 * GiB) == 0
    hms = by["hms"]
    # half of what the cap less plan's headroom leaves beside the predicted peak
    assert optimizer_dram_budget(hms, 8 * GiB) == int((0.9 * 8 * GiB - hms.dram_peak) / 2) // 2**20 > 0
    assert usable_dram(8 * GiB) == pytest.approx(0.9 * 8 * GiB)
    assert optimizer_dram_budget(hms, 8 * GiB, ranks=2) == int((0.9 * 4 * GiB - hms.dram_peak) / 2) // 2**20
    assert optimizer_dram_budget(hms, hms.dram_peak * 0.9) == 0  # nothing left: none
    assert "optimizer_dram_mb" not in candidate_config("hms")["titan"]["hms"]
    assert candidate_config("hms", optimizer_dram_mb=300)["titan"]["hms"]["optimizer_dram_mb"] == 300


@pytest.mark.parametrize("mode", MODES)
def test_candidate_configs_are_valid(mode):
    """Valid, and what the byte model of the mode assumes: the stage, the optimizer and its state dtype, the
    weights' dtype, where gradients and partitions live."""
    from titan_ds.plan import MODE_OPTIMIZER
    cfg = candidate_config(mode, nvme_path="/tmp/x")
    if "titan" in cfg:
        TitanConfig.from_ds_config(cfg)
    z, titan = cfg["zero_optimization"], cfg.get("titan", {})
    assert z["stage"] == (2 if mode == "zero2" else 3)
    opt = titan.get("optimizer")
    assert MODE_OPTIMIZER[mode] == ("adamw" if opt is None else "titan_balanced" if opt == balanced_optimizer()
                                    else f"{opt['name']}_{opt['state_dtype']}")
    assert cfg.get("bf16", {}).get("enabled", False) == (mode == "hms_asdt_bf16")
    assert [z.get(k, {}).get("device") for k in ("offload_param", "offload_optimizer")] == \
        {"zero3_cpu": ["cpu", "cpu"], "zero_inf": ["cpu", "nvme"]}.get(mode, [None, None])
    assert ("hms" in titan) == mode.startswith("hms")
    assert (titan.get("hms", {}).get("gradient_buffer") == "disk") == (mode in ("hms_balanced", "hms_gdisk",
                                                                                 "hms_asdt", "hms_asdt_bf16"))


def test_gradients_on_disk_fit_where_hms_does_not_and_titan_balanced_is_written():
    """Where DeepSpeed's fp32 gradient partitions (4 bytes a parameter) no longer fit in DRAM beside HMS, the
    candidates with the gradients in a file mapping still fit: 41x768 under 2 GiB, which hms_scale.py measured at a
    1.13 GiB peak with AdamW (hms_gdisk) and 1.05 with titan_balanced (hms_balanced; results/hms_scale_zinf.md).
    plan writes hms_balanced, the faster of the two (ahead of hms in MODES: the ordering test below)."""
    m = model_spec("gpt:41x768")
    cands, best = plan(m, seq=128, micro=1, cpu_mem=2 * 2**30, disk=100 * 2**30)
    by = {c.mode: c for c in cands}
    assert not by["hms"].fits and by["hms_gdisk"].fits and by["hms_balanced"].fits
    assert by["hms"].dram["gradients"] > 1e9 and by["hms_gdisk"].dram.get("gradients", 0) == 0
    assert by["hms_gdisk"].disk["gradients"] == by["hms_balanced"].disk["gradients"] == 4 * m.params
    assert best.mode == "hms_balanced"
    cfg = candidate_config("hms_gdisk")
    assert cfg["titan"]["hms"]["gradient_buffer"] == "disk" and "optimizer" not in cfg["titan"]


def test_hms_balanced_config_is_titan_balanced_s_optimizer_with_gradients_on_disk(tmp_path):
    """The hms_balanced candidate: hms's HMS section with the gradients in a file mapping and the titan.optimizer
    section of the shipped ds_configs/titan_balanced.json, as it is (the config hms_scale.py measures under that
    name), valid for titan; plan charges it titan_balanced's state and step temporaries."""
    from launch.bench.hms_scale import ds_config
    from titan_ds.plan import MODE_OPTIMIZER, OPT_STATE_BYTES, load_step_temp
    nvme = str(tmp_path / "nvme")
    cfg = candidate_config("hms_balanced", nvme_path=nvme)
    shipped = json.loads((ROOT / "ds_configs" / "titan_balanced.json").read_text())["titan"]["optimizer"]
    assert cfg["titan"]["optimizer"] == shipped and shipped["state_dtype"] == "8bit"
    assert cfg["titan"]["hms"] == dict(candidate_config("hms", nvme_path=nvme)["titan"]["hms"], gradient_buffer="disk")
    assert {k: v for k, v in cfg.items() if k != "titan"} == \
        {k: v for k, v in candidate_config("hms", nvme_path=nvme).items() if k != "titan"}
    assert cfg == ds_config("hms_balanced", nvme)
    TitanConfig.from_ds_config(cfg)
    assert MODE_OPTIMIZER["hms_balanced"] == "titan_balanced" and "titan_balanced" in load_step_temp()
    m = model_spec("gpt:12x768")
    c = predict("hms_balanced", m)
    assert c.calibrated and c.dram.get("gradients", 0) == 0  # the file mapping's: on disk
    assert c.disk["optimizer"] == pytest.approx((4 + OPT_STATE_BYTES["titan_balanced"]) * m.params)


# a real engine from plan's hms_balanced config (its own process, as tests/hms/ run HMS engines): 2 steps of a tiny
# GPT; the optimizer DeepSpeed steps, and the state bytes per element of its sub-groups (HMS swaps the large state
# tensors to the store and keeps the small ones, the block scales, in the optimizer's state)
HMS_BALANCED_RUN = """
import json, sys, torch
import titan_ds
from titan_ds.models import GPT, GPTConfig
from titan_ds.plan import candidate_config
from titan_ds.utils import ensure_dist_env
ensure_dist_env()
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=1, block_size=128, vocab_size=256))
engine, *_ = titan_ds.initialize(model=model, config=candidate_config("hms_balanced", nvme_path=sys.argv[1]))
losses = []
for step in range(2):
    x = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(step))
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
opt, sw = engine.basic_optimizer, engine.optimizer.optimizer_swapper
state = numel = 0
for p in engine.optimizer.fp32_partitioned_groups_flat:
    numel += sw._numel[p.ds_id]
    swapped = sw._state_names.get(p.ds_id, [])
    state += sum(sw._read_state(p.ds_id, n).nbytes for n in swapped)
    state += sum(v.nbytes for n, v in opt.state[p].items() if torch.is_tensor(v) and n not in swapped)
print("RESULT " + json.dumps({"losses": losses, "optimizer": f"{type(opt).__module__}.{type(opt).__name__}",
                              "state_dtype": opt.quant, "second_dtype": opt.second_quant,
                              "params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
                              "numel": numel, "state_bytes": state}))
"""


def test_hms_balanced_config_trains_on_a_real_engine_with_asdt_8bit_state(tmp_path):
    from tests.helpers.launch import clean_env, run
    from titan_ds.plan import OPT_STATE_BYTES
    r = run([sys.executable, "-c", HMS_BALANCED_RUN, str(tmp_path / "nvme")], cwd=ROOT, env=clean_env(),
            capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert len(out["losses"]) == 2 and all(math.isfinite(v) for v in out["losses"]), out
    assert out["optimizer"] == "titan_ds.optim.asdt.ASDT"
    assert (out["state_dtype"], out["second_dtype"]) == ("8bit", "4bit")
    assert out["numel"] == out["params"]  # one rank: the sub-groups hold every parameter
    # the state HMS keeps of each sub-group is what plan charges per element (+ the blocks' rounding, 8 bytes a unit)
    assert out["state_bytes"] / out["numel"] == pytest.approx(OPT_STATE_BYTES["titan_balanced"], rel=0.005), out


def test_titan_balanced_state_bytes_per_parameter_are_asdts_real_state():
    """OPT_STATE_BYTES["titan_balanced"] against the state ASDT, built from titan_balanced.json's section, holds
    after a step of a small GPT (its 8-bit momentum, 4-bit second moment, their block scales; the per-unit second
    moment and the blocks' rounding at each tensor are the rest, under 0.2% here): the figure without the 4-bit
    second moment (1.02) or with it unquantized fails."""
    import torch

    from titan_ds.optim import qstate
    from titan_ds.optim.install import build_optimizer
    from titan_ds.plan import OPT_STATE_BYTES
    cfg = TitanConfig.from_ds_config(json.loads((ROOT / "ds_configs" / "titan_balanced.json").read_text()))
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=128, n_head=2, block_size=128, vocab_size=256))
    opt = build_optimizer(model, cfg.optimizer)
    x = torch.randint(0, 256, (1, 128))
    model(x, x).backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    assert opt.state_bytes() / n == pytest.approx(OPT_STATE_BYTES["titan_balanced"], rel=0.002)
    assert OPT_STATE_BYTES["titan_balanced"] == qstate.nbytes_per_value("8bit") + qstate.nbytes_per_value("4bit")


def _step_s(path: str, key: str) -> dict[str, float]:
    """The median over runs of each run's median s/step, per ``key`` value, of a committed speed store."""
    import statistics
    steps: dict[str, list[float]] = {}
    for line in (ROOT / path).read_text().splitlines():
        r = json.loads(line)
        r = r.get("result", r)
        if r.get("status") == "ok":
            steps.setdefault(r[key], []).append(r["step_s_median"])
    return {k: statistics.median(v) for k, v in steps.items()}


def test_hms_balanced_ranks_by_the_measured_step_time():
    """MODES is fastest first: hms_balanced (12x768 under 4 GiB: 2.591 s/step before the unscale fold, 2.726 after,
    results/hms_ab_fold.md) sits after ZeRO-Infinity (2.547) and before hms with torch AdamW (3.091;
    results/hms_speed_1207b.speed.md, the same machine)."""
    speed = _step_s("results/hms_speed_1207b.speed.jsonl", "mode")
    balanced = _step_s("results/hms_ab_fold.jsonl", "side")
    assert set(balanced) == {"before", "after"}
    assert speed["hms_dram"] < speed["zero_inf"] < min(balanced.values()) <= max(balanced.values()) < speed["hms"]
    assert MODES.index("hms_dram") < MODES.index("zero_inf") < MODES.index("hms_balanced") < MODES.index("hms")


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "titan_ds.cli", "plan", *args], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), **kw)


def test_cli_prints_the_table_and_writes_the_best(tmp_path):
    out = tmp_path / "cfg.json"
    p = _cli("--model", "gpt:24x1024", "--cpu-mem", "3G", "--disk", "20G", "--out", str(out),
             "--nvme-path", str(tmp_path / "nvme"))
    assert p.returncode == 0, p.stderr
    assert "| zero2 | no |" in p.stdout and "best fitting: hms" in p.stdout
    cfg = json.loads(out.read_text())
    assert cfg["titan"]["hms"]["nvme_path"] == str(tmp_path / "nvme")
    # half of what the 3 GiB (less plan's 10% headroom) leave beside the chosen candidate's predicted peak keeps
    # optimizer sub-groups in DRAM
    m = model_spec("gpt:24x1024")
    best = next(c for c in candidates(m, seq=128, micro=1, cpu_mem=3 * GiB, disk=20 * GiB) if c.fits)
    want = int((0.9 * 3 * GiB - best.dram_peak) / 2) // 2**20
    assert want > 0 and cfg["titan"]["hms"]["optimizer_dram_mb"] == want
    assert f"titan.hms.optimizer_dram_mb {want}" in p.stdout
    TitanConfig.from_ds_config(cfg)
    p = _cli("--model", "gpt:24x1024", "--cpu-mem", "0.5G")
    assert p.returncode == 1 and "nothing fits" in p.stdout
    p = _cli("--model", "gpt:24", "--cpu-mem", "4G")
    assert p.returncode == 2 and "gpt:LAYERSxWIDTH" in p.stderr


@pytest.mark.slow
@pytest.mark.skipif(not cgroup_available(), reason="needs root and a cgroup v1 memory controller")
def test_plan_config_trains_under_the_cap(tmp_path):
    """The issue's check: plan on a cap, train the config it wrote for 2 steps under that cap, and it fits
    (finite loss, not OOM-killed); plain ZeRO-2 (which plan rejected) is OOM-killed under the same cap."""
    cap, spec = "1.5G", "gpt:8x768"
    out = tmp_path / "cfg.json"
    p = _cli("--model", spec, "--cpu-mem", cap, "--disk", "10G", "--out", str(out), "--nvme-path",
             str(tmp_path / "nvme"))
    assert p.returncode == 0, p.stdout + p.stderr
    chosen = p.stdout.split("best fitting: ")[1].split()[0]
    assert chosen != "zero2", p.stdout

    def train(cfg_path, zero_init):
        summary = tmp_path / f"{cfg_path.stem}.summary.json"
        cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--deepspeed_config", str(cfg_path), "--steps",
               "2", *model_spec(spec).gpt_args, "--micro-batch", "1", "--val-batches", "1", "--warmup", "1",
               "--no-progress", "--summary-out", str(summary)] + (["--zero-init"] if zero_init else [])
        env = dict(os.environ, PYTHONPATH=str(ROOT), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
        r = run_capped(cmd, int(parse_size(cap)), env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=900)
        return r, (json.loads(summary.read_text()) if summary.exists() else None)

    r, s = train(out, zero_init=True)
    assert r.ok and s is not None and math.isfinite(s["val_loss"]), r
    z2 = tmp_path / "zero2.json"
    z2.write_text(json.dumps(candidate_config("zero2")))
    r2, _ = train(z2, zero_init=False)
    assert r2.oom_killed, r2


def test_hms_balanced_trains_exactly_the_shipped_profiles_optimizer_section():
    """plan keeps titan_balanced's optimizer section in the package (a wheel has no ds_configs/): it must be the
    shipped profile's, key for key."""
    shipped = json.loads((Path(__file__).resolve().parents[1] / "ds_configs" / "titan_balanced.json").read_text())
    assert balanced_optimizer() == shipped["titan"]["optimizer"]
    assert candidate_config("hms_balanced")["titan"]["optimizer"] == shipped["titan"]["optimizer"]
