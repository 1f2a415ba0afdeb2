"""Block-wise quantized optimizer state: ASDT's ``"8bit"`` and ``"4bit"`` state dtypes.

A buffer of ``n`` fp32 values is stored as ``n`` 8-bit codes (``"8bit"``) or ``ceil(n / 2)`` bytes of packed
4-bit codes (``"4bit"``), plus one fp32 absmax per block of 256 (8-bit) or 128 (4-bit) values: 1.016 or 0.531
bytes a value. The code maps, block scaling and decoding are torchao's (``torchao.optim.quant_utils``, the ones its 8-bit and
4-bit AdamW use; Dettmers et al. 2022, Li et al. 2023): a signed dynamic-exponent map for a momentum, an unsigned
one (8-bit) or the linear map without zero (4-bit; a second moment must never decode to 0) for a second moment.
Encoding is to the nearest code, as torchao's, i.e. ``torch.bucketize`` over the midpoints of the map (a midpoint
rounds up), computed by a table lookup instead of a search: the top 16 bits of a float32 (sign, exponent and 7
mantissa bits) index a table of the code of the smallest value with those bits, and one comparison with the next
midpoint finishes it. That is exact wherever no 16-bit bucket holds two midpoints, which the table's builder
checks for each map (it holds for all four). On this CPU it encodes 4.9M values in ~0.1 s on one thread,
against 0.35 s for ``bucketize`` and 0.85 s for torchao's eight-pass branchless search. Encoding agrees with
torchao's except where a value lies within a rounding error of a midpoint (a few in a million here), where the
two pick neighbouring codes.
torchao's own optimizers keep this in a tensor subclass per parameter; ASDT's buffers hold many units end to
end (rows, ZeRO's flat partitions), so this module applies the same quantizers to slices of a flat buffer.

**Blocks restart at every record** (a unit, or the piece of one this rank holds): a unit's codes depend on its
own values only, never on its neighbours in the buffer. So ZeRO-1/2/3 on one rank, whose flat partitions hold
the same units as stage 0's per-parameter buffers, store the same codes and take the same steps bit for bit. A
unit split across ranks restarts its blocks at the rank boundary (its codes then differ from stage 0's in the
two blocks at the split).

Decoding and encoding go through fp32 in slices of at most ``_CHUNK`` values, so the temporaries of a large
embedding are bounded (~16 bytes a value of one slice). Both run on the buffer's device and never read a value
back to the host (the code maps and the encoding table are copied to each device once, :func:`_on`).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import re
from functools import lru_cache
from typing import Callable, Optional

import torch

__all__ = ["KINDS", "qmap", "quantize", "dequantize", "nbytes_per_value", "blocks", "read", "write"]

KINDS = {"8bit": (256, 8), "4bit": (128, 4)}  # block size, bits per code
_CHUNK = 1 << 20


class _Drop(logging.Filter):
    """Drops the records whose message matches ``pattern`` (one known third-party line), passes the others."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


# What importing torchao 0.18 logs that does not concern titan, which uses only its pure-PyTorch quantizers:
# its CUDA-only extensions failing to load on a machine without them ("Failed to load .../torchao/_C_mxfp8...so",
# "_C_cutlass_90a"), and torch's deprecation of register_constant() on the Enum torchao registers.
_TORCHAO_IMPORT_NOISE = {"torchao": r"^Failed to load \S*torchao/_C\w*",
                         "torch.utils._pytree": r"is an Enum subclass and is now natively supported by torch\.compile"}


@contextlib.contextmanager
def _quiet_import():
    """While titan imports torchao, drop those known lines (each by its message; every other record passes)."""
    added = [(logging.getLogger(name), _Drop(pattern)) for name, pattern in _TORCHAO_IMPORT_NOISE.items()]
    for logger, f in added:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in added:
            logger.removeFilter(f)


def _quant_utils():
    try:
        with _quiet_import():
            from torchao.optim import quant_utils
    except ImportError as e:  # torchao is an optional dependency (extra "quant")
        raise ImportError("ASDT's \"8bit\"/\"4bit\" state needs torchao (its quantizers): pip install "
                          "'titan-ds[quant]' (torchao==0.18.0), or use state_dtype \"bf16\"") from e
    return quant_utils


@lru_cache(maxsize=None)
def qmap(kind: str, signed: bool) -> torch.Tensor:
    """The code map of ``kind``: torchao's for its 8-bit (both signed and unsigned dynamic maps) and 4-bit
    (signed dynamic map with 3 exponent bits; unsigned: the 16 levels ``k/16``, k = 1..16, no zero) AdamW."""
    qu = _quant_utils()
    if kind == "8bit":
        data = qu.create_dynamic_map(signed=signed)
    elif kind == "4bit":
        data = qu.create_dynamic_map(True, 3, 4) if signed else torch.linspace(0, 1, 17)[1:].tolist()
    else:
        raise ValueError(f"unknown quantized state kind {kind!r}; choose one of {sorted(KINDS)}")
    return torch.tensor(data, dtype=torch.float32)


