import numpy as np
import pytest
import torch

from titan_ds.data import Batcher, load_corpus, val_batches


def test_stdlib_corpus_deterministic_and_cached():
    a, b = load_corpus(), load_corpus()
    assert a.source.startswith("cpython-stdlib") and len(a.train) > 1_000_000 and len(a.val) > 10_000
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert a.train.dtype == np.uint8


def test_user_file_and_folder(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_text("world " * 100)
    (tmp_path / "d" / "a.txt").write_text("hello " * 100)
    c = load_corpus(tmp_path / "d")
    assert bytes(c.train[:6]) == b"hello "  # sorted order: a.txt first
    assert len(c.train) + len(c.val) == 1200
    f = tmp_path / "one.txt"
    f.write_text("abc" * 50)
    assert len(load_corpus(f).train) + len(load_corpus(f).val) == 150
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(tmp_path / "missing")


def test_batches_pure_function_of_step_and_rank():
    tokens = np.arange(1000, dtype=np.uint8)
    b = Batcher(tokens, 4, 16, seed=1)
    x1, y1 = b.get(7)
    x2, y2 = Batcher(tokens, 4, 16, seed=1).get(7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(Batcher(tokens, 4, 16, seed=1, rank=1).get(7)[0], x1)
    v = list(val_batches(tokens, 3, 4, 16))
    assert len(v) == 3 and torch.equal(v[0][0], list(val_batches(tokens, 3, 4, 16))[0][0])
