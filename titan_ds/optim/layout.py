"""Where each parameter's elements live inside the tensors the optimizer is handed.

Stage 0 hands the optimizer the parameters themselves; ZeRO-1/2 hand it one flat fp32 partition per param
group, ZeRO-3 one per sub-group (deepspeed_seams.md 1.2). ASDT and BSPS act per *unit* (a parameter, or a
fixed-size block of one), so for every tensor the optimizer sees we keep a :class:`Layout`: the contiguous
*pieces* of units it holds, and which units are split across data-parallel ranks (their top-k threshold is
then found collectively, :func:`kth_largest`). :class:`LayoutMap` finds the layout of a tensor handed to
``step()``. Inside the optimizer state of such a tensor, a :class:`UnitState` record says where each active
unit's slice of a state buffer (``momentum`` or ``anchor``) lives; :func:`place_units` keeps a buffer and its
records in step with the units that are active.

The mapping comes from DeepSpeed's own bookkeeping (read from the installed 0.19.8 sources):

* ZeRO-1/2 ``DeepSpeedZeroOptimizer``: ``round_robin_bit16_groups[i]`` (params in flat order),
  ``round_robin_bit16_offsets[i]`` (each param's offset in the padded flat group, alignment padding
  included), ``partition_size[i]``, and ``single_partition_of_fp32_groups[i]`` (the tensor the client
  optimizer sees) covering ``[rank * partition_size, (rank + 1) * partition_size)`` of the flat group.
* ZeRO-3 ``DeepSpeedZeroOptimizer_Stage3``: ``fp16_groups[s]`` (params of sub-group ``s``), each param's
  partition of ``partition_numel()`` elements holding ``[rank * pn, min((rank + 1) * pn, ds_numel))`` of it,
  laid end to end in ``fp32_partitioned_groups_flat[s]`` (the tensor the client optimizer sees).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from .. import deepspeed_compat as dsc

__all__ = ["Unit", "Piece", "Layout", "LayoutMap", "UnitState", "build_units", "param_layout", "zero_layouts",
           "views", "place_units", "kth_largest", "unit_sums", "GRANULARITIES"]


@dataclass(frozen=True)
class Unit:
    """A parameter or a block of one: the set over which top-k and BSPS act."""

    index: int           # position in the optimizer's unit list (identical on every rank and stage)
    param: str           # parameter name
    start: int           # first element within the flattened parameter
    numel: int
    global_offset: int   # first element's index in the whole model's element space (sketch indices)


@dataclass(frozen=True)
class Piece:
    unit: int            # Unit.index
    start: int           # offset in the flat tensor the optimizer sees
    length: int
    unit_offset: int     # offset of the piece's first element within its unit


@dataclass
class Layout:
    pieces: list[Piece]
    split_units: list[int] = field(default_factory=list)  # units split across ranks: same list on every rank
    group: Any = None                                     # process group over which split units are spread
    zero: bool = False                                    # handed by a ZeRO optimizer (not a real parameter)


@dataclass
class UnitState:
    """Where one active unit's optimizer state lives: ``state[buffer][start:start + length]``."""

    unit: int            # Unit.index
    buffer: str          # the state buffer holding it ("momentum" for Growth, "anchor" for Elastic)
    start: int           # offset in that buffer
    length: int          # = the length of the unit's piece in the tensor


class _Span(Protocol):
    start: int
    length: int


def views(flat: torch.Tensor, spans: Sequence[_Span]) -> list[torch.Tensor]:
    """``flat[s.start:s.start + s.length]`` for each span (a :class:`Piece`, or a state record)."""
    return [flat[s.start:s.start + s.length] for s in spans]


