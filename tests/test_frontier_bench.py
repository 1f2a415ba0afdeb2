"""launch/bench/frontier.py: a tiny real run (AdamW, a peer, a titan profile) writes the table, csv, jsonl and
plot, and a rerun retrains nothing; the table's arithmetic (best lr over seeds, deltas, spreads, verdicts, the
rows that take the best AdamW lr) on synthetic records."""
import csv
import importlib.util
import json
import logging
import shutil
import sys

import pytest

from tests.conftest import ROOT
from tests.helpers.deps import require

_spec = importlib.util.spec_from_file_location("frontier", ROOT / "launch" / "bench" / "frontier.py")
frontier = importlib.util.module_from_spec(_spec)
sys.modules["frontier"] = frontier  # dataclasses look their module up while the module runs
_spec.loader.exec_module(frontier)

TINY = "--layers 2 --width 64 --heads 4 --context 32 --val-batches 2"
require("lion_pytorch")  # pinned by the [test] extra: missing, it fails this module instead of skipping


def test_tiny_frontier_writes_its_files_and_a_rerun_retrains_nothing(tmp_path, monkeypatch, caplog):
    out = tmp_path / "fr"
    argv = ["--steps", "2", "--seeds", "0", "--rows", "adamw_lr1e-3,lion_lr1e-4,titan_exact", "--out", str(out),
            "--train-args", TINY]
    table = frontier.main(argv)
    assert [t["config"] for t in table] == ["adamw_lr1e-3 (best lr)", "lion_lr1e-4", "titan_exact"]
    assert all(t["status"] == "ok" for t in table), table
    lines = out.with_suffix(".jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["row"] for x in lines) == ["adamw_lr1e-3", "lion_lr1e-4", "titan_exact"]
    by = {t["config"].split(" ")[0]: t for t in table}
    assert by["adamw_lr1e-3"]["optim_B_per_param"] == pytest.approx(8.0, abs=0.01)  # 2 fp32 buffers + steps
    assert by["lion_lr1e-4"]["optim_B_per_param"] == pytest.approx(4.0)             # 1 fp32 buffer
    assert by["titan_exact"]["lr"] == 1e-3                                          # the best AdamW lr
    assert by["titan_exact"]["activ_MiB"] < by["adamw_lr1e-3"]["activ_MiB"]         # MLME saves activations
    assert by["titan_exact"]["val_loss"] == pytest.approx(by["adamw_lr1e-3"]["val_loss"], abs=1e-5)  # exact
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))
    assert [r["config"] for r in rows] == [t["config"] for t in table] and "verdict" in rows[0]
    md = out.with_suffix(".md").read_text()
    assert "| adamw_lr1e-3 (best lr) |" in md and "one seed: no spread" in md
    assert out.with_suffix(".png").stat().st_size > 10_000
    first = out.with_suffix(".jsonl").read_text()

    def no_training(*a, **k):
        raise AssertionError("a finished (row, seed) was trained again")

    monkeypatch.setattr(frontier, "run_row", no_training)
    with caplog.at_level(logging.INFO, logger="titan_ds.bench.frontier"):
        again = frontier.main(argv)
    assert out.with_suffix(".jsonl").read_text() == first
    assert sum("skip" in r.message and "finished" in r.message for r in caplog.records) == 3
    assert [t["val_loss"] for t in again] == [t["val_loss"] for t in table]  # the kept figures


def _args(**kw):
    return frontier.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def _rec(row, seed, val, settings, lr=None, mem=100 * 2**20, tps=1000.0):
    return {"row": row.name, "seed": seed, "family": row.family, "settings": settings, "lr": lr,
            "ranks": row.ranks, "fingerprint": row.fingerprint(lr), "wall_s": 1.0, "status": "ok",
            "val_loss": val, "tokens_per_s": tps, "peak_rss": 2**30, "optimizer_bytes_per_param": 8.0,
            "optimizer_state_bytes": 8e6, "trainable_params": 10**6,
            "memory": {"training_state": mem, "parameters": 1, "gradients": 1, "optimizer_state": 1,
                       "activations": 1}}


