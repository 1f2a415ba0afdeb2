"""Byte-level corpus for the reference workload.

Default: the CPython standard-library sources of the running interpreter (found on every machine with Python),
in sorted relative-path order, capped at ``max_bytes``, split into train/val at a fixed fraction and cached as a
uint8 file under ``$TITAN_CACHE`` (default ``./.cache/titan_data``). ``load_corpus(path)`` accepts any text file
or folder the user names instead (every file under a folder, sorted).
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np
import torch

__all__ = ["Corpus", "load_corpus", "Batcher", "val_batches", "stdlib_files"]

DEFAULT_MAX_BYTES = 16 * 1024 * 1024  # 16 MiB: ~13x the 1.2M-token benchmark budget, cached in ~1 s
VAL_FRACTION = 0.05


@dataclass
class Corpus:
    train: np.ndarray  # uint8
    val: np.ndarray    # uint8
    source: str

    def __repr__(self) -> str:
        return f"Corpus({self.source!r}, train={len(self.train):,} B, val={len(self.val):,} B)"


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted((p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()),
                  key=lambda p: p.relative_to(root).as_posix())


def _files(path: Optional[Union[str, os.PathLike]]) -> tuple[list[Path], str]:
    if path is None:
        return stdlib_files(), f"cpython-stdlib-{sysconfig.get_python_version()}"
    p = Path(path)
    if p.is_file():
        return [p], str(p)
    if p.is_dir():
        files = sorted((f for f in p.rglob("*") if f.is_file()), key=lambda f: f.relative_to(p).as_posix())
        if not files:
            raise ValueError(f"data folder {str(p)!r} contains no files")
        return files, str(p)
    raise FileNotFoundError(f"data path {str(p)!r} does not exist; pass a text file or folder, or omit it "
                            f"to use the CPython standard-library sources")


def _cache_dir() -> Path:
    return Path(os.environ.get("TITAN_CACHE", Path.cwd() / ".cache")) / "titan_data"


def load_corpus(path: Optional[Union[str, os.PathLike]] = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """The byte corpus, deterministic for a given file set; cached as ``<cache>/<key>.u8``."""
    files, source = _files(path)
    key = hashlib.sha256("\n".join([source, str(max_bytes)] + [f"{f}:{f.stat().st_size}" for f in files])
                         .encode()).hexdigest()[:16]
    cache = _cache_dir() / f"{key}.u8"
    if cache.is_file():
        data = np.fromfile(cache, dtype=np.uint8)
    else:
        chunks, total = [], 0
        for f in files:
            b = f.read_bytes()
            chunks.append(b)
            total += len(b)
            if total >= max_bytes:
                break
        data = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8).copy()
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        data.tofile(tmp)
        os.replace(tmp, cache)  # atomic: a concurrent rank never reads a partial cache
    n_val = max(int(len(data) * VAL_FRACTION), 1)
    if len(data) - n_val < 2:
        raise ValueError(f"corpus {source!r} is too small ({len(data)} bytes)")
    return Corpus(train=data[:-n_val], val=data[-n_val:], source=source)


class Batcher:
    """Random contiguous windows: ``get(step)`` is a pure function of (seed, step, rank), so runs and resumed
    runs see identical batches. Each rank draws its own micro-batch (data parallel)."""

    def __init__(self, tokens: np.ndarray, micro_batch: int, context: int, seed: int = 0, rank: int = 0,
                 world: int = 1):
        if len(tokens) <= context + 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is shorter than context+1 ({context + 1})")
        self.tokens = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        self.micro_batch, self.context, self.seed, self.rank, self.world = micro_batch, context, seed, rank, world

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1_009 + self.rank)
        starts = torch.randint(0, len(self.tokens) - self.context - 1, (self.micro_batch,), generator=g)
        idx = starts[:, None] + torch.arange(self.context + 1)
        window = self.tokens[idx]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def val_batches(tokens: np.ndarray, n: int, micro_batch: int, context: int, seed: int = 1234) -> Iterator:
    """``n`` fixed validation batches (the same on every rank and every run)."""
    b = Batcher(tokens, micro_batch, context, seed=seed)
    for i in range(n):
        yield b.get(i)
