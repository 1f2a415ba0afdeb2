"""`launch/bench/rms_variants.py` (the preconditioning probe): every variant trains, uncompressed and
compressed; with one worker the mean-gradient estimates reduce to the worker's own RMS (the docstring's algebra),
compressed too (the clamp to [v / W, v] is v at W = 1)."""
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
    assert f"| rms | 1 | 4 | 0.9 | - | 0.003 | 0 | {rms:.4f} | {rms - 3.0:+.4f} |" in table


def test_compressed_one_worker_sketch_is_rms_and_sharded_rows_render():
    kw = dict(world=1, steps=4, seed=0, beta1=0.9, post_momentum=0.0, ratio=100.0, bits=2, chunk=256,
              exchange="sharded")
    rms = train("rms", 3e-3, **kw)
    osk = train("osk", 3e-3, **kw, clamp=True, all_scalar=True)
    assert osk["val_loss"] == pytest.approx(rms["val_loss"], abs=1e-5)
    assert rms["k_chunk"] >= 1 and rms["k2"] >= 1 and math.isfinite(rms["val_loss"])
    table = render([{**osk, "gather_share": 0.6}], "cmd")
    assert "| osk (every 1, s=1, clamped, all scalar) | 1 | 4 | 0 | 100 (value, 2-bit, chunk 256, sharded, share 0.6) |" \
        in table
    two = train("osk", 3e-3, world=2, steps=3, seed=0, beta1=0.9, post_momentum=0.0, ratio=100.0, bits=2, chunk=256,
                clamp=True, all_scalar=True)
    assert math.isfinite(two["val_loss"]) and two["stat_floats"] == 29
