"""`python -m launch.bench`: every suite names a script that exists, and the index finds every maintained result
with its command and a headline read from its table."""
from __future__ import annotations

import re

from launch.bench.__main__ import RESULTS, ROOT, SUITES, build_index, main


def test_every_suite_script_exists_and_every_result_names_a_suite():
    assert all((ROOT / script).is_file() for script, _ in SUITES.values())
    assert {r.suite for r in RESULTS} <= set(SUITES)


def test_index_has_a_command_and_a_headline_for_every_result():
    rows = [line for line in build_index().splitlines() if line.startswith("| ") and "| suite |" not in line]
    assert len(rows) == len(RESULTS)
    for row in rows:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip("|"))]
        assert cells[2] not in ("`-`", "-") and cells[-1] not in ("missing", ""), row


def test_unknown_suite_is_refused_naming_the_choices():
    import pytest
    with pytest.raises(SystemExit, match="frontier"):
        main(["no-such-suite"])


def test_the_committed_index_is_the_generated_one():
    """results/INDEX.md is never edited by hand: after a results file is committed, `python -m launch.bench index`
    rewrites it (its SHA column names the commit that last changed each file, so commit the results first)."""
    assert (ROOT / "results" / "INDEX.md").read_text() == build_index(), "run: python -m launch.bench index"
