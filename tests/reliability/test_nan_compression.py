"""NaN on one rank's gradient with gradient compression on (2 ranks, ZeRO 0/2/3 with topk/hge/tgss): the step
is skipped on every rank, the compressor's residuals, the optimizer state and the parameters come through it
unchanged, StepMetrics and the log report it, and training continues with finite losses. StepMetrics' memory
counts the residuals (and their journal, alive from backward to the optimizer step)."""
import json

import pytest

from tests.helpers.launch import run_deepspeed

POISON = 3


@pytest.mark.slow
def test_nan_on_one_rank_skips_everywhere_and_keeps_residuals(tmp_path):
    r = run_deepspeed("tests/reliability/nan_compress.py", str(tmp_path), num_ranks=2, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert ranks[0].keys() == {"zero0_topk", "zero2_hge", "zero3_tgss"}
    for case in ranks[0]:
        for rank, res in enumerate(r[case] for r in ranks):
            where = f"{case} rank {rank}"
            assert res["skipped"] == [s == POISON for s in range(7)], where  # skipped there, and only there
            if case.startswith("zero3"):
                del res["unchanged"]["parameters"]  # ZeRO-3 module parameters are empty partitions here
            assert all(res["unchanged"].values()), (where, res["unchanged"])
            assert res["nonfinite_metric"][POISON:] == [1] * (7 - POISON), where  # in StepMetrics.extra
            assert all(res["residual_norm_finite"]) and res["final_params_finite"], where
            assert res["residual_bytes"] > 0 and res["compression_state"] == 2 * res["residual_bytes"], where
            later = res["losses"][POISON + 1:]
            assert all(l == l and abs(l) < 1e4 for l in later), (where, later)  # training continues, finite
    assert "non-finite gradients at step 4" in out  # the log names the step (1-based, as DeepSpeed counts)
