"""`driver`'s fixed row chunks: `chunk_bounds` (a row at a time) and `pair_bounds` (the one-row decoders'
pairs of W rows, GGUF's and Nf4Matmul's on AVX-512 hosts) cover every row exactly once, in order, and a
pair chunk never splits a pair: only the last row of all may go alone (as a pair with itself)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fuel.cpu.simd.driver import CHUNKS, chunk_bounds, chunk_count, pair_bounds, pair_chunk_count

ROWS = st.integers(min_value=1, max_value=4 * CHUNKS + 3)


def _spans(bounds: list[tuple[int, int]], rows: int) -> None:
    at = 0
    for lo, hi in bounds:
        assert lo == at and lo <= hi
        at = hi
    assert at == rows


@settings(max_examples=200, deadline=None)
@given(ROWS)
def test_row_chunks_cover_the_rows_once(rows: int) -> None:
    chunks = chunk_count(rows)
    assert 1 <= chunks <= CHUNKS
    _spans([chunk_bounds(c, rows, chunks) for c in range(chunks)], rows)


@settings(max_examples=200, deadline=None)
@given(ROWS)
def test_pair_chunks_cover_the_rows_once_in_whole_pairs(rows: int) -> None:
    chunks = pair_chunk_count(rows)
    assert 1 <= chunks <= CHUNKS
    bounds = [pair_bounds(c, rows) for c in range(chunks)]
    _spans(bounds, rows)
    assert all(lo % 2 == 0 for lo, _ in bounds)
    assert all((hi - lo) % 2 == 0 for lo, hi in bounds if hi != rows)
    assert all(hi > lo for lo, hi in bounds)  # no part runs an empty chunk while another waits


def test_small_weights_have_one_pair_a_chunk() -> None:
    """256 rows in 128 chunks of two; `chunk_bounds` would give 256 chunks of one row each."""
    assert pair_chunk_count(256) == 128
    assert {pair_bounds(c, 256)[1] - pair_bounds(c, 256)[0] for c in range(128)} == {2}
    assert pair_bounds(0, 1) == (0, 1)
    assert [pair_bounds(c, 3) for c in range(pair_chunk_count(3))] == [(0, 2), (2, 3)]
