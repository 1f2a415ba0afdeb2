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
2. per chunk, ``scale = max |selected|`` (fp32, or bf16 with ``scale_dtype="bf16"``: the scale rounded to
   bf16 before the values are quantized against it, 2 bytes instead of 4); a value ``v`` becomes ``bits`` bits: its sign and the magnitude
   level ``j = min(floor(|v| / scale * L), L - 1)`` of ``L = 2^(bits-1)``; it decodes to
   ``sign * (j + 0.5) * (scale / L)`` (the middle of its level);
3. the message is one ``uint8`` tensor: the in-chunk indices (1 byte each for ``C <= 256``, else 2,
   little-endian), the codes packed ``8 / bits`` to a byte, the scales (fp32 or bf16); it is all-gathered (the wire counts
   its real size: ``(W - 1) * len`` received per worker);
4. every worker decodes every message in rank order and sums the decoded values (identical on all workers);
   ``sent`` is this worker's own decoded message, so the reducer's residual ``acc - sent`` keeps the unsent
   entries *and* the quantization error of the sent ones.

:func:`reference_qtopk` is the oracle: a loop over chunks and values with no packing, which the tests hold this
class to bit for bit. ``titan.compression.method: "qtopk"`` with ``bits`` and ``chunk`` (``registry.py``): per
step on DeepSpeed's reduce path (any ZeRO stage, like ``topk``) or as DiLoCo's outer compressor
(``sync_every > 1``, ``diloco.py``).

**Sharded exchange** (``exchange="sharded"``). All-gathered, each worker receives ``W - 1`` messages, so the bytes
it receives grow with ``W`` (100x fewer than a dense ring all-reduce sent is 100 / (W / 2) received). Sharded, rank
``j`` owns shard ``j``: whole chunks, ``[lo_j, hi_j)`` (:func:`shard_bounds`). With ``k`` values per chunk:

