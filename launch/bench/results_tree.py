"""What stays under results/: the files the index reaches, by one rule (STYLE 25).

A *root* is a maintained result (``RESULTS`` and ``TABLES`` of ``launch/bench/__main__.py``) or a results file that
README.md or a page of docs/ links. A root keeps its *companions*:
- a root in its own folder (``results/diloco/table.md``, ``results/demo/demo.md``): the whole folder;
- a root file ``results/X.md`` (or ``X.speed.md``): every file of its folder named ``X.*`` (its jsonl store, csv,
  plot, disk probe ...) or ``X_s<seed>...`` (its per-seed tables), and every file of its folder it names;
- never what a command regenerates and nobody reads: logs (``*.log``, ``logs/``), traces (``*.trace``), raw
  profiler output (``*.collapsed.txt``, a profile's ``*.timeline.json``; its summary table ``.md`` stays), dated
  copies (a ``YYYY-MM-DD/`` folder) and probes (``*.py``, ``*.sh``: they live in launch/experiments/).

``python -m launch.bench index`` lists each root's companions under the table, so every file that stays is linked
from results/INDEX.md; ``tests/test_results_tree.py`` fails on a tracked file under results/ the index does not
reach, or one over ``MAX_BYTES``.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Iterable

ROOT = Path(__file__).resolve().parents[2]
MAX_BYTES = 1_000_000
REGENERATED = re.compile(r"(\.log|\.trace|\.collapsed\.txt|\.py|\.sh)$|(^|/)logs/|/\d{4}-\d\d-\d\d/"
                         r"|^results/hms_profile/.*\.timeline\.json$")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
__all__ = ["MAX_BYTES", "REGENERATED", "results_files", "doc_links", "companions", "kept", "index_section"]


def results_files() -> list[str]:
    """Files under results/ that git tracks or would add (not ignored), INDEX.md aside."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "results"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    return sorted(p for p in set(out) if p != "results/INDEX.md" and (ROOT / p).is_file())


def doc_links() -> set[str]:
    """The results files README.md and docs/*.md link (paths from the repository root)."""
    found = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]:
        for target in LINK.findall(page.read_text()):
            try:
                rel = (page.parent / target).resolve().relative_to(ROOT).as_posix()
            except ValueError:
                continue
            if rel.startswith("results/") and rel != "results/INDEX.md":
                found.add(rel)
    return found


def companions(root: str, files: Iterable[str]) -> list[str]:
    """The files that stay with ``root`` (itself included when it exists), by the rule of the module docstring."""
    files = [f for f in files if not REGENERATED.search(f)]
    root = root.rstrip("/")
    folder = [f for f in files if f.startswith(root + "/")]
    if folder:  # a result that is a folder
        return folder
    parent, name = root.rsplit("/", 1)
    if parent != "results" and root in files:  # a root file in its own folder
        return [f for f in files if f.startswith(parent + "/")]
    stem = name.split(".")[0]
    text = (ROOT / root).read_text() if root.endswith(".md") and (ROOT / root).is_file() else ""
    out = []
    for f in files:
        fparent, fname = f.rsplit("/", 1)
        if fparent != parent:
            continue
        named = bool(text) and re.search(r"(?<![\w.-])" + re.escape(fname) + r"(?![\w])", text) is not None
        if fname.split(".")[0] == stem or re.match(re.escape(stem) + r"_s\d", fname) or named:
            out.append(f)
    return out


def kept(roots: Iterable[str]) -> dict[str, list[str]]:
    """{root: its companions} for every root that has any."""
    files = results_files()
    out = {}
    for r in sorted(set(roots)):
        c = companions(r, files)
        if c:
            out[r] = c
    return out


def index_section(roots: Iterable[str]) -> list[str]:
    """The lines of INDEX.md that link every file that stays, grouped by its root."""
    lines = ["", "## Every file kept, by the result it belongs to", "",
             "Roots: the results above, the committed tables of `python -m launch.bench table`, and the results",
             "files README.md and docs/ link. Logs, traces, raw profiler output and dated copies are not kept:",
             "the command of each result regenerates them (launch/bench/results_tree.py has the rule).", ""]
    for root, files in kept(roots).items():
        links = ", ".join(f"[{Path(f).relative_to('results').as_posix()}]({Path(f).relative_to('results').as_posix()})"
                          for f in files)
        lines.append(f"- {root}: {links}")
    return lines
