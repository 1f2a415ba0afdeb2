"""The one list of gradient compressors, keyed by each class's ``name``.

``titan.compression.method`` (``titan_ds.config``), the error for an unknown name, the keys each method accepts
(``config_keys``) and the docs' list of methods all come from ``REGISTRY``. Adding a compressor means adding
its class to ``_CLASSES``.
"""
from __future__ import annotations

from typing import Any

from .base import Compressor
from .cltk import CLTKCompressor
from .dense import DenseCompressor
from .hge import HGECompressor
from .powersgd import PowerSGDCompressor
from .qtopk import QTopKCompressor
from .randk import RandKCompressor
from .tgss import TGSSCompressor
from .topk import TopKCompressor

__all__ = ["REGISTRY", "build_compressor"]

_CLASSES: tuple[type, ...] = (DenseCompressor, TopKCompressor, CLTKCompressor, QTopKCompressor, RandKCompressor, TGSSCompressor,
                              HGECompressor, PowerSGDCompressor)

REGISTRY: dict[str, type] = {cls.name: cls for cls in _CLASSES}
if len(REGISTRY) != len(_CLASSES):
    raise RuntimeError(f"two compressors share a name: {[cls.name for cls in _CLASSES]}")


def build_compressor(name: str, ratio: float, rows: int = 3, **options: Any) -> Compressor:
    """The compressor called ``name``; raises ``ValueError`` naming the choices for anything else.

    ``options`` (``rank``, ``min_compression``, ``seed``; ``bits``, ``chunk``, ``scale_dtype``, ...) go to the classes that list them in
    ``init_options`` (``powersgd``; ``qtopk``); the others are built from ``ratio`` and ``rows`` alone."""
    if name in REGISTRY:
        cls = REGISTRY[name]
        wanted = getattr(cls, "init_options", ())
        return cls(ratio=ratio, rows=rows, **{k: v for k, v in options.items() if k in wanted})
    else:
        raise ValueError(f"unknown compressor {name!r}; choose one of {sorted(REGISTRY)}")
