"""Lifecycle in one place (STYLE rule 17): pillars' callbacks around engine.step / save / load, run by the engine's
once-only wrappers in the declared order, and every global a pillar patched restored when initialize fails."""
from __future__ import annotations

import json
import sys
import types

import pytest
import torch

import titan_ds
from titan_ds.engine import PillarEntry
from titan_ds.lifecycle import Lifecycle
from tests.helpers.equal_run import TINY, ds_config


# ------------------------------------------------------------------ the registry alone
def test_callbacks_nest_like_wrappers_in_registration_order():
    lc, log = Lifecycle(), []
    for name in ("a", "b"):
        lc.register("before_step", lambda n=name: log.append(f"before {n}"))
        lc.register("after_step", lambda n=name: log.append(f"after {n}"))
        lc.register("save", lambda d, t, n=name: log.append(f"save {n} {d} {t}"))
        lc.register("load", lambda d, t, o, n=name: log.append(f"load {n} {d} {t} {dict(o)}"))
    lc.run_before_step()
    lc.run_after_step()
    lc.run_save("dir", "t1")
    lc.run_load("dir", "t1", {"load_optimizer_states": False})
    assert log == ["before b", "before a", "after a", "after b", "save a dir t1", "save b dir t1",
                   "load a dir t1 {'load_optimizer_states': False}", "load b dir t1 {'load_optimizer_states': False}"]


def test_remover_unregisters_and_unknown_kind_raises():
    lc, log = Lifecycle(), []
    remove = lc.register("after_step", lambda: log.append("x"))
    lc.run_after_step()
    remove()
    remove()  # twice is harmless
    lc.run_after_step()
    assert log == ["x"]
    with pytest.raises(ValueError, match=r"unknown lifecycle callback kind 'after_save'; choose one of \["):
        lc.register("after_save", lambda: None)


def test_rollback_undoes_last_first_and_survives_a_failing_undo():
    from titan_ds.transaction import Transaction
    txn, log = Transaction(torch.nn.Linear(2, 2)), []
    txn.on_undo("one", lambda: log.append("undo 1"))
    txn.on_undo("two", lambda: (_ for _ in ()).throw(OSError("undo 2 failed")))
    txn.on_undo("three", lambda: log.append("undo 3"))
    err = RuntimeError("boom")
    txn.rollback(err)
    assert log == ["undo 3", "undo 1"] and "undoing two failed" in err.__notes__[0]
    txn.rollback()  # closed: nothing runs twice
    assert log == ["undo 3", "undo 1"]


# ------------------------------------------------------------------ fake pillars on a real DeepSpeed engine
def _fake_pillars(monkeypatch, log: list, *, raise_in: str | None = None) -> None:
    """Two pillars ("trd" then "mlme" in PILLARS) that log every callback; ``raise_in`` fails one phase."""
    from titan_ds.pillar import Pillar as PillarBase
    pillars = []
    for key in ("trd", "mlme"):
        mod = types.ModuleType(f"titan_ds._fake_{key}")

        class Fake(PillarBase):
            def apply(self, ctx):
                if raise_in == f"{self.key}.before":
                    raise RuntimeError(f"{self.key} failed in apply")
                with pytest.raises(RuntimeError, match="registered in attach"):
                    ctx.on_after_step(lambda: None)  # no engine yet: the order would not follow PILLARS

            def attach(self, ctx):
                k = self.key
                ctx.on_before_step(lambda: log.append(f"{k} before_step"))
                ctx.on_after_step(lambda: log.append(f"{k} after_step"))
                ctx.on_save(lambda d, t: log.append(f"{k} save {t}"))
                ctx.on_load(lambda d, t, o: log.append(f"{k} load {t}"))
                if raise_in == f"{k}.after":
                    raise RuntimeError(f"{k} failed in attach")

        Fake.key = key
        mod.PILLAR = Fake
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        pillars.append(PillarEntry(key, mod.__name__))
    monkeypatch.setattr("titan_ds.engine.PILLARS", tuple(pillars))


def _tiny_engine(stage: int, titan: dict):
    from titan_ds.models import GPT
    torch.manual_seed(0)
    model = GPT(TINY)
    engine, *_ = titan_ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     config=ds_config(stage, titan))
    return engine


def _train_step(engine, i: int) -> None:
    x = torch.randint(0, TINY.vocab_size, (4, TINY.block_size), generator=torch.Generator().manual_seed(i))
    engine.backward(engine(x, x))
    engine.step()


def assert_wrapped_once(engine) -> None:
    """step/save/load on the instance are titan's wrappers around DeepSpeed's bound methods, nothing between."""
    for name in ("step", "save_checkpoint", "load_checkpoint"):
        inner = vars(engine)[name].__wrapped__
        assert getattr(inner, "__self__", None) is engine, (name, inner)  # a bound method, not another wrapper
        assert inner.__func__ is getattr(type(engine), name), (name, inner)


def test_callbacks_run_in_declared_order_and_methods_are_wrapped_once(dist_env, tmp_path, monkeypatch):
    log: list[str] = []
    _fake_pillars(monkeypatch, log)
    engine = _tiny_engine(0, {"trd": {"rank": 2}, "mlme": {}})
    assert_wrapped_once(engine)
    _train_step(engine, 0)
    assert log == ["mlme before_step", "trd before_step", "trd after_step", "mlme after_step"]
    log.clear()
    engine.save_checkpoint(str(tmp_path), tag="t")
    assert log == ["trd save t", "mlme save t"]
    log.clear()
    engine.load_checkpoint(str(tmp_path))  # tag from `latest`
    assert log == ["trd load t", "mlme load t"]


