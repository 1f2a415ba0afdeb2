"""titan_ds.memcap: a hard memory cap for a command, its measured peak, and no cgroup left behind."""
from __future__ import annotations

import os
import sys

import pytest

from titan_ds.memcap import CGROUP_ROOT, cgroup_available, run_capped

pytestmark = pytest.mark.skipif(not cgroup_available(), reason="needs root and a cgroup v1 memory controller")
MiB = 1 << 20
TOUCH = "import time; b = bytearray({n} << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(0.3)"


def _groups():
    return {d for d in os.listdir(CGROUP_ROOT) if d.startswith(f"titan_cap_{os.getpid()}_")}


def test_fits_and_measures_the_peak():
    r = run_capped([sys.executable, "-c", TOUCH.format(n=300)], 1024 * MiB)
    assert r.ok and not r.oom_killed
    assert 300 * MiB <= r.peak_anon_bytes <= 300 * MiB + 120 * MiB  # the interpreter itself is ~10-40 MiB
    assert r.max_usage_bytes >= r.peak_anon_bytes
    assert not _groups()


def test_over_the_cap_is_killed_not_swapped():
    r = run_capped([sys.executable, "-c", TOUCH.format(n=600)], 400 * MiB)
    assert r.oom_killed and not r.ok and r.returncode != 0
    assert r.max_usage_bytes <= 400 * MiB
    assert not _groups()


def test_timeout_kills_the_whole_group():
    r = run_capped([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                    "'import time; time.sleep(60)']); time.sleep(60)"], 512 * MiB, timeout=2)
    assert r.timed_out and not r.ok
    assert not _groups()