5. every worker encodes each shard of ``acc`` as its own message (the chunks, hence the values, are those of the
   whole-vector message) and sends piece ``j`` to rank ``j`` (one all-to-all with splits: each piece its own
   size, unpadded, so that the last shard's shorter message and, at large ``W``, shards one chunk apart cost what
   they are; a rank's own piece stays where it is);
6. rank ``j`` decodes the ``W`` pieces of its shard and sums them in rank order, adds its shard residual ``e_j``,
   encodes that total again (``k2`` values per chunk, same ``bits`` and ``chunk``) and keeps
   ``e_j = total - decoded``: the second compression has its own error feedback (1-bit Adam's and DeepSpeed's
   compressed all-reduce do the same);
7. the owners' messages are all-gathered (unequal sizes: an all-to-all with splits carrying each owner's message
   to every rank, since gloo's all-gather takes equal sizes only) and every worker decodes the whole sum.

Received per worker: ``(W - 1)`` pieces of ``~1/W`` of a message in step 5 and as many in step 7: ~2x one
message whatever ``W``, the volume of a ring all-reduce of it. The two together take the bytes of two messages at
``ratio``, ``gather_share`` of them step 7's (:func:`sharded_budgets`; 0.5: ``k2 = k``, both at ``ratio``).
``sent`` (what the worker's residual subtracts) is still its own step-5 message. :func:`reference_sharded_qtopk` is the oracle (bit for bit); ``e_j`` is the compressor's journaled
store ``shard_residuals``, saved in checkpoints with the residuals.

The largest ratio a chunk size allows is one value per chunk, ``4 C / (index_bytes + scale_bytes + bits / 8)``
(:func:`qtopk_max_ratio`: 195x at chunk 256 and 2 bits, 315x with bf16 scales); the config refuses a ratio above
it. **bf16 scales** (``scale_dtype="bf16"``): at one value a chunk the fp32 scale is 4 of the 5.25 bytes a chunk
sends; in bf16 (8 exponent bits: fp32's range; 3 significant digits, against the 2-bit code's 2 levels) the same
bytes carry more values (the sharded exchange at chunk 256, ratio 100: the owners' messages 11 values a chunk at
``gather_share`` 0.8 instead of 8 at 0.7). Error feedback keeps the rounding: ``sent`` is the decoded message.
"""
from __future__ import annotations

import math
from typing import Iterator, Optional

import torch

from .base import Collective, ResidualStore, Segment, SparseSent, workspace_zeros

__all__ = ["BITS", "DEFAULT_BITS", "DEFAULT_CHUNK", "EXCHANGES", "MAX_CHUNK", "SCALE_DTYPES", "QTopKCompressor", "qtopk_budget",
           "qtopk_max_ratio", "qtopk_message_bytes", "reference_qtopk", "reference_sharded_qtopk", "shard_bounds",
           "sharded_budgets"]

BITS = (2, 4, 8)
MAX_CHUNK = 65536  # an in-chunk index is at most 2 bytes
# the defaults of titan.compression.bits / chunk: the simulator's best at equal received bytes (docs/compress.md:
# W=8, 1000 steps, DiLoCo H=20, 100x received: chunk 256 +0.253 nats vs dense, chunk 4096 +0.270, top-k +0.403)
DEFAULT_BITS, DEFAULT_CHUNK = 2, 256
BLOCK = 1 << 18  # entries per block of encode/decode (the results do not depend on it)
EXCHANGES = ("all_gather", "sharded")
SCALE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the per-chunk scale's dtype in the message


def _scale_bytes(scale_dtype: str) -> int:
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"qtopk scale_dtype={scale_dtype!r}: choose one of {list(SCALE_DTYPES)}")
    return SCALE_DTYPES[scale_dtype].itemsize


def _index_bytes(chunk: int) -> int:
    return 1 if chunk <= 256 else 2


def qtopk_max_ratio(*, bits: int, chunk: int, scale_dtype: str = "fp32") -> float:
    """The largest ratio ``chunk`` allows: one value per chunk (``k = 1``), on whole chunks."""
    return 4.0 * chunk / (_index_bytes(chunk) + _scale_bytes(scale_dtype) + bits / 8.0)


def qtopk_message_bytes(n: int, k: int, *, bits: int, chunk: int, scale_dtype: str = "fp32") -> int:
    """Bytes of one worker's message: ``k`` (index, code) pairs in each of ``ceil(n / chunk)`` chunks + the scales."""
    chunks = -(-n // chunk)
    return chunks * (k * _index_bytes(chunk) + _scale_bytes(scale_dtype)) + -(-(chunks * k * bits) // 8)


def qtopk_budget(n: int, ratio: float, *, bits: int, chunk: int, scale_dtype: str = "fp32") -> int:
    """Values per chunk: the largest ``k`` in ``[1, chunk]`` whose message is at most ``4 n / ratio`` bytes (1 if
    even that is over: the wire then counts the overshoot)."""
    budget = 4.0 * n / ratio
    k = max(1, min(chunk, int((budget / -(-n // chunk) - _scale_bytes(scale_dtype))
                              / (_index_bytes(chunk) + bits / 8.0))))
    while k > 1 and qtopk_message_bytes(n, k, bits=bits, chunk=chunk, scale_dtype=scale_dtype) > budget:
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
    config_keys: tuple[str, ...] = ("ratio", "error_feedback", "bits", "chunk", "scale_dtype", "exchange",
                                    "gather_share", "ratio_warmup_steps", "ratio_warmup_start")
    init_options = ("bits", "chunk", "scale_dtype", "exchange", "gather_share")

    def __init__(self, ratio: float, rows: int = 1, *, bits: int = DEFAULT_BITS, chunk: int = DEFAULT_CHUNK,
                 exchange: str = "all_gather", gather_share: float = 0.5, scale_dtype: str = "fp32"):
        del rows  # CompressionConfig refuses sketch_rows for "qtopk" (not in config_keys)
        _check(bits, chunk)
        self._sb = _scale_bytes(scale_dtype)  # raises naming the choices
        self.scale_dtype, self._sdt = scale_dtype, SCALE_DTYPES[scale_dtype]
        if exchange not in EXCHANGES:
            raise ValueError(f"qtopk exchange={exchange!r}: choose one of {list(EXCHANGES)}")
        if not 0.0 < gather_share < 1.0:
            raise ValueError(f"qtopk gather_share={gather_share}: must be in (0, 1)")
        self.ratio, self.bits, self.chunk, self.exchange = ratio, bits, chunk, exchange
        self.gather_share = gather_share
        # sharded: the error feedback of each rank's re-compressed shard sum (journaled and saved by the reducer)
        self.stores = {"shard_residuals": ResidualStore()} if exchange == "sharded" else {}
        # the stores that are error feedback (the reducer rescales them with the lr: GradientReducer.lr_follows)
        self.residual_stores = ("shard_residuals",) if exchange == "sharded" else ()
        self._plans: dict[tuple, "_ShardMessages"] = {}  # the sharded messages' layouts (_ShardMessages)

    def __repr__(self) -> str:
        return (f"QTopKCompressor(ratio={self.ratio}, bits={self.bits}, chunk={self.chunk}, "
                f"scale_dtype={self.scale_dtype!r}, exchange={self.exchange!r}, gather_share={self.gather_share})")

    def _blocks(self, chunks: int) -> list[tuple[int, int]]:
        """Chunk ranges ``[c0, c1)`` of about :data:`BLOCK` entries, ``c0`` a multiple of 4 (so that a block's codes
        start on a byte of the packed section whatever ``bits``)."""
        step = max(4, BLOCK // self.chunk // 4 * 4)
        return [(c0, min(chunks, c0 + step)) for c0 in range(0, chunks, step)]

    def _sections(self, n: int, k: int) -> tuple[int, int, int]:
        """``(chunks, codes_at, scales_at)``: where the packed codes and the scales start in the message."""
        chunks = -(-n // self.chunk)
        m = chunks * k
        codes_at = m * _index_bytes(self.chunk)
        return chunks, codes_at, codes_at + -(-m // (8 // self.bits))

    def _select(self, part: torch.Tensor, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 1-2 on ``rows`` whole chunks (``part``: their entries, the last chunk's padding left out): the
        in-chunk indices ``(rows, k)`` int64, the codes ``(rows, k)`` uint8 (sign bit over the level, unpacked) and
        the scales ``(rows,)`` in the scale dtype."""
        c = self.chunk
        pad = rows * c - part.numel()
        mag = torch.nn.functional.pad(part.abs(), (0, pad), value=-1.0).view(rows, c)  # padding loses
        idx = torch.topk(mag, k, dim=1, sorted=False).indices                           # (rows, k), in-chunk
        val = torch.nn.functional.pad(part, (0, pad)).view(rows, c).gather(1, idx)
        scale = val.abs().amax(dim=1).to(self._sdt)                                    # NaN/Inf propagate
        code = _quantize(val.abs(), scale.float()[:, None], 1 << (self.bits - 1)).to(torch.uint8)
        code |= (val < 0).to(torch.uint8) << (self.bits - 1)
        return idx, code, scale

    def _values(self, code: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Codes (``(..., rows, k)`` uint8, unpacked) and their chunks' scales (``(..., rows)`` fp32) -> the decoded
        values (step 2's ``sign * (j + 0.5) * scale / L``)."""
        levels = 1 << (self.bits - 1)
        negative = (code >> (self.bits - 1)).bool()
        return _dequantize((code & (levels - 1)).float(), negative, scale[..., None], levels)

    def _index_bytes(self, idx: torch.Tensor) -> torch.Tensor:
        """In-chunk indices -> their little-endian bytes, flat (step 3)."""
        index = idx.to(torch.int32).reshape(-1, 1)
        return torch.cat([(index >> (8 * b)) & 0xFF for b in range(_index_bytes(self.chunk))],
                         dim=1).to(torch.uint8).reshape(-1)

    def _pack(self, code: torch.Tensor) -> torch.Tensor:
        """Codes (uint8, a multiple of ``8 / bits`` of them) -> packed ``8 / bits`` to a byte, the first lowest."""
        per = 8 // self.bits
        shifts = torch.arange(per, dtype=torch.uint8, device=code.device) * self.bits
        return (code.reshape(-1, per) << shifts).sum(dim=1, dtype=torch.uint8)  # disjoint bits: sum == or

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """:meth:`_pack`'s inverse on ``(..., bytes)``: ``(..., bytes * 8 / bits)`` codes."""
        per = 8 // self.bits
        shifts = torch.arange(per, dtype=torch.uint8, device=packed.device) * self.bits
        return ((packed[..., None] >> shifts) & ((1 << self.bits) - 1)).flatten(-2)

    def encode(self, acc: torch.Tensor, k: int) -> torch.Tensor:
        """``acc`` (flat fp32) -> the ``uint8`` message (steps 1-3), written block by block: the temporaries (top-k
        indices, codes, ~20 bytes an entry) are one block's, not the whole vector's (a DiLoCo sync at ratio 5 on the
        seed GPT measured ~200 MB above its start unblocked)."""
        n, c, ib, per = acc.numel(), self.chunk, _index_bytes(self.chunk), 8 // self.bits
        chunks, codes_at, scales_at = self._sections(n, k)
        sb = self._sb
        msg = torch.empty(scales_at + sb * chunks, dtype=torch.uint8, device=acc.device)
        for c0, c1 in self._blocks(chunks):
            idx, code, scale = self._select(acc[c0 * c:min(n, c1 * c)], c1 - c0, k)
            packed = self._pack(torch.nn.functional.pad(code.reshape(-1), (0, -code.numel() % per)))
            msg[c0 * k * ib:c1 * k * ib] = self._index_bytes(idx)
            msg[codes_at + c0 * k // per:codes_at + c0 * k // per + packed.numel()] = packed
            msg[scales_at + sb * c0:scales_at + sb * c1] = scale.contiguous().view(torch.uint8)
        return msg

    def decode_blocks(self, msg: torch.Tensor, n: int, k: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A message -> (flat positions, decoded fp32 values), block by block (as :meth:`encode` wrote them),
        padding positions (``>= n``) included."""
        c, ib, per = self.chunk, _index_bytes(self.chunk), 8 // self.bits
        chunks, codes_at, scales_at = self._sections(n, k)
        for c0, c1 in self._blocks(chunks):
            m = (c1 - c0) * k
            index = msg[c0 * k * ib:c1 * k * ib].view(m, ib).to(torch.int64)
            index = sum(index[:, b] << (8 * b) for b in range(ib))
            code = self._unpack(msg[codes_at + c0 * k // per:codes_at + c0 * k // per + -(-m // per)])
            scale = msg[scales_at + self._sb * c0:scales_at + self._sb * c1].clone().view(self._sdt).float()
            val = self._values(code[:m].view(c1 - c0, k), scale)
            pos = index.view(c1 - c0, k) + torch.arange(c0, c1, dtype=torch.int64, device=msg.device)[:, None] * c
            yield pos.reshape(-1), val.reshape(-1)

    def _decode_into(self, out: torch.Tensor, msg: torch.Tensor, n: int, k: int, *, add: bool) -> torch.Tensor:
        """``out`` (at least ``n`` rounded up to whole chunks, fp32) += (``add``) or = the decoded ``msg``."""
        for pos, val in self.decode_blocks(msg, n, k):
            if add:
                out.index_add_(0, pos, val)
            else:
                out.index_put_((pos,), val)
        return out

    def _dense(self, msg: torch.Tensor, n: int, k: int, device: torch.device) -> torch.Tensor:
        padded = -(-n // self.chunk) * self.chunk
        return self._decode_into(torch.zeros(padded, dtype=torch.float32, device=device), msg, n, k, add=False)[:n]

    def _entries(self, msg: torch.Tensor, n: int, k: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions + offset, values)`` of a message's real entries: :meth:`_dense`'s non-padding entries
        without its ``n``-element tensor (:meth:`_trim`)."""
        pos, val = self._trim(*_cat_entries(list(self.decode_blocks(msg, n, k)), msg), n, k)
        return pos + offset if offset else pos, val

    def reduce(self, acc: torch.Tensor, comm: Collective, seed: int, *, layout: list[Segment],
               ratio: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
        del seed  # the selection is this worker's own; residuals are the reducer's
        n = acc.numel()
        ratio = self.ratio if ratio is None else ratio
        if self.exchange == "sharded" and comm.world_size > 1:
            k1, k2 = sharded_budgets(n, ratio, bits=self.bits, chunk=self.chunk, gather_share=self.gather_share,
                                     scale_dtype=self.scale_dtype)
            return self._reduce_sharded(acc, comm, k1, k2, layout)
        k = qtopk_budget(n, ratio, bits=self.bits, chunk=self.chunk, scale_dtype=self.scale_dtype)
        msg = self.encode(acc, k)
        summed = workspace_zeros(-(-n // self.chunk) * self.chunk, acc.device)
        for part in comm.all_gather(msg):
            self._decode_into(summed, part, n, k, add=True)
        return summed[:n], SparseSent(*self._entries(msg, n, k), n)  # sent: what the others decode of this worker's

    def _chunks(self, acc: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_select` over every chunk of ``acc``, block by block: ``(chunks, k)`` indices and codes, ``(chunks,)``
        scales (what :meth:`encode` writes, unpacked: the entries' temporaries, not the vector's)."""
        n, c = acc.numel(), self.chunk
        parts = [self._select(acc[c0 * c:min(n, c1 * c)], c1 - c0, k) for c0, c1 in self._blocks(-(-n // c))]
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(t) for t in zip(*parts))  # type: ignore[return-value]

    def _trim(self, pos: torch.Tensor, val: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop the padding entries of an ``n``-entry vector's (positions, values), chunk-major: padding is selected
        only in the last chunk, and only when it holds fewer than ``k`` real entries (their magnitudes beat the
        padding's -1): there the ``k`` entries are ordered by position and the real ones (the first ``n mod
        chunk``) kept; every shape is known on the host (no sync)."""
        rem = n % self.chunk
        if rem and k > rem:
            order = torch.argsort(pos[-k:])[:rem]
            pos = torch.cat([pos[:-k], pos[-k:][order]])
            val = torch.cat([val[:-k], val[-k:][order]])
        return pos, val

    def _layout(self, n: int, k: int, world: int, device: torch.device) -> "_ShardMessages":
        key = (n, k, world, str(device))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 64:  # buckets x budgets x worlds: a handful; bounded all the same
                self._plans.clear()
            plan = self._plans[key] = _ShardMessages.build(self, n, k, world, device)
        return plan

    def _encode_shards(self, acc: torch.Tensor, k: int, plan: "_ShardMessages"
                       ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Step 5's ``W`` messages, concatenated in rank order (each byte for byte :meth:`encode` of its shard: the
        shards are whole chunks of the vector), and the entries they send, ``(positions, values)`` chunk-major with
        the padding dropped. A fixed number of tensor operations whatever ``W``: the chunks are selected once over
        the whole vector and the messages cut out of the whole-vector sections by one gather."""
        idx, code, scale = self._chunks(acc, k)
        packed = self._pack(torch.cat([code.reshape(-1), code.new_zeros(1)])[plan.code_src])
        source = torch.cat([self._index_bytes(idx), packed, scale.contiguous().view(torch.uint8)])
        chunks = idx.shape[0]
        pos = idx + torch.arange(chunks, dtype=torch.int64, device=acc.device)[:, None] * self.chunk
        sent = self._trim(pos.reshape(-1), self._values(code, scale.float()).reshape(-1), acc.numel(), k)
        return source[plan.msg_src], sent

    def _decode_shards(self, messages: torch.Tensor, plan: "_ShardMessages") -> tuple[torch.Tensor, torch.Tensor]:
        """The ``W`` owners' messages concatenated in rank order -> the whole vector's (positions, values), padding
        positions included, each shard's at its place: one gather per section, whatever ``W``."""
        ib = _index_bytes(self.chunk)
        index = messages[plan.dec_index].view(-1, ib).to(torch.int64)
        index = sum(index[:, b] << (8 * b) for b in range(ib))
        code = (messages[plan.dec_code] >> plan.dec_shift) & ((1 << self.bits) - 1)
        scale = messages[plan.dec_scale].view(self._sdt).float()
        chunks = scale.numel()
        val = self._values(code.view(chunks, -1), scale)
        pos = index.view(chunks, -1) + torch.arange(chunks, dtype=torch.int64, device=messages.device)[:, None] * self.chunk
        return pos.reshape(-1), val.reshape(-1)

    def _reduce_sharded(self, acc: torch.Tensor, comm: Collective, k: int, k2: int,
                        layout: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
        """``exchange="sharded"`` (module docstring, "Sharded exchange"): ``k`` values per chunk in the pieces,
        ``k2`` in the owners' messages. The pieces are encoded, and the owners' messages decoded, all at once
        (:meth:`_encode_shards`, :meth:`_decode_shards`); an owner sums the ``W`` pieces of its shard in rank order."""
        n, world, rank = acc.numel(), comm.world_size, comm.rank
        bounds = shard_bounds(n, self.chunk, world)
        plan, plan2 = self._layout(n, k, world, acc.device), self._layout(n, k2, world, acc.device)
        lens, lens2 = plan.lens, plan2.lens

        def others(split: list[int]) -> list[int]:  # this rank's own piece stays here: it never crosses the wire
            return [0 if j == rank else x for j, x in enumerate(split)]

        # unpadded pieces (an all-to-all with splits): rank j's shard message is lens[j] bytes from every rank
        pieces, sent = self._encode_shards(acc, k, plan)
        at, size = plan.offsets[rank], lens[rank]
        own = pieces[at:at + size]
        recv = comm.all_to_all(torch.cat([pieces[:at], pieces[at + size:]]), others(lens), others([size] * world))
        lo, hi = bounds[rank]
        mine = hi - lo
        chunks = -(-mine // self.chunk)
        total = workspace_zeros(chunks * self.chunk, acc.device)
        if mine:  # the W pieces of this shard share one layout: decoded together, summed in rank order
            ib, m = _index_bytes(self.chunk), chunks * k
            packed_at, scales_at = m * ib, m * ib + -(-m // (8 // self.bits))
            rows = torch.cat([recv[:rank * size], own, recv[rank * size:]]).view(world, size)
            index = rows[:, :packed_at].reshape(world, m, ib).to(torch.int64)
            index = sum(index[..., b] << (8 * b) for b in range(ib))
            code = self._unpack(rows[:, packed_at:scales_at])[:, :m].reshape(world, chunks, k)
            val = self._values(code, rows[:, scales_at:].contiguous().view(self._sdt).float())
            pos = index.view(world, chunks, k) + torch.arange(chunks, dtype=torch.int64,
                                                              device=acc.device)[:, None] * self.chunk
            for i in range(world):  # rank order: the same float sum whatever the arrival order
                total.index_add_(0, pos[i].reshape(-1), val[i].reshape(-1))
        total = total[:mine]
        store, key = self.stores["shard_residuals"], _shard_key(layout, n, world, rank)
        kept = store.get(key)
        if kept is not None:
            total += kept
        out = acc.new_zeros(0, dtype=torch.uint8)
        if mine:
            out = self.encode(total, k2)
            store.adopt(key, SparseSent(*self._entries(out, mine, k2), mine).subtract_from_(total))  # total: fresh
        # the owners' messages to every other rank, unpadded (an all-gather of unequal pieces, as an all-to-all:
        # gloo's all-gather takes equal sizes only), decoded together into the whole sum (padded to whole chunks:
        # the last shard's padding lands past n, then cut)
        gathered = comm.all_to_all(out.repeat(world - 1), others([lens2[rank]] * world), others(lens2))
        at2 = plan2.offsets[rank]
        pos2, val2 = self._decode_shards(torch.cat([gathered[:at2], out, gathered[at2:]]), plan2)
        summed = workspace_zeros(-(-n // self.chunk) * self.chunk, acc.device)
        summed.index_put_((pos2,), val2)
        return summed[:n], SparseSent(*sent, n)


class _ShardMessages:
    """Where the sharded exchange's ``W`` messages of an ``n``-entry vector at ``k`` values a chunk lie: each
    message ``j`` is ``[index bytes | packed codes | scale bytes]`` of shard ``j``'s chunks (:meth:`QTopKCompressor.encode`'s
    layout), the ``W`` concatenated in rank order at ``offsets``. ``code_src``: for each packed-code slot of
    each message, the whole-vector code it holds (the sentinel ``chunks * k``, a zero, pads a message's last
    byte); ``msg_src``: for each byte of the concatenation, its place in ``[index bytes | packed codes | scale
    bytes]`` of the whole vector; ``dec_*``: the inverse, for each whole-vector index byte, code and scale byte,
    its place in the concatenation (and a code's shift in its byte). Built once per ``(n, k, W)``: gathers with
    these make encoding and decoding all the shards a fixed number of operations."""

    def __init__(self, lens: list[int], offsets: list[int], **index: torch.Tensor):
        self.lens, self.offsets = lens, offsets
        self.code_src, self.msg_src = index["code_src"], index["msg_src"]
        self.dec_index, self.dec_code, self.dec_shift, self.dec_scale = (
            index["dec_index"], index["dec_code"], index["dec_shift"], index["dec_scale"])

    @classmethod
    def build(cls, comp: QTopKCompressor, n: int, k: int, world: int, device: torch.device) -> "_ShardMessages":
        c, ib, sb, per = comp.chunk, _index_bytes(comp.chunk), comp._sb, 8 // comp.bits
        chunks = -(-n // c)
        packed_total = sum(-(-(-(-(hi - lo) // c) * k) // per) for lo, hi in shard_bounds(n, c, world))
        packed_base, scale_base = chunks * k * ib, chunks * k * ib + packed_total
        ar = torch.arange
        lens, offsets, code_src, msg_src = [], [], [], []
        dec_index, dec_code, dec_shift, dec_scale = [], [], [], []
        off = packed_at = 0
        for lo, hi in shard_bounds(n, c, world):
            a, cj = lo // c, -(-(hi - lo) // c)
            m, p = cj * k, -(-cj * k // per)
            slots = ar(p * per)
            code_src.append(torch.where(slots < m, a * k + slots, chunks * k))
            msg_src += [ar(a * k * ib, (a + cj) * k * ib), packed_base + packed_at + ar(p),
                        scale_base + ar(a * sb, (a + cj) * sb)]
            dec_index.append(off + ar(m * ib))
            dec_code.append(off + m * ib + ar(m) // per)
            dec_shift.append((ar(m) % per) * comp.bits)
            dec_scale.append(off + m * ib + p + ar(cj * sb))
            lens.append(m * ib + p + cj * sb)
            offsets.append(off)
            off += lens[-1]
            packed_at += p
        cat = lambda ts, dtype=torch.int64: torch.cat(ts).to(dtype=dtype, device=device)  # noqa: E731
        return cls(lens, offsets, code_src=cat(code_src), msg_src=cat(msg_src), dec_index=cat(dec_index),
                   dec_code=cat(dec_code), dec_shift=cat(dec_shift, torch.uint8), dec_scale=cat(dec_scale))


def _cat_entries(parts: list[tuple[torch.Tensor, torch.Tensor]],
                 like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, values)`` pairs -> one pair (int64, fp32), empty ones on ``like``'s device for no parts."""
    if not parts:
        return like.new_zeros(0, dtype=torch.int64), like.new_zeros(0, dtype=torch.float32)
    return torch.cat([p for p, _ in parts]), torch.cat([v for _, v in parts])


def sharded_budgets(n: int, ratio: float, *, bits: int, chunk: int, gather_share: float,
                    scale_dtype: str = "fp32") -> tuple[int, int]:
    """Values per chunk ``(k, k2)`` of the sharded exchange's pieces and owners' messages: a rank receives about one
    message of each, which together take the bytes of two messages at ``ratio``, ``gather_share`` of them the
    owners' (0.5: both at ``ratio``, the same ``k``)."""
    return (qtopk_budget(n, ratio / (2.0 * (1.0 - gather_share)), bits=bits, chunk=chunk, scale_dtype=scale_dtype),
            qtopk_budget(n, ratio / (2.0 * gather_share), bits=bits, chunk=chunk, scale_dtype=scale_dtype))


def shard_bounds(n: int, chunk: int, world: int) -> list[tuple[int, int]]:
    """Rank ``j``'s shard ``[lo, hi)`` of an ``n``-entry vector: whole chunks, as even as chunks allow (a rank gets
    none when there are fewer chunks than ranks)."""
    chunks = -(-n // chunk)
    cut = [j * chunks // world * chunk for j in range(world + 1)]
    return [(min(n, cut[j]), min(n, cut[j + 1])) for j in range(world)]


def _shard_key(layout: list[Segment], n: int, world: int, rank: int) -> str:
    """The shard residual's key: the bucket (its first segment and size), the group size and this rank."""
    first = min(layout, key=lambda s: s.flat_offset) if layout else None
    where = f"{first.key}@{first.param_offset}" if first is not None else "flat"
    return f"{where}+{n}/w{world}r{rank}"


def reference_sharded_qtopk(accs: list[torch.Tensor], ratio: float, kept: list[Optional[torch.Tensor]], *,
                            bits: int = DEFAULT_BITS, chunk: int = DEFAULT_CHUNK, gather_share: float = 0.5,
                            scale_dtype: str = "fp32") -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The oracle of ``exchange="sharded"`` over all ranks at once: ``(summed, sent per rank, shard residuals per
    rank)``. ``kept``: each rank's shard residual before the step (None: zeros). Loops over shards and ranks with
    :func:`reference_qtopk`, no messages."""
    world, n = len(accs), accs[0].numel()
    k, k2 = sharded_budgets(n, ratio, bits=bits, chunk=chunk, gather_share=gather_share, scale_dtype=scale_dtype)
    bounds = shard_bounds(n, chunk, world)
    sent = [torch.cat([reference_qtopk(a[lo:hi], ratio, bits=bits, chunk=chunk, k=k, scale_dtype=scale_dtype)
                       for lo, hi in bounds])
            for a in accs]
    summed, residuals = torch.zeros(n), []
    for j, (lo, hi) in enumerate(bounds):
        total = torch.zeros(hi - lo)
        for i in range(world):
            total += sent[i][lo:hi]
        if kept[j] is not None:
            total += kept[j]
        summed[lo:hi] = reference_qtopk(total, ratio, bits=bits, chunk=chunk, k=k2, scale_dtype=scale_dtype)
        residuals.append(total - summed[lo:hi])
    return summed, sent, residuals


def reference_qtopk(acc: torch.Tensor, ratio: float, *, bits: int = DEFAULT_BITS,
                    chunk: int = DEFAULT_CHUNK, k: Optional[int] = None, scale_dtype: str = "fp32") -> torch.Tensor:
    """The oracle of what one worker sends (dense, decoded): chunk by chunk, value by value, no packing. ``k``:
    values per chunk (default: the budget of ``ratio`` over ``acc``); ``scale_dtype``: each chunk's scale is
    rounded to it (bf16) before the values are quantized against it."""
    _check(bits, chunk)
    n, levels = acc.numel(), 1 << (bits - 1)
    k = qtopk_budget(n, ratio, bits=bits, chunk=chunk, scale_dtype=scale_dtype) if k is None else k
    out = torch.zeros_like(acc)
    for lo in range(0, n, chunk):
        part = acc[lo:lo + chunk]
        idx = torch.topk(part.abs(), min(k, part.numel())).indices
        scale = part[idx].abs().max().to(SCALE_DTYPES[scale_dtype]).float()
        for i in idx.tolist():
            v = part[i]
            if scale > 0:
                j = min(math.floor(float(v.abs() / scale * levels)), levels - 1)
            else:
                j = 0
            mid = torch.tensor(j + 0.5, dtype=torch.float32) * (scale / levels)
            out[lo + i] = -mid if v < 0 else mid
    return out
