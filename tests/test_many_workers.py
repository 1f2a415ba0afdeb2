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
