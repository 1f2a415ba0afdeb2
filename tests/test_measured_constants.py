"""Constants copied from a measurement stay equal to it: plan.py's STEP_TEMP_BYTES and results/step_temp.md (made
by `python -m launch.bench step-temp --numel 67108864 --out results/step_temp.md`; issue 31)."""
from __future__ import annotations

from launch.bench.__main__ import ROOT, table_rows
from titan_ds.plan import STEP_TEMP_BYTES


def test_step_temp_bytes_are_the_measured_ones_rounded_to_whole_bytes():
    measured = {r["optimizer"]: float(r["bytes/element above the resident state"])
                for r in table_rows(ROOT / "results" / "step_temp.md")}
    for name, value in STEP_TEMP_BYTES.items():
        assert name in measured, f"{name} has no row in results/step_temp.md"
        assert value == round(measured[name]), (name, value, measured[name])
