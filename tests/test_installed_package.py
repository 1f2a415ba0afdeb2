"""The package works installed: ``pip install`` (not editable) into a fresh venv outside the checkout,
then, from another folder and without the checkout on ``sys.path``, ``titan-ds plan`` gives the checkout's plan,
``titan-ds report`` reports this version with every pillar available, and a tiny GPT trains two steps through
``titan_ds.initialize`` (MLME + the titan optimizer) with a falling loss.

Offline and fast: the fresh venv reaches the heavy dependencies (torch, deepspeed, ...) in the running venv's
site-packages through a ``.pth`` line (a plain path: the running venv's own ``.pth`` files, such as the editable
install of the checkout, are not processed), and titan_ds itself is installed with ``--no-deps
--no-build-isolation --no-index`` from a copy of the files the build reads (so the build writes nothing into the
checkout)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

# what a wheel is built from; a setup.py, setup.cfg or MANIFEST.in is copied too if the checkout gets one
BUILD_INPUTS = ("pyproject.toml", "README.md", "setup.py", "setup.cfg", "MANIFEST.in", "titan_ds")
PLAN = ["--model", "gpt:2x64", "--seq", "32", "--cpu-mem", "8G", "--disk", "1G"]

TRAIN = r"""
import json, sys
import torch
import titan_ds
from titan_ds.models import GPT, GPTConfig
from titan_ds.utils import ensure_dist_env

ensure_dist_env()
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32))
cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
       "steps_per_print": 10**9,
       "titan": {"mlme": {"attention": "tiled", "tile": 16, "stripe_ffn": 16, "chunked_loss": True},
                 "optimizer": {"name": "asdt", "lr": 1e-3, "density": 0.25}}}
engine, *_ = titan_ds.initialize(model=model, config=cfg)
x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
losses = []
for _ in range(2):
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    losses.append(float(loss))
with torch.no_grad():
    losses.append(float(engine(x, x)))  # the same batch after the two steps
print("RESULT " + json.dumps({"file": titan_ds.__file__, "path": sys.path, "finders": [repr(f) for f in sys.meta_path],
                              "losses": losses, "steps": engine.global_steps}))
"""


def _fresh_venv(tmp: Path) -> Path:
    """A venv in ``tmp`` that sees the running venv's packages (never its .pth files) and has titan_ds installed
    from a copy of the checkout; returns its python."""
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False, symlinks=True)
    py = env_dir / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    here = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))  # the venv running pytest
    (Path(site) / "_titan_test_deps.pth").write_text("".join(f"{p}\n" for p in here))
    src = tmp / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif p.exists():
            shutil.copy2(p, src / name)
    # -I: the editable titan-ds that the .pth line makes visible is neither "already satisfied" nor uninstalled
    subprocess.run([py, "-m", "pip", "install", "-q", "-I", "--no-deps", "--no-build-isolation", "--no-index",
                    "--no-cache-dir", "--disable-pip-version-check", str(src)], check=True, cwd=tmp)
    shutil.rmtree(src)  # nothing of the checkout's files is left to import from
    return py


def _env() -> dict[str, str]:
    """This process's environment without anything that points Python at the checkout or at a distributed world
    (this process may hold one)."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1")
    return env


def _json(stdout: str):
    """The JSON document that a ``--json`` command printed (DeepSpeed may log a line to stdout before it)."""
    text = "\n" + stdout
    start = min(i for i in (text.find("\n[\n"), text.find("\n{\n")) if i >= 0)
    return json.JSONDecoder().raw_decode(text, start + 1)[0]


def test_installed_package_plans_reports_and_trains_from_another_folder(tmp_path):
    py = _fresh_venv(tmp_path)
    cli = py.parent / "titan-ds"
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = _env()

    def run(*cmd):
        r = subprocess.run([str(c) for c in cmd], cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{cmd} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r.stdout

    # training: installed titan_ds, not the checkout's, and the checkout nowhere on sys.path
    (work / "train_tiny.py").write_text(TRAIN)
    out = json.loads(next(line for line in run(py, "train_tiny.py").splitlines()
                          if line.startswith("RESULT "))[len("RESULT "):])
    venv_dir = py.parent.parent
    assert Path(out["file"]).resolve().is_relative_to(venv_dir.resolve()), out["file"]
    assert not any(p and Path(p).resolve() == ROOT for p in out["path"]), out["path"]
    assert not any("editable" in f for f in out["finders"]), out["finders"]  # an editable install's import hook
    losses = out["losses"]
    assert all(v == v and abs(v) != float("inf") for v in losses), losses
    assert out["steps"] == 2 and losses[2] < losses[0] and losses[1] < losses[0], losses

    # plan: the installed CLI gives the same candidates as the checkout's titan_ds.plan (calibration included)
    from titan_ds.plan import aio_buildable, candidate_config, model_spec, parse_size, plan
    got = _json(run(cli, "plan", *PLAN, "--json"))
    cands, best = plan(model_spec("gpt:2x64", 32), seq=32, micro=1, cpu_mem=parse_size("8G"),
                       disk=parse_size("1G"), gpu_mem=None, ranks=1,
                       aio=aio_buildable())  # the CLI's --aio auto checks this machine (libaio-dev or not) too
    want = [{"mode": c.mode, "fits": c.fits, "why": c.why, "device": c.device, "dram": c.dram, "disk": c.disk,
             "calibrated": c.calibrated} for c in cands]
    assert got == json.loads(json.dumps(want)) and any(c["calibrated"] for c in got)
    text = run(cli, "plan", *PLAN, "--out", "best.json")
    assert f"best fitting: {best.mode} " in text
    assert json.loads((work / "best.json").read_text()) == candidate_config(best.mode, nvme_path="./titan_storage",
                                                                            micro_batch=1)

    # report: this version, every pillar importable from the installed package
    rep = _json(run(cli, "report", "--json", "--probe-mb", "1", "--nvme-path", work / "nvme"))
    import titan_ds
    assert rep["titan_ds"] == titan_ds.__version__
    assert rep["pillars"] and all(v == "available" for v in rep["pillars"].values()), rep["pillars"]
    assert rep["nvme"]["path"] == str(work / "nvme")
