"""Run a command under a hard memory cap (a cgroup v1 memory controller, as root) and measure its peak.

This is how "does it fit in X GiB" is answered fast: ``launch/bench/hms_scale.py`` bisects model sizes under
a cap, and ``titan-ds plan``'s accuracy table and test train the config it wrote under the cap it was given.

The cap is ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` (so it cannot swap). The kernel
charges page cache to the group too and reclaims it before it kills, so ``max_usage_bytes`` (the kernel's
high-water mark) tends toward the cap for any job that writes files; the figure that says what the job itself
needs is ``peak_anon_bytes``, the largest ``rss + shmem`` of the group seen by sampling ``memory.stat``
every ``sample_s`` (anonymous memory and /dev/shm, which DeepSpeed's CPU collectives use; page cache out).
"""
from __future__ import annotations

import itertools
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

__all__ = ["CapResult", "cgroup_available", "run_capped", "CGROUP_ROOT"]

CGROUP_ROOT = "/sys/fs/cgroup/memory"
_counter = itertools.count()


@dataclass
class CapResult:
    returncode: Optional[int]      # None: killed at the timeout
    oom_killed: bool               # the kernel's OOM killer acted inside the group
    max_usage_bytes: int           # memory.max_usage_in_bytes: includes page cache
    peak_anon_bytes: int           # sampled max of rss + shmem (what the job itself holds)
    wall_s: float
    timed_out: bool = False
    peak_stat: Optional[dict] = None  # the group's memory.stat at the sampled peak (rss, shmem, cache, ...)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.oom_killed and not self.timed_out


def cgroup_available() -> bool:
    """True where this process may create a memory cgroup (cgroup v1 mounted, running as root)."""
    return os.path.isfile(os.path.join(CGROUP_ROOT, "memory.memsw.limit_in_bytes")) and os.access(
        CGROUP_ROOT, os.W_OK)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _stat(group: str) -> dict[str, int]:
    out = {}
    try:
        with open(os.path.join(group, "memory.stat")) as f:
            for line in f:
                k, v = line.split()
                out[k] = int(v)
    except (OSError, ValueError):
        pass
    return out


def _oom_kills(group: str) -> int:
    try:
        with open(os.path.join(group, "memory.oom_control")) as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _procs(group: str) -> list[int]:
    try:
        with open(os.path.join(group, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def run_capped(cmd: Sequence[str], cap_bytes: int, *, env: Optional[Mapping[str, str]] = None,
               cwd: Optional[str] = None, timeout: Optional[float] = None, stdout=None, stderr=None,
               sample_s: float = 0.05) -> CapResult:
    """Run ``cmd`` (and everything it starts) in a fresh memory cgroup capped at ``cap_bytes``; remove the
    cgroup afterwards. Raises ``PermissionError`` (with the fix) where cgroups cannot be created."""
    if not cgroup_available():
        raise PermissionError(f"run_capped needs a cgroup v1 memory controller at {CGROUP_ROOT} and root; run as "
                              f"root on Linux, or measure without a cap")
    group = os.path.join(CGROUP_ROOT, f"titan_cap_{os.getpid()}_{next(_counter)}")
    os.mkdir(group)
    try:
        _write(os.path.join(group, "memory.limit_in_bytes"), str(int(cap_bytes)))
        _write(os.path.join(group, "memory.memsw.limit_in_bytes"), str(int(cap_bytes)))
        procs_file = os.path.join(group, "cgroup.procs")
        # The child joins the group itself (a shell writes its pid, then execs cmd: everything it starts stays in
        # the group) rather than through preexec_fn: that forces a real fork() of this process, which the kernel's
        # overcommit check refused (ENOMEM) for a large pytest worker, where Popen's vfork path needs no copy.
        wrapped = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', procs_file, *cmd]

        peak: list = [0, None]
        done = threading.Event()

        def sample():
            while not done.is_set():
                s = _stat(group)
                anon = s.get("rss", 0) + s.get("shmem", 0)
                if anon > peak[0]:
                    peak[0], peak[1] = anon, s
                done.wait(sample_s)

        t0 = time.perf_counter()
        proc = subprocess.Popen(wrapped, env=None if env is None else dict(env), cwd=cwd, stdout=stdout,
                                stderr=stderr, start_new_session=True)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        timed_out = False
        try:
            rc: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out, rc = True, None
        finally:
            done.set()
            sampler.join()
        wall = time.perf_counter() - t0
        with open(os.path.join(group, "memory.max_usage_in_bytes")) as f:
            max_usage = int(f.read())
        oom = _oom_kills(group) > 0
        return CapResult(returncode=rc, oom_killed=oom, max_usage_bytes=max_usage, peak_anon_bytes=peak[0],
                         wall_s=wall, timed_out=timed_out, peak_stat=peak[1])
    finally:
        for _ in range(100):  # whatever is left (launcher children, a timed-out run) goes with the group
            pids = _procs(group)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        try:
            proc.wait(timeout=5)  # type: ignore[possibly-undefined]
        except Exception:  # never started, or already reaped
            pass
        try:
            os.rmdir(group)
        except OSError:
            pass
