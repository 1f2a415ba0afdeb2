import time

import pytest

from tests.helpers.launch import run_deepspeed


@pytest.mark.slow
def test_one_rank_dying_ends_the_job_quickly_not_a_hang():
    t0 = time.time()
    r = run_deepspeed("tests/helpers/rank_dies.py", num_ranks=2, timeout=300)
    elapsed = time.time() - t0
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-2000:]
    assert "SURVIVOR FINISHED" not in out
    assert elapsed < 240, f"took {elapsed:.0f}s"
    assert "exits with return code = 17" in out, out[-2000:]  # the launcher names the dead rank and its code
