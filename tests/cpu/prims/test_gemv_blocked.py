"""The gemv kernel's bytes are its contract's arithmetic, exactly: each value a[i, k] * b[k, j] accumulated
over k in order by fused multiply-adds within each of K_SPLIT fixed row ranges of the weight, from +0, and the
partial sums added in order. The oracle here computes that arithmetic in NumPy, each fused step rounded once
(`_fma`), independently of the kernel's loops (register blocks of 4 rows, the sweep of the rows left, the
narrow columns past the blocks, the chunks of k), so every row count and width crosses each of them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuel.cpu.prims.gemv import GEMV_MAX_ROWS, K_SPLIT, TASKS, gemv


def _fma32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """x * y + z (float32 arrays) rounded once to float32. In float64, x * y is exact, and s = x * y + z
    is the exact sum rounded once, its error e = (x * y + z) - s found exactly (two-sum). Rounding s to
    float32 is the correct rounding of the exact sum unless s lies exactly halfway between two float32
    values while e != 0: then the exact sum lies past the midpoint on e's side."""
    with np.errstate(invalid="ignore"):  # inf - inf in the error of an infinite sum, which is not used
        p = x.astype(np.float64) * y.astype(np.float64)
        z64 = z.astype(np.float64)
        s = p + z64
        bp = s - z64
        e = (p - bp) + (z64 - (s - bp))
    r = s.astype(np.float32)
    toward = np.where(s > r.astype(np.float64), np.float32(np.inf), np.float32(-np.inf))
    neighbour = np.nextafter(r, toward)
    midpoint = (r.astype(np.float64) + neighbour.astype(np.float64)) / 2 == s
    fix = midpoint & (e != 0) & np.isfinite(s)
    past = np.where(e > 0, neighbour > r, neighbour < r)  # the exact sum lies beyond s toward the neighbour
    return np.where(fix & past, neighbour, r).astype(np.float32)


def _fma64(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """x * y + z (float64 arrays) rounded once, from exact rationals (slow, for small arrays)."""
    from fractions import Fraction
    flat = [float(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))
            for a, b, c in zip(x.ravel(), y.ravel(), z.ravel(), strict=True)]
    return np.array(flat, np.float64).reshape(x.shape)


