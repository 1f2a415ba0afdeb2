"""Gradient compression on DeepSpeed's reduce path (issue #6): compressors, and hooks that install them."""
from .compressor import REGISTRY, GradientReducer, Segment, build_compressor

__all__ = ["REGISTRY", "GradientReducer", "Segment", "build_compressor"]
