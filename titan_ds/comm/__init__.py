"""Gradient compression on DeepSpeed's reduce path: compressors, and hooks that install them."""
from .base import Segment
from .compressor import GradientReducer
from .registry import REGISTRY, build_compressor

__all__ = ["REGISTRY", "GradientReducer", "Segment", "build_compressor"]
