"""launch/bench/hms_scale.py: the configs its modes train (ZeRO-Infinity as DeepSpeed's docs set it up, HMS with
titan_balanced's optimizer, the same ZeRO-3 buffer bounds everywhere), the aio choice, and a tiny capped
ZeRO-Infinity trial that must run DeepSpeed's own CPU Adam."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.conftest import ROOT
from titan_ds.hms.install import ZERO3_BOUNDS

_spec = importlib.util.spec_from_file_location("hms_scale", ROOT / "launch" / "bench" / "hms_scale.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["hms_scale"] = bench
_spec.loader.exec_module(bench)


def test_zero_inf_config_is_deepspeeds_nvme_offload_as_documented(tmp_path):
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    cfg = bench.ds_config("zero_inf", str(tmp_path))
    z = DeepSpeedZeroConfig(**cfg["zero_optimization"])  # DeepSpeed's own parser, as the engine reads it
    assert z.stage == 3
    assert z.offload_optimizer.device == OffloadDeviceEnum.nvme and str(z.offload_optimizer.nvme_path) == str(tmp_path)
    assert z.offload_param.device == OffloadDeviceEnum(bench.ZERO_INF_PARAM)
    # the aio block: every key DeepSpeed reads, DeepSpeed's recommended values by default (its docs' block)
    aio = get_aio_config(cfg)
    assert {k: aio[k] for k in bench.AIO_RECOMMENDED} == bench.AIO_RECOMMENDED
    assert bench.AIO_RECOMMENDED == {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                                     "single_submit": False, "overlap_events": True}
    # DeepSpeed builds the optimizer (DeepSpeedCPUAdam under offload): the config names it, no client optimizer
    assert cfg["optimizer"]["type"] == "AdamW" and cfg["zero_force_ds_cpu_optimizer"] is True
    assert "zero_allow_untested_optimizer" not in cfg and "titan" not in cfg
    tuned = dict(bench.AIO_RECOMMENDED, queue_depth=32)
    assert bench.ds_config("zero_inf", str(tmp_path), tuned)["aio"] == tuned


@pytest.mark.parametrize("mode", bench.MODES)
def test_every_mode_gets_the_same_zero3_buffer_bounds(mode, tmp_path):
    z = bench.ds_config(mode, str(tmp_path))["zero_optimization"]
    assert z["stage"] == 3 and {k: z[k] for k in ZERO3_BOUNDS} == ZERO3_BOUNDS


def test_hms_balanced_trains_titan_balanceds_optimizer_not_the_sign_mode(tmp_path):
    cfg = bench.ds_config("hms_balanced", str(tmp_path))
    balanced = json.loads((ROOT / "ds_configs" / "titan_balanced.json").read_text())["titan"]["optimizer"]
    opt = cfg["titan"]["optimizer"]
    assert opt == balanced
    assert opt["update"] == "adaptive" and opt["density"] == 1.0 and opt["state_dtype"] == "8bit"
    assert cfg["titan"]["hms"]["nvme_path"] == str(tmp_path) and "offload_optimizer" not in cfg["zero_optimization"]



def test_hms_balanced_wb_is_hms_balanced_writing_its_partitions_behind(tmp_path):
    base, wb = (bench.ds_config(m, str(tmp_path)) for m in ("hms_balanced", "hms_balanced_wb"))
    assert base["titan"]["hms"].get("param_write_behind", False) is False
    assert wb["titan"]["hms"].pop("param_write_behind") is True and wb == base


def test_hms_dram_balanced_is_hms_dram_with_titan_balanceds_optimizer(tmp_path):
    base, bal, dram = (bench.ds_config(m, str(tmp_path)) for m in ("hms_dram", "hms_balanced", "hms_dram_balanced"))
    assert dram["titan"]["hms"]["param_tier"] == "dram" and dram["titan"]["hms"].get("gradient_buffer", "dram") == "dram"
    assert dram["titan"].pop("optimizer") == bal["titan"]["optimizer"]
    base["titan"].pop("optimizer", None)
    assert dram == base


def test_aio_settings_take_the_fastest_swept_setting_and_reuse_the_sweep(tmp_path):
    rows = [dict(bench.AIO_RECOMMENDED, block_size=b, read_GBps=r, write_GBps=w)
            for b, r, w in ((262144, 1.0, 1.0), (1048576, 1.5, 0.9), (4194304, 0.2, 0.1))]
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(rows))
    assert bench.aio_settings(str(tmp_path), sweep, None) == dict(bench.AIO_RECOMMENDED, block_size=1048576)


def test_unknown_mode_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown mode 'zero_infinity'; choose from zero3_cpu, zero_inf"):
        bench.ds_config("zero_infinity", str(tmp_path))
    with pytest.raises(SystemExit, match="--speed-shape '12by768': write LAYERSxWIDTH"):
        bench.main(["--path", str(tmp_path), "--speed-shape", "12by768"])


@pytest.mark.slow  # ~100 s on the shared 2-core machine (DeepSpeed's start-up, two steps, validation)
@pytest.mark.heavy  # and the async_io op's JIT build (libaio-dev) on a clean machine
def test_tiny_zero_inf_trial_under_a_cap_runs_deepspeed_cpu_adam_on_nvme(tmp_path):
    from titan_ds.memcap import cgroup_available
    if not cgroup_available():
        pytest.skip("needs root and a cgroup v1 memory controller")
    why = bench.async_io_status()
    if why is not None:
        pytest.skip(why)
    # 1x256: 0.9M parameters, one sub-group of 3.5 MB; DeepSpeed swaps only sub-groups >= max(1 MiB, block_size)
    seen = []
    real = bench.run_capped_clean

    def spy(cmd, *a, **kw):  # the optimizer state must really be on the nvme path while it trains
        r = real(cmd, *a, **kw)
        seen.extend(p.name for p in tmp_path.rglob("*.tensor.swp"))
        return r
    bench.run_capped_clean = spy
    try:
        r = bench.trial("zero_inf", 1, 256, 2.0, path=str(tmp_path), steps=2, timeout=300, logs=tmp_path / "logs")
    finally:
        bench.run_capped_clean = real
    assert r["fits"], (r, (tmp_path / "logs" / "zero_inf_c2_1x256.log").read_text()[-3000:])
    assert r["optimizer"] == "DeepSpeedCPUAdam" and r["aio"] == bench.AIO_RECOMMENDED
    assert any(n.endswith(".tensor.swp") for n in seen), "no optimizer swap file under the nvme path"
    assert len(r["step_s_all"]) == 1 and r["step_s_median"] > 0


def test_lr_goes_to_the_optimizer_each_mode_trains_and_a_store_is_reused_only_at_its_lr(tmp_path):
    titan = bench.ds_config("hms_balanced", str(tmp_path))
    assert bench.set_lr(titan, 1e-5)
    assert titan["titan"]["optimizer"]["lr"] == 1e-5 and "optimizer" not in titan
    ds = bench.ds_config("zero_inf", str(tmp_path))
    assert bench.set_lr(ds, 2e-5)
    assert ds["optimizer"]["params"]["lr"] == 2e-5  # DeepSpeed builds DeepSpeedCPUAdam from this section
    plain = bench.ds_config("hms", str(tmp_path))
    before = json.dumps(plain)
    assert not bench.set_lr(plain, 3e-5) and json.dumps(plain) == before  # train.py's client AdamW: --lr
    assert bench._same_lr({"mode": "hms"}, None) == {"mode": "hms"}
    with pytest.raises(SystemExit, match="another --out"):
        bench._same_lr({"mode": "hms", "lr": 1e-5}, None)
    with pytest.raises(SystemExit, match="another --out"):
        bench._same_lr({"mode": "hms"}, 1e-5)


def test_bounds_price_reads_and_writes_at_the_disks_own_speeds(monkeypatch):
    disk = json.loads((ROOT / "results" / "hms_timeline" / "disk.json").read_text())
    monkeypatch.setattr(bench, "_speeds", lambda: (100.0, 1.0))
    r = {"GiB_read_per_step": 2.0, "GiB_written_per_step": 1.0, "params": 1e9}
    io, compute = bench.bounds(r)
    GiB = 1 << 30
    assert abs(io - (2 * GiB / (disk["raw_read_GBps"] * 1e9) + GiB / (disk["raw_write_GBps"] * 1e9))) < 1e-9
    assert abs(compute - 6 * 1e9 * 128 / 100e9) < 1e-9


def test_bounds_price_io_at_this_invocations_disk_probe_kept_beside_the_table(tmp_path, monkeypatch):
    """The I/O bound uses the disk measured by this invocation (saved as OUT.disk.json and reused by a rerun),
    not an earlier day's results/hms_timeline/disk.json; --no-run without a record falls back to that one."""
    calls = []

    def fake_measure(path, mb, threads, block_mb):
        calls.append(path)
        return {"raw_read_GBps": 2.0, "raw_write_GBps": 0.5}
    monkeypatch.setattr("titan_ds.hms.diskprobe.measure_disk", fake_measure)
    monkeypatch.setattr(bench, "_speeds", lambda: (100.0, 1.0))
    monkeypatch.setattr(bench, "_DISK", {})
    record = tmp_path / "t.disk.json"
    assert bench.disk_speeds(str(tmp_path), record)["raw_write_GBps"] == 0.5 and len(calls) == 1
    io, _ = bench.bounds({"GiB_read_per_step": 2.0, "GiB_written_per_step": 1.0, "params": 1e6})
    assert io == pytest.approx((2 * bench.GiB / 2e9) + (bench.GiB / 0.5e9))
    monkeypatch.setattr(bench, "_DISK", {})
    assert bench.disk_speeds(str(tmp_path), record)["source"] == "t.disk.json" and len(calls) == 1  # reused
    monkeypatch.setattr(bench, "_DISK", {})
    stale = bench.disk_speeds(str(tmp_path), tmp_path / "none.disk.json", no_run=True)
    assert stale["source"] == "results/hms_timeline/disk.json" and len(calls) == 1


