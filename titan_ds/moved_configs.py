"""The ds_configs that left ds_configs/, and where they went: ds_configs/ keeps the profiles a user picks (the
README's table); configs that exist for the tests live in tests/configs/, and those of measured methods that are
not recommended in launch/experiments/configs/ (see each profile's results in the README).

:func:`moved_message` is consulted where titan loads a ds_config path (``config.load_ds_config``: ``launch/train.py
--deepspeed_config``, ``titan_ds.initialize(config=PATH)``, ``titan_ds.zero_init``, the HF route), so an old path
fails with an error naming the new place and the profile to use instead.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

__all__ = ["MOVED", "moved_message"]

# file name -> (its place in a checkout of the repository, the user profile in ds_configs/ to use instead or None)
MOVED: dict[str, tuple[str, Optional[str]]] = {
    "asdt.json": ("tests/configs/asdt.json", "titan_balanced.json"),
    "asdt_bsps.json": ("tests/configs/asdt_bsps.json", "titan_balanced.json"),
    "asdt_zero2.json": ("tests/configs/asdt_zero2.json", "titan_balanced.json"),
    "demo.json": ("tests/configs/demo.json", "titan_memory.json"),
    "mlme.json": ("tests/configs/mlme.json", "titan_exact.json"),
    "trd.json": ("tests/configs/trd.json", None),
    "trd_zero3.json": ("tests/configs/trd_zero3.json", None),
    "titan_2rank.json": ("tests/configs/titan_2rank.json", "compress_rms_sketch.json"),
    "baseline_zero2.json": ("launch/experiments/configs/baseline_zero2.json", "baseline_adamw.json"),
    "compress_diloco.json": ("launch/experiments/configs/compress_diloco.json", "compress_rms_sketch.json"),
    "compress_diloco_qtopk.json": ("launch/experiments/configs/compress_diloco_qtopk.json", "compress_rms_sketch.json"),
    "compress_hge_zero2.json": ("launch/experiments/configs/compress_hge_zero2.json", "compress_rms_sketch.json"),
    "compress_tgss_zero3.json": ("launch/experiments/configs/compress_tgss_zero3.json", "compress_rms_sketch.json"),
    "compress_topk_zero0.json": ("launch/experiments/configs/compress_topk_zero0.json", "compress_rms_sketch.json"),
    "compress_qtopk_rms.json": ("launch/experiments/configs/compress_qtopk_rms.json", "compress_rms_sketch.json"),
    "compress_qtopk_sharded.json": ("launch/experiments/configs/compress_qtopk_sharded.json", "compress_rms_sketch.json"),
    "compress_rms.json": ("launch/experiments/configs/compress_rms.json", "compress_rms_sketch.json"),
    "hf_asdt.json": ("launch/experiments/configs/hf_asdt.json", "hf_asdt_8bit.json"),
    "hf_asdt_backward.json": ("launch/experiments/configs/hf_asdt_backward.json", "hf_asdt_8bit.json"),
    "hf_exact.json": ("launch/experiments/configs/hf_exact.json", "hf_asdt_8bit.json"),
    "hf_trd.json": ("launch/experiments/configs/hf_trd.json", None),
    "titan_all.json": ("launch/experiments/configs/titan_all.json", "titan_memory.json"),
    "titan_full.json": ("launch/experiments/configs/titan_full.json", "titan_memory.json"),
    "titan_zero3_nvme.json": ("launch/experiments/configs/titan_zero3_nvme.json", "hms.json"),
}


def moved_message(path: Union[str, os.PathLike]) -> Optional[str]:
    """The error for a missing ``path`` that names a moved config (``.../ds_configs/<name>``), else None."""
    p = Path(path)
    if p.parent.name != "ds_configs" or p.name not in MOVED:
        return None
    new, instead = MOVED[p.name]
    use = f"; for a user's run, start from ds_configs/{instead}" if instead else ""
    return (f"ds_config {str(p)!r} does not exist: ds_configs/{p.name} moved to {new} in the titan_ds "
            f"repository{use} (ds_configs/ keeps the profiles of the README's table)")
