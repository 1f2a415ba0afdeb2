"""The bounds HMS puts on ZeRO-3's working buffers where the user left them unset (:data:`ZERO3_BOUNDS`).

:mod:`titan_ds.hms.install` sets them (and re-exports them); :mod:`titan_ds.plan` and :mod:`titan_ds.hms.budget`
count them. A leaf module, so that install -> budget -> plan imports no cycle.
"""
from __future__ import annotations

__all__ = ["ZERO3_BOUNDS"]

# DeepSpeed's ZeRO-3 defaults size its working buffers for a GPU beside a large host: reduce_bucket_size 5e8 is a
# 2 GB fp32 bucket, stage3_max_live_parameters / stage3_max_reuse_distance 1e9 let up to 1e9 gathered elements
# (4 GB) stay resident, sub_group_size 1e9 makes the optimizer step swap in 1e9 elements of fp32 state at once
# (16 GB with Adam). A 404M-parameter model under a 4 GiB cgroup was OOM-killed with them and trained with
# 2e7-5e7 (measured); the step of a 57M model peaks 1.2 GB higher with sub_group_size 5e7 than with 1e7
# (measured). HMS exists for models that do not fit, so it bounds them unless the user set them; ``titan-ds
# plan`` sizes them for a given budget (titan_ds/plan.py).
ZERO3_BOUNDS: dict[str, int] = {
    "reduce_bucket_size": 20_000_000,
    "stage3_prefetch_bucket_size": 20_000_000,
    "stage3_max_live_parameters": 40_000_000,
    "stage3_max_reuse_distance": 40_000_000,
    "sub_group_size": 10_000_000,
}
