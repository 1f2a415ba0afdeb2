"""launch/bench/hf_speed.py (suite hf-speed): the phase clock, the summary, and (slow) one tiny-model run of each
mode, resumable, its table regenerated from the store."""
import json
import os
import subprocess
import sys
import time

import pytest

from launch.bench.__main__ import ROOT, SUITES, TABLES
from launch.bench import hf_speed


def test_clock_counts_nested_phases_once_and_only_while_on():
    clock = hf_speed._Clock()
    with clock.phase("forward"):
        time.sleep(0.02)
    assert clock.total == {}  # off: nothing counted
    clock.on = True
    with clock.phase("backward"):
        time.sleep(0.03)
        with clock.phase("optimizer"):  # titan's updates in the gradient hooks: not backward time
            time.sleep(0.05)
    assert clock.total["optimizer"] == pytest.approx(0.05, abs=0.02)
    assert clock.total["backward"] == pytest.approx(0.03, abs=0.02)


def _rec(row, rep, tps, ms=None):
    res = {"tokens_per_s": tps, "tokens_per_step": 64, "step_ms_median": 64e3 / tps}
    if ms is not None:
        res.update(ms=ms, step_ms=sum(ms.values()))
    return {"row": row, "config": {"row": row, "repeat": rep}, "result": res}


def test_summary_is_the_median_of_repeats_with_min_max_and_the_ratio_of_medians():
    recs = [_rec("titan_asdt_8bit", r, t) for r, t in enumerate((5.0, 9.0, 6.0))]
    recs += [_rec("plain", r, t) for r, t in enumerate((10.0, 12.0, 30.0))]
    rows = {t["row"]: t for t in hf_speed.summarise(recs)}
    assert [t["row"] for t in hf_speed.summarise(recs)] == ["plain", "titan_asdt_8bit"]  # ROWS order
    assert rows["plain"]["tokens_per_s"] == 12.0 and (rows["plain"]["min"], rows["plain"]["max"]) == (10.0, 30.0)
    assert rows["titan_asdt_8bit"]["vs_plain"] == pytest.approx(6.0 / 12.0)


def test_suite_is_listed_with_its_tables():
    assert SUITES["hf-speed"][0] == "launch/bench/hf_speed.py"
    assert TABLES["hf-speed"][0] == "launch.bench.hf_speed"


@pytest.mark.slow
def test_tiny_model_profile_is_resumable_and_its_table_regenerates(tmp_path):
    out = tmp_path / "s"
    cmd = [sys.executable, str(ROOT / "launch" / "bench" / "hf_speed.py"), "--what", "profile", "--model",
           "tiny-llama", "--rows", "plain,titan_asdt_8bit", "--steps", "2", "--warmup", "1", "--repeats", "1",
           "--seq", "32", "--out", str(out)]
    env = {**os.environ, "TITAN_CACHE": os.environ.get("TITAN_CACHE", str(ROOT / ".cache"))}
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, timeout=600, capture_output=True)
    recs = [json.loads(x) for x in out.with_suffix(".jsonl").read_text().splitlines()]
    assert [r["row"] for r in recs] == ["plain", "titan_asdt_8bit"]
    plain, titan = (r["result"] for r in recs)
    assert titan["titan"] == ["mlme", "optimizer"] and plain["titan"] == []
    for r in (plain, titan):
        assert r["timed_steps"] == 2 and r["tokens_per_step"] == 64 and r["tokens_per_s"] > 0
        assert all(r["ms"][p] > 0 for p in ("forward", "loss", "backward", "optimizer"))
        assert r["ms"]["rest"] > -0.05 * r["step_ms"]  # the phases do not overlap (nor count the eval after)
    md = out.with_suffix(".md").read_text()
    again = subprocess.run(cmd, check=True, cwd=ROOT, env=env, timeout=600, capture_output=True, text=True)
    assert "INFO row " not in again.stderr  # nothing ran again
    out.with_suffix(".md").write_text(md.split("| row |")[0])
    hf_speed.table(str(out.with_suffix(".md")))
    assert out.with_suffix(".md").read_text() == md
