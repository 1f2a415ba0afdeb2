"""Reference models used by launch/ and the benchmarks."""
from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
