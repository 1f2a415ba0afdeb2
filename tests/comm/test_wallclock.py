"""The time model of launch/bench/wallclock.py: its step formula by hand, the table and plot from synthetic rows,
the codec measurement on a small gradient."""
from __future__ import annotations

import importlib.util

import pytest

from tests.helpers.launch import ROOT

_spec = importlib.util.spec_from_file_location("wallclock", ROOT / "launch" / "bench" / "wallclock.py")
wc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wc)


def _row(family, world, seed, loss, **kw):
    base = {"family": family, "world": world, "seed": seed, "lr": 3e-3, "steps": 100, "val_loss": loss,
            "curve": [[50, loss + 0.5], [100, loss]], "compute_per_worker_step": 0.01, "codec_per_worker_step": 0.002,
            "rounds_per_worker_step": 14.0, "recv_step": 1e6, "x_recv": 1.0, "params": 1000, "sync_every": 1}
    return {**base, **kw}


def test_step_is_compute_codec_latency_and_bytes_over_bandwidth():
    r = _row("x", 8, 0, 2.0)
    assert wc.step_seconds(r, 1e9 / 8, alpha=50e-6) == pytest.approx(0.01 + 0.002 + 14 * 50e-6 + 1e6 * 8 / 1e9)
    # a model 10x larger: bytes and codec x10, compute as given, latency unchanged
    assert wc.step_seconds(r, 1e9 / 8, alpha=50e-6, scale=10, compute=0.5) == pytest.approx(
        0.5 + 0.02 + 14 * 50e-6 + 1e7 * 8 / 1e9)


def test_table_picks_each_methods_best_lr_over_its_seeds_and_projects(tmp_path):
    dense = wc._family("none", {})
    rec = wc._family(wc.RECOMMENDED, {})
    rows = [_row(dense, 8, s, 2.0 + 0.01 * s) for s in (2, 3)]
    rows += [_row(dense, 8, s, 2.5, lr=1e-2) for s in (2, 3)]  # a worse lr: not the row shown
    rows += [_row(rec, 8, s, 2.05, recv_step=1e4, x_recv=100.0, rounds_per_worker_step=28.0) for s in (2, 3)]
    md = wc.render(rows, "cmd", project_params=1e6, project_compute=0.5,
                   codec={"n": 1000, "world": 8, "steps": 3, "seconds": {dense: 1e-4, rec: 1e-3}})
    assert "| 8 | dense DDP (AdamW, all-reduce) | 0.003 | 2,3 | 2.0250 (0.0100) |" in md
    assert "| 8 | compress_rms_sketch.json (shipped) | 0.003 | 2,3 | 2.0500 (0.0000) | 100.0 |" in md
    # projected (no codec: dense has none, the method's left out): compute + rounds x alpha + bytes x 1000 / bw
    t_dense = 0.5 + 14 * 50e-6 + 1000 * 1e6 * 8 / 10e9
    t_rec = 0.5 + 28 * 50e-6 + 1000 * 1e4 * 8 / 10e9
    proj = md.split("Projected")[1]
    assert f"| {t_rec / t_dense:.3f} |" in proj
    t_rec_cpu = t_rec + 1e-3 / 1000 * 1e6  # with the codec at its measured per-element rate
    assert f"| {t_rec_cpu:.2f} |" in proj
    assert wc.plot(rows, tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 1000


def test_codec_seconds_measures_a_workers_encode_decode():
    dense = wc.codec_seconds("none", 1 << 14, 2, steps=1, piece=1 << 12)
    sketch = wc.codec_seconds(wc.RECOMMENDED, 1 << 14, 2, steps=1, piece=1 << 12)
    assert 0 < dense < 1 and 0 < sketch < 5