def test_the_compute_bound_keeps_the_matmul_rate_measured_with_the_disk_before_the_runs(tmp_path, monkeypatch):
    """A table rewritten later (--reuse-stale, --no-run) on a busy machine prices compute at the GFLOP/s its runs'
    invocation measured before any trial, kept in OUT.disk.json, not at what the rewriting process measures."""
    monkeypatch.setattr("titan_ds.hms.diskprobe.measure_disk",
                        lambda path, mb, threads, block_mb: {"raw_read_GBps": 2.0, "raw_write_GBps": 0.5})
    monkeypatch.setattr(bench, "_DISK", {})
    monkeypatch.setattr(bench, "_SPEEDS", [])
    record = tmp_path / "t.disk.json"
    bench.disk_speeds(str(tmp_path), record)
    quiet = json.loads(record.read_text())["fp32_matmul_GFLOPs"]
    assert quiet > 0
    monkeypatch.setattr(bench, "_DISK", {})
    monkeypatch.setattr(bench, "_SPEEDS", [quiet / 5, 1.0])  # what a busy machine would measure now
    bench.disk_speeds(str(tmp_path), record)  # the rerun reads the record
    _, compute = bench.bounds({"GiB_read_per_step": 0.0, "GiB_written_per_step": 0.0, "params": 1e9})
    assert compute == pytest.approx(6 * 1e9 * 128 / (quiet * 1e9))