def _assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bytes, NaNs aside (their payloads are the hardware's choice): NaN exactly where want has one."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    bits = np.uint32 if got.dtype == np.float32 else np.uint64
    np.testing.assert_array_equal(np.where(nan, 0, got).view(bits), np.where(nan, 0, want).view(bits))


def _contract(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The contract's bytes for a [M, K] @ b [K, N]: per row range, a chain of single-rounding FMAs in k
    order from +0, then the partial sums added in order."""
    m, k = a.shape
    fma = _fma32 if a.dtype == np.float32 else _fma64
    total = np.zeros((m, b.shape[1]), a.dtype)
    for s in range(K_SPLIT):
        part = np.zeros_like(total)
        for kk in range(s * k // K_SPLIT, (s + 1) * k // K_SPLIT):
            part = fma(np.broadcast_to(a[:, kk:kk + 1], part.shape), np.broadcast_to(b[kk], part.shape), part)
        total = part if s == 0 else total + part
    return total


def test_the_oracle_rounds_a_fused_step_once() -> None:
    """(1 + 2^-12)^2 - (1 + 2^-11) is 2^-24 exactly: one rounding keeps it, a rounded product loses it. A
    float64 step that lands halfway between two float32 values is settled by its rounding error."""
    x = np.array([1 + 2.0**-12], np.float32)
    assert _fma32(x, x, np.array([-(1 + 2.0**-11)], np.float32))[0] == np.float32(2.0**-24)
    # 2^16 (1 + 2^-23) (1 - 2^-23) + 2^40 + 2^17 is 2^40 + 2^17 + 2^16 - 2^-30: in float64 the float32
    # midpoint 2^40 + 2^17 + 2^16, which ties to even upward; the exact sum lies below it
    got = _fma32(np.array([2.0**16 * (1 + 2.0**-23)], np.float32), np.array([1 - 2.0**-23], np.float32),
                 np.array([2.0**40 + 2.0**17], np.float32))[0]
    assert got == np.float32(2.0**40 + 2.0**17), got
    assert _fma64(np.array([1 + 2.0**-27]), np.array([1 + 2.0**-27]), np.array([-(1 + 2.0**-26)]))[0] == 2.0**-54


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, GEMV_MAX_ROWS), k=st.integers(1, 300), n=st.integers(1, 300),
       seed=st.integers(0, 2**16))
def test_f32_bytes_are_the_contracts_arithmetic(m: int, k: int, n: int, seed: int) -> None:
    """f32 at every row count (blocks of 4 and the 1-3 rows left), K below K_SPLIT and past several chunks
    of k per row range, widths below a vector, between vectors and past blocks."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    out = np.empty((m, n), np.float32)
    gemv(a, b, out)
    _assert_same_bits(out, _contract(a, b))


@pytest.mark.parametrize(("m", "k", "n"), [(16, 300, 600), (7, 33, 515), (5, 9, 3208)], ids=str)
def test_f32_bytes_across_column_tiles(m: int, k: int, n: int, rng: np.random.Generator) -> None:
    """Widths past the column tile of the row count (512 columns at 16 rows, 1600 at 5), whose last tile is
    narrower than a block (88 columns) or a vector (3, 8)."""
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    out = np.empty((m, n), np.float32)
    gemv(a, b, out)
    _assert_same_bits(out, _contract(a, b))


@settings(max_examples=8, deadline=None)
@given(m=st.integers(1, GEMV_MAX_ROWS), k=st.integers(1, 24), n=st.sampled_from([1, 7, 8, 13, 31, 33, 70]),
       seed=st.integers(0, 2**16))
def test_f64_bytes_are_the_contracts_arithmetic(m: int, k: int, n: int, seed: int) -> None:
    """f64 (8-lane vectors: blocks of 32 columns) against the exact-rational oracle."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    out = np.empty((m, n), np.float64)
    gemv(a, b, out)
    _assert_same_bits(out, _contract(a, b))


def test_gemv_serves_f32_and_f64_only() -> None:
    """The byte tests above cover every dtype gemv has a kernel for."""
    assert set(TASKS) == {np.dtype(np.float32), np.dtype(np.float64)}


def test_signed_zeros_infinities_and_nans_follow_the_fused_chain(rng: np.random.Generator) -> None:
    """-0 products summed from +0 give +0; an infinity or NaN in a weight row reaches exactly the values
    whose chain crosses it, in every loop (blocks, sweep, narrow columns)."""
    m, k, n = 7, 20, 70
    a = rng.standard_normal((m, k)).astype(np.float32)
    a[2], a[5] = -0.0, -0.0
    b = rng.standard_normal((k, n)).astype(np.float32)
    b[3, 5], b[11, 66], b[17, 20] = np.inf, np.nan, -np.inf
    out = np.empty((m, n), np.float32)
    gemv(a, b, out)
    want = _contract(a, b)
    _assert_same_bits(out, want)
    assert np.isnan(want[:, 66]).all() and np.isnan(want[[2, 5], 5]).all() and np.isinf(want[0, [5, 20]]).all()
    zeros = np.delete(out[[2, 5]], [5, 20, 66], axis=1)
    assert not zeros.any() and not np.signbit(zeros).any()


@pytest.mark.parametrize("m", [1, 3, 4, 7, 16])
def test_row_ranges_as_items_keep_the_bytes(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A narrow weight of a MB or more (one or two column tiles) runs its (tile, row range) items on the pool
    and adds their partial sums in a second job: the contract's bytes (f32, against the oracle), and the very
    bytes of one job taking whole tiles (f32 and f64), at one and two threads."""
    from fuel.cpu.prims import gemv as gemv_module
    from fuel.testing.contract import fuel_threads

    rng = np.random.default_rng(m)
    for dtype, k in ((np.float32, 1100), (np.float64, 600)):
        a = rng.standard_normal((m, k)).astype(dtype)
        b = rng.standard_normal((k, 300)).astype(dtype)
        out = np.zeros((m, 300), dtype)
        assert isinstance(gemv_module.gemv_job(a, b, out), tuple), "the split path did not run"
        got = []
        for threads in (1, 2):
            with fuel_threads(threads):
                gemv(a, b, out)
                got.append(out.copy())
        with monkeypatch.context() as patch:
            patch.setattr(gemv_module, "SPLIT_MIN_BYTES", 1 << 62)
            whole = np.zeros_like(out)
            gemv(a, b, whole)
        for g in got:
            _assert_same_bits(g, whole)
        if dtype == np.float32:
            _assert_same_bits(got[0], _contract(a, b))
