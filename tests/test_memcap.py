"""titan_ds.memcap: a hard memory cap for a command, its measured peak, and no cgroup left behind."""
from __future__ import annotations

import os
import sys

import pytest

from titan_ds import memcap
from titan_ds.memcap import CGROUP_ROOT, cgroup_available, run_capped

pytestmark = pytest.mark.skipif(not cgroup_available(), reason="needs root and a cgroup v1 memory controller")
MiB = 1 << 20
# Touch n MiB, say so (a "ready" file), and hold the memory until the test says "go". The 60 s is only a safety net
# for a broken sampler: the child is released by an event, not by a sleep long enough for a sample to land.
TOUCH = ("import os, time; b = bytearray({n} << 20); b[::4096] = b'x' * len(b[::4096]); open({ready!r}, 'w').close()\n"
         "t = time.monotonic()\nwhile not os.path.exists({go!r}) and time.monotonic() - t < 60:\n    time.sleep(0.01)")


def _groups():
    return {d for d in os.listdir(CGROUP_ROOT) if d.startswith(f"titan_cap_{os.getpid()}_")}


def _touch(tmp_path, monkeypatch, n: int) -> list[str]:
    """The command that touches n MiB, and run_capped's sampler made to release it: the first memory.stat
    sample taken after the child's "ready" file exists (its memory is all touched) creates "go"."""
    ready, go = str(tmp_path / f"ready{n}"), str(tmp_path / f"go{n}")
    read_stat = memcap._stat

    def sampled(group):
        touched = os.path.exists(ready)
        stat = read_stat(group)
        if touched:
            open(go, "w").close()
        return stat

    monkeypatch.setattr(memcap, "_stat", sampled)
    return [sys.executable, "-c", TOUCH.format(n=n, ready=ready, go=go)]


def test_fits_and_measures_the_peak(tmp_path, monkeypatch):
    base = run_capped(_touch(tmp_path, monkeypatch, 0), 1024 * MiB)  # the interpreter alone, measured here
    r = run_capped(_touch(tmp_path, monkeypatch, 300), 1024 * MiB)
    assert base.ok and r.ok and not r.oom_killed
    # the 300 MiB touched, above the interpreter's own peak (measured: 300.11-300.14 MiB above a 4.6 MiB baseline)
    assert 300 * MiB <= r.peak_anon_bytes
    assert 299 * MiB <= r.peak_anon_bytes - base.peak_anon_bytes <= 316 * MiB, (r.peak_anon_bytes, base.peak_anon_bytes)
    assert r.max_usage_bytes >= r.peak_anon_bytes
    assert not _groups()


def test_over_the_cap_is_killed_not_swapped(tmp_path, monkeypatch):
    r = run_capped(_touch(tmp_path, monkeypatch, 600), 400 * MiB)
    assert r.oom_killed and not r.ok and r.returncode != 0
    assert r.max_usage_bytes <= 400 * MiB
    assert not _groups()


def test_timeout_kills_the_whole_group():
    r = run_capped([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                    "'import time; time.sleep(60)']); time.sleep(60)"], 512 * MiB, timeout=2)
    assert r.timed_out and not r.ok
    assert not _groups()
