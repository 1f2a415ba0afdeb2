"""launch/bench/speed.py and launch/bench/profile_phases.py: tiny real runs write their tables and a rerun runs
nothing again; the speed table's arithmetic (medians, ratios, MFU) on synthetic records; the rows' configs."""
import importlib.util
import json
import sys

import pytest

from tests.conftest import ROOT


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "launch" / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the module runs
    spec.loader.exec_module(mod)
    return mod


speed = _load("speed")
profile_phases = _load("profile_phases")
TINY = "--layers 2 --width 64 --heads 4 --context 32 --val-batches 1"


def test_rows_are_the_profiles_and_the_fair_peers():
    by = {r.name: r for r in speed.build_rows()}
    assert list(by) == ["plain", "titan_exact", "titan_exact_replay", "titan_exact_no_recompute", "titan_exact_pre",
                        "titan_exact_no_recompute_pre", "titan_balanced", "titan_balanced_replay", "titan_memory",
                        "titan_memory_replay",
                        "adamw+memory_mlme", "adamw4bit_bf16+memory_mlme", "adamw8bit+balanced_mlme"]
    memory = json.loads((ROOT / "ds_configs" / "titan_memory.json").read_text())
    peer = by["adamw4bit_bf16+memory_mlme"].cfg
    assert peer["titan"] == {"mlme": memory["titan"]["mlme"]}  # titan_memory's MLME, no titan optimizer
    assert (peer["train_micro_batch_size_per_gpu"], peer["gradient_accumulation_steps"]) == (4, 4)
    assert by["titan_exact_no_recompute"].cfg["titan"]["mlme"]["recompute_blocks"] is False
    assert by["titan_exact"].cfg["titan"]["mlme"]["recompute_blocks"] is True
    for name, rec in (("titan_exact_pre", True), ("titan_exact_no_recompute_pre", False)):
        mlme = by[name].cfg["titan"]["mlme"]
        assert (mlme["stripe_ffn_saves"], mlme["recompute_blocks"]) == ("pre_activation", rec)
    assert "stripe_ffn_saves" not in by["titan_exact"].cfg["titan"]["mlme"]
    for name in ("titan_exact", "titan_balanced", "titan_memory"):  # the shipped default, and the previous replay
        assert "recompute_ffn" not in by[name].cfg["titan"]["mlme"]
        assert by[name + "_replay"].cfg["titan"]["mlme"] == {**by[name].cfg["titan"]["mlme"], "recompute_ffn": "replay"}
    assert [r.name for r in speed.build_rows() if r.bf16_weights] == ["titan_memory", "titan_memory_replay",
                                                                       "adamw4bit_bf16+memory_mlme"]
    with pytest.raises(SystemExit, match="'nope' matches no row"):
        speed._select(speed.build_rows(), "nope")


def test_flops_per_token_formula():
    # 6 N + 12 L T d: N = 1000 parameters, 2 layers, context 8, width 4
    assert speed.flops_per_token(1000, 2, 8, 4) == 6000 + 12 * 2 * 8 * 4


