"""The one results store of the benchmarks: every finished row of every suite is one JSON line in
the suite's ``<out>.jsonl``, and every table is regenerated from that file by a command, never edited by hand.

A record is ``{"suite", "row", "config_hash", "settings_hash", "seed", "git_sha", "code_hash", "dirty",
"date", "config", "settings", "result"}``: ``config`` is what makes the row (its ds_config and arguments),
``settings`` what the suite says fixes a result besides it (steps, ranks, data), both hashed as canonical JSON
(:func:`digest`); ``code_hash`` hashes the git trees of the code that ran (``code_paths``, default ``titan_ds``
and ``launch/train.py``) plus any uncommitted change to them (then ``dirty`` is true).

**The resume rule** (:meth:`Store.find`, written once): a rerun reuses a record iff (suite, row, config hash,
settings hash, seed) match AND its code hash is this checkout's; with ``reuse_stale=True`` (the suites'
``--reuse-stale``) a record from other code is reused too, and a table marks its row (:func:`stale_flags`).
Everything else runs again; where several records match, the last one wins. A record is appended and flushed
the moment its row finishes, so a killed run loses at most the row in flight. A record without these keys (a
results file written before the store) is read through the suite's ``legacy`` function (``raw -> {"row",
"config" or "config_hash", "settings", "seed", "result"}``, KeyError: skip the line) as "code unknown":
reused only with ``reuse_stale``, and always there for ``python -m launch.bench table SUITE``.

    from launch.bench.store import Store
    store = Store("results/speed.jsonl", suite="speed")              # reuse_stale=a.reuse_stale
    for name, cfg in rows:                                           # runs only what the rule does not reuse
        rec = store.get(name, config=cfg, settings={"steps": 100}, seed=0, run=lambda: measure(cfg))
    table = render(store.latest(settings={"steps": 100}))            # a table comes from the store only

A suite adds ``--reuse-stale`` with :func:`add_store_args`, and a ``table(out)`` function that rewrites its table
from the store alone, listed in ``TABLES`` of ``launch/bench/__main__.py`` (``python -m launch.bench table SUITE``).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

__all__ = ["Store", "digest", "code_identity", "stale_flags", "fields_identity", "STALE_MARK", "STALE_NOTE",
           "add_store_args"]

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("suite", "row", "config_hash", "settings_hash", "seed")
CODE_PATHS = ("titan_ds", "launch/train.py")
STALE_MARK = " (stale)"
STALE_NOTE = ("(stale): reused with --reuse-stale from other code than the table's newest row (its git_sha and "
              "code_hash are in the jsonl).")


def digest(obj: Any) -> str:
    """16 hex digits of the sha256 of ``obj`` as canonical JSON (sorted keys, ``json.dumps``'s separators)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _git(*args: str) -> Optional[str]:
    try:
        p = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def code_identity(paths: Sequence[str] = CODE_PATHS) -> dict[str, Any]:
    """``{"git_sha", "code_hash", "dirty"}`` of this checkout: the hash covers the committed trees of ``paths``
    and the bytes of any uncommitted or untracked change under them. Outside git: all None (code unknown)."""
    sha = _git("rev-parse", "HEAD")
    trees = _git("rev-parse", *[f"HEAD:{p}" for p in paths])
    if sha is None or trees is None:
        return {"git_sha": None, "code_hash": None, "dirty": None}
    diff = _git("diff", "HEAD", "--binary", "--", *paths) or ""
    untracked = (_git("ls-files", "--others", "--exclude-standard", "--", *paths) or "").split()
    extra = [(f, hashlib.sha256((ROOT / f).read_bytes()).hexdigest()) for f in sorted(untracked)]
    return {"git_sha": sha.strip(), "code_hash": digest([trees.split(), diff, extra]), "dirty": bool(diff or extra)}


def fields_identity(result: dict, config: Sequence[str], settings: Sequence[str]) -> dict[str, Any]:
    """``{"row", "config", "settings", "seed"}`` of a suite's flat result that carries its own key fields (its
    ``seed`` field; a field it lacks reads None): for :meth:`Store.find`/``append`` as ``**identity``, and for
    ``legacy`` as ``{**identity, "result": raw}``."""
    cfg = {k: result.get(k) for k in config}
    return {"row": " ".join(f"{k}={v}" for k, v in cfg.items()), "config": cfg,
            "settings": {k: result.get(k) for k in settings}, "seed": result.get("seed")}


def add_store_args(p: Any) -> None:
    """The one flag every suite gives its store."""
    p.add_argument("--reuse-stale", action="store_true",
                   help="reuse finished rows recorded by other code (or by a script from before the store); the "
                        "table marks them '(stale)'")


class Store:
    """One suite's records in ``path`` (jsonl). ``legacy`` reads a line written before the store (see the module
    docstring); ``code_paths``: what :func:`code_identity`
    hashes (add the suite's script where the measuring code lives in it)."""

    def __init__(self, path: str | os.PathLike, suite: str, *, reuse_stale: bool = False,
                 legacy: Optional[Callable[[dict], tuple]] = None, code_paths: Sequence[str] = CODE_PATHS):
        self.path, self.suite, self.reuse_stale = Path(path), suite, reuse_stale
        self._code_paths, self._code = tuple(code_paths), None
        self.records: list[dict] = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    rec = self._read(json.loads(line), legacy)
                    if rec is not None:
                        self.records.append(rec)

    def _read(self, raw: dict, legacy: Optional[Callable[[dict], tuple]]) -> Optional[dict]:
        if all(k in raw for k in KEYS) and "result" in raw:
            return raw
        if legacy is None:
            raise ValueError(f"{self.path}: a line without the store's keys {KEYS} and no legacy reader for suite "
                             f"{self.suite!r}; give Store(..., legacy=...) or move the file aside")
        try:
            old = legacy(raw)
        except KeyError:
            return None
        config = old.get("config")
        return {"suite": self.suite, "row": old["row"], "config_hash": old.get("config_hash") or digest(config),
                "settings_hash": digest(old["settings"]), "seed": old["seed"], "git_sha": None, "code_hash": None,
                "dirty": None, "date": raw.get("date"), "config": config, "settings": old["settings"],
                "result": old["result"]}

    @property
    def code(self) -> dict[str, Any]:
        if self._code is None:  # one git call per store, made only when a rule needs it
            self._code = code_identity(self._code_paths)
        return self._code

    def _key(self, row: str, config: Any, settings: Any, seed: Any) -> tuple:
        return (self.suite, row, digest(config), digest(settings), seed)

    def find(self, row: str, *, config: Any, settings: Any, seed: Any = 0) -> Optional[dict]:
        """THE resume rule: the last record with this key and this checkout's code hash (or any code hash, the
        code-unknown ones included, when ``reuse_stale``); None: run it."""
        key = self._key(row, config, settings, seed)
        for rec in reversed(self.records):
            if tuple(rec[k] for k in KEYS) == key and (
                    self.reuse_stale or (rec["code_hash"] is not None and rec["code_hash"] == self.code["code_hash"])):
                return rec
        return None

    def append(self, row: str, *, config: Any, settings: Any, seed: Any = 0, result: dict) -> dict:
        """Record a finished row at once (appended and flushed to disk before this returns)."""
        rec = {"suite": self.suite, "row": row, "config_hash": digest(config), "settings_hash": digest(settings),
               "seed": seed, **self.code, "date": datetime.date.today().isoformat(), "config": config,
               "settings": settings, "result": result}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records.append(rec)
        return rec

    def get(self, row: str, *, config: Any, settings: Any, seed: Any = 0, run: Callable[[], dict],
            keep: Callable[[dict], bool] = lambda result: True) -> dict:
        """The reusable record of this row, else ``run()``'s result recorded at once (only where ``keep(result)``:
        a failed run returned unrecorded runs again next time). Returns the record."""
        rec = self.find(row, config=config, settings=settings, seed=seed)
        if rec is not None:
            return rec
        result = run()
        if not keep(result):
            return {"suite": self.suite, "row": row, "seed": seed, "result": result}  # not recorded
        return self.append(row, config=config, settings=settings, seed=seed, result=result)

    def newest_settings(self) -> Any:
        """The settings of the newest record (by date, then file order): what a suite's ``table(out)`` regenerates
        its table under, read from the store instead of back from the table it wrote."""
        if not self.records:
            raise ValueError(f"{self.path}: no records of suite {self.suite!r} to take the settings from")
        return self.records[_newest(self.records)]["settings"]

    def latest(self, *, settings: Any = None, rows: Optional[Iterable[str]] = None) -> list[dict]:
        """For each (row, config, settings, seed): its last record, in the order first recorded; only those
        under ``settings`` and in ``rows`` where given. What a table is rendered from."""
        want = None if rows is None else set(rows)
        sh = None if settings is None else digest(settings)
        last: dict[tuple, dict] = {}
        for rec in self.records:
            if (sh is None or rec["settings_hash"] == sh) and (want is None or rec["row"] in want):
                k = tuple(rec[k] for k in KEYS)
                last.pop(k, None)
                last[k] = rec
        order = {tuple(r[k] for k in KEYS): i for i, r in reversed(list(enumerate(self.records)))}
        return sorted(last.values(), key=lambda r: order[tuple(r[k] for k in KEYS)])


def stale_flags(records: Sequence[dict]) -> list[bool]:
    """Which of a table's records came from other code than its newest record (by date, then file order): the
    rows a ``--reuse-stale`` run reused. Decided from the records alone, so regenerating a table marks the same
    rows; a table made only of records from before the store (code unknown) marks none."""
    if not records:
        return []
    code = records[_newest(records)].get("code_hash")
    return [r.get("code_hash") != code for r in records]


def _newest(records: Sequence[dict]) -> int:
    """The index of the newest of ``records`` (by date, then file order)."""
    return max(range(len(records)), key=lambda i: (records[i].get("date") or "", i))
