"""launch/bench/store.py: the one resume rule (reuse on a full match from the same code; run again on any change
of config, settings, seed or code; stale records only with reuse_stale, marked), records appended at once (a
run killed mid-row keeps every finished row), and records from before the store read as code unknown."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launch.bench import store as st
from launch.bench.store import Store, digest, stale_flags

CODE_A = {"git_sha": "a" * 40, "code_hash": "code_a", "dirty": False}
CODE_B = {"git_sha": "b" * 40, "code_hash": "code_b", "dirty": True}


@pytest.fixture
def code(monkeypatch):
    """The checkout's code identity, switchable by the test (no git call)."""
    now = dict(CODE_A)
    monkeypatch.setattr(st, "code_identity", lambda paths=st.CODE_PATHS: dict(now))
    return now


def _open(path, **kw):
    return Store(path, suite="t", **kw)


def test_reuse_on_match_and_rerun_on_any_change(tmp_path, code):
    path, calls = tmp_path / "t.jsonl", []

    def run(v):
        return lambda: calls.append(v) or {"val": v}
    s = _open(path)
    key = dict(config={"lr": 1e-3}, settings={"steps": 10}, seed=0)
    assert s.get("a", **key, run=run(1))["result"] == {"val": 1}
    s = _open(path)  # a rerun: a fresh process reading the file
    assert s.get("a", **key, run=run(2))["result"] == {"val": 1} and calls == [1]
    for change in ({"config": {"lr": 3e-3}}, {"settings": {"steps": 11}}, {"seed": 1}):
        assert s.get("a", **{**key, **change}, run=run(3))["result"] == {"val": 3}
    assert s.get("b", **key, run=run(4))["result"] == {"val": 4}  # another row
    assert calls == [1, 3, 3, 3, 4]
    code.update(CODE_B)  # other code: everything runs again
    s = _open(path)
    assert s.get("a", **key, run=run(5))["result"] == {"val": 5}
    assert calls[-1] == 5
    rec = s.find("a", **key)
    assert rec["code_hash"] == "code_b" and rec["dirty"] is True and rec["git_sha"] == "b" * 40
    assert rec["config_hash"] == digest({"lr": 1e-3}) and rec["settings_hash"] == digest({"steps": 10})


def test_stale_records_are_reused_only_when_asked_and_marked(tmp_path, code):
    path = tmp_path / "t.jsonl"
    key = dict(config={"x": 1}, settings={"steps": 3}, seed=0)
    _open(path).append("a", **key, result={"val": 1})
    code.update(CODE_B)
    assert _open(path).find("a", **key) is None
    stale = _open(path, reuse_stale=True)
    assert stale.find("a", **key)["result"] == {"val": 1}
    b = stale.get("b", **key, run=lambda: {"val": 2})  # runs under code B
    a = stale.get("a", **key, run=lambda: pytest.fail("a stale record was not reused"))
    assert stale_flags([a, b]) == [True, False]
    assert stale_flags([b]) == [False]


def test_a_failed_run_is_not_recorded_and_runs_again(tmp_path, code):
    s = _open(tmp_path / "t.jsonl")
    key = dict(config={}, settings={}, seed=0)
    rec = s.get("a", **key, run=lambda: {"status": "failed"}, keep=lambda r: r["status"] == "ok")
    assert rec["result"] == {"status": "failed"} and s.find("a", **key) is None
    assert not (tmp_path / "t.jsonl").exists()


# A fresh interpreter (not a fork of the pytest worker: under pytest-xdist a worker that has run many tests was
# refused os.fork() with ENOMEM once) that records two rows and is SIGKILLed while the third runs.
_KILLED_MID_ROW = """
import json, os, signal, sys
from launch.bench import store as st
code = json.loads(sys.argv[2])
st.code_identity = lambda paths=st.CODE_PATHS: dict(code)
s = st.Store(sys.argv[1], suite="t")
for i in range(3):
    def run(i=i):
        if i == 2:  # the third row is in flight when the run is killed
            os.kill(os.getpid(), signal.SIGKILL)
        return {"val": i}
    s.get(f"r{i}", config={}, settings={}, seed=0, run=run)
"""


