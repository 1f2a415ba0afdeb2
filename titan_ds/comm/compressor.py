"""Gradient compressors for DeepSpeed's reduce path: protocol, registry, residuals and the reducer.

A compressor turns the error-compensated gradient of one bucket into a small payload that crosses a
collective, and reconstructs the sum over ranks from what came back. ``GradientReducer`` wraps one
compressor with the pieces every method shares:

1. ``acc = flat + residual``: residuals are kept **per parameter and offset** (``Segment.key`` /
   ``Segment.param_offset``), never per bucket, because DeepSpeed's bucket composition depends on hook
   order and ``reduce_bucket_size``.
2. ``summed, sent = compressor.reduce(acc, comm, seed)``: ``summed`` is the sum over ranks of what each
   rank sent, identical on all ranks; ``sent`` is this rank's own contribution (dense, mostly zeros).
3. ``residual = acc - sent`` (error feedback) or zero (``error_feedback=False``).
   Invariant (tested): ``sent + new_residual == flat + old_residual``; with one rank ``summed == sent``.
4. Bytes handed to collectives are counted (``CountingCollective``) next to the dense bytes an
   uncompressed all-reduce of ``flat`` would have handed over.

``none`` sends the dense bucket (the uncompressed path through the same code, for byte accounting).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

__all__ = [
    "Collective", "CountingCollective", "LocalCollective", "ThreadCollective", "Segment", "ResidualStore",
    "Compressor", "DenseCompressor", "TopKCompressor", "SketchCompressor", "REGISTRY", "build_compressor",
    "GradientReducer",
]

log = logging.getLogger("titan_ds.comm")


# ----------------------------------------------------------------------------------------- collectives
class Collective(Protocol):
    """The two collectives a compressor may use. Both are sums/gathers over the data-parallel group."""

    world_size: int

    def all_reduce_sum(self, t: torch.Tensor) -> None: ...

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...


class LocalCollective:
    """One rank: the collectives are identities."""

    world_size = 1

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        return None

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t.clone()]


class ThreadCollective:
    """``world_size`` ranks simulated by threads in one process (tests): call ``rank(r)`` for rank r's view."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size)
        self._slots: list[Optional[torch.Tensor]] = [None] * world_size

    def rank(self, r: int) -> "_ThreadRank":
        return _ThreadRank(self, r)


class _ThreadRank:
    def __init__(self, group: ThreadCollective, r: int):
        self.group, self.r, self.world_size = group, r, group.world_size

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        g = self.group
        g._slots[self.r] = t.clone()
        g._barrier.wait()
        out = [s.clone() for s in g._slots]  # type: ignore[union-attr]
        g._barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        parts = self._exchange(t)
        total = parts[0]
        for p in parts[1:]:
            total = total + p  # same order on every rank: bit-identical sums
        t.copy_(total)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self._exchange(t)


