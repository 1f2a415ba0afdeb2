"""``qtopk``: chunked top-k with low-bit values and chunk-relative indices, all-gathered (SparseLoCo's outer
gradient message).

Plain ``topk`` spends 8 bytes per coordinate (int32 index, fp32 value). SparseLoCo (2025) and DeMo (2024) send the
outer gradient's top-k *per chunk* of a fixed size, so that an index only has to address its chunk, and quantize
the values to a few bits; error feedback keeps everything that was not sent, the quantization error included.
At the same bytes this sends ``8 / (index_bytes + bits / 8)`` times more coordinates (3.6x at 2 bits and 2-byte
indices, 6.4x at 1-byte indices).

One message, worker ``r`` (``acc``: its error-compensated outer gradient, ``n`` fp32 entries):

1. ``acc`` is cut into ``C = chunk`` consecutive entries per chunk (the last one padded; padding is never
   preferred to a real entry); each chunk sends its ``k`` largest magnitudes, ``k`` the largest count whose
   message fits ``4 n / ratio`` bytes (:func:`qtopk_budget`);
2. per chunk, ``scale = max |selected|`` (fp32); a value ``v`` becomes ``bits`` bits: its sign and the magnitude
   level ``j = min(floor(|v| / scale * L), L - 1)`` of ``L = 2^(bits-1)``; it decodes to
   ``sign * (j + 0.5) * (scale / L)`` (the middle of its level);
3. the message is one ``uint8`` tensor: the in-chunk indices (1 byte each for ``C <= 256``, else 2,
   little-endian), the codes packed ``8 / bits`` to a byte, the fp32 scales; it is all-gathered (the wire counts
   its real size: ``(W - 1) * len`` received per worker);
4. every worker decodes every message in rank order and sums the decoded values (identical on all workers);
   ``sent`` is this worker's own decoded message, so the reducer's residual ``acc - sent`` keeps the unsent
   entries *and* the quantization error of the sent ones.

:func:`reference_qtopk` is the oracle: a loop over chunks and values with no packing, which the tests hold this
class to bit for bit. ``titan.compression.method: "qtopk"`` with ``bits`` and ``chunk`` (``registry.py``): per
step on DeepSpeed's reduce path (any ZeRO stage, like ``topk``) or as DiLoCo's outer compressor
(``sync_every > 1``, ``diloco.py``).

The largest ratio a chunk size allows is one value per chunk, ``4 C / (index_bytes + 4 + bits / 8)``
(:func:`qtopk_max_ratio`: 195x at chunk 256 and 2 bits); the config refuses a ratio above it.
"""
from __future__ import annotations

import math
from typing import Iterator, Optional

import torch

from .base import Collective, Segment

__all__ = ["BITS", "DEFAULT_BITS", "DEFAULT_CHUNK", "MAX_CHUNK", "QTopKCompressor", "qtopk_budget", "qtopk_max_ratio",
           "qtopk_message_bytes", "reference_qtopk"]

BITS = (2, 4, 8)
MAX_CHUNK = 65536  # an in-chunk index is at most 2 bytes
# the defaults of titan.compression.bits / chunk: the simulator's best at equal received bytes (docs/compress.md:
# W=8, 1000 steps, DiLoCo H=20, 100x received: chunk 256 +0.253 nats vs dense, chunk 4096 +0.270, top-k +0.403)
DEFAULT_BITS, DEFAULT_CHUNK = 2, 256
BLOCK = 1 << 18  # entries per block of encode/decode (the results do not depend on it)


def _index_bytes(chunk: int) -> int:
    return 1 if chunk <= 256 else 2


def qtopk_max_ratio(*, bits: int, chunk: int) -> float:
    """The largest ratio ``chunk`` allows: one value per chunk (``k = 1``), on whole chunks."""
    return 4.0 * chunk / (_index_bytes(chunk) + 4 + bits / 8.0)


