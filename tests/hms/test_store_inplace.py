"""TensorStore(overwrite_in_place=True), HMS's swap store: a put that is not durable rewrites a same-sized file
where it is (writing a new file and renaming it over the old one measured 0.8 against 1.9 GB/s on this disk).
The values stay exact; no read of a key overlaps its rewrite (a prefetch of the old value is waited for or
dropped, a get or prefetch issued meanwhile reads after it); a failed rewrite forgets the key and says so;
durable puts, other sizes and the default store keep writing a new file and renaming it."""
import os
import threading
import time

import pytest
import torch

from titan_ds.hms.store import Tier, TensorStore


def _ino(store, key):
    return os.stat(store.path(key)).st_ino


def test_same_size_rewrites_the_file_in_place_and_reads_back_exact(tmp_path):
    store = TensorStore([Tier(str(tmp_path))], durable=False, overwrite_in_place=True)
    a, b, c = torch.randn(70_000), torch.randn(70_000), torch.randn(90_000)
    store.put("k", a)
    ino = _ino(store, "k")
    store.put("k", b)
    assert _ino(store, "k") == ino and torch.equal(store.get("k"), b)
    store.put_behind("k", a.clone()).result()  # the writer thread's put too
    assert _ino(store, "k") == ino and torch.equal(store.get("k"), a)
    store.put("k", c)  # another size: a new file, renamed over the old one
    assert _ino(store, "k") != ino and torch.equal(store.get("k"), c)
    ino = _ino(store, "k")
    store.put("k", torch.randn(90_000), durable=True)  # durable: never in place
    assert _ino(store, "k") != ino
    assert not any(".tmp." in n for n in os.listdir(tmp_path))
    fresh = TensorStore([Tier(str(tmp_path))])
    assert fresh.scan() == 1 and torch.equal(fresh.get("k"), store.get("k"))
    store.close()
    fresh.close()


def test_the_default_store_replaces_the_file(tmp_path):
    store = TensorStore([Tier(str(tmp_path))], durable=False)
    store.put("k", torch.randn(5000))
    ino = _ino(store, "k")
    store.put("k", torch.randn(5000))
    assert _ino(store, "k") != ino
    store.close()


def test_a_prefetch_of_the_old_value_never_overlaps_the_rewrite(tmp_path):
    store = TensorStore([Tier(str(tmp_path))], durable=False, overwrite_in_place=True)
    old, new = torch.full((300_000,), 1.0), torch.full((300_000,), 2.0)
    store.put("k", old)
    reading, spans = threading.Event(), {}
    read_file, write_file = store._read_file, store._write_file

    def slow_read(key, path, out=None):
        reading.set()
        spans["read0"] = time.perf_counter()
        time.sleep(0.3)
        t = read_file(key, path, out)
        spans["read1"] = time.perf_counter()
        return t

    def timed_write(path, meta, hlen, view, *, durable):
        spans["write0"] = time.perf_counter()
        return write_file(path, meta, hlen, view, durable=durable)

    store._read_file, store._write_file = slow_read, timed_write
    store.prefetch("k")
    assert reading.wait(5)
    store.put("k", new)  # waits for the read of the old value, then rewrites
    assert spans["write0"] >= spans["read1"]
    store._read_file = read_file
    assert torch.equal(store.get("k"), new)
    store.close()


def test_a_get_on_another_thread_waits_for_the_rewrite(tmp_path):
    store = TensorStore([Tier(str(tmp_path))], durable=False, overwrite_in_place=True)
    old, new = torch.full((300_000,), 1.0), torch.full((300_000,), 2.0)
    store.put("k", old)
    write_file, started = store._write_file, threading.Event()

    def half_then_rest(path, meta, hlen, view, *, durable):
        started.set()
        time.sleep(0.3)  # a reader now would see a torn file
        return write_file(path, meta, hlen, view, durable=durable)

    store._write_file = half_then_rest
    t = threading.Thread(target=store.put, args=("k", new))
    t.start()
    assert started.wait(5)
    store.prefetch("k")  # not started while the file is rewritten
    assert "k" not in store._staged
    assert torch.equal(store.get("k"), new)
    t.join()
    store.close()


