"""launch/bench/harness.py compare: per-row arguments reach only their row; the table is written from the summaries."""
import json

from launch.bench import harness


def test_compare_passes_row_args_to_their_row_only(tmp_path, monkeypatch):
    calls = []

    def fake_run_row(name, cfg, *, steps, num_ranks, extra_args, workdir, timeout, log_dir):
        calls.append((name, list(extra_args)))
        lr = float(extra_args[extra_args.index("--lr") + 1]) if "--lr" in extra_args else 1e-3
        return {"name": name, "status": "ok", "val_loss": 2.0 + lr, "tokens_per_s": 100.0, "memory": {},
                "titan_metrics": {}, "model": {}, "micro_batch": 16}

    monkeypatch.setattr(harness, "run_row", fake_run_row)
    rows = [("base", {}), ("base_lr3e-3", {}, ["--lr", "3e-3"])]
    out = harness.compare(rows, steps=3, out=tmp_path / "t", extra_args=["--val-batches", "2"], command="cmd")
    assert calls == [("base", ["--val-batches", "2"]), ("base_lr3e-3", ["--val-batches", "2", "--lr", "3e-3"])]
    assert [r["name"] for r in out] == ["base", "base_lr3e-3"]
    md = (tmp_path / "t.md").read_text()
    assert "| base_lr3e-3 | 2.003 | +0.002 |" in md


def test_bench_compress_rows_validate_and_give_dgc_its_beta1():
    """launch/bench/bench_compress.py: powersgd at each rank, ``name@ratio`` overrides --ratios, the DGC row is topk
    with the DGC keys and AdamW beta1 0; every row's titan section passes the strict config."""
    import argparse
    import importlib.util

    from titan_ds.config import TitanConfig
    spec = importlib.util.spec_from_file_location("bench_compress", harness.ROOT / "launch/bench/bench_compress.py")
    bc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bc)
    p = argparse.ArgumentParser()
    harness.add_dgc_args(p)
    a = p.parse_args(["--dgc-ramp-steps", "100", "--dgc-ramp-start", "4", "--dgc-clip", "0.7"])
    rows = bc.rows(["powersgd", "dgc@300", "topk@120", "hge"], [100.0], 0, 2, [1, 4], a)
    assert [r[0] for r in rows] == ["dense_allreduce", "powersgd_r1", "powersgd_r4", "hge_100x", "topk_120x",
                                    "dgc_300x"]
    dgc = rows[-1]
    assert dgc[2] == ["--beta1", "0.0"] and dgc[1]["titan"]["compression"] == {
        "method": "topk", "ratio": 300.0, "error_feedback": True, "warmup_steps": 0, "momentum": 0.9,
        "momentum_masking": True, "local_clip": 0.7, "ratio_warmup_steps": 100, "ratio_warmup_start": 4.0}
    for r in rows[1:]:
        assert TitanConfig.from_ds_config(r[1]).compression is not None, r[0]
        assert r[1]["zero_optimization"] == {"stage": 2}
    a.rms_lr = "1e-3"
    (name, cfg, args), = bc.rows(["rms_sketch"], [50.0], 0, 0, [1], a)[1:]
    shipped = json.loads((harness.ROOT / "ds_configs/compress_rms_sketch.json").read_text())["titan"]["compression"]
    assert name == "rms_sketch_50x" and args == ["--lr", "1e-3"] and cfg["gradient_clipping"] == 0.0
    assert cfg["titan"]["compression"] == {**shipped, "ratio": 50.0}  # the shipped section at the row's ratio
    assert TitanConfig.from_ds_config(cfg).compression.precondition == "rms_sketch"


def test_compare_resume_reuses_finished_rows_and_reruns_failed_or_changed_ones(tmp_path, monkeypatch):
    calls = []

    def fake_run_row(name, cfg, *, steps, num_ranks, extra_args, workdir, timeout, log_dir):
        calls.append(name)
        ok = not (name == "b" and calls.count("b") == 1)  # b fails the first time
        return {"name": name, "status": "ok" if ok else "failed (exit 1)", "val_loss": 2.0 + len(calls),
                "tokens_per_s": 100.0, "memory": {}, "titan_metrics": {}, "model": {}, "micro_batch": 16}

    monkeypatch.setattr(harness, "run_row", fake_run_row)
    rows = [("a", {"x": 1}), ("b", {"x": 2})]
    first = harness.compare(rows, steps=3, out=tmp_path / "t", command="cmd", resume=True)
    assert calls == ["a", "b"] and first[1]["status"] != "ok"
    again = harness.compare(rows, steps=3, out=tmp_path / "t", command="cmd", resume=True)
    assert calls == ["a", "b", "b"]  # a reused with its figures, the failed b run again
    assert again[0]["val_loss"] == first[0]["val_loss"] and again[1]["status"] == "ok"
    harness.compare([("a", {"x": 1}), ("b", {"x": 3})], steps=3, out=tmp_path / "t", command="cmd", resume=True)
    assert calls == ["a", "b", "b", "b"]  # b's config changed: run; a kept
    harness.compare(rows, steps=4, out=tmp_path / "t", command="cmd", resume=True)
    assert calls[-2:] == ["a", "b"]  # other steps: everything again


