"""launch/demo.py (`make demo`): with both runs' summaries present (from before the store: --reuse-stale) it trains
nothing and writes the comparison, its two-line summary and the plot from them; the figures are the runs' own. A
run recorded in the store is reused from the same code without --reuse-stale. A first run is quiet: the progress
bars, the two summary lines and the plot's path, none of the third-party lines titan used to trigger."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

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


def test_demo_launches_deepspeed_at_warning_level_unless_verbose(tmp_path, monkeypatch):
    """The launcher's INFO lines only under --verbose; on a machine without CUDA DeepSpeed is told it is the CPU
    (no fallback warning from each process) unless the user chose an accelerator."""
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cmd, env = demo._launch("ds_configs/titan_memory.json", 8, tmp_path, verbose=False)
    assert "--log_level=warning" in cmd and cmd.index("--log_level=warning") < cmd.index("launch/train.py")
    assert env["DS_ACCELERATOR"] == "cpu"
    cmd, env = demo._launch("ds_configs/titan_memory.json", 8, tmp_path, verbose=True)
    assert not any(a.startswith("--log_level") for a in cmd) and "DS_ACCELERATOR" not in env
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    assert demo._launch("ds_configs/titan_memory.json", 8, tmp_path, verbose=False)[1]["DS_ACCELERATOR"] == "cuda"


# Lines a first `make demo` printed before it was made quiet (each from a third party, triggered by titan)
NOISE = ["Failed to load",                                # torchao's CUDA-only extensions, at its import
         "is an Enum subclass",                           # torch's pytree deprecation, at torchao's import
         "[INFO]",                                        # DeepSpeed's launcher
         "Setting accelerator to CPU",                    # DeepSpeed's accelerator fallback, in each process
         "has been overridden after learning rate scheduler initialization"]  # torch, on titan's optimizer


@pytest.mark.slow
def test_a_short_demo_prints_only_its_progress_and_summary(tmp_path):
    """The demo entry, 2 steps (both runs, each through DeepSpeed's launcher): none of the noise above, and the
    two summary lines and the plot's path are there."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "launch/demo.py", "--steps", "2", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=1200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert [n for n in NOISE if n in out] == [], out[-4000:]
    assert "titan_memory vs plain DeepSpeed, 2 steps: validation loss" in r.stdout and "training state" in r.stdout
    assert f"plot: {tmp_path / 'demo.png'}" in r.stdout
