"""Constants taken from a measurement stay equal to it: titan_ds/step_temp.json (the optimizer step's temporaries
``titan-ds plan`` charges, package data) holds exactly the figures of results/optim_step.jsonl, so a hand edit of
either fails (written by ``python launch/bench/optim_step.py ... --step-temp-json titan_ds/step_temp.json``; the
command is in the file)."""
from __future__ import annotations

import json
import sys

import pytest

from launch.bench.__main__ import ROOT
from titan_ds.plan import MODE_OPTIMIZER, STEP_TEMP_FILE, load_step_temp


def _optim_step():
    import importlib.util
    spec = importlib.util.spec_from_file_location("optim_step", ROOT / "launch" / "bench" / "optim_step.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("optim_step", mod)  # dataclasses look their module up while the module runs
    spec.loader.exec_module(mod)
    return mod


def test_step_temp_json_holds_the_measured_temporaries_of_results_optim_step():
    data = json.loads(STEP_TEMP_FILE.read_text())
    bench = _optim_step()
    assert data["rows"] == bench.PLAN_ROWS  # each plan key is the row the benchmark measures for it
    records = [json.loads(x) for x in (ROOT / "results" / "optim_step.jsonl").read_text().splitlines() if x.strip()]
    for key, row in data["rows"].items():
        measured = [r for r in records if r["kind"] == "temp" and r["row"] == row and r["dtype"] == "fp32"
                    and r["numel"] == data["numel"] and r["threads"] == data["threads"] and r["status"] == "ok"]
        assert measured, f"results/optim_step.jsonl has no fp32 temporaries of {row} at {data['numel']} elements"
        assert data["bytes_per_element"][key] == measured[-1]["temp_bytes_per_element"], key
    assert data["numel"] == 1 << 26 and data["dtype"] == "fp32"
    assert "--step-temp-json" in data["written_by"] and data["git_sha"] and data["command"]


def test_plan_charges_the_file_and_every_mode_has_a_figure():
    assert set(MODE_OPTIMIZER.values()) <= set(load_step_temp())
    assert load_step_temp() == json.loads(STEP_TEMP_FILE.read_text())["bytes_per_element"]


@pytest.mark.parametrize("text, match", [(None, "is missing: regenerate it: python launch/bench/optim_step.py"),
                                         ("{", "malformed"), ('{"bytes": {}}', "malformed"),
                                         ('{"bytes_per_element": {"adamw": 8}}', "no figure for asdt_8bit"),
                                         ('{"bytes_per_element": {"adamw": "x"}}', "malformed")])
def test_a_missing_or_malformed_file_is_refused_naming_the_command(tmp_path, text, match):
    path = tmp_path / "step_temp.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises((FileNotFoundError, ValueError), match=match):
        load_step_temp(path)
