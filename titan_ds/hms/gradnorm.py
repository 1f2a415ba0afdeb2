"""ZeRO-3's gradient norms into one reused buffer (HMS).

With the optimizer offloaded, ZeRO-3 takes each gradient partition's norm as it is partitioned in backward
(``_constant_buffered_norm2``, stage3.py:1960): the partition converted to fp64 (a fresh tensor of 8 bytes a value),
then its 2-norm, squared and rooted. HMS makes glibc hand every allocation over 1 MiB straight from and back to the
OS (``install._bound_allocator_retention``), so each of those fp64 tensors is new pages the kernel zeroes: measured
12.4 ms against 1.8 ms for the same norm written into a reused buffer, on a 768x3072 gradient on this CPU (7x);
at 907M parameters ~5 s of a 67 s HMS step (py-spy, results/hms_profile).

:class:`ScratchNorm` converts into one fp64 buffer kept for the backward pass and computes the same norm of it: the
same values and the same ATen reduction, which splits its work by index, not by address, so the result is the same
bits (``tests/hms/test_gradnorm.py``: against the original on random sizes and offsets, and whole clipped runs
against DeepSpeed's own CPU offload). The buffer grows to the largest partition seen and is dropped before each
optimizer step (:meth:`release`), so it exists only during backward, where each call's fresh copy existed anyway.
Anything it does not handle (not a CPU tensor, a partition larger than DeepSpeed's ``buffer_size`` split) goes to
DeepSpeed's own.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["ScratchNorm"]


class ScratchNorm:
    """``_constant_buffered_norm2`` with the fp64 conversion written into a reused buffer; ``release`` drops it."""

    def __init__(self, original: Callable[..., Any], dtype: torch.dtype):
        self.original, self.dtype = original, dtype
        self.buf: Optional[torch.Tensor] = None
        self.calls = 0  # norms taken here (not by the original)

    def __call__(self, input: torch.Tensor, buffer_size: int = 250000000) -> torch.Tensor:
        n = input.numel()
        if input.device.type != "cpu" or n > buffer_size or n == 0:
            return self.original(input, buffer_size)
        if self.buf is None or self.buf.numel() < n:
            self.buf = None  # (the old one freed before the larger one is made)
            self.buf = torch.empty(n, dtype=self.dtype)
        part = self.buf[:n]
        part.copy_(input.data.view(-1))
        self.calls += 1
        return (part.norm(2) ** 2.0) ** 0.5

    def release(self) -> None:
        self.buf = None