class CountingCollective:
    """Wraps a collective and counts the bytes this rank hands to it (the send buffer of each call)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.world_size = inner.world_size
        self.bytes = 0
        self.calls = 0

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        self.bytes += t.numel() * t.element_size()
        self.calls += 1
        self.inner.all_reduce_sum(t)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.bytes += t.numel() * t.element_size()
        self.calls += 1
        return self.inner.all_gather(t)


# ----------------------------------------------------------------------------------------- residuals
@dataclass(frozen=True)
class Segment:
    """``numel`` elements of parameter ``key`` starting at ``param_offset`` sit at ``flat_offset`` in a bucket."""

    key: str
    param_offset: int
    flat_offset: int
    numel: int
    param_numel: int


class ResidualStore:
    """Error-feedback residuals, one fp32 tensor per parameter (created on first use), addressed by offset.

    Writes are journaled per optimizer step (:meth:`begin`): the first write to a parameter's residual in a
    step keeps its previous value, so that :meth:`rollback` can put back exactly what the step started from
    when the step turns out to be skipped (non-finite gradients). :meth:`commit` drops the journal. The
    journal holds at most one copy of the residuals, and only while a step is being reduced and applied.
    """

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}
        self._journal: dict[str, Optional[torch.Tensor]] = {}  # key -> value at step start (None: created)

    def _get(self, seg: Segment, device: torch.device) -> torch.Tensor:
        r = self.residuals.get(seg.key)
        if r is None:
            r = self.residuals[seg.key] = torch.zeros(seg.param_numel, dtype=torch.float32, device=device)
            self._journal.setdefault(seg.key, None)
        elif r.numel() != seg.param_numel:
            raise RuntimeError(f"residual for {seg.key!r} has {r.numel()} elements but the parameter has "
                               f"{seg.param_numel}: the model changed under a running compressor")
        return r

    def add_into(self, acc: torch.Tensor, layout: list[Segment]) -> None:
        for s in layout:
            r = self._get(s, acc.device)
            acc[s.flat_offset:s.flat_offset + s.numel] += r[s.param_offset:s.param_offset + s.numel]

    def write(self, new: torch.Tensor, layout: list[Segment]) -> None:
        for s in layout:
            r = self._get(s, new.device)
            if s.key not in self._journal:
                self._journal[s.key] = r.clone()
            r[s.param_offset:s.param_offset + s.numel] = new[s.flat_offset:s.flat_offset + s.numel]

    def commit(self) -> None:
        """The step was applied: its residual writes stand."""
        self._journal.clear()

    def rollback(self) -> None:
        """The step is skipped: every residual goes back to its value at the step's start."""
        for key, old in self._journal.items():
            if old is None:
                self.residuals.pop(key, None)
            else:
                self.residuals[key].copy_(old)
        self._journal.clear()

    def nbytes(self) -> int:
        """Bytes held now: the residuals and, mid-step, the journal."""
        held = list(self.residuals.values()) + [t for t in self._journal.values() if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def norm(self) -> float:
        return float(sum(float(r.double().pow(2).sum()) for r in self.residuals.values()) ** 0.5)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {k: v.detach().clone().float() for k, v in state.items()}
        self._journal.clear()


def check_layout(layout: list[Segment], numel: int) -> None:
    """Segments must tile ``[0, numel)`` exactly once: a gap or overlap would lose or double residuals."""
    covered = sorted((s.flat_offset, s.numel) for s in layout)
    pos = 0
    for off, n in covered:
        if off != pos:
            raise RuntimeError(f"bucket layout does not tile the bucket: gap or overlap at element {pos} "
                               f"(next segment starts at {off})")
        pos += n
    if pos != numel:
        raise RuntimeError(f"bucket layout covers {pos} of {numel} elements")


# ----------------------------------------------------------------------------------------- compressors
class Compressor(Protocol):
    """Encode ``acc`` (this rank's error-compensated flat gradient), run collectives, decode.

    ``reduce`` returns ``(summed, sent)``: ``summed`` is the sum over ranks of every rank's ``sent`` (the
    same on all ranks), ``sent`` is the part of ``acc`` this rank transmitted (``acc - sent`` is its new
    residual). ``seed`` is identical on all ranks for the same call, so hashes and phases agree.
    """

    name: str

    def reduce(self, acc: torch.Tensor, comm: Collective, seed: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class DenseCompressor:
    """``none``: the dense all-reduce (ratio 1), through the same accounting as the lossy methods."""

    name = "none"

    def __init__(self, ratio: float = 1.0, rows: int = 1):
        del ratio, rows  # validated by CompressionConfig: "none" takes neither

    def reduce(self, acc, comm, seed):
        summed = acc.clone()
        comm.all_reduce_sum(summed)
        return summed, acc


def topk_budget(n: int, ratio: float) -> int:
    """(int32 index, fp32 value) pairs: 8 bytes each against 4 dense bytes per element, so k = n / (2 ratio)."""
    return max(1, min(n, int(n / (2.0 * ratio))))


class TopKCompressor:
    """``topk``: each rank sends its own k largest-magnitude entries as (index, value) pairs via all-gather.

    1. ``k = n / (2 * ratio)``; ``idx = topk(|acc|, k)`` on this rank (index sets differ between ranks).
    2. all-gather ``idx`` (int32) and ``acc[idx]`` (fp32): 8k bytes handed over per rank.
    3. ``summed = sum_r scatter(idx_r, val_r)``; ``sent = scatter(idx, acc[idx])``.
    Note the gather's *received* bytes grow with the number of ranks; ratios here are per-rank send bytes.
    """

    name = "topk"

    def __init__(self, ratio: float, rows: int = 1):
        del rows
        self.ratio = ratio

    def reduce(self, acc, comm, seed):
        n = acc.numel()
        k = topk_budget(n, self.ratio)
        idx = torch.topk(acc.abs(), k, sorted=False).indices
        val = acc[idx]
        idx_all = comm.all_gather(idx.to(torch.int32))
        val_all = comm.all_gather(val.contiguous())
        summed = torch.zeros_like(acc)
        for i, v in zip(idx_all, val_all):
            summed.index_add_(0, i.long(), v)
        sent = torch.zeros_like(acc)
        sent[idx] = val
        return summed, sent


def sketch_budget(n: int, ratio: float, rows: int) -> tuple[int, int]:
    """(k, cols) for a two-round sketch within ``4 n / ratio`` bytes.

    Round 1 sends ``rows * cols`` fp32 (a complex bin counts as 2), round 2 sends ``k`` fp32 values, with
    ``cols = 2 k`` (a table twice as wide as the number of heavy coordinates it must find): ``k (1 + 2 rows)``
    floats in all.
    """
    k = max(1, int(n / (ratio * (1 + 2 * rows))))
    return min(k, n), 2 * k


class SketchCompressor:
    """Two-round linear-sketch compression (FetchSGD-style recovery with exact values), shared by tgss and hge.

    1. ``S = encode(acc)``: a linear sketch of ``rows x cols`` reals (identical hashes on every rank).
    2. all-reduce ``S``: by linearity it is now the sketch of the sum of all ranks' ``acc``.
    3. From ``S`` (identical on all ranks): candidates = coordinates whose bin is non-zero in **every** row
       (always a superset of the support of the summed gradient), ranked by ``|estimate|``; ``idx`` = all of
       them when there are at most ``k``, else the ``k`` best. The index set is the same on every rank.
    4. all-reduce the exact values ``acc[idx]`` (k fp32): ``summed`` is exact on ``idx`` and zero elsewhere.
    5. ``sent = acc`` on ``idx``, so the residual keeps everything else (and nothing is double-counted).
    Exact case: if the summed gradient has at most ``k`` candidates it is recovered exactly.
    """

    name = "sketch"

    def __init__(self, ratio: float, rows: int):
        self.ratio, self.rows = ratio, rows

    # subclasses: keys(n, cols, seed, device) -> hashes, computed once per call and shared by
    # encode(acc, keys, cols, seed) -> sketch and estimate(sketch, keys, n, cols, seed) -> (est, nonzero_in_all_rows)
    def keys(self, n: int, cols: int, seed: int, device: Any) -> Any:
        raise NotImplementedError

    def encode(self, acc: torch.Tensor, keys: Any, cols: int, seed: int) -> torch.Tensor:
        raise NotImplementedError

    def estimate(self, sketch: torch.Tensor, keys: Any, n: int, cols: int,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def select(self, sketch: torch.Tensor, keys: Any, n: int, k: int, cols: int, seed: int) -> torch.Tensor:
        est, cand = self.estimate(sketch, keys, n, cols, seed)
        n_cand = int(cand.sum())
        if n_cand <= k:
            return cand.nonzero().flatten()
        score = torch.where(cand, est.abs(), torch.full_like(est, -1.0))
        return torch.topk(score, k, sorted=False).indices

    def reduce(self, acc, comm, seed):
        n = acc.numel()
        k, cols = sketch_budget(n, self.ratio, self.rows)
        keys = self.keys(n, cols, seed, acc.device)
        sketch = self.encode(acc, keys, cols, seed)
        comm.all_reduce_sum(sketch)
        if not bool(torch.isfinite(sketch).all()):
            # some rank's gradient holds NaN/Inf, and every rank holds this same summed sketch: all of them
            # return a non-finite sum (the step will be skipped everywhere) and skip the second round
            return torch.full_like(acc, float("nan")), torch.zeros_like(acc)
        idx = self.select(sketch, keys, n, k, cols, seed)
        del keys  # rows x n hashes: freed before the second round
        vals = acc[idx].contiguous()
        sent = torch.zeros_like(acc)
        sent[idx] = vals
        comm.all_reduce_sum(vals)
        summed = torch.zeros_like(acc)
        summed[idx] = vals
        return summed, sent


def _registry() -> dict[str, Callable[..., Any]]:
    from .hge import HGECompressor
    from .tgss import TGSSCompressor
    return {"none": DenseCompressor, "topk": TopKCompressor, "tgss": TGSSCompressor, "hge": HGECompressor}


REGISTRY: tuple[str, ...] = ("hge", "none", "tgss", "topk")


def build_compressor(name: str, ratio: float, rows: int = 3) -> Compressor:
    """The compressor called ``name``; raises ``ValueError`` naming the choices for anything else."""
    table = _registry()
    if name in table:
        return table[name](ratio=ratio, rows=rows)
    else:
        raise ValueError(f"unknown compressor {name!r}; choose one of {sorted(table)}")


# ----------------------------------------------------------------------------------------- the reducer
class GradientReducer:
    """One compressor plus residuals, warm-up and byte accounting: what the DeepSpeed seams call.

    ``reduce(flat, layout, comm, step)`` returns the **sum over ranks** of the (compressed) gradient, in
    ``flat``'s dtype; the seams divide where DeepSpeed would. Steps ``< warmup_steps`` go dense.

    Non-finite gradients: every compressor returns a non-finite sum on **every** rank when any rank's gradient
    holds NaN/Inf (dense and sketch sums carry it; top-k sends NaN/Inf first). DeepSpeed then skips the step on
    all ranks, and the reducer rolls its residuals back to the step's start, so a skipped step leaves them
    unchanged (and later steps are not poisoned by a NaN kept in a residual).
    """

    def __init__(self, method: str, ratio: float, *, error_feedback: bool = True, warmup_steps: int = 0,
                 rows: int = 3, seed: int = 0):
        self.compressor = build_compressor(method, ratio, rows)
        self.method, self.ratio = method, ratio
        self.error_feedback, self.warmup_steps, self.seed = error_feedback, warmup_steps, seed
        self.residuals = ResidualStore()
        self.dense_bytes = 0    # bytes an uncompressed all-reduce would have handed over, since last take
        self.wire_bytes = 0     # bytes actually handed to collectives, since last take
        self.total_dense = 0
        self.total_wire = 0
        self.calls = 0
        self.nonfinite_steps = 0
        self._step, self._call_in_step = -1, 0
        self._skipped_step: Optional[int] = None  # the step whose sum was non-finite (its residuals rolled back)

    def end_step(self) -> None:
        """After the optimizer step: keep this step's residual writes (a skipped step's were rolled back)."""
        self.residuals.commit()

    def _call_seed(self, step: int) -> int:
        if step != self._step:
            self.residuals.commit()  # a new step: the previous one's writes stand (no end_step was called)
            self._step, self._call_in_step = step, 0
        self._call_in_step += 1
        # identical on all ranks: same config seed, same step, same call order (collectives are ordered)
        return (self.seed * 1_000_003 + step * 7_919 + self._call_in_step) & 0x7FFFFFFF

    def reduce(self, flat: torch.Tensor, layout: list[Segment], comm: Any, step: int) -> torch.Tensor:
        check_layout(layout, flat.numel())
        counting = CountingCollective(comm)
        dense = flat.numel() * flat.element_size()
        seed = self._call_seed(step)
        if step < self.warmup_steps:
            summed = flat.clone()
            counting.all_reduce_sum(summed)
        else:
            acc = flat.detach().float().clone()
            if self.error_feedback:
                self.residuals.add_into(acc, layout)
            summed, sent = self.compressor.reduce(acc, counting, seed)
            if not bool(torch.isfinite(summed).all()):  # the same verdict on every rank (see the class doc)
                if self._skipped_step != step:
                    self._skipped_step = step
                    self.nonfinite_steps += 1
                    log.warning("titan compression: non-finite gradients at step %d; residuals rolled back to the "
                                "step's start (DeepSpeed skips the step on every rank)", step + 1)
                self.residuals.rollback()
            elif self.error_feedback and self._skipped_step != step:
                self.residuals.write(acc - sent, layout)
            summed = summed.to(flat.dtype)
        self.calls += 1
        self.dense_bytes += dense
        self.wire_bytes += counting.bytes
        self.total_dense += dense
        self.total_wire += counting.bytes
        return summed

    def take_metrics(self) -> dict[str, Any]:
        """Bytes since the previous call (one optimizer step when called per step), then reset the window."""
        ratio = self.dense_bytes / self.wire_bytes if self.wire_bytes else None
        out = {"hge_compression_ratio": ratio, "wire_bytes": self.wire_bytes, "dense_grad_bytes": self.dense_bytes,
               "compression_method": self.method,
               "compression_total_ratio": self.total_dense / self.total_wire if self.total_wire else None,
               "compression_state_bytes": self.residuals.nbytes(), "compression_nonfinite_steps": self.nonfinite_steps}
        self.dense_bytes = self.wire_bytes = 0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": self.residuals.state_dict(), "total_dense": self.total_dense,
                "total_wire": self.total_wire, "calls": self.calls, "method": self.method}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("method") != self.method:
            raise RuntimeError(f"checkpoint holds residuals of compressor {state.get('method')!r} but "
                               f"titan.compression.method is {self.method!r}; resume with the same method")
        self.residuals.load_state_dict(state["residuals"])
        self.total_dense, self.total_wire = int(state["total_dense"]), int(state["total_wire"])
        self.calls = int(state["calls"])
