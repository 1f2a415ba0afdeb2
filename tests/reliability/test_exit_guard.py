"""A 2-rank CPU (gloo) job must not abort with SIGABRT at interpreter exit after it has finished.

torch 2.13's gloo worker thread can be the last holder of a collective's tensors; it then needs the GIL after the
main thread has begun finalizing and the process dies in ``std::terminate`` (exit 134), see
``titan_ds.utils.guard_interpreter_exit``. The job below is plain ``torch.distributed``: the race is torch's, and
it shows without DeepSpeed. ``titan_ds.initialize`` (and every harness here) installs the guard.
"""
import subprocess
import sys

import pytest

from tests.helpers.launch import ROOT, clean_env
from titan_ds import utils
from titan_ds.utils import free_port

# Ends right after a blocking all_gather of tensors that carry Python attributes (as DeepSpeed's do).
JOB = r"""
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
if os.environ.get("TITAN_TEST_GUARD") == "1":
    from titan_ds.utils import guard_interpreter_exit
    assert guard_interpreter_exit()
x = torch.randn(1000); x.tag = 1
outs = [torch.empty_like(x) for _ in range(2)]
for t in outs:
    t.tag = 1
dist.all_gather(outs, x)
"""


def _job(guard: bool) -> list[int]:
    """Exit codes of the two ranks of one run of JOB."""
    env = dict(clean_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               TITAN_TEST_GUARD="1" if guard else "0")
    procs = [subprocess.Popen([sys.executable, "-c", JOB], cwd=ROOT, env=dict(env, RANK=str(r)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(2)]
    codes = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode in (0, -6, 134), err[-2000:]  # a clean exit or the abort; anything else is a bug
        codes.append(p.returncode)
    return codes


def test_guard_registers_once_and_settles_only_where_gloo_threads_run(monkeypatch):
    registered = []
    monkeypatch.setattr(utils, "_exit_guarded", False)
    monkeypatch.setattr(utils.atexit, "register", registered.append)
    assert utils.guard_interpreter_exit() is True
    assert utils.guard_interpreter_exit() is False  # idempotent: one handler however many engines
    assert registered == [utils._settle_gloo_workers]
    slept = []
    monkeypatch.setattr(utils.time, "sleep", slept.append)
    monkeypatch.setattr(utils, "_gloo_worker_threads", lambda: 0)
    assert utils._settle_gloo_workers() is False and slept == []  # no gloo threads: exit is not slowed down
    monkeypatch.setattr(utils, "_gloo_worker_threads", lambda: 2)
    assert utils._settle_gloo_workers() is True and slept == [utils.GLOO_SETTLE_S]


def test_gloo_worker_threads_are_counted():
    # gloo starts its worker threads asynchronously: on a loaded machine none may exist yet right after
    # init_process_group returns (seen with a benchmark on the other core), so wait for them (at most 10 s)
    code = ("import time\nimport torch.distributed as d\nfrom titan_ds.utils import _gloo_worker_threads as n\n"
            "before = n()\n"
            f"d.init_process_group('gloo', rank=0, world_size=1, init_method='tcp://127.0.0.1:{free_port()}')\n"
            "t = time.time()\nwhile n() == 0 and time.time() - t < 10:\n    time.sleep(0.01)\n"
            "print(before, n())")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    before, after = map(int, p.stdout.split())
    assert before == 0 and after > 0


@pytest.mark.slow
def test_two_rank_gloo_job_exits_cleanly_with_the_guard():
    """12 runs, guarded: none may abort (unguarded, about 1 run in 4 aborts here: see the next test)."""
    runs = [_job(guard=True) for _ in range(12)]
    assert all(c == [0, 0] for c in runs), runs


@pytest.mark.slow
def test_control_the_race_is_real_without_the_guard():
    """The control: unguarded, the same job aborts within a few runs (8 of 30 here). Stops at the first abort;
    skips, not fails, where this machine never shows it (a torch that fixed it makes the guard unnecessary)."""
    for i in range(40):
        codes = _job(guard=False)
        if any(c in (-6, 134) for c in codes):
            return
    pytest.skip("40 unguarded runs, no abort: this torch/machine does not show the race")