def test_a_failing_save_callback_fails_the_save_and_keeps_latest(dist_env, tmp_path, monkeypatch):
    """A pillar's save callback runs inside the crash-safe protocol: its error is a CheckpointSaveError, the
    partial tag goes, ``latest`` still names the last complete checkpoint, and a later save works."""
    from titan_ds.checkpoint import MANIFEST, CheckpointSaveError, complete_tags
    fail = {"on": False}
    mod = types.ModuleType("titan_ds._fake_saver")

    def on_save(save_dir, tag):
        (tmp_path / tag / "pillar.bin").write_bytes(b"x")
        if fail["on"]:
            raise OSError(28, "No space left on device")

    from titan_ds.pillar import Pillar as PillarBase

    class Saver(PillarBase):
        key = "trd"

        def attach(self, ctx):
            ctx.on_save(on_save)
    mod.PILLAR = Saver
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr("titan_ds.engine.PILLARS", (PillarEntry("trd", mod.__name__),))
    engine = _tiny_engine(0, {"trd": {"rank": 2}})
    engine.save_checkpoint(str(tmp_path), tag="a")
    assert "pillar.bin" in json.loads((tmp_path / "a" / MANIFEST).read_text())["files"]  # written before it
    fail["on"] = True
    with pytest.raises(CheckpointSaveError, match=r"checkpoint 'b' could not be written .*`latest` still names 'a'"):
        engine.save_checkpoint(str(tmp_path), tag="b")
    assert not (tmp_path / "b").exists() and (tmp_path / "latest").read_text() == "a"
    fail["on"] = False
    engine.save_checkpoint(str(tmp_path), tag="c")
    assert complete_tags(tmp_path) == ["a", "c"] and (tmp_path / "latest").read_text() == "c"


# ------------------------------------------------------------------ HMS (+ compression): globals and wrappers
def _hms_cfg(tmp_path, compression: bool) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "steps_per_print": 10**9,
           "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
           "titan": {"hms": {"nvme_path": str(tmp_path / "nvme")}}}
    if compression:
        cfg["titan"]["compression"] = {"method": "none"}  # the dense path: allowed on 1 rank
    return cfg


def _hms_engine(tmp_path, compression: bool):
    from titan_ds.models import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=8, vocab_size=64))
    engine, *_ = titan_ds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                     config=_hms_cfg(tmp_path, compression))
    return engine


def _stage3_globals() -> tuple:
    from deepspeed.runtime.zero import stage3
    return stage3.PartitionedOptimizerSwapper, stage3.PipelinedOptimizerSwapper, stage3.reduce_scatter_coalesced


def test_hms_and_compression_register_callbacks_and_uninstall_removes_compressions(dist_env, tmp_path):
    engine = _hms_engine(tmp_path, compression=True)
    assert_wrapped_once(engine)
    hms, hooks = engine.titan.reports["hms"], engine.titan.reports["compression"]
    lc = engine.titan.lifecycle
    assert lc.before_step == [hms.before_step, hooks._before_step]  # PILLARS order: HMS innermost
    assert lc.after_step == [hms.after_step, hooks._after_step] and lc.save == [hms.save]
    ends = []
    real_end_step = hms.param_swapper.end_step

    def end_step():  # an instance attribute that counts the calls
        ends.append(engine.global_steps)
        real_end_step()
    hms.param_swapper.end_step = end_step
    for i in range(2):
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i))
        engine.backward(engine(x, x))
        engine.step()
    assert engine.global_steps == 2 and hooks.reducer.calls > 0 and ends == [1, 2]
    hooks.uninstall()
    assert lc.before_step == [hms.before_step] and lc.after_step == [hms.after_step]
    assert "allreduce_bucket" not in vars(engine) and _stage3_globals()[2].__module__ != "titan_ds.comm.hooks"
    assert_wrapped_once(engine)


@pytest.mark.parametrize("fail_at", ["deepspeed.initialize", "later pillar apply", "after every attach"])
def test_failed_initialize_restores_every_patched_global(dist_env, tmp_path, monkeypatch, fail_at):
    import deepspeed

    import titan_ds.engine as te
    original = _stage3_globals()
    if fail_at == "deepspeed.initialize":
        def boom(*a, **kw):
            assert _stage3_globals()[0] is not original[0]  # HMS's swapper factory is in place during the call
            raise RuntimeError("injected failure")
        monkeypatch.setattr(deepspeed, "initialize", boom)
    elif fail_at == "later pillar apply":
        from titan_ds.pillar import Pillar as PillarBase
        bad = types.ModuleType("titan_ds._fake_failing")

        class Failing(PillarBase):
            key = "compression"

            def apply(self, ctx):
                raise RuntimeError("injected failure")
        bad.PILLAR = Failing
        monkeypatch.setitem(sys.modules, bad.__name__, bad)
        monkeypatch.setattr(te, "PILLARS", (te.PILLARS[0], PillarEntry("compression", bad.__name__)))
    else:  # compression installed its ZeRO-3 dispatcher (a module global) before this
        def boom(engine):
            assert _stage3_globals()[2] is not original[2]
            raise RuntimeError("injected failure")
        monkeypatch.setattr(te, "_install_nonfinite_guard", boom)
    with pytest.raises(RuntimeError, match="injected failure"):
        _hms_engine(tmp_path, compression=True)
    now = _stage3_globals()
    assert all(a is b for a, b in zip(now, original)), (now, original)
