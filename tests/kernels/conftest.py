"""Kernel tests (RNGs are seeded by tests/conftest.py): the Triton interpreter is switched on before any kernel
is compiled when there is no GPU."""
import os

import torch

# Triton reads TRITON_INTERPRET when a @triton.jit function is defined: set it before titan_ds imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
