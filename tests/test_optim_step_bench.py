"""launch/bench/optim_step.py: a tiny real run (3 rows, speed and temporaries) writes its table, jsonl and plot, and
a rerun measures nothing again; the state count against ASDT's own; plan's file from the records."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("optim_step", ROOT / "launch" / "bench" / "optim_step.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["optim_step"] = bench  # dataclasses look their module up while the module runs
_spec.loader.exec_module(bench)

ROWS = "adamw,asdt_sign_bf16,titan_balanced"


def test_tiny_run_writes_table_jsonl_plot_and_a_rerun_measures_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # main sets it (and torch's threads: reset below) to --threads
    out = tmp_path / "os"
    argv = ["--sizes", "16384", "--dtypes", "fp32", "--rows", ROWS, "--repeats", "2", "--steps", "2", "--out", str(out)]
    records = bench.main(argv)
    assert sorted((r["kind"], r["row"]) for r in records) == sorted(
        (k, r) for k in ("speed", "temp") for r in ROWS.split(","))
    assert all(r["status"] == "ok" and r["numel"] == 16384 and r["threads"] == 1 for r in records), records
    speed = {r["row"]: r for r in records if r["kind"] == "speed"}
    assert all(len(r["seconds"]) == 2 and r["elements_per_s"] == 16384 / r["seconds_median"] for r in speed.values())
    assert speed["adamw"]["state_bytes_per_element"] == pytest.approx(8.0, abs=0.01)  # exp_avg + exp_avg_sq
    assert all(r["temp_bytes_per_element"] >= 0 for r in records if r["kind"] == "temp")
    md = out.with_suffix(".md").read_text()
    assert "| optimizer | dtype | M/s 2^14 | x torchao 2^14 | x DS 2^14 | temp B/el 2^14 | state B/el 2^14 |" in md
    assert md.count("| fp32 |") == 3 and "Command: `python launch/bench/optim_step.py --sizes 16384" in md
    assert "#### bf16" not in md
    assert out.with_suffix(".png").stat().st_size > 10_000
    first = out.with_suffix(".jsonl").read_text()

    def measured(*a, **k):
        raise AssertionError("a finished case was measured again")

    monkeypatch.setattr(bench, "time_steps", measured)
    monkeypatch.setattr(bench, "run_temp_case", measured)
    again = bench.main(argv)
    assert out.with_suffix(".jsonl").read_text() == first and len(again) == len(records)
    with pytest.raises(AssertionError, match="measured again"):  # other settings are another case
        bench.main(argv + ["--threads", "2", "--what", "temp"])
    torch.set_num_threads(1)


def test_state_bytes_counts_each_storage_once_as_asdt_does():
    from titan_ds.optim.asdt import ASDT
    m = bench._model(8192, "fp32")
    opt = ASDT([m.w], lr=1e-3, update="adaptive", second_moment="coordinate", state_dtype="8bit", second_dtype="4bit")
    opt.step()
    assert bench.state_bytes(opt) == opt.state_bytes() > 0  # ASDT's own count is the oracle


def test_a_failing_row_is_recorded_with_its_error_and_shown_failed(tmp_path, monkeypatch):
    def broken(model, dtype):
        raise RuntimeError("cannot build")
    monkeypatch.setitem(bench.ROWS, "adamw", bench.Row(broken, "broken"))
    out = tmp_path / "os"
    [rec] = bench.main(["--sizes", "1024", "--dtypes", "fp32", "--rows", "adamw", "--what", "speed", "--repeats", "1",
                        "--out", str(out)])
    assert rec["status"] == "failed" and "RuntimeError: cannot build" in rec["error"]
    assert "| adamw | fp32 | failed |" in out.with_suffix(".md").read_text()


def _temp(row, numel, value):
    return {"kind": "temp", "row": row, "dtype": "fp32", "numel": numel, "threads": 1, "status": "ok",
            "temp_bytes_per_element": value, "command": "cmd", "git_sha": "abc"}


def test_plan_file_takes_the_largest_size_measured_for_every_plan_row(tmp_path):
    rows = list(bench.PLAN_ROWS.values())
    recs = [_temp(r, 1 << 20, 1.0 + i) for i, r in enumerate(rows)] + [_temp(rows[0], 1 << 24, 99.0)]
    data = bench.write_step_temp(tmp_path / "st.json", recs, 1, "python optim_step.py --step-temp-json st.json")
    assert data["numel"] == 1 << 20  # 2^24 lacks the other rows
    assert data["bytes_per_element"] == {k: 1.0 + rows.index(r) for k, r in bench.PLAN_ROWS.items()}
    assert json.loads((tmp_path / "st.json").read_text()) == data
    with pytest.raises(SystemExit, match="--what temp --dtypes fp32 --rows"):
        bench.write_step_temp(tmp_path / "st.json", recs[1:], 1, "cmd")


def test_bad_arguments_are_refused_naming_the_choices():
    with pytest.raises(SystemExit):
        bench.parse_args(["--rows", "adamw,nope"])
    with pytest.raises(SystemExit, match="multiple of 1024"):
        bench._model(1000, "fp32")
    assert bench.label(1 << 26) == "2^26"
