"""Where each parameter's elements live inside the tensors the optimizer is handed.

Stage 0 hands the optimizer the parameters themselves; ZeRO-1/2 hand it one flat fp32 partition per param
group, ZeRO-3 one per sub-group (deepspeed_seams.md 1.2). ASDT and BSPS act per *unit* (a parameter, or a
fixed-size block of one), so for every tensor the optimizer sees we keep a :class:`Layout`: the contiguous
*pieces* of units it holds, and which units are split across data-parallel ranks (their top-k threshold is
then found collectively, see ``asdt._kth_largest``).

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
from typing import Any, Optional

import torch

__all__ = ["Unit", "Piece", "Layout", "build_units", "param_layout", "zero_layouts"]


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


def build_units(named: list[tuple[str, torch.Tensor]], granularity: str, block_size: int) -> list[Unit]:
    """Units of every parameter in order: one per parameter (``tensor``) or per ``block_size`` elements."""
    if granularity not in ("tensor", "block"):
        raise ValueError(f"unknown granularity {granularity!r}; choose one of ['block', 'tensor']")
    units: list[Unit] = []
    offset = 0
    for name, p in named:
        n = _numel(p)
        step = n if granularity == "tensor" else block_size
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
    """``{id(flat tensor): (flat tensor, Layout)}`` for a DeepSpeed ZeRO-1/2/3 optimizer wrapper.

    ``names`` maps ``id(model parameter)`` to its name (the names the optimizer's units were built with).
    """
    import deepspeed.comm as dist

    if hasattr(zero_opt, "fp32_partitioned_groups_flat"):
        return _stage3_layouts(zero_opt, names, units_by_param, dist)
    if hasattr(zero_opt, "single_partition_of_fp32_groups"):
        return _stage12_layouts(zero_opt, names, units_by_param, dist)
    raise TypeError(f"cannot map flat partitions of {type(zero_opt).__name__}: expected DeepSpeed's "
                    f"DeepSpeedZeroOptimizer (ZeRO-1/2) or DeepSpeedZeroOptimizer_Stage3")


def _name(p: torch.Tensor, names: dict[int, str]) -> str:
    if id(p) not in names:
        raise KeyError("a parameter held by the ZeRO optimizer was not given to ASDT; build ASDT over all of "
                       "model.named_parameters() (titan_ds.optim.install does)")
    return names[id(p)]


def _stage12_layouts(zo: Any, names, units_by_param, dist) -> dict[int, tuple[torch.Tensor, Layout]]:
    out = {}
    for i, flat in enumerate(zo.single_partition_of_fp32_groups):
        group = zo.real_dp_process_group[i]
        world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        ps = zo.partition_size[i]
        pieces, split = [], []
        for p, off in zip(zo.round_robin_bit16_groups[i], zo.round_robin_bit16_offsets[i]):
            units = units_by_param[_name(p, names)]
            n = sum(u.numel for u in units)
            ranges = [(max(0, r * ps - off), min(n, (r + 1) * ps - off)) for r in range(world)]
            split += _split_units(units, ranges)
            lo, hi = ranges[rank]
            if lo < hi:
                pieces += _pieces_of(units, lo, hi, off + lo - rank * ps)
        out[id(flat)] = (flat, Layout(sorted(pieces, key=lambda q: q.start), sorted(split),
                                      group if world > 1 else None, zero=True))
    return out


def _stage3_layouts(zo: Any, names, units_by_param, dist) -> dict[int, tuple[torch.Tensor, Layout]]:
    out = {}
    for s, flat in enumerate(zo.fp32_partitioned_groups_flat):
        group = zo.sub_group_process_groups[s]
        world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        pieces, split, cursor = [], [], 0
        for p in zo.fp16_groups[s]:
            units = units_by_param[_name(p, names)]
            n, pn = int(p.ds_numel), int(p.partition_numel())
            ranges = [(min(n, r * pn), min(n, (r + 1) * pn)) for r in range(world)]
            split += _split_units(units, ranges)
            lo, hi = ranges[rank]
            if lo < hi:
                pieces += _pieces_of(units, lo, hi, cursor)
            cursor += pn
        if cursor != flat.numel():
            raise RuntimeError(f"ZeRO-3 sub-group {s}: partitions add up to {cursor} elements but the flat fp32 "
                               f"tensor has {flat.numel()}; DeepSpeed's layout changed, titan cannot map it")
        out[id(flat)] = (flat, Layout(pieces, sorted(split), group if world > 1 else None, zero=True))
    return out
