"""What every gradient compressor shares: collectives, residuals, the ``Compressor`` protocol and byte budgets.

The concrete compressors (``dense``, ``topk``, ``tgss``, ``hge``) import from here; the registry
(``registry.py``) imports them; ``GradientReducer`` (``compressor.py``) builds one through the registry. This
module imports no other module of ``titan_ds.comm``, so the package has no import cycle
(``tests/test_import_graph.py``). ``SketchCompressor`` is the two-round recovery that ``tgss`` and ``hge``
share.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

__all__ = [
    "Collective", "LocalCollective", "CountingCollective", "Segment", "ResidualStore", "check_layout",
    "Compressor", "topk_budget", "sketch_budget", "SketchCompressor", "all_finite", "nonfinite", "SparseSent", "check_splits",
    "to_device_async", "workspace_zeros", "WORKSPACE_MMAP_BYTES", "EXPERIMENTAL_NOTE",
]


def all_finite(t: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """``torch.isfinite(t).all()`` in chunks of ``chunk`` elements: on CPU ``isfinite`` builds a full-size fp32
    ``abs`` and three bool tensors (torch profiler, one 4.9M-element fp32 sum: 18.7 MB + 3 x 4.7 MB), which
    the reducer's peak memory does not need."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[lo:lo + chunk]).all()) for lo in range(0, flat.numel(), chunk))


def nonfinite(t: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """``~all_finite(t)`` as a 0-dim bool tensor on ``t``'s device (chunked alike): a verdict the step can act on
    with ``masked_fill_`` / ``torch.where`` without reading it back to the host (a sync on a GPU)."""
    flat = t.reshape(-1)
    bad = torch.zeros((), dtype=torch.bool, device=t.device)
    for lo in range(0, flat.numel(), chunk):
        bad |= ~torch.isfinite(flat[lo:lo + chunk]).all()
    return bad


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t.to(device)`` for a tensor made on the host, without the host waiting for the device: on CUDA a blocking
    copy synchronizes the stream, so ``t`` is pinned and copied asynchronously (the caching host allocator keeps
    the pinned buffer until the copy is done)."""
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


# a host buffer of at least this many bytes is its own anonymous mapping (workspace_zeros)
WORKSPACE_MMAP_BYTES = 1 << 20


def workspace_zeros(numel: int, device: "torch.device | str", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch.zeros(numel)`` for the reducer's full-size per-step buffers (the flattened bucket that becomes the
    residual, the sum, a shard's total, the journal). On the host, from :data:`WORKSPACE_MMAP_BYTES` on, the
    buffer is an anonymous mapping of its own (zero pages from the kernel, given back when the tensor and its
    views are freed) instead of glibc's heap, where buffers that live across a step (the residual, the journal)
    and the step's temporaries interleave and the heap grows around them (docs/compress.md, "Peak RSS on 2
    ranks"). On an accelerator, and for small buffers, it is ``torch.zeros``."""
    device = torch.device(device)
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < WORKSPACE_MMAP_BYTES:
        return torch.zeros(numel, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=numel)  # the tensor keeps the mapping


class SparseSent:
    """What a sparse compressor sent: ``values`` at the distinct ``indices`` of a flat tensor of ``numel``,
    zeros elsewhere. It stands for the dense ``sent`` without its full-size tensor (the reducer only subtracts
    it from ``acc`` and masks where it is non-zero); :meth:`dense` builds that tensor (tests)."""

    def __init__(self, indices: torch.Tensor, values: torch.Tensor, numel: int):
        self.indices, self.values, self.numel = indices, values, numel

    def dense(self) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=self.values.dtype, device=self.values.device)
        out[self.indices] = self.values
        return out

    def subtract_from_(self, acc: torch.Tensor) -> torch.Tensor:
        """``acc -= dense()``, element for element the same floats (``x - 0`` is ``x``, ``-0.0`` included)."""
        acc[self.indices] = acc[self.indices] - self.values
        return acc

    def zero_where_sent_(self, t: torch.Tensor) -> None:
        """``t.masked_fill_(dense() != 0, 0)`` (the indices are distinct; no boolean indexing: its size would be
        read on the host)."""
        t[self.indices] = t[self.indices].masked_fill_(self.values != 0, 0.0)