def test_a_failed_rewrite_forgets_the_key_and_names_it(tmp_path):
    store = TensorStore([Tier(str(tmp_path))], durable=False, overwrite_in_place=True)
    store.put("k", torch.randn(5000))
    path, write_file = store.path("k"), store._write_file

    def dying(path, meta, hlen, view, *, durable):
        write_file(path, meta, hlen, view[: view.numel() // 2], durable=durable)
        raise OSError(5, "Input/output error")

    store._write_file = dying
    with pytest.raises(OSError, match=r"overwriting .*k\.hms.* the value of 'k' is lost"):
        store.put("k", torch.randn(5000))
    assert "k" not in store and not os.path.exists(path)
    with pytest.raises(KeyError, match="no tensor stored under 'k'"):
        store.get("k")
    store._write_file = write_file
    store.put("k", torch.ones(5000))  # the key can be written again
    assert torch.equal(store.get("k"), torch.ones(5000))
    store.close()


def test_put_behind_calls_on_written_once_landed_and_never_after_a_failure(tmp_path, monkeypatch):
    # titan.hms.gradient_store punches a gradient piece out of its mapping in on_written: only once the piece is on
    # disk (a get that waited for the write finds the file's value), and never where the write failed
    store = TensorStore([Tier(str(tmp_path))], durable=False, overwrite_in_place=True)
    seen = []
    v = torch.randn(5000)
    f = store.put_behind("g", v, on_written=lambda: seen.append("g" in store._index))
    f.result()
    assert seen == [True]  # called once the write was indexed (landed)
    assert torch.equal(store.get("g"), v)
    original = store._write_file

    def fail(path, *a, **kw):
        raise OSError(5, "injected")

    monkeypatch.setattr(store, "_write_file", fail)
    f = store.put_behind("g", torch.zeros(5000), on_written=lambda: seen.append("written"))
    with pytest.raises(OSError, match="injected"):
        f.result()
    assert seen == [True]
    monkeypatch.setattr(store, "_write_file", original)
    with pytest.raises(OSError, match="injected"):  # a failed write is raised once more at close, as documented
        store.close()


def test_get_from_the_cache_waits_for_a_prefetch_still_reading_into_the_callers_buffer(tmp_path, monkeypatch):
    # prefetch(out=buf) issued while the key's write is queued waits for the write, then reads the file into buf;
    # the write cached the value as it landed (write-allocate), so the get is a cache hit. It must not return
    # before that read is done: the caller reuses buf next (gradient_store's two gradient buffers), and a read
    # landing later would write this key's bytes over whatever buf holds then (a flaky resume test found it)
    store = TensorStore([Tier(str(tmp_path))], dram_cache_bytes=1 << 20, durable=False, overwrite_in_place=True)
    v = torch.randn(1000)
    store.put("g", torch.zeros(1000))
    store._cache_drop("g")
    go, reading = threading.Event(), []
    original = store._read_file

    def slow_read(key, path, out=None):
        go.wait(5)
        t = original(key, path, out)
        reading.append("done")
        return t

    monkeypatch.setattr(store, "_read_file", slow_read)
    write_go = threading.Event()
    write_go.set()
    original_put = store._put

    def held_put(*args, **kwargs):  # the writer thread's whole write, held before it starts (or marks the file
        write_go.wait(5)             # as being overwritten, which a prefetch issued then would skip)
        return original_put(*args, **kwargs)

    monkeypatch.setattr(store, "_put", held_put)
    store.put_behind("g", v).result()  # landed and cached
    store._cache_drop("g")
    write_go.clear()
    store.put_behind("g", v + 1)  # held (on a busy machine it could otherwise land, or start overwriting the file,
    buf = torch.empty(1000)       # before the prefetch below, which then reads nothing: CI saw that twice)
    store.prefetch("g", out=buf)  # queued behind the write: reads the new file once it lands
    write_go.set()
    store.flush()
    assert "g" in store._cache  # the write cached the value as it landed
    threading.Timer(0.3, go.set).start()
    out = store.get("g", out=buf)
    assert reading == ["done"] and torch.equal(out, v + 1)
    store.close()
