"""TGSS: Temporal Gradient Superposition Sketching, a linear sketch of gradients accumulated over steps.

Two sketches in fixed memory (``depth x width`` fp32, independent of model size), both linear in the input:

* :class:`CountSketch` (signed, Charikar et al. 2002): row ``j`` adds ``s_j(i) * v_i`` into bucket ``h_j(i)``;
  the estimate of element ``i`` is the median over rows of ``s_j(i) * T[j, h_j(i)]``. Unbiased for signed
  values (gradients, momenta). Error per element ~ ||v||_2 / sqrt(width).
* :class:`CountMinSketch` (Cormode & Muthukrishnan 2005): row ``j`` adds ``v_i >= 0`` into ``h_j(i)``; the
  estimate is the minimum over rows. Never under-estimates a non-negative value (|g| magnitudes).

Temporal superposition: ``decay_(beta)`` scales the table, so ``decay_(beta); update((1 - beta) * g)`` keeps
the sketch of the per-element EMA of ``g`` exactly (linearity), in width x depth memory.

Mergeable: sketches with the same ``(width, depth, seed)`` add (``merge_`` / ``+``), so rank-local sketches
can be all-reduced as plain tensors (``table``).

Frequency domain (``dct_chunk=C``): the input is cut into chunks of ``C`` elements (global offsets aligned to
``C``), each chunk goes through an orthonormal DCT-II, and the coefficients are sketched; ``query`` sketches
back the chunk's coefficients and inverts the DCT. Only :class:`CountSketch` supports it (the transform is
signed). Its worth is measured in ``tests/optim/test_sketch.py`` and ``docs/asdt.md``.

Indices are global element indices (``indices_offset + arange(n)`` in ``update``), so a flat ZeRO partition
or one parameter of a model can be sketched into the same table by giving its global offset. Hashes are
deterministic functions of ``(seed, row, index)``; indices must be below 2**62.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

__all__ = ["CountSketch", "CountMinSketch", "dct_matrix"]

_M31 = (1 << 31) - 1


def _row_constants(seed: int, depth: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed) * 1000003 + 12345)
    # odd 31-bit multipliers and offsets for a multiply-xorshift hash per row (bucket and sign each)
    c = torch.randint(1, _M31, (depth, 4), generator=g, dtype=torch.int64)
    return c | 1


def _hash(idx: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """31-bit hash of non-negative int64 indices; each product stays below 2**62 (no int64 overflow)."""
    x = ((idx & _M31) ^ ((idx >> 31) * 0x5BD1E995 & _M31))
    x = (x * a + b) & ((1 << 62) - 1)
    x = x ^ (x >> 31)
    x = ((x & _M31) * (b | 1) + a) & ((1 << 62) - 1)
    x = x ^ (x >> 29)
    return x & _M31


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device: Any = None) -> torch.Tensor:
    """Orthonormal DCT-II matrix ``D`` (n x n): ``coeffs = D @ x``, ``x = D.T @ coeffs``."""
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    d = torch.cos(math.pi / n * (i + 0.5) * k) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(dtype=dtype, device=device)


class _SketchBase:
    signed = True

    def __init__(self, width: int, depth: int, seed: int = 0, device: Any = None,
                 dct_chunk: Optional[int] = None):
        if width < 1 or depth < 1:
            raise ValueError(f"sketch width and depth must be >= 1, got width={width}, depth={depth}")
        if dct_chunk is not None:
            if not self.signed:
                raise ValueError("dct_chunk needs a signed sketch (CountSketch): DCT coefficients are signed")
            if dct_chunk < 2:
                raise ValueError(f"dct_chunk must be >= 2 or None, got {dct_chunk}")
        self.width, self.depth, self.seed, self.dct_chunk = int(width), int(depth), int(seed), dct_chunk
        self.table = torch.zeros(depth, width, dtype=torch.float32, device=device)
        self._consts = _row_constants(seed, depth)
        self._dct = dct_matrix(dct_chunk, device=device) if dct_chunk else None

    # ------------------------------------------------------------------ hashing
    def _buckets_signs(self, idx: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        idx = idx.to(device=self.table.device, dtype=torch.int64)
        rows = []
        signs = [] if self.signed else None
        for j in range(self.depth):
            a, b, c, d = (int(v) for v in self._consts[j])
            rows.append(_hash(idx, a, b) % self.width)
            if signs is not None:
                signs.append((_hash(idx, c, d) & 1).to(torch.float32) * 2 - 1)
        return torch.stack(rows), (torch.stack(signs) if signs is not None else None)

    # ------------------------------------------------------------------ linear ops
    def update(self, values: torch.Tensor, indices_offset: int = 0) -> None:
        """Add ``values`` (any shape, flattened) at global indices ``indices_offset + arange(numel)``."""
        v = values.detach().reshape(-1).to(device=self.table.device, dtype=torch.float32)
        if not self.signed and bool((v < 0).any()):
            raise ValueError("CountMinSketch takes non-negative values (magnitudes); use CountSketch for signed")
        start = int(indices_offset)
        if self._dct is not None:
            v, start = self._to_freq(v, start)
        idx = torch.arange(start, start + v.numel(), dtype=torch.int64, device=self.table.device)
        self.update_at(idx, v)

    def update_at(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``values`` at explicit global ``indices`` (1-D, same length); no frequency transform."""
        v = values.detach().reshape(-1).to(device=self.table.device, dtype=torch.float32)
        buckets, signs = self._buckets_signs(indices.reshape(-1))
        for j in range(self.depth):
            self.table[j].index_add_(0, buckets[j], v * signs[j] if signs is not None else v)

    def decay_(self, factor: float) -> None:
        """Multiply every counter by ``factor`` (EMA: ``decay_(beta)`` then ``update((1-beta) * g)``)."""
        self.table.mul_(factor)

    def query(self, indices: torch.Tensor) -> torch.Tensor:
        """Estimates at global ``indices`` (1-D int tensor), fp32."""
        indices = indices.reshape(-1).to(device=self.table.device, dtype=torch.int64)
        if self._dct is not None:
            return self._query_freq(indices)
        return self._query_raw(indices)

    def query_range(self, start: int, numel: int) -> torch.Tensor:
        return self.query(torch.arange(int(start), int(start) + int(numel), dtype=torch.int64))

    def _query_raw(self, indices: torch.Tensor) -> torch.Tensor:
        buckets, signs = self._buckets_signs(indices)
        est = torch.stack([self.table[j][buckets[j]] for j in range(self.depth)])
        if signs is not None:
            return (est * signs).median(dim=0).values
        return est.min(dim=0).values

    # ------------------------------------------------------------------ frequency domain
    def _to_freq(self, v: torch.Tensor, start: int) -> tuple[torch.Tensor, int]:
        c = self.dct_chunk
        lead = start % c
        first = start - lead
        total = lead + v.numel()
        padded = torch.zeros(-(-total // c) * c, dtype=torch.float32, device=v.device)
        padded[lead:lead + v.numel()] = v
        coeffs = padded.view(-1, c) @ self._dct.T  # per chunk: D @ x
        return coeffs.reshape(-1), first

    def _query_freq(self, indices: torch.Tensor) -> torch.Tensor:
        c = self.dct_chunk
        chunks, pos = torch.unique(indices // c, return_inverse=True)
        coeff_idx = (chunks.unsqueeze(1) * c + torch.arange(c, device=indices.device)).reshape(-1)
        coeffs = self._query_raw(coeff_idx).view(-1, c)
        values = coeffs @ self._dct  # per chunk: D.T @ coeffs
        return values[pos, indices % c]

    # ------------------------------------------------------------------ merge / state
    def _check_compatible(self, other: "_SketchBase") -> None:
        mine = (type(self), self.width, self.depth, self.seed, self.dct_chunk)
        theirs = (type(other), other.width, other.depth, other.seed, other.dct_chunk)
        if mine != theirs:
            raise ValueError(f"cannot merge sketches with different (type, width, depth, seed, dct_chunk): "
                             f"{mine} vs {theirs}")

    def merge_(self, other: "_SketchBase") -> "_SketchBase":
        """In-place sum with a compatible sketch (sketch of the summed inputs)."""
        self._check_compatible(other)
        self.table.add_(other.table.to(self.table.device))
        return self

    def __add__(self, other: "_SketchBase") -> "_SketchBase":
        out = self.copy()
        return out.merge_(other)

    def copy(self) -> "_SketchBase":
        out = type(self)(self.width, self.depth, self.seed, device=self.table.device, dct_chunk=self.dct_chunk)
        out.table.copy_(self.table)
        return out

    def zero_(self) -> None:
        self.table.zero_()

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def state_dict(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, "width": self.width, "depth": self.depth, "seed": self.seed,
                "dct_chunk": self.dct_chunk, "table": self.table.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        got = (state.get("kind"), state.get("width"), state.get("depth"), state.get("seed"), state.get("dct_chunk"))
        want = (type(self).__name__, self.width, self.depth, self.seed, self.dct_chunk)
        if got != want:
            raise ValueError(f"sketch state {got} does not match this sketch {want} (kind, width, depth, seed, "
                             f"dct_chunk); build the sketch with the saved settings")
        self.table.copy_(state["table"])


class CountSketch(_SketchBase):
    """Signed count sketch (median-of-rows estimate); see the module docstring."""

    signed = True


class CountMinSketch(_SketchBase):
    """Count-Min sketch of non-negative values (min-of-rows estimate, never below the true value)."""

    signed = False

    def __init__(self, width: int, depth: int, seed: int = 0, device: Any = None, dct_chunk: Optional[int] = None):
        super().__init__(width, depth, seed, device=device, dct_chunk=dct_chunk)