def subtract_sent_(acc: torch.Tensor, sent: "torch.Tensor | SparseSent") -> torch.Tensor:
    """``acc -= sent`` in place, for a dense ``sent`` or a :class:`SparseSent`."""
    return sent.subtract_from_(acc) if isinstance(sent, SparseSent) else acc.sub_(sent)


def zero_where_sent_(t: torch.Tensor, sent: "torch.Tensor | SparseSent") -> None:
    if isinstance(sent, SparseSent):
        sent.zero_where_sent_(t)
    else:
        t.masked_fill_(sent != 0, 0.0)


# ----------------------------------------------------------------------------------------- collectives
class Collective(Protocol):
    """The collectives a compressor may use, over the data-parallel group: a sum, a gather, and an all-to-all
    (``torch.distributed.all_to_all_single``): piece ``j`` of ``t`` goes to rank ``j``, the result's piece ``i``
    came from rank ``i``. Without splits the pieces are ``world_size`` equal ones; with them (host ints, elements
    of the flat ``t``) this rank sends ``send[j]`` elements to rank ``j`` and receives ``recv[i]`` from rank ``i``
    (``recv[i]`` must be what rank ``i`` sends here), so unequal pieces cross the wire unpadded. A compressor that
    uses ``all_to_all`` also reads ``rank``, which every multi-rank collective here has."""

    world_size: int

    def all_reduce_sum(self, t: torch.Tensor) -> None: ...

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...

    def all_to_all(self, t: torch.Tensor, send: Optional[list[int]] = None,
                   recv: Optional[list[int]] = None) -> torch.Tensor: ...


def check_splits(t: torch.Tensor, world: int, send: Optional[list[int]], recv: Optional[list[int]]) -> None:
    """An all-to-all's splits: both or neither, ``world`` non-negative entries each, ``send`` summing to ``t``."""
    if (send is None) != (recv is None):
        raise ValueError("all_to_all takes both send and recv splits, or neither")
    if send is None:
        if t.numel() % world:
            raise ValueError(f"all_to_all needs {world} equal pieces, got {t.numel()} elements")
        return
    assert recv is not None
    if len(send) != world or len(recv) != world or min(send) < 0 or min(recv) < 0:
        raise ValueError(f"all_to_all splits need {world} non-negative entries each, got send={send} recv={recv}")
    if sum(send) != t.numel():
        raise ValueError(f"all_to_all send splits add up to {sum(send)}, the tensor has {t.numel()} elements")


class LocalCollective:
    """One rank: the collectives are identities."""

    world_size = 1
    rank = 0

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        return None

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t.clone()]

    def all_to_all(self, t: torch.Tensor, send: Optional[list[int]] = None,
                   recv: Optional[list[int]] = None) -> torch.Tensor:
        check_splits(t, 1, send, recv)
        return t.clone()



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

    def all_to_all(self, t: torch.Tensor, send: Optional[list[int]] = None,
                   recv: Optional[list[int]] = None) -> torch.Tensor:
        self.bytes += t.numel() * t.element_size()
        self.calls += 1
        return self.inner.all_to_all(t) if send is None else self.inner.all_to_all(t, send, recv)

    @property
    def rank(self) -> int:
        return self.inner.rank


# ----------------------------------------------------------------------------------------- residuals
@dataclass(frozen=True)
class Segment:
    """``numel`` elements of parameter ``key`` starting at ``param_offset`` sit at ``flat_offset`` in a bucket.

    ``shape`` is the parameter's shape (``None`` when the caller does not know it). Only ``powersgd`` needs
    it: it views each parameter as the matrix ``(shape[0], prod(shape[1:]))``, as the paper and torch's hook do.
    """

    key: str
    param_offset: int
    flat_offset: int
    numel: int
    param_numel: int
    shape: Optional[tuple[int, ...]] = None


_SCALE_CHUNK = 1 << 20  # elements per temporary of a pending scale (ResidualStore.add_into)


