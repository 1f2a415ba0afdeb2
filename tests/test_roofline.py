"""docs/gpu.md's roofline and CPU tables are what titan_ds.roofline computes, and the bytes per element follow the
state layouts in the code."""
import re
from pathlib import Path

import pytest

from titan_ds import roofline

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "gpu.md"


def _block(name: str) -> str:
    text = DOC.read_text()
    m = re.search(rf"<!-- {name}:begin -->\n(.*?)\n<!-- {name}:end -->", text, re.S)
    assert m, f"docs/gpu.md has no {name} table between its markers"
    return m.group(1)


def test_the_docs_roofline_is_computed():
    assert _block("roofline") == roofline.markdown()


def test_the_docs_cpu_table_is_computed_from_the_results():
    assert _block("cpu") == roofline.cpu_markdown(str(ROOT))


def test_bytes_per_element_follow_the_layouts():
    pytest.importorskip("torchao")
    from titan_ds.optim import qstate
    by = {r.optimizer: r for r in roofline.rows()}
    assert by["torch AdamW (fused)"].total == 7 * 4  # w, g, m, v read; w, m, v written; fp32
    assert by["titan_balanced"].states == (qstate.nbytes_per_value("8bit"), qstate.nbytes_per_value("4bit"))
    assert by["titan_memory"].states == (qstate.nbytes_per_value("4bit"),) * 2 and by["titan_memory"].weight == 2
    assert by["torchao AdamW8bit"].states[0] == 1 + 4 / 256 and by["torchao AdamW4bit"].states[0] == 0.5 + 4 / 128
    assert by["torch AdamW (fused)"].ms(3.35e12) == pytest.approx(28e9 / 3.35e12 * 1e3)


def test_a_missing_cpu_row_is_named(tmp_path):
    (tmp_path / "results" / "optim_step_avx512").mkdir(parents=True)
    (tmp_path / roofline.CPU_SOURCE).write_text(
        "| optimizer | dtype | M/s 2^24 |\n|---|---|---|\n| adamw_fused | fp32 | 1 |\n")
    with pytest.raises(ValueError, match="torchao_adamw8bit"):
        roofline.cpu_markdown(str(tmp_path))
