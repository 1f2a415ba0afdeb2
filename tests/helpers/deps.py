"""Test dependencies that the ``[test]`` extra of pyproject.toml pins: a missing one fails the test module that needs
it (a skip would let ``make test`` pass with whole areas untested). Skips stay for what this machine may really
lack (a CUDA device: the ``gpu`` marker)."""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(name: str) -> ModuleType:
    """``import name``, or an ImportError that says it is a pinned test dependency and how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"{name} is pinned by the [test] extra of pyproject.toml but cannot be imported here "
                          f"({e}); install it: pip install -e '.[test]'") from e
