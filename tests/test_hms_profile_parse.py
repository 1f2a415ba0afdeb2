"""launch/experiments/hms_profile.py reads py-spy's raw stacks: both py-spy 0.4.2's bare frame names and 0.4.3's
qualified ones (``DeepSpeedEngine.forward``) land in the same thread roles, work labels and functions."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("hms_profile", ROOT / "launch" / "experiments" / "hms_profile.py")
prof = importlib.util.module_from_spec(_spec)
sys.modules["hms_profile"] = prof
_spec.loader.exec_module(prof)

ENGINE = "DeepSpeedEngine.{} (deepspeed/runtime/engine.py:1)"
STACKS = [  # (thread, frames, samples) as py-spy 0.4.3 writes them
    ("MainThread", ["<module> (launch/train.py:1)", ENGINE.format("forward"),
                    "LinearFunctionForZeroStage3.forward (deepspeed/runtime/zero/linear.py:50)"], 40),
    ("MainThread", ["<module> (launch/train.py:1)", ENGINE.format("backward"),
                    "LinearFunctionForZeroStage3.backward (deepspeed/runtime/zero/linear.py:80)"], 60),
    ("MainThread", ["<module> (launch/train.py:1)", ENGINE.format("step"),
                    "DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads (deepspeed/runtime/zero/stage3.py:2988)"], 30),
    ("MainThread", ["<module> (launch/train.py:1)", ENGINE.format("step"), "ASDT.step (titan_ds/optim/asdt.py:1)",
                    "step (titan_ds/optim/core_cpu.py:100)"], 20),
    ("MainThread", ["<module> (launch/train.py:1)", "build (launch/train.py:9)"], 10),  # not in a step
    ("titan-hms-io_0", ["_Worker.<locals>.chunk (titan_ds/hms/io.py:10)"], 50),
]


def _collapsed(tmp_path, qualified: bool):
    lines = []
    for thread, frames, n in STACKS:
        if not qualified:
            frames = [prof._QUALIFIER.sub("", f) for f in frames]
        lines.append(f"thread (1): {thread};" + ";".join(frames) + f" {n}")
    p = tmp_path / f"q{int(qualified)}.collapsed.txt"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize("qualified", [False, True])
def test_roles_labels_and_functions_whatever_py_spy_names_the_frames(tmp_path, qualified):
    samples = prof.parse(_collapsed(tmp_path, qualified))
    by_role, by_label = prof.summarize(samples, rate=10)
    assert by_role == {"main (steps)": 15.0, "main (init/other)": 1.0, "io workers": 5.0}
    assert by_label["main (steps)"]["forward"] == 4.0
    assert by_label["io workers"] == {"pwritev/preadv (syscall)": 5.0}
    fn = prof.by_function(samples, rate=10)
    assert fn == {"backward matmuls (zero/linear.py)": 6.0, "forward matmuls (zero/linear.py)": 4.0,
                  "ZeRO-3 unscale_and_clip_grads (the sub-group's gradient scaled in place)": 3.0,
                  "titan optimizer kernel (core_cpu)": 2.0}
