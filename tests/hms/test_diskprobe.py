"""``titan-ds report``'s disk probe: positive speeds, a read-back check, nothing left behind."""
import os

import pytest

from titan_ds.hms.diskprobe import measure_disk


def test_measure_disk_reports_speeds_and_cleans_up(tmp_path):
    out = measure_disk(str(tmp_path), 2, repeats=1)
    for k in ("raw_write_GBps", "raw_read_GBps", "store_write_GBps", "store_read_GBps"):
        assert out[k] > 0
    assert isinstance(out["direct_io"], bool) and out["probe_MiB"] == 2
    assert os.listdir(tmp_path) == []


def test_measure_disk_rejects_zero():
    with pytest.raises(ValueError, match="mb must be >= 1"):
        measure_disk("/tmp", 0)
