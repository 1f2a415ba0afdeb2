"""Kernel tests (RNGs are seeded by tests/conftest.py, which also switches the Triton interpreter on before any
kernel is compiled when there is no GPU)."""
