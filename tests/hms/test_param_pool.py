"""Parameter partitions read into pooled buffers (titan.hms.pooled_reads, the parameter side): a read of a
``param/`` key lands in a buffer of the swapper's pool, and the buffer goes back to the pool when ZeRO-3 releases the
partition, unless another tensor still shares its storage. Bit for bit the run with fresh buffers; buffers reused."""
import pytest
import torch

from tests.hms.test_swapper import assert_same, run
from titan_ds.hms.io import BufferPool, storage_refs
from titan_ds.hms.store import TensorStore, Tier


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("hms_param_pool")


def _store(path, cache_bytes=0):
    return TensorStore([Tier(str(path))], dram_cache_bytes=cache_bytes, verify=False, checksum=False)


def test_a_pooled_read_is_given_back_and_reused(tmp_path):
    store, pool = _store(tmp_path), BufferPool()
    store.pool_reads("param/", pool)
    a, b = torch.randn(3000), torch.randn(3000)
    store.put("param/1", a)
    store.put("param/2", b)
    store.put("opt/1", a)
    t = store.get("param/1")
    assert torch.equal(t, a) and pool.allocated == 1
    assert store.recycle(t) and pool.free_bytes > 0
    del t
    u = store.get("param/2")  # the same size: the buffer given back, not a new one
    assert torch.equal(u, b) and pool.allocated == 1 and pool.free_bytes == 0
    assert not store.recycle(store.get("opt/1"))  # another prefix: a fresh tensor, nothing to give back
    store.close()


def test_a_buffer_still_shared_is_not_given_back(tmp_path):
    store, pool = _store(tmp_path), BufferPool()
    store.pool_reads("param/", pool)
    store.put("param/1", torch.randn(3000))
    t = store.get("param/1")
    view = t[:10]  # e.g. a tensor autograd kept: the next read must not overwrite it
    before = view.clone()
    assert not store.recycle(t)
    assert pool.free_bytes == 0
    store.put("param/2", torch.randn(3000))
    store.get("param/2")
    assert torch.equal(view, before) and storage_refs(view) >= 1
    store.close()


def test_a_cached_or_prefetched_value_follows_the_same_rule(tmp_path):
    store, pool = _store(tmp_path, cache_bytes=1 << 20), BufferPool()
    store.pool_reads("param/", pool)
    small, big = torch.randn(100), torch.randn(1 << 16)  # 400 bytes cached; 256 KiB over the cache's 1/8
    store.put("param/s", small)
    store.put("param/b", big)
    c = store.get("param/s")  # a copy of the cached value: not a pool buffer
    assert torch.equal(c, small) and not store.recycle(c)
    store.prefetch("param/b")
    p = store.get("param/b")  # the finished prefetch read into a pool buffer
    assert torch.equal(p, big) and store.recycle(p)
    store.close()


def test_the_pool_keeps_at_most_its_byte_bound():
    pool = BufferPool(max_free_bytes=3 * 4096)
    bufs = [pool.take(4096) for _ in range(5)]
    for b in bufs:
        pool.give(b)
    assert pool.free_bytes == 3 * 4096 and pool.dropped == 2


def test_pooled_parameter_reads_are_bit_exact_and_reuse_buffers(tmp):
    fresh, = run(tmp, "fresh", "--mode", "hms", "--no-pooled-reads")
    pooled, = run(tmp, "pooled", "--mode", "hms")
    assert_same(fresh, pooled)  # losses of every step, parameters, every sub-group's master and state, lr
    assert fresh["param_pool"]["allocated"] is None and fresh["param_pool"]["recycled"] == 0
    use = pooled["param_pool"]
    assert use["recycled"] > 0
    # most reads reuse a buffer: far fewer made than partitions read
    assert use["allocated"] < use["recycled"] < use["swap_ins"], use
