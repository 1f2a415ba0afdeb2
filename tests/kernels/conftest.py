"""Kernel tests: every RNG seeded; the Triton interpreter switched on before any kernel is compiled."""
import os
import random

import numpy as np
import pytest
import torch

# Triton reads TRITON_INTERPRET when a @triton.jit function is defined: set it before titan_ds imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def seeded():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
