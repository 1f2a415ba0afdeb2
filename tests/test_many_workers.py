"""launch/bench/many_workers.py: each method's best row at >= min_x against the best dense of its (steps, W, seed)."""
from launch.bench.many_workers import best


def row(family, val, x, world=8, lr=1e-3, steps=200, seed=0, setting="s"):
    return {"source": "t", "family": family, "setting": setting, "world": world, "steps": steps, "seed": seed,
            "lr": lr, "val_loss": val, "x_recv": x, "recv_mib": 1.0}


def test_best_takes_the_lowest_dense_and_each_methods_best_row_that_receives_little_enough():
    rows = [row("dense", 2.2, 1.0, lr=1e-3), row("dense", 2.1, 1.0, lr=3e-3),
            row("top-k", 2.3, 100.0, lr=1e-3), row("top-k", 2.25, 100.0, lr=3e-3),
            row("top-k", 2.0, 25.0),  # receives too much: not the 100x point
            row("DiLoCo (uncompressed outer)", 2.4, 20.0),  # uncompressed: kept at what it receives
            row("dense", 1.5, 1.0, world=32), row("HGE", 3.0, 100.0, world=32)]
    out = {(r["world"], r["label"]): r for r in best(rows, 90.0)}
    assert out[8, "dense"]["val_loss"] == 2.1 and out[8, "dense"]["delta"] == 0.0
    assert abs(out[8, "top-k"]["delta"] - 0.15) < 1e-12 and out[8, "top-k"]["lr"] == 3e-3
    assert abs(out[8, "DiLoCo (uncompressed outer) @20x"]["delta"] - 0.3) < 1e-12
    assert abs(out[32, "HGE"]["delta"] - 1.5) < 1e-12
    assert len(out) == 5


def test_wall_clock_model_is_compute_plus_received_bytes_over_the_link():
    from launch.bench.many_workers import compute_by_world, render, step_seconds
    rows = [dict(row("dense", 2.1, 1.0), compute_s=0.03), dict(row("dense", 2.2, 1.0), compute_s=0.05),
            dict(row("dense", 2.0, 1.0, world=32), compute_s=None)]
    assert compute_by_world(rows) == {8: 0.04}  # the median of the rows that measured it; W=32 has none
    r = dict(row("top-k", 2.3, 100.0), recv_mib=200.0)  # 200 MiB over 200 steps: 1 MiB a step
    assert abs(step_seconds(r, 0.04, 1e9 / 8) - (0.04 + 2**20 / (1e9 / 8))) < 1e-12
    md = render([dict(r, delta=0.2, label="top-k")], 90.0, {8: 0.04})
    assert "| 48.4 | 40.8 |" in md  # 40 ms + 8.4 ms at 1 Gbit/s, + 0.84 ms at 10 Gbit/s