class ResidualStore:
    """Error-feedback residuals, one fp32 tensor per parameter (created on first use), addressed by offset.

    The same journaled store keeps the other per-parameter state of a compressor (DGC's momentum, PowerSGD's
    warm-start ``Q``): :meth:`get` / :meth:`put` read and replace a whole tensor by key, journaled like
    :meth:`write`.

    Writes are journaled per optimizer step (:meth:`begin`): the first write to a parameter's residual in a
    step keeps its previous value, so that :meth:`rollback` can put back exactly what the step started from
    when the step turns out to be skipped (non-finite gradients). :meth:`commit` drops the journal. The
    journal holds at most one copy of the residuals, and only while a step is being reduced and applied; a
    whole parameter written by :meth:`write` costs no copy (the old tensor is the journal's).
    """

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}
        self._journal: dict[str, Optional[torch.Tensor]] = {}  # key -> value at step start (None: created)
        # key -> a pending multiplier of the stored tensor (:meth:`scale_`; absent: 1), and the keys' multipliers
        # at the step's start for those changed in the step (rolled back with the tensors)
        self._factor: dict[str, float] = {}
        self._jfactor: dict[str, float] = {}

    def _set_factor(self, key: str, factor: float) -> None:
        if key not in self._jfactor:
            self._jfactor[key] = self._factor.get(key, 1.0)
        if factor == 1.0:
            self._factor.pop(key, None)
        else:
            self._factor[key] = factor

    def _materialize(self, key: str) -> None:
        """Apply ``key``'s pending multiplier, if any: the stored tensor becomes ``old * factor``, a new tensor (the
        old one is journaled by reference, never changed in place), as :meth:`scale_` did eagerly. A factor exists
        only for a stored key (rollback and load drop the others)."""
        factor = self._factor.get(key)
        if factor is None:
            return
        old = self.residuals[key]
        if key not in self._journal:
            self._journal[key] = old
        self.residuals[key] = old * factor
        self._set_factor(key, 1.0)

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
        """``acc``'s segments += the stored values (a pending :meth:`scale_` applied on the way, in chunks: the
        same bits as the scaled tensor, without it)."""
        for s in layout:
            r = self._get(s, acc.device)
            out, piece = acc[s.flat_offset:s.flat_offset + s.numel], r[s.param_offset:s.param_offset + s.numel]
            factor = self._factor.get(s.key)
            if factor is None:
                out += piece
                continue
            for lo in range(0, s.numel, _SCALE_CHUNK):
                out[lo:lo + _SCALE_CHUNK] += piece[lo:lo + _SCALE_CHUNK] * factor

    def write(self, new: torch.Tensor, layout: list[Segment]) -> None:
        """Store ``new``'s segments. A segment that is a whole parameter, written once in the step, is adopted
        (the store keeps a view of ``new``; the old tensor becomes the journal's copy): ``new`` is handed over,
        and the caller must not change it afterwards. Other segments are copied into the stored tensor."""
        for s in layout:
            piece = new[s.flat_offset:s.flat_offset + s.numel]
            if s.param_offset == 0 and s.numel == s.param_numel and s.key not in self._journal:
                old = self.residuals.get(s.key)
                if old is not None and old.numel() != s.param_numel:
                    self._get(s, new.device)  # raises: the model changed
                self._journal[s.key] = old  # None: created in this step
                self.residuals[s.key] = piece
                self._set_factor(s.key, 1.0)
                continue
            self._materialize(s.key)
            r = self._get(s, new.device)
            if s.key not in self._journal:
                self._journal[s.key] = r.clone()
            r[s.param_offset:s.param_offset + s.numel] = piece

    def slice_(self, seg: Segment, device: torch.device) -> torch.Tensor:
        """The stored slice of ``seg``, journaled like :meth:`write`, for the caller to change in place."""
        self._materialize(seg.key)
        r = self._get(seg, device)
        if seg.key not in self._journal:
            self._journal[seg.key] = r.clone()
        return r[seg.param_offset:seg.param_offset + seg.numel]

    def journal_(self, layout: list[Segment], device: torch.device) -> None:
        """Journal, before the caller changes them in place, the stored tensors of ``layout``'s segments not yet
        journaled in this step, as views of **one** buffer (what :meth:`slice_` would clone one by one: the same
        values, one allocation a bucket instead of one a parameter, which a long run's heap does not fragment)."""
        todo: dict[str, torch.Tensor] = {}
        for seg in layout:
            self._materialize(seg.key)  # a scaled key is journaled by reference: not copied below
            if seg.key not in self._journal and seg.key not in todo:
                if seg.key not in self.residuals:
                    self._get(seg, device)  # created in this step: journaled as None (a rollback drops it)
                    continue
                todo[seg.key] = self._get(seg, device)
        if len(todo) < 2:
            return
        buf = workspace_zeros(sum(r.numel() for r in todo.values()), device)
        at = 0
        for key, r in todo.items():
            view = buf[at:at + r.numel()].view_as(r)
            view.copy_(r)
            self._journal[key] = view
            at += r.numel()

    def update_(self, flat: torch.Tensor, layout: list[Segment],
                fn: "Callable[[torch.Tensor, torch.Tensor], None]") -> None:
        """``fn(stored, piece)`` for each segment: the stored slice (journaled like :meth:`write`, in one buffer:
        :meth:`journal_`, then changed in place by ``fn``) beside the segment's piece of ``flat``, so a running
        state needs no full-size copy."""
        self.journal_(layout, flat.device)
        for s in layout:
            fn(self.slice_(s, flat.device), flat[s.flat_offset:s.flat_offset + s.numel])

    def get(self, key: str) -> Optional[torch.Tensor]:
        """The tensor kept under ``key`` (``None`` if there is none yet; a new tensor where a :meth:`scale_` is
        pending); do not modify it in place."""
        r = self.residuals.get(key)
        factor = self._factor.get(key)
        return r if r is None or factor is None else r * factor

    def put(self, key: str, value: torch.Tensor) -> None:
        """Replace (or create) the whole tensor under ``key``, journaled like :meth:`write`."""
        old = self.residuals.get(key)
        if key not in self._journal:
            self._journal[key] = None if old is None else old  # replaced, never modified in place: no copy
        self.residuals[key] = value.detach().float().clone()
        self._set_factor(key, 1.0)

    def adopt(self, key: str, value: torch.Tensor) -> None:
        """:meth:`put` without the copy: the store keeps ``value`` itself (fp32; the caller hands it over)."""
        if value.dtype != torch.float32:
            raise TypeError(f"adopt takes an fp32 tensor, got {value.dtype}")
        old = self.residuals.get(key)
        if key not in self._journal:
            self._journal[key] = old
        self.residuals[key] = value.detach()
        self._set_factor(key, 1.0)

    def scale_(self, factor: float) -> None:
        """Every stored value times ``factor``, journaled like :meth:`write`. Pending: the multiplier is applied
        where the values are read (:meth:`add_into` adds ``r * factor`` in chunks; :meth:`get`, :meth:`state_dict`)
        or before a tensor is changed in place, bit for bit the values of multiplying at once, without a second
        full-size copy of the store beside the journal's (a whole parameter's residual is then replaced by
        :meth:`write` and never scaled). A second multiplier on a pending one applies the first (the same
        roundings as two multiplications)."""
        for key in list(self.residuals):
            self._materialize(key)
            self._set_factor(key, factor)

    def commit(self) -> None:
        """The step was applied: its residual writes stand."""
        self._journal.clear()
        self._jfactor.clear()

    def rollback(self) -> None:
        """The step is skipped: every residual goes back to its value at the step's start."""
        for key, old in self._journal.items():
            if old is None:
                self.residuals.pop(key, None)
            else:
                self.residuals[key] = old  # the journal's own copy (or, after put, the replaced tensor)
        for key, factor in self._jfactor.items():
            if factor == 1.0 or key not in self.residuals:
                self._factor.pop(key, None)
            else:
                self._factor[key] = factor
        self._journal.clear()
        self._jfactor.clear()

    def nbytes(self) -> int:
        """Bytes held now: the residuals and, mid-step, the journal."""
        held = list(self.residuals.values()) + [t for t in self._journal.values() if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def norm(self) -> float:
        return float(sum(float(self.get(k).double().pow(2).sum()) for k in self.residuals) ** 0.5)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: self.get(k).detach().cpu().clone() for k in self.residuals}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {k: v.detach().clone().float() for k, v in state.items()}
        self._journal.clear()
        self._factor.clear()
        self._jfactor.clear()


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
    residual). ``seed`` is identical on all ranks for the same call, so hashes and phases agree. ``layout``
    maps ``acc`` to parameters (``powersgd`` needs the matrices); ``ratio`` is this call's target ratio (the
    reducer's sparsity warm-up ramps it), ``None`` for the compressor's own.

    A compressor that keeps per-parameter state across steps (``powersgd``'s warm-start ``Q``) exposes it as
    ``stores: dict[str, ResidualStore]``: the reducer rolls it back with the residuals when a step is
    skipped, checkpoints it and counts its bytes.
    """

    name: str                      # the key in ``registry.REGISTRY`` and in ``titan.compression.method``
    # ``titan.compression`` keys this method uses besides ``method`` and ``warmup_steps``; any other is an error
    config_keys: tuple[str, ...]

    def reduce(self, acc: torch.Tensor, comm: Collective, seed: int, *, layout: list[Segment],
               ratio: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]: ...


def topk_budget(n: int, ratio: float) -> int:
    """(int32 index, fp32 value) pairs: 8 bytes each against 4 dense bytes per element, so k = n / (2 ratio)."""
    return max(1, min(n, int(n / (2.0 * ratio))))



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
       (always a superset of the support of the summed gradient), ranked by ``|estimate|``; ``idx`` = the ``k``
       best, all of them when there are at most ``k`` (then the rest of ``idx`` is not taken: it sends 0). The
       index set is the same on every rank, and its size is ``k`` whatever the data (no host read).
    4. all-reduce the exact values ``acc[idx]`` of the taken coordinates (k fp32): ``summed`` is exact on them
       and zero elsewhere.
    5. ``sent = acc`` on the taken coordinates, so the residual keeps everything else (and nothing is
       double-counted).
    Exact case: if the summed gradient has at most ``k`` candidates it is recovered exactly.
    A non-finite summed sketch (NaN/Inf on some rank) gives a non-finite ``summed`` and a zero ``sent`` on every
    rank, decided on the device (:func:`nonfinite`).
    """

    config_keys: tuple[str, ...] = ("ratio", "error_feedback", "sketch_rows", "seed", "ratio_warmup_steps",
                                    "ratio_warmup_start")

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

    def select(self, sketch: torch.Tensor, keys: Any, n: int, k: int, cols: int,
               seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(idx, take)``: ``k`` coordinates, the candidates first by ``|estimate|``, and which of them are
        candidates. A fixed ``k``, so nothing is read on the host: with at most ``k`` candidates every one of
        them is among ``idx``, the rest of ``idx`` is marked not taken."""
        est, cand = self.estimate(sketch, keys, n, cols, seed)
        score = torch.where(cand, est.abs(), torch.full_like(est, -1.0))
        idx = torch.topk(score, k, sorted=False).indices
        return idx, cand[idx]

    def reduce(self, acc, comm, seed, *, layout, ratio=None):
        del layout  # the sketch hashes flat coordinates; residuals are the reducer's
        n = acc.numel()
        k, cols = sketch_budget(n, self.ratio if ratio is None else ratio, self.rows)
        keys = self.keys(n, cols, seed, acc.device)
        sketch = self.encode(acc, keys, cols, seed)
        comm.all_reduce_sum(sketch)
        # some rank's gradient holds NaN/Inf: every rank holds this same summed sketch, so all of them return a
        # non-finite sum (the step will be skipped everywhere); the verdict stays on the device
        bad = nonfinite(sketch)
        idx, take = self.select(sketch, keys, n, k, cols, seed)
        del keys  # rows x n hashes: freed before the second round
        vals = torch.where(take, acc[idx], 0.0)
        sent = torch.zeros_like(acc)
        sent[idx] = vals
        comm.all_reduce_sum(vals)
        summed = torch.zeros_like(acc)
        summed[idx] = vals
        return summed.masked_fill_(bad, float("nan")), sent.masked_fill_(bad, 0.0)


# the warning ``titan.compression`` gives at initialize for an experimental method (a compressor's ``experimental``)
EXPERIMENTAL_NOTE = ("{method} with the sketch preconditioner (precondition \"rms_sketch\") was 0.7 to 2.2 nats behind "
                     "dense AdamW at 100x on 2, 8 and 32 simulated workers, 400 steps, each at its best lr, where the "
                     "recommended section (ds_configs/compress_rms_sketch.json: qtopk, sharded exchange) was within "
                     "0.1 (results/compress_heldout/hge.md); use that section")