@lru_cache(maxsize=None)
def _midpoints(kind: str, signed: bool) -> torch.Tensor:
    q = qmap(kind, signed)
    return q[:-1] + (q[1:] - q[:-1]) * 0.5


@lru_cache(maxsize=None)
def _table(kind: str, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, next_midpoint)`` of each top-16-bit pattern: the code of the smallest float32 with those bits,
    and the midpoint above that code (+inf above the last code), where a value with those bits rounds one code
    up (a value below it, which then has no midpoint in its 16-bit bucket, never reaches it)."""
    mids = _midpoints(kind, signed)
    h = torch.arange(1 << 16, dtype=torch.int32)
    neg = h >= (1 << 15)  # sign bit set: the low 16 bits all ones give the smallest value
    lo = torch.where(neg, (h << 16) | 0xFFFF, h << 16).view(torch.float32)
    hi = torch.where(neg, h << 16, (h << 16) | 0xFFFF).view(torch.float32)
    a, b = torch.bucketize(lo, mids, right=True), torch.bucketize(hi, mids, right=True)
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    if int((b - a)[finite].max()) > 1:  # two midpoints in one bucket: one comparison would not be enough
        raise AssertionError(f"qstate: the {kind} {'signed' if signed else 'unsigned'} map is finer than bf16")
    a = a.to(torch.int32)
    return a, torch.cat([mids, torch.tensor([float("inf")])]).index_select(0, a)


@lru_cache(maxsize=None)
def _on(kind: str, signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qmap, codes, next_midpoint)`` of :func:`qmap` and :func:`_table`, on ``device`` (copied once)."""
    codes, nxt = _table(kind, signed)
    return qmap(kind, signed).to(device), codes.to(device), nxt.to(device)


# from this many values on, :func:`_encode` of a CPU tensor takes the C++ kernel's encoding: a fresh state's first
# quantization took ~59 s of the 907.7M HMS run's first step with the eager lookup; quantize() of 2^24 values takes
# 0.14 s with it against 0.45 s (1 thread; the block scales stay torchao's scale_tensor)
_KERNEL_MIN = 1 << 16
# fn(x, kind, signed) -> the codes of the 1-D fp32 CPU tensor x, or None where it cannot: the C++ kernel's
# encoding, which titan_ds.optim.core_cpu registers when it is imported (the same codes as encode_with:
# tests/optim/test_core_cpu.py); None here means the lookup below
_CPU_ENCODER: Optional[Callable[[torch.Tensor, str, bool], Optional[torch.Tensor]]] = None


def _encode(scaled: torch.Tensor, kind: str, signed: bool) -> torch.Tensor:
    """The nearest code of each value of ``scaled`` (in [-1, 1]): ``bucketize(scaled, midpoints, right=True)``
    (a midpoint rounds up, as in torchao), by the table of :func:`_table`."""
    x = scaled.contiguous().float()
    if x.device.type == "cpu" and x.numel() >= _KERNEL_MIN and _CPU_ENCODER is not None:
        out = _CPU_ENCODER(x.view(-1), kind, signed)
        if out is not None:
            return out.view(x.shape)
    _, codes, nxt = _on(kind, signed, x.device)
    return encode_with(x, codes, nxt)