class LayoutMap:
    """The :class:`Layout` of every tensor the optimizer is handed, looked up by identity.

    Stage 0: the parameters (``param_layout``); ZeRO-1/2/3: the flat partitions (``zero_layouts``).
    """

    def __init__(self, layouts: dict[int, tuple[torch.Tensor, Layout]], zero: bool):
        self._layouts = dict(layouts)
        self.zero = zero

    def of(self, t: torch.Tensor) -> Layout:
        hit = self._layouts.get(id(t))
        if hit is None or hit[0] is not t:
            raise RuntimeError(
                f"ASDT was handed a tensor of shape {tuple(t.shape)} it has no layout for. Under ZeRO-1/2/3 "
                f"DeepSpeed passes flat partitions: build the engine with titan_ds.initialize (which attaches "
                f"the layout), or call titan_ds.optim.install.attach_zero_layout(engine, optimizer)")
        return hit[1]

    def group(self) -> Any:
        """The process group split units are spread over (None: nothing is split, e.g. stage 0 or 1 rank)."""
        for _, lay in self._layouts.values():
            if lay.group is not None:
                return lay.group
        return None

    def device(self) -> Optional[torch.device]:
        """The device of the tensors handed to the optimizer (None when there are none)."""
        for t, _ in self._layouts.values():
            return t.device
        return None


def place_units(st: dict[str, Any], buffer: str, pieces: list[Piece], init: Callable[[Piece], torch.Tensor],
                empty: torch.Tensor, per_unit: Optional[int] = None) -> None:
    """Make ``st[buffer]`` hold exactly the units of ``pieces``, in their order, and ``st["units"]`` say so.

    Units already held keep their values; a new unit starts at ``init(piece)``; no pieces: ``empty``. Each unit
    takes its piece's length in the buffer, or ``per_unit`` elements (a per-unit statistic, e.g. ASDT's second
    moment and its step count) when given.
    """
    held = [r for r in st["units"] if r.buffer == buffer]
    if buffer in st and [r.unit for r in held] == [pc.unit for pc in pieces]:
        return
    where, old = {r.unit: r for r in held}, st.get(buffer)
    parts, records, cursor = [], [], 0
    for pc in pieces:
        r = where.get(pc.unit)
        parts.append(old[r.start:r.start + r.length] if r is not None else init(pc))
        length = pc.length if per_unit is None else per_unit
        records.append(UnitState(pc.unit, buffer, cursor, length))
        cursor += length
    st[buffer] = torch.cat(parts) if parts else empty  # the old buffer is needed until here (kept slices)
    st["units"] = [r for r in st["units"] if r.buffer != buffer] + records


GRANULARITIES = ("tensor", "block", "row")


def build_units(named: list[tuple[str, torch.Tensor]], granularity: str, block_size: int) -> list[Unit]:
    """Units of every parameter in order: one per parameter (``tensor``), per ``block_size`` elements
    (``block``), or per row of the first dimension of a matrix (``row``: a linear layer's output channel, an
    embedding's token) and per element of a vector (biases and norms keep a statistic of their own: ASDT's
    ``update="adaptive"`` is then Adam on them)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; choose one of {sorted(GRANULARITIES)}")
    units: list[Unit] = []
    offset = 0
    for name, p in named:
        n = _numel(p)
        shape = tuple(getattr(p, "ds_shape", p.shape))
        step = n if granularity == "tensor" else block_size if granularity == "block" else \
            (n // shape[0] if len(shape) >= 2 and shape[0] > 0 else 1)
        for s in range(0, max(n, 1), max(step, 1)):
            length = min(step, n - s)
            units.append(Unit(len(units), name, s, length, offset + s))
        offset += n
    return units


def _numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def _pieces_of(units: list[Unit], lo: int, hi: int, flat_start: int) -> list[Piece]:
    """Pieces of the parameter's units overlapping its element range [lo, hi), placed at flat_start."""
    out = []
    for u in units:
        a, b = max(u.start, lo), min(u.start + u.numel, hi)
        if a < b:
            out.append(Piece(u.index, flat_start + a - lo, b - a, a - u.start))
    return out


