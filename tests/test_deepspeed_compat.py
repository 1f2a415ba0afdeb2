"""The seam module (titan_ds/deepspeed_compat.py): the version check, one canary per DeepSpeed symbol and private
attribute titan relies on, private names nowhere else in the package, and the patches' undo."""
from __future__ import annotations

import ast
import inspect
import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import torch

from titan_ds import deepspeed_compat as dsc

PACKAGE = Path(__file__).resolve().parents[1] / "titan_ds"


# ------------------------------------------------------------------ version
def test_supported_version_passes_and_others_name_both():
    assert dsc.check_version("0.19.8") == "0.19.8"
    for bad in ("0.20.0", "0.18.9", "not-a-version"):
        with pytest.raises(dsc.UnsupportedDeepSpeed) as e:
            dsc.check_version(bad)
        assert f"DeepSpeed {bad} is installed" in str(e.value) and ">=0.19.0" in str(e.value) \
            and "pip install deepspeed==0.19.8" in str(e.value)
    assert dsc.check_version() == "0.19.8"  # what pyproject.toml pins


def test_importing_titan_ds_with_an_unsupported_deepspeed_fails_clearly(tmp_path):
    """A faked installed version (the distribution metadata ``import titan_ds`` reads) stops the import."""
    code = ("import importlib.metadata as m\nreal = m.version\n"
            "m.version = lambda name: '0.20.1' if name == 'deepspeed' else real(name)\n"
            "import titan_ds\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(PACKAGE.parent)}, timeout=120)
    assert r.returncode != 0
    assert "UnsupportedDeepSpeed: titan_ds supports DeepSpeed <0.20.0,>=0.19.0" in r.stderr, r.stderr[-2000:]
    assert "DeepSpeed 0.20.1 is installed" in r.stderr


# ------------------------------------------------------------------ canaries
@pytest.mark.parametrize("symbol", dsc.SYMBOLS, ids=lambda s: s.path)
def test_each_deepspeed_symbol_exists_with_the_expected_signature(symbol):
    obj = dsc.unwrap(dsc.resolve(symbol))
    if symbol.params is not None:  # each expected parameter is there, in the expected order
        got = list(inspect.signature(obj).parameters)
        assert [g for g in got if g in symbol.params] == list(symbol.params), (symbol.what, got)


def _tiny(stage: int, extra: dict | None = None):
    import deepspeed
    from tests.helpers.equal_run import TINY, ds_config
    from titan_ds.models import GPT
    model = GPT(TINY)
    cfg = dict(ds_config(stage), **(extra or {}))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
    return engine


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_each_private_attribute_exists_on_a_live_engine(dist_env, stage):
    engine = _tiny(stage)
    import deepspeed.comm.comm as ds_comm
    owners = {"DeepSpeedEngine": engine, "TorchBackend": ds_comm.cdb}
    if stage:
        owners[type(engine.optimizer).__name__] = engine.optimizer
    for cls, obj in owners.items():
        missing = [a for a in dsc.INSTANCE_ATTRIBUTES[cls] if not hasattr(obj, a)]
        assert not missing, (cls, missing)
    if stage == 3:  # what the gradient-partitions seam checks: the buffer holds every partition of the rank
        parts = sum(int(p.partition_numel()) for g in engine.optimizer.fp16_groups for p in g)
        assert dsc.z3_gradient_partitions(engine.optimizer).numel() == parts


def test_the_seams_doc_holds_the_current_table():
    """docs/deepspeed_seams.md quotes ``python -m titan_ds.deepspeed_compat``; a DeepSpeed change that moves a
    symbol shows up here."""
    doc = (PACKAGE.parent / "docs" / "deepspeed_seams.md").read_text()
    assert dsc.seam_table() in doc


# ------------------------------------------------------------------ private names only in the seam module
def _violations(path: Path) -> list[str]:
    out, prev = [], []
    toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    for tok in toks:
        if tok.type == tokenize.NAME and tok.string in dsc.PRIVATE_NAMES and prev[-1:] and prev[-1].string == "." \
                and not (len(prev) >= 2 and prev[-2].string in ("dsc", "from", ".")):  # (from .module import: a
            # module of titan's own that shares a private name, hms/optimizer_swapper.py)
            out.append(f"{path.name}:{tok.start[0]}: .{tok.string}")
        elif tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):
                value = None
            if value in dsc.PRIVATE_NAMES:
                out.append(f"{path.name}:{tok.start[0]}: {tok.string}")
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
            prev = (prev + [tok])[-2:]
    return out


def test_private_deepspeed_names_appear_only_in_the_seam_module():
    found = [v for f in sorted(PACKAGE.rglob("*.py")) if f.name != "deepspeed_compat.py" for v in _violations(f)]
    assert found == []


def test_the_grep_finds_a_private_access(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("def f(engine):\n    return engine.optimizer.ipg_buckets, getattr(engine, 'enable_backward_allreduce')\n"
                 "def g(engine):\n    return dsc.gradient_average(engine)  # the seam's own function: allowed\n")
    assert _violations(f) == ["bad.py:2: .ipg_buckets", "bad.py:2: 'enable_backward_allreduce'"]
    g = tmp_path / "ok.py"
    g.write_text("from .optimizer_swapper import X\n"
                 "def f(opt):\n    return opt.optimizer_swapper\n")
    assert _violations(g) == ["ok.py:3: .optimizer_swapper"]  # titan's own module by that name is not a read


# ------------------------------------------------------------------ patches
def test_a_patch_restores_exactly_what_was_there():
    class Owner:
        attr = "class value"
    o = Owner()
    p = dsc.Patch("instance attr", o, "attr", "patched").apply()
    assert o.attr == "patched"
    p.undo()
    assert "attr" not in vars(o) and o.attr == "class value"  # deleted again, not set to the class's value
    p.undo()  # a no-op once undone
    with dsc.Patch("class attr", Owner, "attr", "patched"):
        assert Owner.attr == "patched"
    assert Owner.__dict__["attr"] == "class value"
    q = dsc.Patch("x", o, "attr", "mine").apply()
    o.attr = "someone else's"
    with pytest.raises(RuntimeError, match="cannot undo x: attr was replaced again"):
        q.undo()


def test_the_gradient_partitions_allocator_is_used_and_undone(dist_env):
    from deepspeed.runtime.zero import stage3
    original = stage3.DeepSpeedZeroOptimizer_Stage3.__dict__["_setup_for_real_optimizer"]
    made = []

    def alloc(numel, dtype):
        made.append(torch.zeros(numel, dtype=dtype))
        return made[-1]

    with dsc.z3_gradient_partitions_allocator(alloc):
        engine = _tiny(3)
    assert stage3.DeepSpeedZeroOptimizer_Stage3.__dict__["_setup_for_real_optimizer"] is original
    assert len(made) == 1 and dsc.z3_gradient_partitions(engine.optimizer).data_ptr() == made[0].data_ptr()
    assert "initialize_optimizer_states" not in vars(engine.optimizer)  # the instance patch is gone too