def test_bench_compress_seeds_summary_mean_spread_and_verdict(tmp_path):
    """bench_compress.py --seeds: the mean over the seeds against dense's mean, the larger seed spread of the two,
    and the verdict; step time and RSS against the same seed's dense row."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_compress", harness.ROOT / "launch/bench/bench_compress.py")
    bc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bc)

    def row(name, val, step_s, rss, wire=None):
        return {"name": name, "status": "ok", "val_loss": val, "step_s": step_s, "peak_rss": rss,
                "titan_metrics": {"wire_compression_ratio_run": wire} if wire else {}}
    per_seed = {0: [row("dense_allreduce", 1.30, 1.0, 1000), row("rms_100x", 1.32, 1.1, 1050, 100.0),
                    row("topk_100x", 1.60, 1.2, 1100, 100.0)],
                1: [row("dense_allreduce", 1.26, 2.0, 1000), row("rms_100x", 1.27, 2.0, 1150, 100.0),
                    {"name": "topk_100x", "status": "failed (exit 1)"}]}
    md = bc.seeds_summary(per_seed, tmp_path / "c", "cmd", 1000)
    assert (tmp_path / "c.md").read_text() == md
    # rms: mean 1.295 vs dense 1.28 -> +0.015; spread max(0.05, 0.04) = 0.05 -> no difference
    assert "| rms_100x | 1.2950 | 1.3200 / 1.2700 | +0.0150 | 0.0500 | no difference | 1.05 | 1.10 / 1.15 | 100.0 |" in md
    assert "| dense_allreduce | 1.2800 |" in md and "reference" in md
    assert "Not finished for every seed: topk_100x." in md
    one = bc.seeds_summary({1: per_seed[1][:2]}, tmp_path / "d", "cmd", 1000)  # one seed: no spread, no verdict
    assert "| rms_100x | 1.2700 | 1.2700 | +0.0100 | 0.0000 | one seed: no spread |" in one


def test_bench_compress_received_table_counts_what_the_network_delivers():
    """--count-wire rows: x_recv is the dense row's received bytes over the row's (the larger rank of each), not the
    compressor's handed-bytes ratio; rows without the count (no --count-wire) add no table."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_compress", harness.ROOT / "launch/bench/bench_compress.py")
    bc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bc)
    mib = 2 ** 20

    def row(name, recv, sent):
        return {"name": name, "status": "ok", "wire_per_rank": [{"received": r, "sent": s} for r, s in zip(recv, sent)],
                "titan_metrics": {"wire_compression_ratio_run": 83.5}}
    lines = bc.received_table([row("dense_allreduce", [100 * mib, 100 * mib], [100 * mib, 100 * mib]),
                               row("sketch", [1 * mib, 2 * mib], [2 * mib, 1 * mib]),
                               {"name": "broken", "status": "failed (exit 1)"}])
    assert "| dense_allreduce | 100.00 / 100.00 | 100.00 / 100.00 | 1.0 |" in lines
    assert "| sketch | 1.00 / 2.00 | 2.00 / 1.00 | 50.0 |" in lines  # the larger rank's 2 MiB
    assert not any("broken" in ln for ln in lines)
    assert bc.received_table([{"name": "dense_allreduce", "status": "ok"}]) == []


def test_the_table_names_the_seed_its_rows_trained_with(tmp_path, monkeypatch):
    """A seed-1 table says seed 1 (it once said seed 0 whatever --seed was)."""
    def fake_run_row(name, cfg, *, steps, num_ranks, extra_args, workdir, timeout, log_dir):
        return {"name": name, "status": "ok", "val_loss": 2.0, "tokens_per_s": 100.0, "memory": {},
                "titan_metrics": {}, "model": {}, "micro_batch": 16}

    monkeypatch.setattr(harness, "run_row", fake_run_row)
    harness.compare([("a", {}), ("b", {})], steps=3, out=tmp_path / "s1", extra_args=["--seed", "1"], command="c")
    assert ", seed 1, validation" in (tmp_path / "s1.md").read_text()
    harness.compare([("a", {}), ("b", {}, ["--seed=2"])], steps=3, out=tmp_path / "s", command="c")
    assert ", seeds 0, 2, validation" in (tmp_path / "s.md").read_text()


def test_compare_reruns_rows_from_other_code_unless_reuse_stale_which_marks_them(tmp_path, monkeypatch):
    from launch.bench import store
    code = {"git_sha": "a", "code_hash": "A", "dirty": False}
    monkeypatch.setattr(store, "code_identity", lambda paths=store.CODE_PATHS: dict(code))
    calls = []

    def fake_run_row(name, cfg, *, steps, num_ranks, extra_args, workdir, timeout, log_dir):
        calls.append(name)
        return {"name": name, "status": "ok", "val_loss": 2.0 + len(calls), "tokens_per_s": 100.0, "memory": {},
                "titan_metrics": {}, "model": {}, "micro_batch": 16}
    monkeypatch.setattr(harness, "run_row", fake_run_row)
    rows = [("a", {"x": 1}), ("b", {"x": 2})]
    harness.compare(rows, steps=3, out=tmp_path / "t", command="cmd", resume=True)
    code.update(code_hash="B")
    harness.compare(rows[1:], steps=3, out=tmp_path / "t", command="cmd", resume=True)
    assert calls == ["a", "b", "b"]  # b's record came from other code: run again
    out = harness.compare(rows, steps=3, out=tmp_path / "t", command="cmd", resume=True, reuse_stale=True)
    assert calls == ["a", "b", "b"] and [r["val_loss"] for r in out] == [3.0, 5.0]
    md = (tmp_path / "t.md").read_text()
    assert "| a (stale) |" in md and "| b |" in md and "(stale): reused with --reuse-stale" in md
    harness.compare_table(tmp_path / "t")  # regenerated from the store alone: the same marks
    assert (tmp_path / "t.md").read_text().split("\n", 4)[4] == md.split("\n", 4)[4]