def test_summary_medians_ratios_and_mfu():
    rows = [r for r in speed.build_rows() if r.name in ("plain", "titan_memory")]
    model = {"n_layer": 1, "block_size": 10, "n_embd": 10}
    rec = lambda r, rep, tps: {"row": r.name, "tokens_per_s": tps, "trainable_params": 100,  # noqa: E731
                               "model": model, "micro_batch": 16, "optimizer": "AdamW"}
    done = {("plain", rows[0].fingerprint(), i): rec(rows[0], i, t) for i, t in enumerate([100.0, 400.0, 200.0])}
    done.update({("titan_memory", rows[1].fingerprint(), i): rec(rows[1], i, t) for i, t in enumerate([50.0, 70.0])})
    done[("titan_memory", "stale-fingerprint", 2)] = rec(rows[1], 2, 1e6)  # an edited profile's old run: not used
    table = {t["row"]: t for t in speed.summarise(rows, done, {"fp32": 1e6, "bf16": 2e6})}
    assert table["plain"]["tokens_per_s"] == 200.0 and (table["plain"]["min"], table["plain"]["max"]) == (100, 400)
    assert table["titan_memory"]["tokens_per_s"] == 60.0 and table["titan_memory"]["repeats"] == 2
    assert table["titan_memory"]["vs_plain"] == pytest.approx(0.3)
    fpt = 6 * 100 + 12 * 1 * 10 * 10
    assert table["plain"]["mfu"] == pytest.approx(fpt * 200 / 1e6)
    assert table["titan_memory"]["peak"] == "bf16" and table["titan_memory"]["mfu"] == pytest.approx(fpt * 60 / 2e6)
    cpu = {t["row"]: t for t in speed.summarise(rows, done, {"fp32": 3e6, "bf16": 1e6})}  # bf16 slower: fp32's peak
    assert cpu["titan_memory"]["peak"] == "fp32" and cpu["titan_memory"]["mfu"] == pytest.approx(fpt * 60 / 3e6)


def test_tiny_speed_run_alternates_rows_and_a_rerun_trains_nothing(tmp_path, monkeypatch):
    out = tmp_path / "speed"
    argv = ["--steps", "2", "--repeats", "2", "--rows", "plain,titan_exact", "--out", str(out), "--peak-n", "64",
            "--train-args", TINY]
    table = speed.main(argv)
    assert [t["row"] for t in table] == ["plain", "titan_exact"] and all(t["repeats"] == 2 for t in table)
    recs = [json.loads(x) for x in out.with_suffix(".jsonl").read_text().splitlines()]
    recs = [r.get("result", r) for r in recs]  # the results store's records hold each result under "result"
    order = [(r["row"], r["repeat"]) for r in recs]
    assert order == [("plain", 0), ("titan_exact", 0), ("plain", 1), ("titan_exact", 1)]  # A B, A B
    assert all(t["tokens_per_s"] > 0 and 0 < t["mfu"] for t in table)
    md = out.with_suffix(".md").read_text()
    assert "| plain |" in md and "| titan_exact |" in md and "6 N + 12 L T d" in md
    assert out.with_suffix(".png").stat().st_size > 5_000

    def no_training(*a, **k):
        raise AssertionError("a finished (row, repeat) was trained again")
    monkeypatch.setattr(speed, "run_row", no_training)
    assert [t["tokens_per_s"] for t in speed.main(argv)] == [t["tokens_per_s"] for t in table]


def test_tiny_profile_phases_sum_to_the_step_and_a_rerun_measures_nothing(tmp_path, monkeypatch):
    out = tmp_path / "pp"
    argv = ["--rows", "plain,titan_exact", "--steps", "2", "--warmup", "1", "--profile-steps", "1", "--out", str(out),
            "--train-args", "--layers 2 --width 64 --heads 4 --context 32"]
    recs = profile_phases.main(argv)
    assert [r["row"] for r in recs] == ["plain", "titan_exact"]
    for r in recs:
        assert sum(r["ms"].values()) == pytest.approx(r["step_ms"])
        assert all(r["ms"][p] > 0 for p in ("forward", "loss", "backward", "optimizer")), r["ms"]
    exact = recs[1]
    assert "mlme.recompute_blocks" in exact["kernels"]
    assert any("CheckpointFunction" in op for op, _ in exact["top_ops"]["backward"])  # recompute is in backward
    md = out.with_suffix(".md").read_text()
    assert "| titan_exact |" in md and "top ops of backward" in md

    monkeypatch.setattr(profile_phases, "_run_child", lambda *a: pytest.fail("a finished row was measured again"))
    assert [r["step_ms"] for r in profile_phases.main(argv)] == [r["step_ms"] for r in recs]
    with pytest.raises(SystemExit, match="unknown row 'nope'"):
        profile_phases.main(["--rows", "nope", "--out", str(out)])
