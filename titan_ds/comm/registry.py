"""The one list of gradient compressors, keyed by each class's ``name``.

``titan.compression.method`` (``titan_ds.config``), the error for an unknown name and the docs' list of
methods all come from ``REGISTRY``. Adding a compressor means adding its class to ``_CLASSES``.
"""
from __future__ import annotations

from .base import Compressor
from .dense import DenseCompressor
from .hge import HGECompressor
from .tgss import TGSSCompressor
from .topk import TopKCompressor

__all__ = ["REGISTRY", "build_compressor"]

_CLASSES: tuple[type, ...] = (DenseCompressor, TopKCompressor, TGSSCompressor, HGECompressor)

REGISTRY: dict[str, type] = {cls.name: cls for cls in _CLASSES}
if len(REGISTRY) != len(_CLASSES):
    raise RuntimeError(f"two compressors share a name: {[cls.name for cls in _CLASSES]}")


def build_compressor(name: str, ratio: float, rows: int = 3) -> Compressor:
    """The compressor called ``name``; raises ``ValueError`` naming the choices for anything else."""
    if name in REGISTRY:
        return REGISTRY[name](ratio=ratio, rows=rows)
    else:
        raise ValueError(f"unknown compressor {name!r}; choose one of {sorted(REGISTRY)}")
