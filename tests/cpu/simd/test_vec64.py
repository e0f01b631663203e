"""64-byte vectors of an array's float type (`fuel.cpu.simd.vec64`): 16 float32 lanes or 8 float64, each
operation rounded once, checked against exact rational arithmetic; other element types do not compile."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

from fuel.cpu.simd.vec64 import fma1, fmas, vadd, vload, vstore, vzero


@njit(cache=True)
def _lanes(s: Any, x: Any, y: Any, out: Any) -> None:
    """out[0:L] = y + s·x (fused), out[L:2L] = x + y, out[2L:3L] = +0, the vectors at offset 1 of x and y."""
    lanes = 64 // x.itemsize
    vstore(out, 0, fmas(s, vload(x, 1), vload(y, 1)))
    vstore(out, lanes, vadd(vload(x, 1), vload(y, 1)))
    vstore(out, 2 * lanes, vzero(x))


@njit(cache=True)
def _scalar(a: Any, b: Any, c: Any) -> Any:
    return fma1(a, b, c)


def _rounded(value: Fraction, dtype: type) -> float:
    """value rounded once to dtype: to float64 by Fraction's correct rounding, then, for float32, compared
    with its two float32 neighbours exactly."""
    if dtype is np.float64:
        return float(value)
    near = np.float32(float(value))
    lo, hi = sorted((near, np.nextafter(near, np.float32(np.inf if Fraction(float(near)) < value else -np.inf))))
    dlo, dhi = value - Fraction(float(lo)), Fraction(float(hi)) - value
    if dlo != dhi:
        return float(lo if dlo < dhi else hi)
    return float(lo if int(np.array(lo).view(np.uint32)) % 2 == 0 else hi)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: d.__name__)
def test_lanes_are_single_roundings_of_exact_values(dtype: type, rng: np.random.Generator) -> None:
    lanes = 64 // np.dtype(dtype).itemsize
    x: np.ndarray = rng.standard_normal(lanes + 1).astype(dtype)
    y: np.ndarray = (rng.standard_normal(lanes + 1) * 1e-3).astype(dtype)
    x[2], y[2] = 1 + 2.0**-12, -(1 + 2.0**-11)  # (1 + 2^-12)^2 - (1 + 2^-11) = 2^-24: kept only when fused
    s = 1 + 2.0**-12
    out: np.ndarray = np.full(3 * lanes, 7, dtype)
    _lanes(dtype(s), x, y, out)
    fx, fy = [Fraction(float(v)) for v in x[1:]], [Fraction(float(v)) for v in y[1:]]
    fused = [_rounded(Fraction(float(dtype(s))) * p + q, dtype) for p, q in zip(fx, fy, strict=True)]
    np.testing.assert_array_equal(out[:lanes], np.array(fused, dtype))
    assert out[1] == dtype(2.0**-24)
    sums = [_rounded(p + q, dtype) for p, q in zip(fx, fy, strict=True)]
    np.testing.assert_array_equal(out[lanes:2 * lanes], np.array(sums, dtype))
    assert not out[2 * lanes:].any() and not np.signbit(out[2 * lanes:]).any()
    assert _scalar(dtype(s), dtype(s), dtype(-(1 + 2.0**-11))) == dtype(2.0**-24)


def test_integer_arrays_do_not_compile() -> None:
    @njit
    def load(x: Any) -> None:
        vstore(x, 0, vload(x, 0))

    with pytest.raises(TypingError):
        load(np.zeros(16, np.int32))