def encode_with(x: torch.Tensor, codes: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """:func:`_encode` of the contiguous fp32 ``x`` with the tables of :func:`_on` given (pure tensor code, so
    core's compiled step traces it): both tables are indexed by the top 16 bits (no lookup depends on another)."""
    top = ((x.view(torch.int32) >> 16) & 0xFFFF).view(-1)
    c = codes.index_select(0, top) + (x.view(-1) >= nxt.index_select(0, top))
    return c.to(torch.uint8).view(x.shape)


def decode_with(q: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, block: int) -> torch.Tensor:
    """The fp32 values of ``codes`` (one per value, whole blocks of ``block``) with the code map ``q`` and one
    block scale each of ``absmax`` (of any shape), as ``[*absmax.shape, block]``: torchao's dequant_with_qmap,
    with index_select for its qmap[codes] (4x faster on this CPU)."""
    return q.index_select(0, codes.reshape(-1).int()).view(*absmax.shape, block) * absmax.float().unsqueeze(-1)


def nbytes_per_value(kind: str) -> float:
    block, bits = KINDS[kind]
    return bits / 8 + 4 / block


def _runs(lengths: list[int]):
    """``(offset, count, length)`` of each run of consecutive records of one length."""
    off = 0
    for length, group in itertools.groupby(lengths):  # a row-unit embedding has ~50k records of one length
        count = sum(1 for _ in group)
        yield off, count, length
        off += count * length


def _slices(lengths: list[int], block: int):
    """``(start, rows, length, padded)`` slices of whole records, each at most ~``_CHUNK`` values (one record
    when it alone is larger), in buffer order; ``padded`` is ``length`` rounded up to whole blocks."""
    for off, count, length in _runs(lengths):
        if length == 0:
            continue
        padded = math.ceil(length / block) * block
        step = max(1, _CHUNK // padded)
        for r in range(0, count, step):
            rows = min(step, count - r)
            yield off + r * length, rows, length, padded


def _codes(x: torch.Tensor, lengths: list[int], kind: str, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of :func:`quantize` with the codes one per value (uint8; not packed)."""
    qu = _quant_utils()
    block, _ = KINDS[kind]
    n = x.numel()
    if sum(lengths) != n:
        raise ValueError(f"quantize: the records' lengths sum to {sum(lengths)}, the buffer has {n} values")
    codes = torch.empty(n, dtype=torch.uint8, device=x.device)
    scales = []
    for start, rows, length, padded in _slices(lengths, block):
        seg = x[start:start + rows * length].float().view(rows, length)
        if padded != length:
            seg = torch.nn.functional.pad(seg, (0, padded - length))
        scaled, scale = qu.scale_tensor(seg.reshape(-1), block)
        c = _encode(scaled, kind, signed).view(rows, padded)[:, :length]
        codes[start:start + rows * length] = c.reshape(-1)
        scales.append(scale)
    return codes, (torch.cat(scales) if scales else torch.zeros(0, device=x.device))


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes a byte, the first in the high half (an odd count gets a 0 code at the end)."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    return (codes[0::2] << 4) | codes[1::2]


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed >> 4, packed & 0b1111], dim=-1).view(-1)


def quantize(x: torch.Tensor, lengths: list[int], kind: str, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of the 1-D fp32 ``x``, whose records (units) have ``lengths`` (sum = ``x.numel()``)."""
    codes, absmax = _codes(x, lengths, kind, signed)
    return (_pack4(codes) if KINDS[kind][1] == 4 else codes), absmax


def _values(codes: torch.Tensor, absmax: torch.Tensor, lengths: list[int], kind: str, signed: bool) -> torch.Tensor:
    """:func:`dequantize` of codes one per value (not packed)."""
    block, _ = KINDS[kind]
    q = _on(kind, signed, codes.device)[0]
    n = sum(lengths)
    if codes.numel() != n:
        raise ValueError(f"dequantize: {codes.numel()} codes for records of {n} values")
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    at = 0  # blocks used so far
    for start, rows, length, padded in _slices(lengths, block):
        c = codes[start:start + rows * length].view(rows, length)
        if padded != length:
            c = torch.nn.functional.pad(c, (0, padded - length))
        nb = rows * padded // block
        vals = decode_with(q, c, absmax[at:at + nb], block)
        out[start:start + rows * length] = vals.view(rows, padded)[:, :length].reshape(-1)
        at += nb
    if at != absmax.numel():
        raise ValueError(f"dequantize: {absmax.numel()} block scales for records needing {at}")
    return out


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, lengths: list[int], kind: str,
               signed: bool) -> torch.Tensor:
    """The fp32 values of :func:`quantize`'s ``(codes, absmax)``, for records of ``lengths``."""
    if KINDS[kind][1] == 4:
        codes = _unpack4(codes)[:sum(lengths)]
    return _values(codes, absmax, lengths, kind, signed)


def blocks(lengths: list[int], kind: str) -> int:
    """The block scales (absmax entries) that records of ``lengths`` take."""
    block = KINDS[kind][0]
    return sum(-(-n // block) for n in lengths)


def read(codes: torch.Tensor, absmax: torch.Tensor, start: int, block0: int, lengths: list[int], kind: str,
         signed: bool) -> torch.Tensor:
    """The fp32 values of ``sum(lengths)`` consecutive values of a quantized buffer, from value ``start``: whole
    records of ``lengths`` (or one piece of a record that starts at a block boundary of it and ends at one or at
    the record's end), whose first block scale is ``absmax[block0]``. Only that range is decoded."""
    n = sum(lengths)
    if KINDS[kind][1] == 4:
        lead = start % 2
        c = _unpack4(codes[start // 2:(start + n + 1) // 2])[lead:lead + n]
    else:
        c = codes[start:start + n]
    return _values(c, absmax[block0:block0 + blocks(lengths, kind)], lengths, kind, signed)


def write(codes: torch.Tensor, absmax: torch.Tensor, start: int, block0: int, x: torch.Tensor, lengths: list[int],
          kind: str, signed: bool) -> None:
    """Store ``x`` where :func:`read` with the same arguments reads, in place: the codes and block scales are
    those :func:`quantize` gives the whole buffer (blocks restart at each record), the neighbours' untouched."""
    c, scales = _codes(x, lengths, kind, signed)
    absmax[block0:block0 + scales.numel()] = scales
    n = c.numel()
    if KINDS[kind][1] != 4:
        codes[start:start + n] = c
        return
    lo, hi = start // 2, (start + n + 1) // 2
    parts = [c]
    if start % 2:  # the byte's first code belongs to the value before
        parts.insert(0, codes[lo:lo + 1] >> 4)
    if (start + n) % 2:  # ... and its second to the value after (or the pad of an odd buffer)
        parts.append(codes[hi - 1:hi] & 0b1111)
    codes[lo:hi] = _pack4(torch.cat(parts) if len(parts) > 1 else c)