def test_loss_reference_is_reused_only_for_the_same_schedule_and_the_plot_is_written(tmp_path, monkeypatch):
    import argparse
    out = tmp_path / "t"
    a = argparse.Namespace(loss_reference="2x64", speed_warmup=1, speed_steps=4, lr=None, lr_warmup=2,
                           no_run=True)
    record = tmp_path / "t.speed.reference.json"
    want = {"shape": "2x64", "steps": 5, "lr": None, "lr_warmup": 2, "config": "ds_configs/baseline_adamw.json"}
    record.write_text(json.dumps(dict(want, losses=[5.6, 5.0, 4.0, 3.5, 3.0])))
    ref = bench.reference_losses(a, out)
    assert ref["losses"][0] == 5.6
    a.lr_warmup = 3  # another schedule: the record is not this reference, and --no-run will not make one
    with pytest.raises(SystemExit, match="lacks this reference"):
        bench.reference_losses(a, out)

    class St:
        rows = {1: {"mode": "hms_balanced", "layers": 2, "width": 64, "cap_GiB": 4.0, "lr_warmup": 2,
                    "loss_all": [5.5, 4.9, 4.2, 3.9, 3.1]}}
    png = bench.plot_losses(St(), out, a, ref)
    assert png == tmp_path / "t.speed.losses.png" and png.read_bytes()[:4] == b"\x89PNG"