def _split_units(units: list[Unit], ranges_per_rank: list[tuple[int, int]]) -> list[int]:
    split = []
    for u in units:
        owners = sum(1 for lo, hi in ranges_per_rank if max(u.start, lo) < min(u.start + u.numel, hi))
        if owners > 1:
            split.append(u.index)
    return split


def param_layout(units_of_param: list[Unit]) -> Layout:
    """Stage 0: the tensor is the parameter itself."""
    return Layout(pieces=_pieces_of(units_of_param, 0, sum(u.numel for u in units_of_param), 0))


def zero_layouts(zero_opt: Any, names: dict[int, str], units_by_param: dict[str, list[Unit]]) -> dict[int, tuple[torch.Tensor, Layout]]:
    """``{id(flat tensor): (flat tensor, Layout)}`` for a DeepSpeed ZeRO-1/2/3 optimizer wrapper (its flat
    partitions read through :func:`titan_ds.deepspeed_compat.zero_partitions`).

    ``names`` maps ``id(model parameter)`` to its name (the names the optimizer's units were built with).
    """
    import deepspeed.comm as dist

    parts = dsc.zero_partitions(zero_opt)
    if parts is None:
        raise TypeError(f"cannot map flat partitions of {type(zero_opt).__name__}: expected DeepSpeed's "
                        f"DeepSpeedZeroOptimizer (ZeRO-1/2) or DeepSpeedZeroOptimizer_Stage3")
    out = {}
    for s, part in enumerate(parts):
        world, rank = dist.get_world_size(group=part.group), dist.get_rank(group=part.group)
        pieces, split = (_stage12_pieces if part.offsets is not None else _stage3_pieces)(part, s, world, rank, names,
                                                                                          units_by_param)
        out[id(part.flat)] = (part.flat, Layout(sorted(pieces, key=lambda q: q.start), sorted(split),
                                                part.group if world > 1 else None, zero=True))
    return out


def _name(p: torch.Tensor, names: dict[int, str]) -> str:
    if id(p) not in names:
        raise KeyError("a parameter held by the ZeRO optimizer was not given to ASDT; build ASDT over all of "
                       "model.named_parameters() (titan_ds.optim.install does)")
    return names[id(p)]


def _stage12_pieces(part: Any, s: int, world: int, rank: int, names, units_by_param):
    pieces, split, ps = [], [], part.rank_numel
    for p, off in zip(part.params, part.offsets):
        units = units_by_param[_name(p, names)]
        n = sum(u.numel for u in units)
        ranges = [(max(0, r * ps - off), min(n, (r + 1) * ps - off)) for r in range(world)]
        split += _split_units(units, ranges)
        lo, hi = ranges[rank]
        if lo < hi:
            pieces += _pieces_of(units, lo, hi, off + lo - rank * ps)
    return pieces, split


def _stage3_pieces(part: Any, s: int, world: int, rank: int, names, units_by_param):
    pieces, split, cursor = [], [], 0
    for p in part.params:
        units = units_by_param[_name(p, names)]
        n, pn = int(p.ds_numel), int(p.partition_numel())
        ranges = [(min(n, r * pn), min(n, (r + 1) * pn)) for r in range(world)]
        split += _split_units(units, ranges)
        lo, hi = ranges[rank]
        if lo < hi:
            pieces += _pieces_of(units, lo, hi, cursor)
        cursor += pn
    if cursor != part.numel:
        raise RuntimeError(f"ZeRO-3 sub-group {s}: partitions add up to {cursor} elements but the flat fp32 "
                           f"tensor has {part.numel}; DeepSpeed's layout changed, titan cannot map it")
    return pieces, split


# ---------------------------------------------------------------------------------------------- top-k thresholds
def _bits(x: torch.Tensor) -> torch.Tensor:
    """int32 bit patterns of non-negative floats: monotone in the value (IEEE-754)."""
    return x.float().contiguous().view(torch.int32)