def test_table_picks_the_best_lr_over_seeds_and_labels_deltas_within_the_spread():
    rows = frontier.build_rows(_args(adamw_lrs="1e-3,3e-3", lion_lrs="1e-4", adafactor_lrs="1e-2"))
    by = {r.name: r for r in rows}
    s = {"steps": 10, "train_args": ""}
    a1, a3, lion, exact = by["adamw_lr1e-3"], by["adamw_lr3e-3"], by["lion_lr1e-4"], by["titan_exact"]
    fac = by["adafactor_lr1e-2"]
    done = [
        # seed 0 alone would pick 3e-3 (2.00 < 2.01); the mean over both seeds picks 1e-3 (2.015 < 2.05)
        _rec(a1, 0, 2.01, s, 1e-3), _rec(a1, 1, 2.02, s, 1e-3),
        _rec(a3, 0, 2.00, s, 3e-3), _rec(a3, 1, 2.10, s, 3e-3),
        _rec(lion, 0, 2.03, s, 1e-4, mem=50 * 2**20, tps=500.0), _rec(lion, 1, 2.04, s, 1e-4, mem=50 * 2**20),
        _rec(fac, 0, 2.02, s, 1e-2), _rec(fac, 1, 2.02, s, 1e-2),
        _rec(exact, 0, 2.10, s, 3e-3), _rec(exact, 1, 2.10, s, 3e-3),  # trained at a stale best lr: not used
    ]
    table = {t["config"]: t for t in frontier.summarise(rows, done, {}, s, [0, 1], 1e-3)}
    assert table["adamw_lr1e-3 (best lr)"]["verdict"] == "reference"
    assert table["adamw_lr3e-3"]["delta"] == pytest.approx(0.035)
    assert table["adamw_lr3e-3"]["spread"] == pytest.approx(0.10)
    assert table["adamw_lr3e-3"]["verdict"] == "no difference"   # 0.035 < its own spread 0.10
    assert table["lion_lr1e-4"]["delta"] == pytest.approx(0.02)
    assert table["lion_lr1e-4"]["verdict"] == "worse"            # 0.02 > both spreads (0.01, 0.01)
    assert table["adafactor_lr1e-2"]["spread"] == 0.0
    assert table["adafactor_lr1e-2"]["verdict"] == "no difference"  # 0.005 < the reference's spread 0.01
    assert table["lion_lr1e-4"]["mem_vs_adamw"] == pytest.approx(0.5)
    assert table["lion_lr1e-4"]["tokens_per_s_ratio"] == pytest.approx(0.75)
    assert table["titan_exact"]["lr"] == 1e-3 and table["titan_exact"]["status"] == "pending"
    assert table["titan_exact"]["seeds"] == "0/2"
    # the same records under other settings (another step count) are not this table's
    assert all(t["status"] == "pending" for t in frontier.summarise(rows, done, {}, {**s, "steps": 11}, [0, 1],
                                                                     1e-3))


def test_rows_filter_profiles_ranks_and_errors():
    rows = frontier.build_rows(_args())
    names = [r.name for r in rows]
    assert names[:3] == ["adamw_lr3e-4", "adamw_lr1e-3", "adamw_lr3e-3"]
    assert {"adafactor_lr1e-2", "lion_lr1e-4", "adamw8bit", "adamw4bit", "titan_exact", "titan_balanced",
            "titan_memory", "titan_full"} <= set(names)
    by = {r.name: r for r in rows}
    assert by["titan_full"].ranks == 2 and by["titan_exact"].ranks == 1  # gradient compression needs 2 ranks
    assert by["titan_exact"].inherit_lr and not by["titan_balanced"].inherit_lr and by["adamw8bit"].inherit_lr
    assert frontier._train_args(by["titan_full"], 3e-4, 1, []) == ["--seed", "1", "--micro-batch", "8",
                                                                    "--val-micro-batch", "16"]
    assert [r.name for r in frontier._select(rows, "titan_*,adamw_lr1e-3")][:2] == ["adamw_lr1e-3", "titan_exact"]
    with pytest.raises(SystemExit, match="'nope' matches no row"):
        frontier._select(rows, "nope")
    with pytest.raises(SystemExit, match="--lion-lrs: 'x' is not a number"):
        frontier.build_rows(_args(lion_lrs="1e-4,x"))


