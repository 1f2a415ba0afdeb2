"""The HMS store's file format: one checked file per key, written payload first (see :mod:`titan_ds.hms.store`).

File format (one file per key, ``<quoted key>.hms``)::

    [0:8)   magic b"TITANHMS"      [8:12)  format version (u32 LE)   [12:16) header length = payload offset
    [16:20) JSON length (u32 LE)   [20:24) CRC32 of the JSON (u32 LE)
    [24:..) JSON {key, shape, dtype, nbytes, chunk, hash, crcs, gen}, zero-padded to the header length (a
            multiple of ALIGN, sized for the largest possible checksum values so the payload can be written first)
    payload: the tensor's bytes, zero-padded to a multiple of ALIGN (so O_DIRECT can read it whole)

``crcs`` holds one checksum per ``chunk`` bytes of payload (of the tensor's bytes, never of the padding),
computed by the I/O thread that writes or reads that chunk (so checksumming overlaps the transfer); ``hash``
names the function: ``xxh3_64`` (format 2, written now: ~9 GB/s a core here, where zlib's CRC32 ran at
2.1-3.1 GB/s) or ``crc32`` (format 1, still read), or ``none`` (``crcs`` empty): a swap file, which a restarted
run discards (HMS's per-step traffic; ZeRO-Infinity's swap is unchecked too), so checksumming it would spend the
I/O threads' CPU on bytes that never outlive the process; the files that do (snapshots, checkpoints, the disk
probe's) keep ``xxh3_64``. ``gen`` counts the versions written under that key. A payload or header that does not
match its checksum raises :class:`ChecksumError` naming the file (the header is checked in every file).

:func:`write_file` and :func:`read_file` move one file through an :class:`~titan_ds.hms.io.AsyncIOHandle`; where
the file goes, when it is renamed and what is cached is the store's.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Optional
from urllib.parse import quote, unquote

import torch
import xxhash

from .io import ALIGN, AsyncIOHandle, aligned_empty, tensor_bytes

__all__ = ["ChecksumError", "FORMAT_VERSION", "HASH", "NO_HASH", "CRC_CHUNK", "SUFFIX", "file_name", "key_of", "new_header",
           "write_file", "read_header", "read_file"]

MAGIC = b"TITANHMS"
FORMAT_VERSION = 2
_READS = (1, 2)  # format 1: the same layout with CRC32 checksums
_FIXED = struct.Struct("<8sIIII")
# 4 MiB checksum chunks: big enough that the per-chunk Python overhead is negligible, small enough that a
# 64 MiB tensor is checked by 16 parallel tasks.
CRC_CHUNK = 4 << 20
# payload checksum of each format's files; each takes a bytes-like object and returns an int
_HASHES = {"crc32": zlib.crc32, "xxh3_64": xxhash.xxh3_64_intdigest}
HASH = "xxh3_64"
_HASH_MAX = {"crc32": 0xFFFFFFFF, "xxh3_64": 0xFFFFFFFFFFFFFFFF}  # header sizing: the widest value
NO_HASH = "none"  # a swap file's payload: unchecked (module docstring)
SUFFIX = ".hms"
_DTYPES = {str(d): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
    *[getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)])}


class ChecksumError(RuntimeError):
    """A store file whose header or payload does not match its checksum (the message names the file)."""


def file_name(key: str) -> str:
    return quote(key, safe="") + SUFFIX


def key_of(name: str) -> str:
    """The key of the file ``name`` (a :func:`file_name`)."""
    return unquote(name[:-len(SUFFIX)])


def new_header(key: str, src: torch.Tensor, nbytes: int, gen: int, *, checksum: bool = True) -> tuple[dict, int]:
    """The header of ``src`` (``nbytes`` of payload) as generation ``gen``, with placeholder checksums, and the
    header's length: an upper bound (every checksum at its widest), so the payload can be written first.
    ``checksum=False``: a swap file's (hash ``none``, no payload checksums)."""
    crcs = [_HASH_MAX[HASH]] * (-(-nbytes // CRC_CHUNK)) if checksum else []
    meta = {"key": key, "shape": list(src.shape), "dtype": str(src.dtype), "nbytes": nbytes,
            "chunk": CRC_CHUNK, "hash": HASH if checksum else NO_HASH, "crcs": crcs, "gen": gen}
    hlen = -(-(_FIXED.size + len(json.dumps(meta, separators=(",", ":")))) // ALIGN) * ALIGN  # upper bound
    return meta, hlen


def _close_last_chunk(sums: list, h, view: torch.Tensor, body: int, nbytes: int, chunk: int) -> None:
    """Finish ``sums`` (one checksum per ``chunk`` of ``view[:body]``) for the bytes ``[body, nbytes)`` that
    followed as an unaligned tail: a new chunk, or the rest of the last one, which is hashed again whole (a
    hash such as XXH3 cannot be continued from its digest, unlike CRC32; same values for CRC32)."""
    lo = (body // chunk) * chunk
    value = h(memoryview(view[lo:nbytes].numpy()))
    if body % chunk:
        sums[-1] = value
    else:
        sums.append(value)


def _encode_header(meta: dict, hlen: int) -> torch.Tensor:
    js = json.dumps(meta, separators=(",", ":")).encode()
    raw = _FIXED.pack(MAGIC, FORMAT_VERSION, hlen, len(js), zlib.crc32(js)) + js
    if len(raw) > hlen:
        raise AssertionError(f"header of {len(raw)} bytes exceeds its reserved {hlen}")  # bound is exact
    head = aligned_empty(hlen)
    head.zero_()
    head[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return head


def write_file(io: AsyncIOHandle, path: str, meta: dict, hlen: int, view: torch.Tensor, *, durable: bool) -> None:
    """Payload first (checksummed chunk by chunk on the I/O threads unless the hash is ``none``), then the header
    with the checksums."""
    nbytes = view.numel()
    body = nbytes - nbytes % ALIGN
    h = _HASHES.get(meta["hash"])  # None: a swap file, unchecked

    def crc(lo: int, hi: int) -> int:
        return h(memoryview(view[lo:hi].numpy())) if h is not None else 0

    crcs = io.transfer_with(True, view[:body], path, hlen, CRC_CHUNK, crc) if body else []
    if nbytes > body:
        tail = aligned_empty(ALIGN)
        tail.zero_()
        tail[:nbytes - body] = view[body:]
        io.run_all([(True, tail, path, hlen + body)])
        if h is not None:
            _close_last_chunk(crcs, h, view, body, nbytes, CRC_CHUNK)
    meta = dict(meta, crcs=crcs if h is not None else [])
    io.run_all([(True, _encode_header(meta, hlen), path, 0)])
    if durable:
        for target, flags in ((path, os.O_RDONLY), (os.path.dirname(path), os.O_RDONLY)):
            fd = os.open(target, flags)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def read_header(io: AsyncIOHandle, path: str) -> tuple[dict, int]:
    """The checked header of the file at ``path`` and its length (the payload's offset)."""
    buf = aligned_empty(ALIGN)
    n = io.sync_pread(buf, path, 0) if os.path.getsize(path) >= ALIGN else -1
    if n < _FIXED.size:
        raise ChecksumError(f"titan hms: {path!r} is truncated (no complete header); delete it or restore it")
    magic, version, hlen, jlen, jcrc = _FIXED.unpack(bytes(buf[:_FIXED.size].numpy()))
    if magic != MAGIC:
        raise ChecksumError(f"titan hms: {path!r} is not an HMS store file (bad magic {magic!r})")
    if version not in _READS:
        raise ChecksumError(f"titan hms: {path!r} has format version {version}, this build reads "
                            f"{', '.join(map(str, _READS))}")
    if hlen % ALIGN or hlen < _FIXED.size + jlen:
        raise ChecksumError(f"titan hms: {path!r} has a corrupt header (length {hlen})")
    if hlen > ALIGN:
        buf = aligned_empty(hlen)
        io.sync_pread(buf, path, 0)
    js = bytes(buf[_FIXED.size:_FIXED.size + jlen].numpy())
    if zlib.crc32(js) != jcrc:
        raise ChecksumError(f"titan hms: header checksum mismatch in {path!r}: the file is corrupt")
    meta = json.loads(js)
    meta.setdefault("hash", "crc32")  # format 1
    if meta["hash"] not in _HASHES and meta["hash"] != NO_HASH:
        raise ChecksumError(f"titan hms: {path!r} uses checksum {meta['hash']!r}, unknown to this build")
    return meta, hlen


def read_file(io: AsyncIOHandle, key: str, path: str, out: Optional[torch.Tensor] = None, *,
              verify: bool = True, alloc=None) -> tuple[torch.Tensor, int]:
    """Read ``key``'s file (checked against its checksums when ``verify``) and its payload's byte count; into
    ``out`` directly when it is a contiguous CPU tensor of the stored size (no fresh allocation: first-touch page
    faults cost ~0.8 s/GiB on this VM). Otherwise into ``alloc(padded_bytes)`` (an ALIGN-aligned uint8 buffer of
    the payload rounded up to ALIGN; default a fresh one), whose storage the returned tensor shares."""
    meta, hlen = read_header(io, path)
    verify = verify and meta["hash"] != NO_HASH  # a swap file carries no payload checksums
    nbytes = meta["nbytes"]
    dtype = _DTYPES[meta["dtype"]]
    direct = (out is not None and out.is_contiguous() and out.device.type == "cpu" and out.dtype == dtype
              and out.numel() * out.element_size() == nbytes)
    if direct:
        target, body = tensor_bytes(out), nbytes - nbytes % ALIGN
    else:
        target = aligned_empty(nbytes) if alloc is None else alloc(-(-max(nbytes, 1) // ALIGN) * ALIGN)
        body = target.numel()  # padded: the whole payload in one aligned read
    if nbytes:
        chunk, h = meta["chunk"], _HASHES.get(meta["hash"])

        def crc(lo: int, hi: int) -> int:
            return h(memoryview(target[lo:min(hi, nbytes)].numpy())) if verify else 0

        got = io.transfer_with(False, target[:body], path, hlen, chunk, crc) if body else []
        if direct and nbytes > body:
            tail = aligned_empty(ALIGN)
            io.run_all([(False, tail, path, hlen + body)])
            target[body:] = tail[:nbytes - body]
            if verify:
                _close_last_chunk(got, h, target, body, nbytes, chunk)
        if verify and got != meta["crcs"]:
            bad = next((i for i, (a, b) in enumerate(zip(got, meta["crcs"])) if a != b), 0)
            lo = bad * chunk
            raise ChecksumError(f"titan hms: checksum mismatch in {path!r} (key {key!r}, payload bytes "
                                f"[{lo}, {min(lo + chunk, nbytes)})): the file is corrupt")
    if direct:
        return out, nbytes
    if nbytes == 0:
        return torch.empty(meta["shape"], dtype=dtype), nbytes
    return target[:nbytes].view(dtype).reshape(meta["shape"]), nbytes