def kth_largest(scores: list[torch.Tensor], ks: list[int], pieces: list[Piece], layout: Layout,
                device: Optional[torch.device] = None) -> list[torch.Tensor]:
    """The k-th largest score of each piece's unit: local ``topk``, or a collective bisection when split.

    ``layout.split_units`` must be the same list on every rank (the collective runs when it is not empty,
    also on a rank that holds no piece of it). ``device``: where the bisection's counts live (the tensor the
    optimizer steps on; a rank may hold no scores); the scores' own device when None, else the CPU.
    """
    taus: list[Optional[torch.Tensor]] = [None] * len(pieces)
    split_pos = {u: j for j, u in enumerate(layout.split_units)}
    local_split = []
    for i, (s, k, pc) in enumerate(zip(scores, ks, pieces)):
        if pc.unit in split_pos:
            local_split.append(i)
        else:
            taus[i] = torch.topk(s, k).values[-1]
    if layout.split_units:
        if device is None:
            device = scores[0].device if scores else torch.device("cpu")
        found = _bisect_split(scores, ks, pieces, layout, local_split, split_pos, device)
        for i in local_split:
            taus[i] = found[split_pos[pieces[i].unit]]
    return taus  # type: ignore[return-value]


def _bisect_split(scores: list[torch.Tensor], ks: list[int], pieces: list[Piece], layout: Layout,
                  local_split: list[int], split_pos: dict[int, int], device: torch.device) -> torch.Tensor:
    """Exact k-th largest over units spread across ranks: bisect the int32 bit pattern (32 all-reduces of counts).

    Finds, per split unit, the largest pattern ``t`` with ``count(bits >= t) >= k`` summed over ranks, which is
    the pattern of the k-th largest value. Every rank calls this with the same ``layout.split_units``. Every
    tensor lives on ``device`` and nothing is read back to the host (the loop runs 32 times whatever the data).
    """
    import deepspeed.comm as dist

    n = len(layout.split_units)
    kvec = torch.zeros(n, dtype=torch.int64, device=device)
    for i in local_split:
        j = split_pos[pieces[i].unit]
        kvec[j:j + 1].fill_(ks[i])
    dist.all_reduce(kvec, op=dist.ReduceOp.MAX, group=layout.group)
    bits = {i: _bits(scores[i]) for i in local_split}
    lo = torch.zeros(n, dtype=torch.int64, device=device)
    hi = torch.full((n,), 0x7F800000, dtype=torch.int64, device=device)  # +inf
    for _ in range(32):
        mid = (lo + hi + 1) // 2
        counts = torch.zeros(n, dtype=torch.int64, device=device)
        for i in local_split:
            j = split_pos[pieces[i].unit]
            counts[j:j + 1] += (bits[i] >= mid[j]).sum()
        dist.all_reduce(counts, group=layout.group)
        ok = counts >= kvec
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid - 1)
    return lo.to(torch.int32).view(torch.float32)


# ---------------------------------------------------------------------------------------------- per-unit sums
def unit_sums(partial: torch.Tensor, pieces: list[Piece], layout: Layout) -> torch.Tensor:
    """Whole-unit sums from the per-piece ``partial`` sums of this rank: a piece of a unit split across ranks gets
    the sum over every rank's piece of it (one all-reduce); the others are already whole.

    ``layout.split_units`` must be the same list on every rank (the collective runs when it is not empty, also on
    a rank that holds no piece of it).
    """
    if not layout.split_units:
        return partial
    import deepspeed.comm as dist

    split_pos = {u: j for j, u in enumerate(layout.split_units)}
    acc = torch.zeros(len(layout.split_units), dtype=torch.float64, device=partial.device)
    where = [(i, split_pos[pc.unit]) for i, pc in enumerate(pieces) if pc.unit in split_pos]
    for i, j in where:
        acc[j:j + 1] += partial[i].double()
    dist.all_reduce(acc, group=layout.group)
    out = partial.clone()
    for i, j in where:
        out[i:i + 1] = acc[j].to(out.dtype)
    return out
