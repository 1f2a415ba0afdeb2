import subprocess
import time

import pytest

from tests.helpers.launch import run_deepspeed


@pytest.mark.slow
def test_one_rank_dying_ends_the_job_quickly_not_a_hang(tmp_path):
    """Rank 1 vanishes at step 3. The launcher (it polls its ranks every second) must end the job: rank 0 would
    otherwise wait in a collective for the process group's timeout (DeepSpeed's default: 10 minutes). The bound
    is relative to this same run's start-up (imports, rendezvous, engine, 3 steps; measured 14 s on this 2-core
    machine): the tear-down after the death (measured 1.3 s) must take less than that plus 30 s (a loaded
    machine stretches both)."""
    death = tmp_path / "death"
    t0 = time.time()
    try:
        r = run_deepspeed("tests/helpers/rank_dies.py", str(death), num_ranks=2, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job was still running 900 s after launch (rank 1 died: {death.exists()}): a hang")
    t_end = time.time()
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-2000:]
    assert "SURVIVOR FINISHED" not in out
    assert "exits with return code = 17" in out, out[-2000:]  # the launcher names the dead rank and its code
    t_death = float(death.read_text())
    startup, teardown = t_death - t0, t_end - t_death
    assert teardown < startup + 30, f"start-up {startup:.1f} s, tear-down after the death {teardown:.1f} s"
