"""The README is a user's guide held to a line budget, and every figure in it is in the results file it links.

The rule, for README.md (and for the tables of docs pages whose last column is "measured by"):
- The text is cut into units: a table row, a paragraph, a list item. Fenced and indented code blocks, headings and
  image lines are not units.
- A *figure* is a number written in digits outside inline code (`...`), outside a link's target, and not part of a
  name (`ZeRO-3`, `GPT-2`: a number right after a letter and a hyphen; `4-bit`: a number followed by a hyphen
  and a letter). Settings that are not measurements are written in words or in inline code.
- A unit with a figure must link at least one file under results/ that git tracks, and each figure must occur in
  one of the files the unit links, as written (sign and decimals included, not as part of a longer number), or be
  one of the explicit derivations in DERIVED (a ratio of two numbers of the same file, rounded as shown).
Fast tier: reads files only.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_LINE_BUDGET = 250
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?![\d]|\.\d|-[A-Za-z])")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CODE_SPAN = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")

# Figures computed from a results file rather than copied from it: {figure: (file, numerator, denominator)}.
# Each operand must be in the file and numerator / denominator, rounded to the figure's decimals, must be the figure.
DERIVED: dict[str, tuple[str, str, str]] = {
    # HMS + AdamW's largest model under 2 GiB over ZeRO-Infinity's
    "16.9": ("results/hms_scale_zinf.md", "1205.431", "71.372"),
    # ... and under 4 GiB (ZeRO-Infinity's figure quoted in the HMS search's file from hms_scale_zinf_layer.md)
    "14.0": ("results/hms_scale_gdisk4.md", "3090.805", "220.217"),
    # ... and under 8 GiB, where HMS stopped at the disk's limit (a lower bound)
    "6.9": ("results/hms_scale_gdisk8.md", "3898.823", "567.523"),
    # the parameter read pool against fresh buffers at 907.7M, two invocations (docs/hms.md)
    "0.786": ("results/hms_ppool_900m.speed.md", "32.471", "41.286"),
    "0.985": ("results/hms_ppool_900m_r.speed.md", "36.575", "37.130"),
    "0.844": ("results/hms_ppool_900m_3.speed.md", "32.483", "38.479"),
    # HMS like for like over ZeRO-Infinity, run by run (docs/hms.md)
    "0.66": ("results/hms_speed_1207b.speed.md", "1.80", "2.73"),
    "0.72": ("results/hms_speed_1207b.speed.md", "1.60", "2.23"),
    "0.71": ("results/hms_speed_1207b.speed.md", "1.82", "2.55"),
    # the 5.04B step with titan.hms.gradient_store over without it, and over the bound without the gradient's bytes
    "0.910": ("results/hms_gstore_5b.speed.md", "105.651", "116.063"),
    "3.288": ("results/hms_gstore_5b.speed.md", "105.651", "32.129"),
}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def units(text: str) -> list[tuple[str, str, bool]]:
    """(unit text, first line, is a table row) for every table row, paragraph and list item outside code."""
    out: list[tuple[str, str, bool]] = []
    block: list[str] = []
    fenced = False

    def flush():
        if block:
            out.append(("\n".join(block), block[0], False))
            block.clear()

    for line in text.splitlines():
        if line.startswith("```"):
            flush()
            fenced = not fenced
            continue
        if fenced or line.startswith("    ") and not block or not line.strip() or line.startswith("#") \
                or line.startswith("!["):
            flush()
            continue
        if line.startswith("|"):
            flush()
            if not all(set(c) <= set("-: ") for c in _cells(line)):
                out.append((line, line, True))
            continue
        if re.match(r"\s*[-*] ", line):
            flush()
        block.append(line)
    flush()
    return out


def figures(unit: str) -> list[str]:
    text = LINK_TARGET.sub("]", CODE_SPAN.sub(" ", unit)).replace("*", "")
    found = []
    for m in NUMBER.finditer(text):
        before = text[max(0, m.start() - 2):m.start()]
        if len(before) == 2 and before[1] == "-" and before[0].isalpha():
            continue  # a name: ZeRO-3, GPT-2
        found.append(m.group())
    return found


def _links(unit: str, page: Path) -> list[str]:
    """The results files a unit links, as paths relative to the repository root."""
    out = []
    for target in LINK.findall(CODE_SPAN.sub(" ", unit)):
        path = (page.parent / target).resolve()
        try:
            rel = path.relative_to(ROOT).as_posix()
        except ValueError:
            continue
        if rel.startswith("results/"):
            out.append(rel)
    return out


def _in_text(num: str, text: str) -> bool:
    return re.search(r"(?<![\d.])" + re.escape(num) + r"(?![\d]|\.\d)", text) is not None


def _derived(num: str, path: str, text: str) -> bool:
    if num not in DERIVED or DERIVED[num][0] != path:
        return False
    _, a, b = DERIVED[num]
    decimals = len(num.split(".")[1]) if "." in num else 0
    return _in_text(a, text) and _in_text(b, text) and f"{float(a) / float(b):.{decimals}f}" == num


def _tracked() -> set[str]:
    return set(subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.split())


def problems(text: str, tracked: set[str], page: Path, rows_only: bool = False) -> list[str]:
    """Every figure of the page's units (only the "measured by" tables' rows with rows_only) not in its files."""
    found = []
    header = None
    for unit, first, is_row in units(text):
        if is_row:
            cells = _cells(unit)
            if header is None or not unit.startswith("|") or cells == header:
                header = cells
                continue
            if rows_only and header[-1] != "measured by":
                continue
        else:
            header = None
            if rows_only:
                continue
        nums = figures(unit)
        if not nums:
            continue
        label = first[:70]
        links = _links(unit, page)
        if not links:
            found.append(f"{label!r}: figures {nums} but no results file linked")
            continue
        missing = [p for p in links if p not in tracked]
        if missing:
            found.append(f"{label!r}: {missing} not committed")
            continue
        texts = {p: (ROOT / p).read_text() for p in links}
        for num in nums:
            if not any(_in_text(num, t) or _derived(num, p, t) for p, t in texts.items()):
                found.append(f"{label!r}: {num} is in none of {links}")
    return found


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_readme_is_within_its_line_budget():
    assert len(_readme().splitlines()) <= README_LINE_BUDGET


def test_readme_units_are_found():
    checked = [u for u, _, _ in units(_readme()) if figures(u)]
    joined = "\n".join(checked)
    assert len(checked) >= 12, checked  # the profile table's rows and the HMS / plan / compression paragraphs
    for expected in ("titan_memory", "titan_balanced", "hf_asdt_8bit", "plan", "ZeRO-Infinity", "32 workers"):
        assert expected in joined, expected


def test_every_readme_figure_is_in_the_results_file_it_links():
    assert problems(_readme(), _tracked(), ROOT / "README.md") == []


def test_derivations_hold():
    for num, (path, _, _) in DERIVED.items():
        assert _derived(num, path, (ROOT / path).read_text()), num


@pytest.mark.parametrize("old,new", [
    ("27.5 MiB (0.100)", "27.5 MiB (0.101)"),        # a table cell
    ("| 0.95 |", "| 0.96 |"),                        # a speed cell
    ("within 14.0% of", "within 12.0% of"),          # prose
    ("71.372M, 16.9x", "71.372M, 17.9x"),            # a derived figure
    ("nats at 105.3x fewer", "nats at 105x fewer"),  # a rounded figure is not the figure
])
def test_a_changed_figure_is_caught(old, new):
    readme = _readme()
    assert old in readme
    found = problems(readme.replace(old, new, 1), _tracked(), ROOT / "README.md")
    assert found, (old, new)


def test_a_figure_without_a_link_is_caught():
    found = problems("Trains 3.5x faster than anything.\n", _tracked(), ROOT / "README.md")
    assert found and "no results file linked" in found[0]


def test_names_settings_and_code_are_not_figures():
    assert figures("ZeRO-3 and GPT-2 with `lr 1e-3`, 4-bit states, [w8](results/x_8.md)") == []
    assert figures("0.94x plain, -0.0085 nats, 13.6%") == ["0.94", "-0.0085", "13.6"]


# docs/log.md is the dated measurement history, not a reference page. Pages still waiting for their history to
# move there are listed in NOT_YET_REFERENCE until they are rewritten.
NOT_YET_REFERENCE: set[str] = set()
DOC_PAGES = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "log.md" and p.name not in NOT_YET_REFERENCE)


@pytest.mark.parametrize("page", DOC_PAGES, ids=[p.name for p in DOC_PAGES])
def test_docs_headline_tables_figures_are_in_their_results_files(page):
    assert problems(page.read_text(), _tracked(), page, rows_only=True) == []


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOC_PAGES, ROOT / "docs" / "log.md"],
                         ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    """A moved page or file leaves no broken link behind (anchors are not checked)."""
    text = CODE_SPAN.sub(" ", page.read_text())
    broken = [t for t in LINK.findall(text) if "://" not in t and not t.startswith(("mailto:", "#"))
              and not (page.parent / t).exists()]
    assert broken == []