def test_timeline_plot_draws_each_modes_first_run_from_the_spans_its_trial_left(tmp_path):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    spans = [dict(phase=ph, lane=lane, start=a, end=b, step=1) for ph, lane, a, b in
             [("wall", "main", 0.0, 3.0), ("forward", "main", 0.0, 1.0), ("backward", "main", 1.0, 2.0),
              ("step", "main", 2.0, 3.0), ("param fetch", "main", 0.1, 0.2), ("opt write", "writer", 2.1, 2.5)]]
    (cfg / "hms_balanced_c8_2x64_speed0.timeline.json").write_text(json.dumps({"meta": {}, "spans": spans}))
    (cfg / "hms_balanced_c8_2x64_speed0.metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")

    class St:
        rows = {1: {"mode": "hms_balanced", "cap_GiB": 8.0, "layers": 2, "width": 64, "repeat": 0,
                    "phases": {"wall": 3.0}},
                2: {"mode": "hms", "cap_GiB": 8.0, "layers": 2, "width": 64, "repeat": 0, "phases": {"wall": 1.0}}}
    png = bench.plot_timeline(St(), tmp_path / "t", str(tmp_path))  # the hms run left no spans: left out
    assert png == tmp_path / "t.speed.timeline.png" and png.read_bytes()[:4] == b"\x89PNG"
    St.rows.pop(1)
    assert bench.plot_timeline(St(), tmp_path / "u", str(tmp_path)) is None


def test_build_ops_builds_titans_kernel_too_outside_the_cap(monkeypatch):
    """A capped trial must not JIT-compile an op (its peak would be g++'s): build_ops builds DeepSpeed's ops and
    titan's CPU optimizer kernel first, uncapped (without titan's, a first titan_balanced trial peaked at 2.93 GiB
    against 1.42)."""
    import subprocess

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    bench.build_ops({})
    code = calls[0][-1]
    assert "CPUAdamBuilder().load" in code
    # async_io only where it can build (without libaio zero_inf is skipped and the other modes still run)
    assert "b = AsyncIOBuilder(); b.load(verbose=False) if b.is_compatible(verbose=False) else None" in code
    assert "from titan_ds.optim import core_cpu; core_cpu.available()" in code


