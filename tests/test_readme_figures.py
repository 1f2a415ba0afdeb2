"""Every number in the README's tables is in a committed results file that the row itself links.

A README table is checked when its last column is "measured by": each row must link at least one file under
results/ that git tracks, and every number of the row's figure columns (all but the first column, the "what it
turns on" column and the links) must occur in one of those files as written (sign and decimals included, not
as part of a longer number). Fast tier: reads files only.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?")
LINK = re.compile(r"\]\((results/[^)#]+)\)")
TEXT_COLUMNS = {"what it turns on", "what it does"}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def measured_rows(readme: str) -> list[tuple[str, dict[str, str], list[str]]]:
    """(row label, {header: cell} of the figure columns, linked results files) for every checked table row."""
    out, header = [], None
    for line in readme.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = cells
            continue
        if all(set(c) <= set("-: ") for c in cells) or header[-1] != "measured by":
            continue
        figures = {h: c for i, (h, c) in enumerate(zip(header, cells))
                   if 0 < i < len(header) - 1 and h not in TEXT_COLUMNS}
        out.append((cells[0], figures, LINK.findall(cells[-1])))
    return out


def _tracked() -> set[str]:
    return set(subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.split())


def problems(readme: str, tracked: set[str]) -> list[str]:
    found = []
    for label, figures, links in measured_rows(readme):
        if not links:
            found.append(f"{label}: links no results file")
            continue
        missing = [p for p in links if p not in tracked]
        if missing:
            found.append(f"{label}: {missing} not committed")
            continue
        texts = [(ROOT / p).read_text() for p in links]
        for column, cell in figures.items():
            for num in NUMBER.findall(cell.replace("*", "").replace("`", "")):
                pat = re.compile(r"(?<![\d.])" + re.escape(num) + r"(?![\d])")
                if not any(pat.search(t) for t in texts):
                    found.append(f"{label} / {column}: {num} is in none of {links}")
    return found


def test_readme_tables_are_checked():
    rows = measured_rows((ROOT / "README.md").read_text())
    labels = " ".join(label for label, _, _ in rows)
    assert len(rows) >= 12, rows  # the profile table, the demo table and the HMS scale table
    for expected in ("titan_memory", "titan_balanced", "8 GiB"):
        assert expected in labels


def test_every_readme_figure_is_in_the_results_file_its_row_links():
    assert problems((ROOT / "README.md").read_text(), _tracked()) == []


@pytest.mark.parametrize("old,new", [("27.5 MiB (0.100)", "27.5 MiB (0.101)"), ("21.100x", "21.0x")])
def test_a_changed_figure_is_caught(old, new):
    readme = (ROOT / "README.md").read_text()
    assert old in readme
    found = problems(readme.replace(old, new, 1), _tracked())
    assert found and all(new.split()[-1].strip("()x") in p for p in found), found
