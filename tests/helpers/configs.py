"""Where the ds_configs live: the profiles a user picks (ds_configs/), the configs that exist for the tests
(tests/configs/), and the configs of measured methods that are not recommended (launch/experiments/configs/).
Tests that load "every shipped config" load all three, so none of them rots."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIRS = (ROOT / "ds_configs", ROOT / "tests" / "configs", ROOT / "launch" / "experiments" / "configs")


def config_path(name: str) -> Path:
    """The file of config ``name`` (``"hf_trd.json"``), wherever it lives."""
    for d in CONFIG_DIRS:
        if (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"no config {name!r} in {[str(d.relative_to(ROOT)) for d in CONFIG_DIRS]}")


def all_configs(pattern: str = "*.json") -> list[Path]:
    """Every config matching ``pattern`` in the three folders, sorted by name."""
    return sorted((p for d in CONFIG_DIRS for p in d.glob(pattern)), key=lambda p: p.name)
