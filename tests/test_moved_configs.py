"""A ds_config that left ds_configs/ fails with an error naming its new place and the profile to use instead, and
the table of moved names agrees with the repository (each moved file is where it says, none is back in ds_configs/)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from titan_ds.config import TitanConfigError, load_ds_config
from titan_ds.moved_configs import MOVED, moved_message

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(MOVED))
def test_every_moved_config_is_where_the_table_says(name):
    new, instead = MOVED[name]
    assert (ROOT / new).is_file() and not (ROOT / "ds_configs" / name).exists()
    assert instead is None or (ROOT / "ds_configs" / instead).is_file()


def test_loading_an_old_path_names_the_new_place_and_the_replacement():
    with pytest.raises(TitanConfigError) as e:
        load_ds_config("ds_configs/titan_full.json")
    msg = str(e.value)
    assert "launch/experiments/configs/titan_full.json" in msg and "ds_configs/titan_memory.json" in msg


def test_other_missing_paths_keep_the_plain_error():
    assert moved_message("ds_configs/no_such.json") is None and moved_message("elsewhere/titan_full.json") is None
    with pytest.raises(TitanConfigError, match="does not exist or is not a file"):
        load_ds_config("ds_configs/no_such.json")


def test_train_script_refuses_an_old_path_with_the_new_place():
    r = subprocess.run([sys.executable, "launch/train.py", "--deepspeed_config", "ds_configs/demo.json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "tests/configs/demo.json" in r.stderr, r.stderr[-2000:]
