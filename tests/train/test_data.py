"""fuel.train.data: the built-in corpus, the tokenizers, the split and the seeded batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuel.errors import FuelError
from fuel.train.data import BYTE_VOCAB, Batches, ByteTokenizer, DataError, builtin_text, load_tokens, split


def test_builtin_corpus_is_pythons_own_topics_text() -> None:
    from pydoc_data.topics import topics

    text = builtin_text("pydoc-topics")
    assert len(text) > 400_000
    for name in ("assert", "if", "lambda"):
        assert topics[name] in text
    ids = load_tokens("pydoc-topics", ByteTokenizer())
    assert ids.dtype == np.int64 and bytes(ids.astype(np.uint8).tolist()) == text.encode("utf-8")


@given(text=st.text(max_size=60))
def test_byte_tokenizer_is_utf8(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8", errors="replace"))
    assert tok.decode(ids) == text.encode("utf-8", errors="replace").decode("utf-8")
    assert max(ids, default=0) < 256 < BYTE_VOCAB


@settings(max_examples=30)
@given(n=st.integers(20, 300), batch=st.integers(1, 6), block=st.integers(1, 16), seed=st.integers(0, 2**32))
def test_batches_are_shifted_windows_of_the_data(n: int, batch: int, block: int, seed: int) -> None:
    data = np.arange(n, dtype=np.int64) * 7 + 3  # distinct values: a window's first value gives its offset
    b = Batches(data, batch, block, seed)
    for _ in range(3):
        x, y = b.next()
        assert x.shape == y.shape == (batch, block) and x.dtype == np.int64
        for row_x, row_y in zip(x, y, strict=True):
            start = int((row_x[0] - 3) // 7)
            assert 0 <= start < n - block  # nanoGPT's range: the target window fits
            np.testing.assert_array_equal(row_x, data[start:start + block])
            np.testing.assert_array_equal(row_y, data[start + 1:start + block + 1])


@settings(max_examples=20)
@given(seed=st.integers(0, 2**32), skip=st.integers(0, 5))
def test_batches_state_round_trip_continues_the_same_draws(seed: int, skip: int) -> None:
    data = np.arange(500, dtype=np.int64)
    a = Batches(data, 4, 8, seed)
    for _ in range(skip):
        a.next()
    saved = a.state()
    expect = [a.next() for _ in range(3)]
    b = Batches(data, 4, 8, seed + 1)  # another seed: only the restored state makes them agree
    b.set_state(saved)
    for (x0, y0), (x1, y1) in zip(expect, [b.next() for _ in range(3)], strict=True):
        np.testing.assert_array_equal(x0, x1)
        np.testing.assert_array_equal(y0, y1)
    assert not np.array_equal(Batches(data, 4, 8, seed).next()[0], Batches(data, 4, 8, seed + 1).next()[0])


def test_split_is_head_and_tail() -> None:
    ids = np.arange(1000)
    train, val = split(ids, 0.1, 8)
    assert len(train) == 900 and len(val) == 100 and train[-1] + 1 == val[0]


def test_data_errors_name_the_problem(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    with pytest.raises(DataError, match="validation split has 3 tokens, fewer than block_size"):
        split(np.arange(30), 0.1, 8)
    with pytest.raises(DataError, match="neither a built-in corpus"):
        load_tokens(str(tmp_path / "missing.txt"), tok)
    bad = tmp_path / "two_d.npy"
    np.save(bad, np.zeros((2, 2), np.int32))
    with pytest.raises(DataError, match="1-D integer array, got 2-D int32"):
        load_tokens(str(bad), tok)
    big = tmp_path / "big.npy"
    np.save(big, np.array([1, 300], np.int32))
    with pytest.raises(DataError, match=r"ids span \[1, 300\], outside the byte tokenizer's vocabulary \[0, 258\)"):
        load_tokens(str(big), tok)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes(b"caf\xe9")
    with pytest.raises(DataError, match="cannot read it as UTF-8"):
        load_tokens(str(latin), tok)
    with pytest.raises(FuelError, match="not a PCG64 state"):
        Batches(np.arange(100), 2, 4, 0).set_state({"bit_generator": "MT19937"})


def test_text_file_and_npy_corpora(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    f = tmp_path / "t.txt"
    f.write_text("héllo\n", encoding="utf-8")
    assert load_tokens(str(f), tok).tolist() == list("héllo\n".encode())
    n = tmp_path / "t.npy"
    np.save(n, np.array([5, 6, 257], np.uint16))
    got = load_tokens(str(n), tok)
    assert got.dtype == np.int64 and got.tolist() == [5, 6, 257]