def test_a_run_killed_mid_row_keeps_every_finished_row(tmp_path, code):
    path = tmp_path / "t.jsonl"
    root = Path(st.__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-c", _KILLED_MID_ROW, str(path), json.dumps(CODE_A)], cwd=root,
                       env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    s = _open(path)
    assert [r["row"] for r in s.records] == ["r0", "r1"]
    ran = []
    for i in range(3):  # the rerun reuses the finished rows and runs only the one in flight
        s.get(f"r{i}", config={}, settings={}, seed=0, run=lambda i=i: ran.append(i) or {"val": i})
    assert ran == [2]


def test_lines_from_before_the_store_read_as_code_unknown(tmp_path, code):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"name": "a", "k": 1, "val": 2.0}) + "\n" + json.dumps({"other": 1}) + "\n")

    def legacy(raw):
        return {"row": raw["name"], "config": {"k": raw["k"]}, "settings": {}, "seed": 0, "result": raw}
    s = Store(path, suite="t", legacy=legacy)
    assert len(s.records) == 1 and s.records[0]["code_hash"] is None  # the line legacy cannot read is skipped
    assert s.find("a", config={"k": 1}, settings={}) is None  # code unknown: not reused ...
    assert Store(path, suite="t", legacy=legacy, reuse_stale=True).find(  # ... except when asked
        "a", config={"k": 1}, settings={})["result"]["val"] == 2.0
    assert stale_flags(s.records) == [False]  # a table made only of old records marks none
    with pytest.raises(ValueError, match="no legacy reader"):
        Store(path, suite="t")


def test_latest_is_the_last_record_per_key_in_first_recorded_order(tmp_path, code):
    s = _open(tmp_path / "t.jsonl")
    for row, v in (("a", 1), ("b", 2), ("a", 3)):
        s.append(row, config={}, settings={"steps": 1}, seed=0, result={"val": v})
    s.append("c", config={}, settings={"steps": 2}, seed=0, result={"val": 4})
    assert [(r["row"], r["result"]["val"]) for r in s.latest(settings={"steps": 1})] == [("a", 3), ("b", 2)]
    assert len(s.latest()) == 3


def test_newest_settings_are_the_newest_records(tmp_path, code):
    """What a suite regenerates its table under: the settings of the newest record (by date, then file order)."""
    s = _open(tmp_path / "r.jsonl")
    with pytest.raises(ValueError, match="no records"):
        s.newest_settings()
    for steps in (100, 300, 200):
        s.append("a", config={}, settings={"steps": steps}, result={})
    assert s.newest_settings() == {"steps": 200}
    s.records[0]["date"] = "9999-01-01"  # dated later than the others: newest whatever its place in the file
    assert s.newest_settings() == {"steps": 100}


def test_code_identity_changes_with_an_uncommitted_edit(tmp_path, monkeypatch):
    """The real thing, on a scratch git repository: the hash covers the committed tree and any change to it."""
    import subprocess
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("x = 1\n")
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "-A"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "c"], cwd=tmp_path, check=True)
    monkeypatch.setattr(st, "ROOT", tmp_path)
    clean = st.code_identity(("pkg",))
    assert clean["dirty"] is False and clean["code_hash"]
    (tmp_path / "pkg" / "m.py").write_text("x = 2\n")
    dirty = st.code_identity(("pkg",))
    assert dirty["dirty"] is True and dirty["code_hash"] != clean["code_hash"]
    (tmp_path / "pkg" / "m.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "new.py").write_text("y = 1\n")
    assert st.code_identity(("pkg",))["code_hash"] not in (clean["code_hash"], dirty["code_hash"])