def test_fair_peer_rows_take_the_shipped_profiles_exact_pillars_and_follow_them(tmp_path, monkeypatch):
    """adamw_mlme_memory / adamw4bit_bf16_mlme_memory / adamw8bit_mlme_balanced: plain DeepSpeed + the profile's
    titan.mlme section and micro-batch/accumulation, no titan optimizer, the peer's --optimizer at the best AdamW
    lr; built from the profile file, so an edited profile changes the row (and its fingerprint)."""
    from titan_ds.config import TitanConfig
    by = {r.name: r for r in frontier.build_rows(_args())}
    for name, (opt, profile) in {"adamw_mlme_memory": ("adamw", "titan_memory"),
                                 "adamw4bit_bf16_mlme_memory": ("adamw4bit_bf16", "titan_memory"),
                                 "adamw8bit_mlme_balanced": ("adamw8bit", "titan_balanced")}.items():
        row, prof = by[name], json.loads((ROOT / "ds_configs" / f"{profile}.json").read_text())
        assert row.family == "peer" and row.inherit_lr and row.ranks == 1 and row.args[:2] == ["--optimizer", opt]
        assert row.cfg["titan"] == {"mlme": prof["titan"]["mlme"]}
        for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            assert row.cfg[k] == prof[k], (name, k)
        titan = TitanConfig.from_ds_config(row.cfg)
        assert titan.optimizer is None and titan.mlme.recompute_blocks
        assert {k: v for k, v in row.cfg.items() if k not in ("titan", "train_micro_batch_size_per_gpu",
                                                             "gradient_accumulation_steps")} == \
            {k: v for k, v in frontier.baseline_config(0).items() if k not in ("train_micro_batch_size_per_gpu",
                                                                               "gradient_accumulation_steps")}
        assert frontier._train_args(row, 3e-3, 1, [])[-4:] == ["--seed", "1", "--lr", "0.003"]
    assert by["adamw_mlme_memory"].cfg["gradient_accumulation_steps"] == 4  # titan_memory: 4 micro-batches of 4
    # an edited profile: the row follows it
    root = tmp_path / "root"
    shutil.copytree(ROOT / "ds_configs", root / "ds_configs")
    mem = json.loads((root / "ds_configs" / "titan_memory.json").read_text())
    mem["titan"]["mlme"]["tile"] = 64
    mem["gradient_accumulation_steps"] = 8
    (root / "ds_configs" / "titan_memory.json").write_text(json.dumps(mem))
    monkeypatch.setattr(frontier, "ROOT", root)
    edited = {r.name: r for r in frontier.build_rows(_args())}["adamw_mlme_memory"]
    assert edited.cfg["titan"]["mlme"]["tile"] == 64 and edited.cfg["gradient_accumulation_steps"] == 8
    assert edited.fingerprint(1e-3) != by["adamw_mlme_memory"].fingerprint(1e-3)
    del mem["titan"]["mlme"]
    mem["titan"]["optimizer"] = json.loads((ROOT / "ds_configs" / "titan_memory.json").read_text())["titan"]["optimizer"]
    (root / "ds_configs" / "titan_memory.json").write_text(json.dumps(mem))
    with pytest.raises(SystemExit, match="titan_memory.json has no titan.mlme section"):
        frontier.build_rows(_args())


def test_committed_records_read_as_code_unknown_and_match_their_rows(tmp_path):
    """results/frontier_1000.jsonl (written before the store): each line's fingerprint is the hash of its row's
    config as the store computes it, so --reuse-stale finds it for the same row, lr, settings and seed; without
    --reuse-stale nothing from unknown code is reused; another seed or step count is not found."""
    rows = {r.name: r for r in frontier.build_rows(_args(adamw_lrs="1e-3,3e-3"))}
    key = dict(config=rows["adamw_lr1e-3"].config(1e-3), settings={"steps": 1000, "train_args": ""}, seed=0)
    path = ROOT / "results" / "frontier_1000.jsonl"
    stale = frontier.open_store(path, reuse_stale=True)
    rec = stale.find("adamw_lr1e-3", **key)
    assert rec is not None and rec["code_hash"] is None and rec["result"]["val_loss"] > 0
    assert frontier.open_store(path).find("adamw_lr1e-3", **key) is None
    assert stale.find("adamw_lr1e-3", **{**key, "seed": 7}) is None
    assert stale.find("adamw_lr1e-3", **{**key, "settings": {"steps": 999, "train_args": ""}}) is None
