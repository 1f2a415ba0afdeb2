"""HMS's memory check: the memory reader on fake /proc and cgroup files, the decision on synthetic numbers, the
estimate against plan's prediction, the pillar's validate, and a capped run that picks the disk buffer and trains."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_ds.config import TitanConfig
from titan_ds.hms import budget
from titan_ds.hms.budget import KNOBS, Memory, decide, read_memory

ROOT = Path(__file__).resolve().parents[2]
GiB, MiB = 1 << 30, 1 << 20
UNLIMITED_V1 = "9223372036854771712"


# ------------------------------------------------------------------------------------------------ the reader
def _fake(tmp_path, cgroup: str, files: dict[str, str], avail_kb: int = 8 << 20, rss_kb: int = 1 << 20):
    proc, root = tmp_path / "proc", tmp_path / "cg"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "meminfo").write_text(f"MemTotal:       {avail_kb * 2} kB\nMemAvailable:   {avail_kb} kB\n")
    (proc / "self" / "status").write_text(f"Name:\tpython\nVmRSS:\t  {rss_kb} kB\n")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    return str(proc), str(root)


def test_reader_v1_takes_the_smallest_limit_up_the_path(tmp_path):
    proc, root = _fake(tmp_path, "5:cpu:/\n4:memory:/a/b\n0::/\n", {
        "memory/memory.limit_in_bytes": UNLIMITED_V1, "memory/a/memory.limit_in_bytes": str(2 * GiB),
        "memory/a/b/memory.limit_in_bytes": str(3 * GiB)})
    m = read_memory(proc, root)
    assert m.bytes == 2 * GiB and m.source == f"memory.limit_in_bytes of {root}/memory/a"


def test_reader_v1_own_group_and_the_unlimited_value(tmp_path):
    proc, root = _fake(tmp_path, "4:memory:/a\n", {"memory/memory.limit_in_bytes": UNLIMITED_V1,
                                                    "memory/a/memory.limit_in_bytes": str(3 * GiB)})
    assert read_memory(proc, root).bytes == 3 * GiB
    proc, root = _fake(tmp_path / "u", "4:memory:/a\n", {"memory/memory.limit_in_bytes": UNLIMITED_V1,
                                                          "memory/a/memory.limit_in_bytes": UNLIMITED_V1})
    m = read_memory(proc, root)  # no limit: MemAvailable plus what this process holds
    assert m.bytes == (8 << 30) + (1 << 30) and m.source.startswith("MemAvailable of ") and "VmRSS" in m.source


def test_reader_v2_memory_max(tmp_path):
    proc, root = _fake(tmp_path, "0::/job\n", {"job/memory.max": str(GiB), "memory.max": "max"})
    m = read_memory(proc, root)
    assert m.bytes == GiB and m.source == f"memory.max of {root}/job"
    proc, root = _fake(tmp_path / "m", "0::/job\n", {"job/memory.max": "max"})
    assert read_memory(proc, root).source.startswith("MemAvailable")


def test_reader_group_not_visible_falls_back_to_the_mount_root(tmp_path):
    # a container without its own cgroup namespace: /proc/self/cgroup names the host's path, the mount is its own
    proc, root = _fake(tmp_path, "4:memory:/docker/abc\n", {"memory/memory.limit_in_bytes": str(GiB)})
    assert read_memory(proc, root).bytes == GiB


def test_reader_takes_meminfo_where_it_is_smaller_than_the_cgroup_limit(tmp_path):
    proc, root = _fake(tmp_path, "4:memory:/a\n", {"memory/a/memory.limit_in_bytes": str(64 * GiB)},
                       avail_kb=4 << 20, rss_kb=0)
    m = read_memory(proc, root)
    assert m.bytes == 4 * GiB and m.source.startswith("MemAvailable")


def test_reader_nothing_readable(tmp_path):
    assert read_memory(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_reader_on_this_machine():
    m = read_memory()
    assert m is not None and m.bytes > 0 and m.source


# ------------------------------------------------------------------------------------------------ the decision
DEFAULTS = {"dram_cache_mb": 2048, "gradient_buffer": "dram", "optimizer_dram_mb": 0, "param_tier": "nvme"}
GRADS = 3 * GiB  # the synthetic model's fp32 gradient partition


def _need(s):
    """1 GiB of everything else, the gradients unless on disk, the cache, resident sub-groups, parameters in RAM."""
    return (GiB + (0 if s["gradient_buffer"] == "disk" else GRADS) + s["dram_cache_mb"] * MiB
            + s["optimizer_dram_mb"] * MiB + (2 * GiB if s["param_tier"] == "dram" else 0))


def _have(gib):
    return Memory(int(gib * GiB), "memory.limit_in_bytes of /sys/fs/cgroup/memory/job")


def test_decide_fits_as_given():
    d = decide(_need, DEFAULTS, {}, _have(10), 0.1)
    assert d.fits and d.changes == {} and d.need == 6 * GiB and "about 6.00 GiB" in d.message


def test_decide_smaller_cache_before_the_gradients_on_disk():
    d = decide(_need, DEFAULTS, {}, _have(5), 0.1)  # 4.5 usable: 1 + 3 + 0.5 GiB of cache
    assert d.fits and d.changes == {"dram_cache_mb": 512}, d
    assert "titan.hms.dram_cache_mb=512" in d.message and "6.00 GiB" in d.message


def test_decide_fits_only_with_the_gradients_on_disk():
    s = dict(DEFAULTS, dram_cache_mb=64)
    d = decide(_need, s, {}, _have(3), 0.1)  # 2.7 usable: 4.06 as given, 1.06 with the gradients on disk
    assert d.fits and d.changes == {"gradient_buffer": "disk"} and d.need == GiB + 64 * MiB
    assert 'titan.hms.gradient_buffer="disk"' in d.message and "4.06 GiB" in d.message
    assert "3.00 GiB (memory.limit_in_bytes of /sys/fs/cgroup/memory/job" in d.message


def test_decide_both_and_the_cache_as_large_as_fits():
    d = decide(_need, DEFAULTS, {}, _have(2), 0.1)  # 1.8 usable: gradients on disk and 0.8 GiB of cache
    assert d.fits and d.changes == {"dram_cache_mb": int(0.8 * 1024), "gradient_buffer": "disk"}, d


def test_decide_does_not_fit_at_all():
    d = decide(_need, DEFAULTS, {}, _have(1), 0.1)
    assert not d.fits and d.changes == {}
    for part in ("needs about 6.00 GiB", "has 1.00 GiB (memory.limit_in_bytes of /sys/fs/cgroup/memory/job",
                 "0.90 GiB of it usable", "no titan.hms setting makes it fit", "the least is about 1.06 GiB",
                 "titan-ds plan"):
        assert part in d.message, (part, d.message)


def test_decide_never_overrides_an_explicit_setting():
    s = dict(DEFAULTS, dram_cache_mb=64)
    d = decide(_need, s, {"gradient_buffer": "you set titan.hms.gradient_buffer"}, _have(3), 0.1)
    assert not d.fits and d.changes == {}
    assert 'set titan.hms.gradient_buffer="disk" (about 1.06 GiB) (you set titan.hms.gradient_buffer)' in d.message
    assert "needs about 4.06 GiB" in d.message and "has 3.00 GiB" in d.message
    # an explicit cache is not shrunk either: the gradients go to disk instead
    d = decide(_need, DEFAULTS, {"dram_cache_mb": "you set it"}, _have(5), 0.1)
    assert d.fits and d.changes == {"gradient_buffer": "disk"}


def test_decide_names_settings_it_never_changes():
    s = dict(DEFAULTS, dram_cache_mb=64, param_tier="dram", gradient_buffer="disk")
    fixed = {k: f"you set titan.hms.{k}" for k in ("param_tier", "gradient_buffer", "dram_cache_mb")}
    d = decide(_need, s, fixed, _have(3), 0.1)  # 3.06 as given; param_tier "nvme" gives 1.06
    assert not d.fits and 'titan.hms.param_tier="nvme"' in d.message and "(you set titan.hms.param_tier)" in d.message


# ------------------------------------------------------------------------------------------------ the estimate
def test_estimate_is_plans_prediction():
    from titan_ds.plan import HMSLayout, model_spec, predict
    m = model_spec("gpt:16x768")
    for mode, settings in (("hms", dict(DEFAULTS, dram_cache_mb=64)),
                           ("hms_gdisk", dict(DEFAULTS, dram_cache_mb=64, gradient_buffer="disk")),
                           ("hms_dram", dict(DEFAULTS, dram_cache_mb=64, param_tier="dram"))):
        t = TitanConfig.from_ds_config({"titan": {"hms": {"nvme_path": "/x", **settings}}})
        got = budget.estimate(params=m.params, largest=m.largest, settings=settings, titan=t, zero={}, half=False,
                              gpu=False)
        c = predict(mode, m)
        assert predict(mode, m, layout=HMSLayout.of_mode(mode)).dram == c.dram
        assert c.dram.pop("activations") > 0  # the batch's: not known to initialize
        assert got == pytest.approx(c.dram_peak, rel=1e-12), mode
    t = TitanConfig.from_ds_config({"titan": {"hms": {"nvme_path": "/x"}}})
    kw = dict(params=m.params, largest=m.largest, titan=t, half=False, gpu=False)
    base = budget.estimate(settings=DEFAULTS, zero={}, **kw)
    # the user's ZeRO-3 bounds count: a sub-group 10x larger holds 10x the step's working set
    assert budget.estimate(settings=DEFAULTS, zero={"sub_group_size": 100_000_000}, **kw) > base + GiB
    assert budget.estimate(settings=dict(DEFAULTS, gradient_buffer="disk"), zero={}, **kw) == \
        pytest.approx(base - 4 * m.params)
    assert budget.estimate(settings=dict(DEFAULTS, optimizer_dram_mb=100), zero={}, **kw) == \
        pytest.approx(base + 100 * MiB)
    # on a GPU, ZeRO-3 with the optimizer offloaded keeps its fp32 gradient partition in CPU memory all the same
    gpu = dict(kw, gpu=True)
    assert budget.estimate(settings=DEFAULTS, zero={}, **gpu) == pytest.approx(
        budget.estimate(settings=dict(DEFAULTS, gradient_buffer="disk"), zero={}, **gpu) + 4 * m.params)


def test_estimate_counts_titan_balanceds_second_moment_as_plans_hms_balanced():
    """titan_balanced's section (8-bit momentum and a 4-bit per-coordinate second moment) is estimated as plan's
    hms_balanced candidate, not as the 8-bit momentum alone; a pairing plan has not measured counts as AdamW."""
    import json
    from titan_ds.plan import candidate_config, model_spec, predict
    m = model_spec("gpt:16x768")
    cfg = candidate_config("hms_balanced", nvme_path="/x")
    t = TitanConfig.from_ds_config(cfg)
    settings = dict(DEFAULTS, dram_cache_mb=64, gradient_buffer="disk")
    kw = dict(params=m.params, largest=m.largest, settings=settings, zero={}, half=False, gpu=False)
    c = predict("hms_balanced", m)
    c.dram.pop("activations")
    assert budget.estimate(titan=t, **kw) == pytest.approx(c.dram_peak, rel=1e-12)
    momentum_only = json.loads(json.dumps(cfg))
    momentum_only["titan"]["optimizer"].update(second_moment="unit")
    assert budget.estimate(titan=t, **kw) > budget.estimate(titan=TitanConfig.from_ds_config(momentum_only), **kw)
    other = json.loads(json.dumps(cfg))
    other["titan"]["optimizer"].update(second_dtype="bf16")
    assert budget._optimizer_key(TitanConfig.from_ds_config(other)) == "adamw"


# ------------------------------------------------------------------------------------------------ the pillar
def _validate(monkeypatch, hms: dict, have_gib: float, model):
    from titan_ds.hms.install import HMSPillar
    from titan_ds.pillar import View
    monkeypatch.setattr(budget, "read_memory", lambda: _have(have_gib))
    ds = {"train_micro_batch_size_per_gpu": 1, "titan": {"hms": hms}}
    titan = TitanConfig.from_ds_config(ds)
    pillar = HMSPillar(titan)
    return pillar, pillar.validate(View.of(titan, {k: v for k, v in ds.items() if k != "titan"}, model))


def test_pillar_picks_the_disk_buffer_and_keeps_the_explicit(monkeypatch, tmp_path):
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(32)])  # 134M
    hms = {"nvme_path": str(tmp_path), "dram_cache_mb": 64}
    pillar, problems = _validate(monkeypatch, hms, 1.5, model)
    assert problems == [] and pillar.decision.changes == {"gradient_buffer": "disk"}, pillar.decision
    pillar, problems = _validate(monkeypatch, dict(hms, gradient_buffer="dram"), 1.5, model)
    assert len(problems) == 1 and "you set titan.hms.gradient_buffer" in problems[0], problems
    assert 'titan.hms.gradient_buffer="disk"' in problems[0] and "has 1.50 GiB" in problems[0]
    pillar, problems = _validate(monkeypatch, hms, 64, model)
    assert problems == [] and pillar.decision.fits and pillar.decision.changes == {}


# ------------------------------------------------------------------------------------------------ a capped run
@pytest.mark.slow
def test_capped_run_picks_the_disk_buffer_and_trains_or_refuses_what_the_user_set(tmp_path):
    """A 114M-parameter GPT built under titan_ds.zero_init with a new user's titan.hms section under a 1.3 GiB
    cap: as configured HMS would hold its 0.42 GiB fp32 gradient partition in RAM (1.41 GiB estimated, 1.17
    usable); it picks gradient_buffer "disk", says so, and trains 2 steps instead of being OOM-killed. With
    gradient_buffer "dram" written by the user, initialize refuses, naming the setting, instead."""
    from titan_ds.memcap import cgroup_available, run_capped
    if not cgroup_available():
        pytest.skip("needs root and a cgroup v1 memory controller")

    def run(name, **hms):
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
               "steps_per_print": 10**9, "zero_optimization": {"stage": 3},
               "titan": {"hms": {"nvme_path": str(tmp_path / name), "dram_cache_mb": 64, "prefetch": "trace",
                                 **hms}}}
        path, summary, err = (tmp_path / f"{name}.{x}" for x in ("cfg.json", "summary.json", "stderr.txt"))
        path.write_text(json.dumps(cfg))
        cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--deepspeed_config", str(path), "--steps", "2",
               "--layers", "16", "--width", "768", "--heads", "12", "--context", "128", "--micro-batch", "1",
               "--val-batches", "1", "--warmup", "1", "--no-progress", "--zero-init", "--summary-out", str(summary)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
        with open(err, "w") as f:
            r = run_capped(cmd, int(1.3 * GiB), env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=f,
                           timeout=600)
        return r, err.read_text(), (json.loads(summary.read_text()) if summary.exists() else None)

    r, text, summary = run("auto")
    assert r.ok, (r, text[-3000:])
    assert 'set titan.hms.gradient_buffer="disk"' in text and "memory.limit_in_bytes of" in text, text[-3000:]
    assert math.isfinite(summary["val_loss"])
    r, text, summary = run("explicit", gradient_buffer="dram")
    assert r.returncode not in (0, None) and not r.oom_killed and summary is None, (r, text[-3000:])
    assert "TitanConfigError" in text and "you set titan.hms.gradient_buffer" in text, text[-3000:]
    assert 'set titan.hms.gradient_buffer="disk"' in text and "memory.limit_in_bytes of" in text, text[-3000:]
