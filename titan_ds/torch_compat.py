"""Every place titan reads torch's internals: one module, versioned, each read switchable.

titan's C++ CPU kernel (``titan_ds/optim/csrc/core_cpu.cpp``) rounds bf16 weights stochastically with the very
draws the eager loop takes from the optimizer's CPU generator, ``torch.randint(0, 2**16, (n,), generator=g)``.
It gets them without calling torch per value by reading ATen's private state:

* **the CPU generator's engine**: ``at::CPUGeneratorImpl::engine()`` / ``set_engine()`` and the layout of
  ``at::mt19937_data_pod`` (624 state words, ``left_``, ``next_``, ``seeded_``): the kernel copies the engine,
  draws from the copy and stores it back (the C++ seam is one block, "the torch seam", in that file);
* **randint's draw**: ``randint(0, 2**16)`` on a CPU generator takes one 32-bit mt19937 output per value and keeps
  it mod 2^16 (ATen's ``uniform_int_from_to_distribution`` for a range under 2^32).

Both are checked against the installed torch by the canary tests (``tests/test_torch_compat.py``: the kernel's
draws equal ``torch.randint``'s from a same-seeded generator, across the engine's 624-word twists, and the
generator's state afterwards equals torch's). :data:`SUPPORTED` is the range they were checked on. On a torch
outside it the kernel does not read the generator (:func:`generator_seam` is False, with one warning naming the
installed and the supported versions): bf16 weights step on the eager loop, the same results, slower.
``TITAN_TORCH_SEAM=0`` turns the read off on any version (the undo).
"""
from __future__ import annotations

import logging
import os
import warnings
from functools import lru_cache
from typing import Optional

import torch

__all__ = ["SUPPORTED", "check_version", "generator_seam"]

log = logging.getLogger("titan_ds")

# the versions the canary tests passed on (pyproject installs torch==2.13.0); widen after they pass on another
SUPPORTED = (">=2.13.0", "<2.14")

_env = os.environ.get("TITAN_TORCH_SEAM", "1")
if _env not in ("0", "1"):
    raise ValueError(f"TITAN_TORCH_SEAM={_env!r}: set 1 (the CPU kernel reads the generator's engine, default) or 0 "
                     "(it does not: bf16 weights with stochastic rounding step on the eager loop)")


def check_version(installed: Optional[str] = None) -> Optional[str]:
    """None when ``installed`` (default: the running torch) is in :data:`SUPPORTED`, else why the seam is off (a
    message naming the installed and the supported versions and what to do)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version
    version = installed if installed is not None else torch.__version__
    spec = SpecifierSet(",".join(SUPPORTED))
    try:
        ok = Version(version) in spec
    except InvalidVersion:
        ok = False
    if ok:
        return None
    return (f"titan_ds reads the CPU generator's mt19937 engine on torch {','.join(SUPPORTED)} (checked by "
            f"tests/test_torch_compat.py), but torch {version} is installed: the C++ optimizer kernel does not read "
            "it, and bf16 weights with stochastic rounding step on the eager loop (the same results, slower). Run "
            "tests/test_torch_compat.py on this torch and widen titan_ds.torch_compat.SUPPORTED if it passes.")


@lru_cache(maxsize=None)
def _version_ok() -> bool:
    problem = check_version()
    if problem is not None:
        warnings.warn(problem, RuntimeWarning, stacklevel=3)
    return problem is None


def generator_seam() -> bool:
    """Whether the CPU kernel may read and advance a CPU generator's engine itself: the installed torch is in
    :data:`SUPPORTED` (else one warning) and ``TITAN_TORCH_SEAM`` is not 0."""
    return _env == "1" and _version_ok()