def qtopk_message_bytes(n: int, k: int, *, bits: int, chunk: int) -> int:
    """Bytes of one worker's message: ``k`` (index, code) pairs in each of ``ceil(n / chunk)`` chunks + fp32 scales."""
    chunks = -(-n // chunk)
    return chunks * (k * _index_bytes(chunk) + 4) + -(-(chunks * k * bits) // 8)


def qtopk_budget(n: int, ratio: float, *, bits: int, chunk: int) -> int:
    """Values per chunk: the largest ``k`` in ``[1, chunk]`` whose message is at most ``4 n / ratio`` bytes (1 if
    even that is over: the wire then counts the overshoot)."""
    budget = 4.0 * n / ratio
    k = max(1, min(chunk, int((budget / -(-n // chunk) - 4) / (_index_bytes(chunk) + bits / 8.0))))
    while k > 1 and qtopk_message_bytes(n, k, bits=bits, chunk=chunk) > budget:
        k -= 1
    return k


def _check(bits: int, chunk: int) -> None:
    if bits not in BITS:
        raise ValueError(f"qtopk bits={bits}: choose one of {BITS} (codes are packed 8 / bits to a byte)")
    if not 2 <= chunk <= MAX_CHUNK:
        raise ValueError(f"qtopk chunk={chunk}: must be in [2, {MAX_CHUNK}] (an in-chunk index is 1 or 2 bytes)")


def _quantize(mag: torch.Tensor, scale: torch.Tensor, levels: int) -> torch.Tensor:
    """Magnitude level ``min(floor(mag / scale * L), L - 1)`` (``scale`` broadcast; 0 where ``scale`` is 0)."""
    safe = scale.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.floor(mag / safe * levels).clamp_(0, levels - 1)


def _dequantize(level: torch.Tensor, negative: torch.Tensor, scale: torch.Tensor, levels: int) -> torch.Tensor:
    mid = (level + 0.5) * (scale / levels)
    return torch.where(negative, -mid, mid)


class QTopKCompressor:
    """The module's steps 1-4 (``ratio``: dense fp32 bytes / message bytes per worker, as for ``topk``)."""

    name = "qtopk"
    config_keys: tuple[str, ...] = ("ratio", "error_feedback", "bits", "chunk", "ratio_warmup_steps",
                                    "ratio_warmup_start")
    init_options = ("bits", "chunk")

    def __init__(self, ratio: float, rows: int = 1, *, bits: int = DEFAULT_BITS, chunk: int = DEFAULT_CHUNK):
        del rows  # CompressionConfig refuses sketch_rows for "qtopk" (not in config_keys)
        _check(bits, chunk)
        self.ratio, self.bits, self.chunk = ratio, bits, chunk

    def __repr__(self) -> str:
        return f"QTopKCompressor(ratio={self.ratio}, bits={self.bits}, chunk={self.chunk})"

    def _blocks(self, chunks: int) -> list[tuple[int, int]]:
        """Chunk ranges ``[c0, c1)`` of about :data:`BLOCK` entries, ``c0`` a multiple of 4 (so that a block's codes
        start on a byte of the packed section whatever ``bits``)."""
        step = max(4, BLOCK // self.chunk // 4 * 4)
        return [(c0, min(chunks, c0 + step)) for c0 in range(0, chunks, step)]

    def _sections(self, n: int, k: int) -> tuple[int, int, int]:
        """``(chunks, codes_at, scales_at)``: where the packed codes and the fp32 scales start in the message."""
        chunks = -(-n // self.chunk)
        m = chunks * k
        codes_at = m * _index_bytes(self.chunk)
        return chunks, codes_at, codes_at + -(-m // (8 // self.bits))

    def encode(self, acc: torch.Tensor, k: int) -> torch.Tensor:
        """``acc`` (flat fp32) -> the ``uint8`` message (steps 1-3), written block by block: the temporaries (top-k
        indices, codes, ~20 bytes an entry) are one block's, not the whole vector's (a DiLoCo sync at ratio 5 on the
        seed GPT measured ~200 MB above its start unblocked)."""
        n, c, ib, per = acc.numel(), self.chunk, _index_bytes(self.chunk), 8 // self.bits
        chunks, codes_at, scales_at = self._sections(n, k)
        msg = torch.empty(scales_at + 4 * chunks, dtype=torch.uint8, device=acc.device)
        shifts = torch.arange(per, dtype=torch.uint8, device=acc.device) * self.bits
        for c0, c1 in self._blocks(chunks):
            part = acc[c0 * c:min(n, c1 * c)]
            pad = (c1 - c0) * c - part.numel()
            mag = torch.nn.functional.pad(part.abs(), (0, pad), value=-1.0).view(c1 - c0, c)  # padding loses
            idx = torch.topk(mag, k, dim=1, sorted=False).indices                             # (chunks, k), in-chunk
            val = torch.nn.functional.pad(part, (0, pad)).view(c1 - c0, c).gather(1, idx)
            scale = val.abs().amax(dim=1)                                                    # NaN/Inf propagate
            code = _quantize(val.abs(), scale[:, None], 1 << (self.bits - 1)).to(torch.uint8)
            code |= (val < 0).to(torch.uint8) << (self.bits - 1)
            code = torch.nn.functional.pad(code.reshape(-1), (0, -code.numel() % per)).view(-1, per)
            packed = (code << shifts).sum(dim=1, dtype=torch.uint8)                           # disjoint bits: sum == or
            index = idx.to(torch.int32).reshape(-1, 1)
            index = torch.cat([(index >> (8 * b)) & 0xFF for b in range(ib)], dim=1).to(torch.uint8)
            msg[c0 * k * ib:c1 * k * ib] = index.reshape(-1)
            msg[codes_at + c0 * k // per:codes_at + c0 * k // per + packed.numel()] = packed
            msg[scales_at + 4 * c0:scales_at + 4 * c1] = scale.contiguous().view(torch.uint8)
        return msg

    def decode_blocks(self, msg: torch.Tensor, n: int, k: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A message -> (flat positions, decoded fp32 values), block by block (as :meth:`encode` wrote them),
        padding positions (``>= n``) included."""
        c, levels, ib, per = self.chunk, 1 << (self.bits - 1), _index_bytes(self.chunk), 8 // self.bits
        chunks, codes_at, scales_at = self._sections(n, k)
        shifts = torch.arange(per, dtype=torch.uint8, device=msg.device) * self.bits
        for c0, c1 in self._blocks(chunks):
            m = (c1 - c0) * k
            index = msg[c0 * k * ib:c1 * k * ib].view(m, ib).to(torch.int64)
            index = sum(index[:, b] << (8 * b) for b in range(ib))
            packed = msg[codes_at + c0 * k // per:codes_at + c0 * k // per + -(-m // per)]
            code = ((packed[:, None] >> shifts) & ((1 << self.bits) - 1)).reshape(-1)[:m].view(c1 - c0, k)
            scale = msg[scales_at + 4 * c0:scales_at + 4 * c1].clone().view(torch.float32)
            negative = (code >> (self.bits - 1)).bool()
            val = _dequantize((code & (levels - 1)).float(), negative, scale[:, None], levels)
            pos = index.view(c1 - c0, k) + torch.arange(c0, c1, dtype=torch.int64, device=msg.device)[:, None] * c
            yield pos.reshape(-1), val.reshape(-1)

    def reduce(self, acc: torch.Tensor, comm: Collective, seed: int, *, layout: list[Segment],
               ratio: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
        del seed, layout  # the selection is this worker's own; residuals are the reducer's
        n = acc.numel()
        k = qtopk_budget(n, self.ratio if ratio is None else ratio, bits=self.bits, chunk=self.chunk)
        msg = self.encode(acc, k)
        padded = -(-n // self.chunk) * self.chunk
        summed = torch.zeros(padded, dtype=torch.float32, device=acc.device)
        for part in comm.all_gather(msg):
            for pos, val in self.decode_blocks(part, n, k):
                summed.index_add_(0, pos, val)
        sent = torch.zeros(padded, dtype=torch.float32, device=acc.device)
        for pos, val in self.decode_blocks(msg, n, k):  # what the others decode of this worker's message
            sent.index_put_((pos,), val)
        return summed[:n], sent[:n]


def reference_qtopk(acc: torch.Tensor, ratio: float, *, bits: int = DEFAULT_BITS,
                    chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """The oracle of what one worker sends (dense, decoded): chunk by chunk, value by value, no packing."""
    _check(bits, chunk)
    n, levels = acc.numel(), 1 << (bits - 1)
    k = qtopk_budget(n, ratio, bits=bits, chunk=chunk)
    out = torch.zeros_like(acc)
    for lo in range(0, n, chunk):
        part = acc[lo:lo + chunk]
        idx = torch.topk(part.abs(), min(k, part.numel())).indices
        scale = part[idx].abs().max()
        for i in idx.tolist():
            v = part[i]
            if scale > 0:
                j = min(math.floor(float(v.abs() / scale * levels)), levels - 1)
            else:
                j = 0
            mid = torch.tensor(j + 0.5, dtype=torch.float32) * (scale / levels)
            out[lo + i] = -mid if v < 0 else mid
    return out
