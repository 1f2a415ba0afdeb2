"""HMS store and I/O handle: bit-exact round trips, atomicity, checksums, disk full, tiers, cache."""
import os
import subprocess
import sys

import pytest
import torch

from titan_ds.hms.io import ALIGN, AsyncIOHandle, reference_pread, reference_pwrite, tensor_bytes
from titan_ds.hms.store import ChecksumError, StoreFullError, Tier, TensorStore

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.uint8,
          torch.int8, torch.int16, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _random(dtype, shape):
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod().item()) * torch.empty(0, dtype=dtype).element_size(),),
                        dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)  # every bit pattern, NaNs and denormals included


def _bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(tensor_bytes(a.contiguous()),
                                                                     tensor_bytes(b.contiguous()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 5, 7), (1025,), (ALIGN + 3,)])
def test_round_trip_every_dtype_bit_exact(tmp_path, dtype, shape):
    store = TensorStore([Tier(str(tmp_path))], durable=False)
    x = _random(dtype, shape)
    store.put("a/b", x)
    assert _bits_equal(store.get("a/b"), x)
    fresh = TensorStore([Tier(str(tmp_path))])  # a fresh reader finds it from the files alone
    assert fresh.scan() == 1 and _bits_equal(fresh.get("a/b"), x)


def test_non_contiguous_and_large_multi_chunk(tmp_path):
    store = TensorStore([Tier(str(tmp_path))], durable=False)
    x = torch.randn(1500, 1100).t()  # non-contiguous, 6.6 MB: several CRC chunks and I/O blocks
    store.put("big", x)
    assert torch.equal(store.get("big"), x)


def test_io_handle_matches_reference_and_pinned_views(tmp_path):
    h = AsyncIOHandle(block_size=ALIGN * 4, intra_op_parallelism=3)
    buf = h.new_cpu_locked_tensor(10_000, torch.empty(0, dtype=torch.float32))
    buf.copy_(torch.randn(10_000))
    assert h.is_pinned(buf) and h.is_pinned(buf[100:200]) and not h.is_pinned(torch.empty(10))
    p = str(tmp_path / "f.swp")
    assert h.async_pwrite(buf, p, 0) == 0 and h.async_pwrite(buf[:1024], p, 40_000) == 0
    assert h.wait() == 2
    ref = torch.empty(10_000)
    reference_pread(ref, p, 0)
    assert torch.equal(ref, buf)
    out = torch.empty(1024)
    h.async_pread(out, p, 40_000)
    assert h.wait() == 1 and torch.equal(out, buf[:1024])
    reference_pwrite(torch.arange(5.0), p, 8)
    h.sync_pread(out[:5], p, 8)
    assert torch.equal(out[:5], torch.arange(5.0))
    h.free_cpu_locked_tensor(buf)
    assert not h.is_pinned(buf)


def test_io_error_names_the_file(tmp_path):
    h = AsyncIOHandle()
    with pytest.raises(OSError, match="missing.swp"):
        h.async_pread(torch.empty(4), str(tmp_path / "missing.swp"), 0)


@pytest.mark.parametrize("direct", ["detect", "on", "off"])
def test_direct_modes_round_trip(tmp_path, direct):
    from titan_ds.hms.io import probe_direct_io
    if direct == "on" and not probe_direct_io(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT")
    store = TensorStore([Tier(str(tmp_path))], io=AsyncIOHandle(direct=direct), durable=False)
    x = torch.randn(3 * ALIGN + 5)
    store.put("d", x)
    assert torch.equal(store.get("d"), x)


_CRASH = r"""
import os, sys, torch
from titan_ds.hms.store import TensorStore, Tier
s = TensorStore([Tier(sys.argv[1])], durable=False)
s.scan()
import titan_ds.hms.store as m
orig = m.TensorStore._write_file
def dying(self, path, meta, hlen, view, durable):
    orig(self, path, meta, hlen, view[: view.numel() // 2], durable=durable)  # half the payload reaches the disk
    os._exit(9)                                                         # then the process dies
m.TensorStore._write_file = dying
s.put("w", torch.full((4096,), 2.0))
"""


def test_atomic_write_under_simulated_crash(tmp_path):
    store = TensorStore([Tier(str(tmp_path))], durable=True)
    old = torch.full((4096,), 1.0)
    store.put("w", old)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    rc = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path)], env=env).returncode
    assert rc == 9
    assert any(".tmp." in n for n in os.listdir(tmp_path))  # the torn file exists, under its temporary name
    fresh = TensorStore([Tier(str(tmp_path))])
    assert fresh.scan() == 1
    assert torch.equal(fresh.get("w"), old)                  # readers see the previous version, whole
    assert not any(".tmp." in n for n in os.listdir(tmp_path))