def test_timeline_option_records_each_phase_of_the_timed_steps_and_writes_a_second_table(tmp_path, monkeypatch):
    """--timeline: the trial asks launch/train.py for its timeline, keeps each phase's mean over the timed steps
    (the warm-up step left out, titan_ds.hms.timeline.breakdown's accounting) and the thread count it ran with;
    the speed table gets a phase table beside it."""
    import argparse
    import types
    from pathlib import Path

    from titan_ds.hms.timeline import breakdown

    seen = {}

    def fake_run(cmd, cap, log, env=None, **kw):
        seen["cmd"], seen["env"] = list(cmd), env
        arg = lambda flag: cmd[cmd.index(flag) + 1]  # noqa: E731
        spans, metrics = [], []
        for step, (fwd, opt) in enumerate([(5.0, 9.0), (1.0, 2.0), (3.0, 4.0)]):  # step 0: the warm-up
            t = 100.0 * step
            spans += [dict(phase="wall", lane="steps", start=t, end=t + fwd + opt + 1, step=step),
                      dict(phase="forward", lane="main", start=t, end=t + fwd, step=step),
                      dict(phase="param fetch", lane="main", start=t, end=t + 0.5, step=step),
                      dict(phase="step", lane="main", start=t + fwd + 1, end=t + fwd + 1 + opt, step=step),
                      dict(phase="opt read", lane="main", start=t + fwd + 1, end=t + fwd + 1.25, step=step)]
            metrics.append(dict(step=step, step_s=fwd + opt + 1, loss=1.0,
                                hms=dict(bytes_read=1 << 30, bytes_written=1 << 29)))
        if "--timeline-out" in cmd:
            Path(arg("--timeline-out")).write_text(json.dumps({"meta": {}, "spans": spans}))
        Path(arg("--metrics-out")).write_text("".join(json.dumps(m) + "\n" for m in metrics))
        Path(arg("--summary-out")).write_text(json.dumps(dict(val_loss=1.0, train_loss_last10=1.0, optimizer="ASDT",
                                                              trainable_params=10, peak_rss=1 << 30)))
        return types.SimpleNamespace(peak_anon_bytes=1 << 30, max_usage_bytes=1 << 30, wall_s=30.0, returncode=0,
                                     oom_killed=False, timed_out=False, ok=True)

    monkeypatch.setattr(bench, "run_capped_clean", fake_run)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    kw = dict(path=str(tmp_path), steps=3, warmup=1, timeout=60, logs=tmp_path / "logs")
    plain = bench.trial("hms_balanced", 1, 64, 2.0, **kw)
    assert "--timeline-out" not in seen["cmd"] and "phases" not in plain and plain["omp_threads"] == 3
    r = bench.trial("hms_balanced", 1, 64, 2.0, timeline=True, **kw)
    assert "--timeline-out" in seen["cmd"]
    spans = json.loads(Path(seen["cmd"][seen["cmd"].index("--timeline-out") + 1]).read_text())["spans"]
    want = [breakdown(spans, s) for s in (1, 2)]
    assert r["phases"] == pytest.approx({k: (want[0][k] + want[1][k]) / 2 for k in want[0]})
    assert r["phases"]["forward"] == pytest.approx(1.5) and r["phases"]["param fetch"] == pytest.approx(0.5)
    assert r["phases"]["opt compute"] == pytest.approx(2.75) and r["phases"]["wall"] == pytest.approx(6.0)

    monkeypatch.setattr(bench, "_speeds", lambda: (100.0, 1.0))
    monkeypatch.setattr(bench, "_DISK", {"raw_read_GBps": 2.0, "raw_write_GBps": 1.0, "source": "t"})
    st = bench.SpeedTrials(tmp_path / "o.speed.jsonl")
    rows = bench.speed_rows(st, ["hms_balanced"], 2.0, 1, 64, 1, 2, 1, {}, path=str(tmp_path), timeout=60,
                            logs=tmp_path / "logs", timeline=True)
    assert rows[0]["threads"] == 3 and rows[0]["phases"]["wall"] == pytest.approx(6.0)
    a = argparse.Namespace(speed_cap=2.0, speed_repeats=1, speed_warmup=1, speed_steps=2, cmdline="x")
    bench.write_speed(rows, tmp_path / "o", a)
    md = (tmp_path / "o.speed.md").read_text()
    assert "#### Where the step goes" in md
    table = md.split("#### Where the step goes")[1]
    assert "| mode | param fetch | forward | backward | param write |" in table
    assert "| hms_balanced | 0.500 | 1.500 |" in table
