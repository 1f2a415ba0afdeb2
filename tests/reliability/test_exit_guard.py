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
    # init_process_group returns (seen with a benchmark on the other core), so wait for them: the loop ends as
    # soon as they exist; 120 s only bounds a run where they never appear
    code = ("import time\nimport torch.distributed as d\nfrom titan_ds.utils import _gloo_worker_threads as n\n"
            "before = n()\n"
            f"d.init_process_group('gloo', rank=0, world_size=1, init_method='tcp://127.0.0.1:{free_port()}')\n"
            "t = time.monotonic()\nwhile n() == 0 and time.monotonic() - t < 120:\n    time.sleep(0.01)\n"
            "print(before, n())")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    before, after = map(int, p.stdout.split())
    assert before == 0 and after > 0


def _aborted(codes: list[int]) -> bool:
    return any(c in (-6, 134) for c in codes)


@pytest.mark.slow
@pytest.mark.heavy
def test_guarded_job_exits_cleanly_while_the_unguarded_one_aborts():
    """Guarded and unguarded runs of the same job, alternated, so both see the same machine and load (how often
    the race shows depends on both: 8 of 30 unguarded runs aborted here once, 1 of 12 on a busier day). The
    unguarded runs are the measured baseline: the test goes on until they have aborted twice, and for at least
    12 pairs, at most 40; no guarded run may abort. Where no unguarded run aborts in 40 it skips (a torch that
    fixed the race makes the guard unnecessary), after checking the guarded runs all the same."""
    guarded, unguarded = [], []
    while len(guarded) < 40 and (len(guarded) < 12 or sum(map(_aborted, unguarded)) < 2):
        unguarded.append(_job(guard=False))
        guarded.append(_job(guard=True))
        assert not _aborted(guarded[-1]), (guarded, unguarded)
    assert all(c == [0, 0] for c in guarded), guarded
    if not any(map(_aborted, unguarded)):
        pytest.skip(f"{len(unguarded)} unguarded runs, no abort: this torch/machine does not show the race")
