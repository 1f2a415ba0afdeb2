"""The one place that knows which optional accelerators and kernel backends are usable here.

Nothing else in titan_ds imports ``triton`` at module level: Triton kernels live in modules that are imported
lazily, after :func:`require_triton` has succeeded. The backend of every op in ``titan_ds/kernels`` is chosen by
:func:`kernel_backend`:

* ``TITAN_KERNELS=reference`` -- the pure-PyTorch reference (any device; the CPU fallback and the test oracle);
* ``TITAN_KERNELS=triton``    -- the Triton kernel; needs Triton and a CUDA tensor, or ``TRITON_INTERPRET=1``
  (the Triton interpreter, fp32 only, for CPU tests on tiny shapes); raises an actionable error otherwise;
* unset / empty               -- Triton on CUDA tensors when Triton imports, the reference everywhere else. An op
  may have an exact kernel of PyTorch's own that it prefers: attention (``attention.attention_kernel``) runs
  PyTorch's SDPA -- its flash / memory-efficient kernels on CUDA, its CPU flash kernel on CPU tensors -- and its
  Triton kernel only under ``TITAN_KERNELS=triton``; ``reference`` switches those off too.

Any other value raises ``ValueError`` naming the choices.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Any, Optional

import torch

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "KernelBackendError",
    "triton_available",
    "triton_interpreting",
    "cuda_available",
    "aio_available",
    "require_triton",
    "requested_backend",
    "kernel_backend",
    "describe",
]

log = logging.getLogger("titan_ds.kernels")

ENV_VAR = "TITAN_KERNELS"
BACKENDS = ("reference", "triton")


class KernelBackendError(RuntimeError):
    """A kernel backend was asked for that cannot run here; the message says what to install or set."""


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> Optional[str]:
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception as e:  # ImportError, or a broken install raising something else at import time
        return f"{type(e).__name__}: {e}"
    return None


def triton_available() -> bool:
    """True when ``import triton`` works (it does not say a GPU is present)."""
    return _triton_import_error() is None


def triton_interpreting() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``, set before they are compiled)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cuda_available() -> bool:
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def aio_available() -> bool:
    """True when DeepSpeed's async I/O op is compatible here (libaio present). Never JIT-builds it."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        return bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception as e:  # deepspeed missing or its builder failing to probe: not usable either way
        log.debug("DeepSpeed aio op not usable: %s", e)
        return False


def require_triton() -> tuple[Any, Any]:
    """``(triton, triton.language)``, or :class:`KernelBackendError` saying how to get them."""
    err = _triton_import_error()
    if err is not None:
        raise KernelBackendError(
            f"the Triton kernels need `triton` (pip install 'titan-ds[triton]', i.e. triton==3.7.1), but importing "
            f"it failed ({err}); or set {ENV_VAR}=reference to use the pure-PyTorch kernels")
    return importlib.import_module("triton"), importlib.import_module("triton.language")


def requested_backend() -> str:
    """``TITAN_KERNELS`` as set (``"reference"``, ``"triton"``, or ``""`` when unset); any other value raises."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value and value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={value!r} is not a kernel backend; choose one of {list(BACKENDS)} "
                         f"or leave it unset (Triton on CUDA, reference elsewhere)")
    return value


def kernel_backend(*tensors: torch.Tensor, op: str = "kernel") -> str:
    """Which backend runs ``op`` on these tensors: ``"reference"`` or ``"triton"``.

    Raises :class:`KernelBackendError` when ``TITAN_KERNELS=triton`` is set but the Triton kernel cannot run on
    these tensors (no Triton; CPU tensors without ``TRITON_INTERPRET=1``).
    """
    requested = requested_backend()
    on_cuda = bool(tensors) and all(t.is_cuda for t in tensors)
    if requested == "reference":
        return "reference"
    if requested == "triton":
        require_triton()
        if not (on_cuda or triton_interpreting()):
            devices = sorted({str(t.device) for t in tensors})
            raise KernelBackendError(
                f"{ENV_VAR}=triton asks for the Triton {op} but its tensors are on {devices}: move them to CUDA, "
                f"or set TRITON_INTERPRET=1 (before the kernels are imported; fp32, tiny shapes) to run Triton on the "
                f"CPU, or set {ENV_VAR}=reference")
        return "triton"
    return "triton" if on_cuda and triton_available() else "reference"


def describe() -> dict[str, Any]:
    """What is usable here (for ``titan-ds report``)."""
    return {
        "triton": triton_available(),
        "triton_error": _triton_import_error(),
        "triton_interpret": triton_interpreting(),
        "cuda": cuda_available(),
        "aio": aio_available(),
        ENV_VAR: os.environ.get(ENV_VAR, ""),
    }
