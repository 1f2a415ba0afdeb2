"""The code runs on the oldest Python that pyproject.toml declares (``requires-python``): every source file of the
package, the launch scripts, the examples and the tests parses as that version's grammar and uses none of the
standard library's names that came later (a list of the ones a 3.11 habit reaches for)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ("titan_ds", "launch", "examples", "tests")

# name -> the Python that added it; each as it would be written in code
NEWER = {"contextlib.chdir": (3, 11), "tomllib": (3, 11), "ExceptionGroup": (3, 11), "typing.Self": (3, 11),
         "StrEnum": (3, 11), "datetime.UTC": (3, 11), "asyncio.TaskGroup": (3, 11), "asyncio.timeout(": (3, 11),
         "typing.LiteralString": (3, 11), "typing.assert_never": (3, 11), "hashlib.file_digest": (3, 11),
         "itertools.batched": (3, 12), "typing.override": (3, 12)}


def _floor() -> tuple[int, int]:
    text = (ROOT / "pyproject.toml").read_text()
    major, minor = re.search(r'requires-python\s*=\s*">=\s*(\d+)\.(\d+)"', text).groups()
    return int(major), int(minor)


def _sources() -> list[Path]:
    return sorted(p for t in TREES for p in (ROOT / t).rglob("*.py") if p.resolve() != Path(__file__).resolve())


def test_the_floor_is_read():
    assert _floor() == (3, 10) and len(_sources()) > 100


@pytest.mark.parametrize("tree", TREES)
def test_sources_parse_as_the_floor_version(tree):
    floor = _floor()
    bad = []
    for p in _sources():
        if p.relative_to(ROOT).parts[0] != tree:
            continue
        try:
            ast.parse(p.read_text(), filename=str(p), feature_version=floor)
        except SyntaxError as e:
            bad.append(f"{p.relative_to(ROOT)}:{e.lineno}: {e.msg}")
    assert bad == []


def test_no_standard_library_name_newer_than_the_floor():
    floor = _floor()
    names = [n for n, v in NEWER.items() if v > floor]
    pattern = re.compile("|".join(re.escape(n) + (r"\b" if n[-1].isalnum() else "") for n in names))
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in _sources()
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line) and "3.11" not in line]  # a line that names the version handles it
    assert hits == []
