"""titan_ds.bench.compare: per-row arguments reach only their row; the table is written from the summaries."""
from titan_ds import bench


def test_compare_passes_row_args_to_their_row_only(tmp_path, monkeypatch):
    calls = []

    def fake_run_row(name, cfg, *, steps, num_ranks, extra_args, workdir, timeout, log_dir):
        calls.append((name, list(extra_args)))
        lr = float(extra_args[extra_args.index("--lr") + 1]) if "--lr" in extra_args else 1e-3
        return {"name": name, "status": "ok", "val_loss": 2.0 + lr, "tokens_per_s": 100.0, "memory": {},
                "titan_metrics": {}, "model": {}, "micro_batch": 16}

    monkeypatch.setattr(bench, "run_row", fake_run_row)
    rows = [("base", {}), ("base_lr3e-3", {}, ["--lr", "3e-3"])]
    out = bench.compare(rows, steps=3, out=tmp_path / "t", extra_args=["--val-batches", "2"], command="cmd")
    assert calls == [("base", ["--val-batches", "2"]), ("base_lr3e-3", ["--val-batches", "2", "--lr", "3e-3"])]
    assert [r["name"] for r in out] == ["base", "base_lr3e-3"]
    md = (tmp_path / "t.md").read_text()
    assert "| base_lr3e-3 | 2.003 | +0.002 |" in md
