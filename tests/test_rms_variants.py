"""`launch/bench/rms_variants.py` (issue 30's uncompressed preconditioning probe): every variant trains, and with
one worker the mean-gradient estimates reduce to the worker's own RMS (the docstring's algebra)."""
from __future__ import annotations

import math

import pytest

from launch.bench.rms_variants import VARIANTS, render, train


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_trains_two_workers(variant):
    row = train(variant, 3e-3, world=2, steps=3, seed=0, beta1=0.9, post_momentum=0.9)
    assert math.isfinite(row["val_loss"]) and row["variant"] == variant


def test_one_worker_mean_estimate_is_the_workers_own_rms():
    rms = train("rms", 3e-3, world=1, steps=4, seed=0, beta1=0.9, post_momentum=0.9)["val_loss"]
    for v in ("ncd", "oracle"):  # W = 1: (1 - 1/W) m^2 + g^2 / W = g^2; the mean gradient is the worker's own
        assert train(v, 3e-3, world=1, steps=4, seed=0, beta1=0.9, post_momentum=0.9)["val_loss"] == \
            pytest.approx(rms, abs=1e-5), v
    table = render([{"variant": "dense", "post_momentum": 0.0, "lr": 3e-3, "world": 1, "steps": 4, "seed": 0,
                     "val_loss": 3.0, "seconds": 1.0},
                    {"variant": "rms", "post_momentum": 0.9, "lr": 3e-3, "world": 1, "steps": 4, "seed": 0,
                     "val_loss": rms, "seconds": 1.0}], "cmd")
    assert f"| rms | 1 | 4 | 0.9 | 0.003 | 0 | {rms:.4f} | {rms - 3.0:+.4f} |" in table
