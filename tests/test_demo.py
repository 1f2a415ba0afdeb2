"""launch/demo.py (`make demo`): with both runs' summaries present (from before the store: --reuse-stale) it trains
nothing and writes the comparison, its two-line summary and the plot from them; the figures are the runs' own. A
run recorded in the store is reused from the same code without --reuse-stale."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("demo", ROOT / "launch/demo.py")
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)


def _fake_run(d: Path, val: float, state_mib: float, tps: float, steps: int) -> None:
    d.mkdir(parents=True)
    mem = {"parameters": state_mib * 2**20, "gradients": 0, "optimizer_state": 0, "activations": 0}
    (d / "summary.json").write_text(json.dumps({"steps": steps, "val_loss": val, "memory": mem, "peak_rss": 2**30,
                                                "tokens_per_s": tps, "val_history": [[0, 5.5], [steps, val]]}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / steps}) + "\n"
                                             for s in range(1, steps + 1)))


def test_demo_compares_the_two_runs_without_training_again(tmp_path, capsys):
    _fake_run(tmp_path / "plain", 2.0, 200.0, 1000.0, 8)
    _fake_run(tmp_path / "titan_memory", 2.01, 20.0, 500.0, 8)
    c = demo.main(["--steps", "8", "--out", str(tmp_path), "--reuse-stale"])
    assert c["val_loss_delta"] == 0.01 and c["train_state_vs_plain"] == 0.1 and c["tokens_per_s_vs_plain"] == 0.5
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("titan_memory vs plain DeepSpeed, 8 steps: validation loss 2.0100 vs 2.0000 (+0.0100")
    assert "training state 20.0 vs 200.0 MiB (0.100x)" in out[1] and "tokens/s 0.50x plain" in out[1]
    assert json.loads((tmp_path / "demo.json").read_text())["compare"] == c
    assert (tmp_path / "demo.png").stat().st_size > 0 and "| val_loss_delta | 0.01 |" in (tmp_path / "demo.md").read_text()


def test_demo_reuses_its_recorded_runs_and_reruns_on_other_steps(tmp_path, monkeypatch):
    calls, real_run = [], demo.subprocess.run

    def fake_train(cmd, **kw):  # stands for launch/train.py: writes the run's files
        if "--summary-out" not in cmd:
            return real_run(cmd, **kw)  # git, for the store's code hash
        name = Path(cmd[cmd.index("--summary-out") + 1]).parent.name
        calls.append(name)
        steps = int(cmd[cmd.index("--steps") + 1])
        (tmp_path / name).rmdir()
        _fake_run(tmp_path / name, 2.0 + len(calls) / 100, 100.0, 1000.0, steps)
    monkeypatch.setattr(demo.subprocess, "run", fake_train)
    first = demo.main(["--steps", "8", "--out", str(tmp_path)])
    assert calls == ["plain", "titan_memory"]
    assert demo.main(["--steps", "8", "--out", str(tmp_path)]) == first and len(calls) == 2  # recorded: reused
    demo.main(["--steps", "8", "--out", str(tmp_path), "--table-only"])
    assert len(calls) == 2
    import shutil
    for name in ("plain", "titan_memory"):
        shutil.rmtree(tmp_path / name)
    demo.main(["--steps", "9", "--out", str(tmp_path)])
    assert calls[2:] == ["plain", "titan_memory"]  # other settings: run again
