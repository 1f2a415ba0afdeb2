"""Kernels: one file per op, each a pure-PyTorch reference plus (where it pays) a Triton version.

The backend is chosen per call by ``TITAN_KERNELS=reference|triton`` (``_guard.kernel_backend``); Triton is
imported only by ``_guard`` and by the lazily imported Triton modules, never at package import.
"""
from ._guard import KernelBackendError, aio_available, cuda_available, kernel_backend, triton_available
from .attention import TiledAttention, tiled_attention, tiled_attention_reference
from .chunked_ce import ChunkedLMLoss, chunked_linear_cross_entropy
from .stripe_ffn import StripeFFN, stripe_ffn

__all__ = [
    "KernelBackendError", "aio_available", "cuda_available", "kernel_backend", "triton_available",
    "TiledAttention", "tiled_attention", "tiled_attention_reference",
    "ChunkedLMLoss", "chunked_linear_cross_entropy",
    "StripeFFN", "stripe_ffn",
]
