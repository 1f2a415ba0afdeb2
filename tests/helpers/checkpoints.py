"""Look inside saved checkpoints (tests)."""
from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["bsps_states"]


def bsps_states(tag_dir: Path) -> list[dict]:
    """Every BSPS state dict (``Plasticity.state_dict()``) held anywhere in the checkpoint's ``*.pt`` files
    (DeepSpeed's shards, HMS's per-rank snapshot)."""
    def find(x):
        if isinstance(x, dict):
            here = [x] if {"blocks", "modes", "in_mode", "acc"} <= set(x) else []
            return here + [d for v in x.values() for d in find(v)]
        if isinstance(x, (list, tuple)):
            return [d for v in x for d in find(v)]
        return []
    files = sorted(Path(tag_dir).rglob("*.pt"))
    assert files, f"no .pt files under {tag_dir}"
    return [d for f in files for d in find(torch.load(f, map_location="cpu", weights_only=False))]