@pytest.mark.parametrize("where", ["payload", "header"])
def test_checksum_corruption_detected_names_file(tmp_path, where):
    store = TensorStore([Tier(str(tmp_path))], durable=False)
    store.put("c", torch.randn(3000))
    path = store.path("c")
    with open(path, "r+b") as f:
        f.seek(ALIGN + 1000 if where == "payload" else 40)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(ChecksumError, match=os.path.basename(path)):
        store.get("c")


def test_disk_full_raises_and_keeps_previous_version(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a 1 MiB tmpfs here (needs root)")
    try:
        store = TensorStore([Tier(str(mnt))], durable=True)
        old = torch.randn(50_000)  # 200 kB fits
        store.put("p", old)
        with pytest.raises(StoreFullError, match=r"disk full writing .*p\.hms.*previous version"):
            store.put("p", torch.randn(400_000))  # 1.6 MB does not
        assert torch.equal(store.get("p"), old)
        assert not any(".tmp." in n for n in os.listdir(mnt))
        fresh = TensorStore([Tier(str(mnt))])
        fresh.scan()
        assert torch.equal(fresh.get("p"), old)
    finally:
        subprocess.run(["umount", str(mnt)])


def test_capacity_spills_to_next_tier_and_rebalance_by_frequency(tmp_path):
    fast, slow = Tier(str(tmp_path / "nvme"), capacity_bytes=3 * 2 * ALIGN), Tier(str(tmp_path / "ssd"))
    store = TensorStore([fast, slow], durable=False)
    xs = {f"k{i}": torch.full((ALIGN // 4,), float(i)) for i in range(5)}  # each file: 1 header + 1 payload block
    for k, v in xs.items():
        store.put(k, v)
    assert [store.tier_of(k) for k in xs] == [0, 0, 0, 1, 1]
    for _ in range(3):
        store.get("k4")
        store.get("k3")
    store.get("k0")
    assert store.rebalance() == 4  # k1, k2 demoted; k3, k4 promoted
    assert {k for k in xs if store.tier_of(k) == 0} == {"k0", "k3", "k4"}
    for k, v in xs.items():
        assert torch.equal(store.get(k), v)
    with pytest.raises(StoreFullError, match="capacity"):
        TensorStore([Tier(str(tmp_path / "tiny"), capacity_bytes=ALIGN)]).put("x", torch.zeros(10))


def test_dram_cache_is_bounded_lru_and_write_through(tmp_path):
    store = TensorStore([Tier(str(tmp_path))], dram_cache_bytes=8 * 4000, durable=False)
    for i in range(9):
        store.put(f"t{i}", torch.full((1000,), float(i)))  # write-allocate: t0 evicted when t8 arrives
    assert store.cache_bytes <= 32000 and "t0" not in store._cache
    hits = store.stats.cache_hits
    store.get("t8")
    store.get("t1")
    assert store.stats.cache_hits == hits + 2
    store.get("t0")  # a miss, cached again (t2, the least recently used, goes)
    assert store.stats.cache_hits == hits + 2 and "t0" in store._cache and "t2" not in store._cache
    store.put("t1", torch.full((1000,), 7.0))  # cached copy follows the file
    assert torch.equal(store.get("t1"), torch.full((1000,), 7.0))
    got = store.get("t1")
    got.add_(1)  # the caller owns what get returns
    assert torch.equal(store.get("t1"), torch.full((1000,), 7.0))


def test_dram_cache_admits_tensors_of_at_most_an_eighth_of_its_budget(tmp_path):
    """Every admission is a copy; a tensor near the budget would evict the rest and itself before its next use
    (a 12x768 HMS step under a 64 MiB cache cloned every 40 MB optimizer-state tensor it read or wrote)."""
    store = TensorStore([Tier(str(tmp_path))], dram_cache_bytes=8 * 4000, durable=False)
    small, big = torch.full((1000,), 1.0), torch.full((1001,), 2.0)  # 4000 bytes: admitted; 4004: not
    store.put("small", small)
    store.put("big", big)
    assert "small" in store._cache and "big" not in store._cache
    assert torch.equal(store.get("big"), big) and "big" not in store._cache  # a read does not admit it either
    store.prefetch("big")
    assert torch.equal(store.get("big"), big) and "big" not in store._cache
    store.close()


@pytest.mark.parametrize("bounce", [True, False])
def test_an_unaligned_slice_goes_o_direct_through_the_bounce_block(tmp_path, monkeypatch, bounce):
    """A partition is a slice of its sub-group's master, rarely at a 4 KiB-aligned address: with the bounce block
    its payload is written and read back with O_DIRECT (not through the page cache), the same bytes either way."""
    from titan_ds.hms.io import aligned_empty, probe_direct_io
    if not probe_direct_io(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT")
    store = TensorStore([Tier(str(tmp_path))], durable=False)
    store.io.bounce = bounce
    n = 3 * (1 << 20) // 4 + 5  # 3 MiB + 20 bytes: an aligned body of several chunks and an unaligned tail
    base = aligned_empty(4 * (n + 1))[:4 * (n + 1)].view(torch.float32)
    base.copy_(torch.randn(n + 1))
    part = base.narrow(0, 1, n)  # 4 bytes past an aligned address
    opened = []
    real = os.open
    monkeypatch.setattr(os, "open", lambda path, flags, *a: opened.append((str(path), flags)) or real(path, flags, *a))
    store.put("param/1", part)
    out = torch.empty(n + 3)[3:]  # an unaligned destination too
    assert torch.equal(store.get("param/1", out=out), part)
    monkeypatch.undo()
    payload = [f for p, f in opened if p.endswith(".hms") or ".tmp." in p]
    direct = [bool(f & os.O_DIRECT) for f in payload]
    # the header and the tail are aligned buffers (O_DIRECT either way); the payload's chunks follow the setting
    assert len(payload) >= 4 and (all(direct) if bounce else not all(direct)), (bounce, direct)
    assert torch.equal(store.get("param/1"), part)
    store.close()


def test_prefetch_counts_hits_and_bytes(tmp_path):
    store = TensorStore([Tier(str(tmp_path))], durable=False)
    store.put("a", torch.randn(5000))
    store.prefetch("a")
    store._staged["a"].result()  # let the read finish: the get below is then a prefetch hit
    x = store.get("a")
    assert x.numel() == 5000 and store.stats.bytes_prefetched == 20000
    assert store.stats.prefetch_hits == 1 and store.stats.misses == 0


def test_store_threads_all_exist_from_the_start(tmp_path):
    """The I/O and prefetch pools start every worker at once, so the thread count never grows mid-run (the soak
    test's leak check saw 9 -> 10 when two reads first overlapped late)."""
    import threading
    # Compare sets of threads, not counts: pools of earlier tests may finish shutting down meanwhile (a count
    # check failed in CI that way, 6 != 4 + 3 + 2).
    before = set(threading.enumerate())
    store = TensorStore([Tier(str(tmp_path))], durable=False, prefetch_workers=3, io=AsyncIOHandle(threads=2))
    started = set(threading.enumerate()) - before
    assert len(started) == 3 + 2 + 2  # prefetch, I/O, the writers (lanes "opt" and "param")
    for i in range(8):
        store.put(f"k{i}", torch.randn(70000))
    for i in range(8):
        store.prefetch(f"k{i}")
    for i in range(8):
        store.get(f"k{i}")
    assert set(threading.enumerate()) - before == started
    store.close()


def test_a_cache_hit_drops_the_staged_copy_of_a_finished_prefetch(tmp_path):
    """A finished prefetch also caches its value; the get then hits the cache and must forget the staged copy
    (before, every prefetched partition stayed staged until its next put: a second copy of the model in DRAM
    through forward and backward)."""
    store = TensorStore([Tier(str(tmp_path))], durable=False, dram_cache_bytes=1 << 20)
    x = torch.randn(5000)
    store.put("a", x)
    store._cache_drop("a")  # as after an eviction: the next prefetch reads the file and re-caches it
    store.prefetch("a")
    store._staged["a"].result()
    assert "a" in store._cache and "a" in store._staged
    assert torch.equal(store.get("a"), x) and store.stats.cache_hits == 1
    assert not store._staged


def test_speculative_prefetches_are_bounded_oldest_dropped(tmp_path):
    """Unread guesses hold at most max_speculative tensors: the oldest is dropped (its get reads the file, same
    value); a plain prefetch is never dropped, and a plain prefetch of a guessed key makes it plain."""
    store = TensorStore([Tier(str(tmp_path))], durable=False, max_speculative=2)
    vals = {k: torch.randn(3000) for k in "abcdef"}
    for k, v in vals.items():
        store.put(k, v)
    store.prefetch("a")                      # plain
    for k in "bcd":
        store.prefetch(k, speculative=True)  # b is dropped when d comes
    assert set(store._staged) == {"a", "c", "d"} and store.stats.prefetch_dropped == 1
    store.prefetch("c")                      # now plain: e and f push out d, then e, never c
    for k in "ef":
        store.prefetch(k, speculative=True)
    assert set(store._staged) == {"a", "c", "e", "f"} and store.stats.prefetch_dropped == 2
    for f in list(store._staged.values()):
        f.result()
    hits = store.stats.prefetch_hits
    for k in "abcdef":
        assert torch.equal(store.get(k), vals[k])
    assert store.stats.prefetch_hits == hits + 4 and not store._staged and not store._speculative
    unbounded = TensorStore([Tier(str(tmp_path / "u"))], durable=False)
    for k, v in vals.items():
        unbounded.put(k, v)
        unbounded.prefetch(k, speculative=True)
    assert len(unbounded._staged) == 6 and unbounded.stats.prefetch_dropped == 0
    with pytest.raises(ValueError, match="max_speculative"):
        TensorStore([Tier(str(tmp_path / "x"))], max_speculative=0)


@pytest.mark.parametrize("numel", [1, 1025, (4 << 20) // 4 + 3, (4 << 20) // 4 + 1025, 2 * (4 << 20) // 4])
def test_get_into_caller_buffer_bit_exact_and_verified(tmp_path, numel):
    # sizes around the 4 KiB alignment and the 4 MiB CRC chunk: the tail read separately continues or starts a chunk
    store = TensorStore([Tier(str(tmp_path))], durable=False)
    x = _random(torch.float32, (numel,))
    store.put("k", x)
    out = torch.empty(numel)
    assert store.get("k", out=out) is out and _bits_equal(out, x)
    with open(store.path("k"), "r+b") as f:  # corrupt the last payload byte: caught on the direct path too
        f.seek(ALIGN + numel * 4 - 1)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        store.get("k", out=out)


def _payload_sums(path, hash_fn):
    """An independent reading of a store file: the header's JSON and one checksum per chunk of the payload."""
    import json
    import struct
    raw = open(path, "rb").read()
    _, version, hlen, jlen, _ = struct.unpack("<8sIIII", raw[:24])
    meta = json.loads(raw[24:24 + jlen])
    payload = raw[hlen:hlen + meta["nbytes"]]
    sums = [hash_fn(payload[i:i + meta["chunk"]]) for i in range(0, len(payload), meta["chunk"])]
    return version, meta, sums


@pytest.mark.parametrize("numel", [1025, (4 << 20) // 4 + 3, 2 * (4 << 20) // 4])
def test_checksums_are_xxh3_of_each_chunk(tmp_path, numel):
    import xxhash
    store = TensorStore([Tier(str(tmp_path))], durable=False)
    store.put("k", _random(torch.float32, (numel,)))
    version, meta, sums = _payload_sums(store.path("k"), xxhash.xxh3_64_intdigest)
    assert version == 2 and meta["hash"] == "xxh3_64" and meta["crcs"] == sums


@pytest.mark.parametrize("numel", [1025, (4 << 20) // 4 + 1025])
def test_format_1_crc32_files_still_read_and_verified(tmp_path, numel, monkeypatch):
    """Stores (and checkpoints' HMS snapshots) written before XXH3 hold CRC32 files of format 1."""
    import zlib

    import titan_ds.hms.store_format as st
    x = _random(torch.float32, (numel,))
    with monkeypatch.context() as m:
        m.setattr(st, "FORMAT_VERSION", 1)
        m.setattr(st, "HASH", "crc32")
        old = TensorStore([Tier(str(tmp_path))], durable=False)
        old.put("k", x)
    version, meta, sums = _payload_sums(old.path("k"), zlib.crc32)
    assert version == 1 and meta["crcs"] == sums
    # what format 1 wrote had no "hash" key: take it out of the header, which stays valid (its own CRC32)
    import json
    import struct
    with open(old.path("k"), "r+b") as f:
        _, _, hlen, _, _ = struct.unpack("<8sIIII", f.read(24))
        meta.pop("hash")
        js = json.dumps(meta, separators=(",", ":")).encode()
        f.seek(0)
        f.write((struct.pack("<8sIIII", b"TITANHMS", 1, hlen, len(js), zlib.crc32(js)) + js).ljust(hlen, b"\0"))
    fresh = TensorStore([Tier(str(tmp_path))])
    assert fresh.scan() == 1 and _bits_equal(fresh.get("k"), x)
    out = torch.empty(numel)
    assert fresh.get("k", out=out) is out and _bits_equal(out, x)
    with open(old.path("k"), "r+b") as f:
        f.seek(ALIGN + 7)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        fresh.get("k", out=out)


def test_stage_serves_the_written_value_without_reading_the_file(tmp_path):
    store = TensorStore([Tier(str(tmp_path))], durable=False)  # no DRAM cache: every get reads the file
    x = torch.randn(5000)
    store.put("p", x)
    store.stage("p", x.clone())
    reads, hits = store.stats.reads, store.stats.prefetch_hits
    assert torch.equal(store.get("p"), x)
    assert store.stats.reads == reads and store.stats.prefetch_hits == hits + 1 and store.stats.staged_writes == 1
    assert torch.equal(store.get("p"), x) and store.stats.reads == reads + 1  # taken once, then from the file
    store.stage("p", x.clone())
    y = torch.randn(5000)
    store.put("p", y)  # a new value drops the staged old one
    assert torch.equal(store.get("p"), y)
    store.stage("missing", x)  # unknown keys are ignored
    assert "missing" not in store


def _slow_writer(store, gate):
    """The store's writes wait for ``gate`` (a threading.Event) on the writer thread: they stay pending."""
    import threading
    put = store._put

    def slow(key, tensor, **kw):
        if threading.current_thread() is not threading.main_thread():
            assert gate.wait(30), "test gate never opened"
        return put(key, tensor, **kw)

    store._put = slow


@pytest.mark.parametrize("cache_mb", [0, 1])
def test_read_of_a_key_with_a_pending_write_sees_the_new_value(tmp_path, cache_mb):
    """get and prefetch of a key whose put_behind has not landed: the new value, never the file (or cached copy)
    it replaces; a new key is readable too."""
    import threading
    store = TensorStore([Tier(str(tmp_path))], durable=False, dram_cache_bytes=cache_mb << 20)
    old, new, fresh = torch.full((5000,), 1.0), torch.full((5000,), 2.0), torch.arange(3000.0)
    store.put("k", old)
    assert torch.equal(store.get("k"), old)  # cached when cache_mb: a stale copy a read must not return
    gate = threading.Event()
    _slow_writer(store, gate)
    f = store.put_behind("k", new.clone())
    store.put_behind("n", fresh.clone())
    assert not f.done() and sorted(store.pending_writes()) == ["k", "n"] and "n" in store
    store.prefetch("k")  # queued behind the write
    threading.Timer(0.3, gate.set).start()
    assert torch.equal(store.get("k"), new)  # waits for the write
    assert torch.equal(store.get("n"), fresh)
    store.flush()
    assert store.pending_writes() == []
    reread = TensorStore([Tier(str(tmp_path))], durable=False)
    reread.scan()
    assert torch.equal(reread.get("k"), new) and torch.equal(reread.get("n"), fresh)
    store.close()
    reread.close()


def test_prefetch_queued_behind_a_pending_write_reads_the_new_value(tmp_path):
    import threading
    store = TensorStore([Tier(str(tmp_path))], durable=False)
    store.put("k", torch.full((5000,), 1.0))
    gate = threading.Event()
    _slow_writer(store, gate)
    store.put_behind("k", torch.full((5000,), 2.0))
    store.prefetch("k")
    staged = store._staged["k"]
    gate.set()
    assert torch.equal(staged.result(), torch.full((5000,), 2.0))  # the prefetch itself read the new file
    store.close()


def test_failed_background_write_surfaces_at_flush_naming_the_key(tmp_path):
    """A disk full on the writer thread: flush raises StoreFullError naming the key (not lost), the previous
    version stays readable, and the next flush is clean."""
    store = TensorStore([Tier(str(tmp_path), capacity_bytes=64 << 10)], durable=False)
    store.put("opt/3/fp32", torch.full((1000,), 1.0))
    f = store.put_behind("opt/3/state/exp_avg", torch.zeros(1 << 16))  # 256 KiB > the tier's 64 KiB
    f.exception()  # done (failed) before the flush
    with pytest.raises(StoreFullError, match=r"opt/3/state/exp_avg"):
        store.flush()
    store.flush()
    assert torch.equal(store.get("opt/3/fp32"), torch.full((1000,), 1.0))
    g = store.put_behind("opt/3/state/exp_avg", torch.zeros(1 << 16))
    with pytest.raises(StoreFullError, match=r"opt/3/state/exp_avg"):
        store.close()  # close flushes too
    assert g.done()


def test_failed_background_io_error_is_raised_naming_the_key(tmp_path):
    store = TensorStore([Tier(str(tmp_path))], durable=False)

    def broken(*a, **k):
        raise OSError(5, "Input/output error")

    store._write_file = broken
    store.put_behind("opt/9/fp32", torch.zeros(100))
    with pytest.raises(OSError, match=r"background write of 'opt/9/fp32' failed"):
        store.flush()
    store.close()


def test_io_buffers_are_aligned_huge_page_mappings_that_read_direct(tmp_path, monkeypatch):
    """io_empty (the swappers' reused buffers): aligned for O_DIRECT (no bounce copy), on a 2 MiB boundary from 2 MiB
    up when huge pages are on, the bytes a direct read puts there equal the reference read's; the mapping lives as
    long as a view of it. With huge pages off (TITAN_HMS_HUGE_PAGES=0) the same call gives ordinary aligned memory."""
    import gc

    import titan_ds.hms.io as hio
    from titan_ds.hms.io import ALIGN, HUGE_PAGE, AsyncIOHandle, io_empty, reference_pread
    n = (5 << 20) // 4 + 3  # 5 MiB + 12 bytes of fp32: a tail past the last whole huge page
    src = torch.randn(n)
    io = AsyncIOHandle(block_size=1 << 20)
    path = str(tmp_path / "f.bin")
    a = io_empty(n, torch.float32)
    assert a.dtype == torch.float32 and a.numel() == n and a.data_ptr() % ALIGN == 0
    if hio.HUGE_PAGES:
        assert a.data_ptr() % HUGE_PAGE == 0
    a.copy_(src)
    io.sync_pwrite(a[:n // 1024 * 1024], path, 0)  # an aligned length: O_DIRECT from the buffer itself
    b = io_empty(n // 1024 * 1024, torch.float32)
    io.sync_pread(b, path, 0)
    ref = torch.empty(n // 1024 * 1024)
    reference_pread(ref, path, 0)
    assert torch.equal(b, src[:n // 1024 * 1024]) and torch.equal(ref, b)
    view = a[7:9].clone(), a[7:9]
    del a
    gc.collect()
    assert torch.equal(view[1], view[0])  # the mapping outlives the tensor it came from while a view lives
    monkeypatch.setattr(hio, "HUGE_PAGES", False)
    c = io_empty(n, torch.float32)
    assert c.data_ptr() % ALIGN == 0 and c.numel() == n
    assert hio.aligned_empty(4 << 20, huge=False).data_ptr() % ALIGN == 0


@pytest.mark.parametrize("numel", [1, 1025, (4 << 20) // 4 + 3])
def test_swap_files_carry_no_payload_checksum_and_snapshot_files_keep_theirs(tmp_path, numel):
    """HMS's per-step swap files (a restarted run discards them) are written with hash ``none``: no I/O-thread
    CPU on checksums, read back bit exact; a store with checksums (snapshots, checkpoints) still detects
    corruption; ``hms.swap_checksums`` puts them back on the swap store."""
    import xxhash
    from titan_ds.config import HMSConfig
    from titan_ds.hms.install import build_store
    swap = TensorStore([Tier(str(tmp_path / "swap"))], durable=False, checksum=False)
    x = _random(torch.float32, (numel,))
    swap.put("k", x)
    _, meta, _ = _payload_sums(swap.path("k"), xxhash.xxh3_64_intdigest)
    assert meta["hash"] == "none" and meta["crcs"] == []
    assert _bits_equal(swap.get("k"), x) and _bits_equal(swap.get("k", out=torch.empty(numel)), x)
    snap = TensorStore([Tier(str(tmp_path / "snap"))], durable=True)
    snap.put("k", swap.get("k"))
    version, meta, sums = _payload_sums(snap.path("k"), xxhash.xxh3_64_intdigest)
    assert meta["hash"] == "xxh3_64" and meta["crcs"] == sums
    with open(snap.path("k"), "r+b") as f:
        f.seek(ALIGN)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        snap.get("k")
    for on in (False, True):
        st = build_store(HMSConfig(nvme_path=str(tmp_path / f"b{on}"), swap_checksums=on), str(tmp_path / f"b{on}"))
        try:
            assert st.checksum is on
        finally:
            st.close()
