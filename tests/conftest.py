"""Shared fixtures: every RNG seeded; a one-process distributed world for deepspeed.initialize."""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
os.environ.setdefault("TITAN_CACHE", str(ROOT / ".cache"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

# Triton reads TRITON_INTERPRET when a @triton.jit function is defined, so it must be set before any test module
# imports titan_ds.kernels (tests/inject's HF tests reach them too, and are collected before tests/kernels).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def reset_accelerate_state():
    """accelerate keeps one AcceleratorState per process: a Trainer or Accelerator of one test would otherwise
    refuse the DeepSpeed plugin of the next ("cannot pass in a deepspeed_plugin when creating a second
    Accelerator")."""
    yield
    if "accelerate.state" in sys.modules:
        sys.modules["accelerate.state"].AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="session")
def dist_env():
    from titan_ds.utils import ensure_dist_env
    ensure_dist_env()
    return True


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
