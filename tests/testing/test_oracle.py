"""The checkers themselves: a wrong output (one zeroed element, a NaN, a wrong-signed inf, an element
4x off its bound) fails every checker, and the true output passes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from fuel.cpu.norms.softmax_last_dim import SOFTMAX_PRECISION
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.testing.check import nonfinite_mismatch, row_max_scale
from fuel.testing.contract import precision_excess
from fuel.testing.oracle import CONTRACTION, ROWWISE, assert_close_contraction, assert_close_rowwise

Checker = Callable[[np.ndarray, np.ndarray], None]


def _softmax_case(dt: DType, shape: tuple[int, ...] = (3, 1000)) -> tuple[np.ndarray, np.ndarray]:
    """(kernel-like output rounded once to dt, float64 torch reference) for a softmax of randn·3."""
    x = (np.random.default_rng(0).standard_normal(shape) * 3).astype(dt.np)
    ref = torch.softmax(torch.from_numpy(x.astype(np.float64)), -1).numpy()
    return ref.astype(dt.np), ref


def _rowwise(dt: DType) -> Checker:
    return lambda out, ref: assert_close_rowwise(out, ref, dt)


def _contract(dt: DType) -> Checker:
    def check(out: np.ndarray, ref: np.ndarray) -> None:
        assert precision_excess(out, ref, SOFTMAX_PRECISION[dt]) <= 1.0

    return check


def _contraction(dt: DType) -> Checker:
    return lambda out, ref: assert_close_contraction(out, ref, row_max_scale(ref), dt)


CHECKERS = [("rowwise", _rowwise), ("contract", _contract), ("contraction", _contraction)]


def _fails(check: Checker, out: np.ndarray, ref: np.ndarray) -> bool:
    try:
        check(out, ref)
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)
@pytest.mark.parametrize(("name", "make"), CHECKERS, ids=[c[0] for c in CHECKERS])
def test_every_checker_passes_the_truth_and_fails_each_corruption(dt: DType, name: str,
                                                                   make: Callable[[DType], Checker]) -> None:
    check = make(dt)
    out, ref = _softmax_case(dt)
    check(out, ref)
    big = np.unravel_index(np.argmax(ref), ref.shape)
    corruptions = {"zeroed": 0.0, "NaN": np.nan, "-inf": -np.inf, "+inf": np.inf}
    for label, value in corruptions.items():
        bad = out.copy()
        bad[big] = value
        assert _fails(check, bad, ref), f"{name} passed an output with one {label} element"


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)
def test_an_element_four_times_its_bound_fails_and_half_passes(dt: DType) -> None:
    _, ref = _softmax_case(dt, (4, 50))
    row = np.max(np.abs(ref), -1, keepdims=True)
    rtol, atol = ROWWISE[dt]
    p = SOFTMAX_PRECISION[dt]
    s = row_max_scale(ref)
    # Each checker with the allowed |err| it documents, written out independently of the checker.
    checks: list[tuple[Checker, np.ndarray]] = [
        (_rowwise(dt), rtol * np.abs(ref) + atol * row),
        (_contract(dt), p.max_relative * np.abs(ref) + p.max_absolute * row),
        (_contraction(dt), CONTRACTION[dt.acc][0] * s + CONTRACTION[dt][1] * np.abs(ref)),
    ]
    for check, allowed in checks:
        for idx in [(0, 0), (1, int(np.argmin(ref[1]))), (3, int(np.argmax(ref[3])))]:
            for k in (4.0, -4.0):
                out = ref.copy()  # float64, so the perturbation is not rounded away
                out[idx] += k * allowed[idx]
                assert _fails(check, out, ref), (idx, k)
                out[idx] = ref[idx] + k / 8 * allowed[idx]
                check(out, ref)


def test_a_bf16_softmax_with_most_elements_zeroed_fails() -> None:
    out, ref = _softmax_case(DType.BF16)
    zeroed = out.copy()
    # Every element the old whole-tensor scale allowed to be 0: most of them.
    atol = ROWWISE[DType.BF16][1]
    zeroed[ref < 0.99 * atol * np.max(ref)] = 0
    assert (zeroed == 0).mean() > 0.9
    assert_close_rowwise(zeroed, ref, DType.BF16, scale=np.full(ref.shape, np.max(ref)))
    with pytest.raises(AssertionError, match="elements off"):
        assert_close_rowwise(zeroed, ref, DType.BF16)
    with pytest.raises(AssertionError, match="elements off"):
        assert_close_rowwise(zeroed, ref, DType.BF16, scale=np.abs(ref))
    assert precision_excess(zeroed, ref, SOFTMAX_PRECISION[DType.BF16]) > 1.0


def test_a_small_row_is_judged_by_its_own_scale() -> None:
    ref = np.array([[1000.0, 2000.0, 3000.0], [1e-3, 2e-3, 3e-3]])
    out = ref.copy()
    out[1] = 0.0
    assert_close_rowwise(out, ref, DType.F32, scale=np.full(ref.shape, 3000.0))
    with pytest.raises(AssertionError):
        assert_close_rowwise(out, ref, DType.F32)
    assert_close_rowwise(out, ref, DType.F32, axis=0)  # down the columns the large values dominate
    with pytest.raises(AssertionError):
        assert_close_rowwise(out.T, ref.T, DType.F32, axis=0)


def test_nonfinite_values_must_match_exactly() -> None:
    ref = np.array([1.0, np.inf, -np.inf, np.nan])
    assert nonfinite_mismatch(ref, ref) is None
    assert "NaN" in str(nonfinite_mismatch(np.array([1.0, np.inf, -np.inf, 0.0]), ref))
    assert "NaN" in str(nonfinite_mismatch(np.array([np.nan, np.inf, -np.inf, np.nan]), ref))
    assert "infinities" in str(nonfinite_mismatch(np.array([1.0, -np.inf, -np.inf, np.nan]), ref))
    assert "infinities" in str(nonfinite_mismatch(np.array([1.0, 5.0, -np.inf, np.nan]), ref))
    assert "infinities" in str(nonfinite_mismatch(np.array([np.inf, np.inf, -np.inf, np.nan]), ref))


def test_contraction_compares_nonfinite_positions_not_just_their_presence() -> None:
    ref = np.array([np.inf, 1.0, 2.0])
    s = np.abs(ref)
    assert_close_contraction(ref.copy(), ref, s, DType.F32)
    for bad in ([1.0, np.inf, 2.0], [-np.inf, 1.0, 2.0], [np.inf, np.nan, 2.0], [np.inf, 1.0, np.inf]):
        with pytest.raises(AssertionError):
            assert_close_contraction(np.array(bad), ref, s, DType.F32)


def test_a_reference_past_the_formats_range_is_the_infinity_it_stores() -> None:
    """f16 stores -88344.9 as -inf (its largest finite value is 65504): an f16 kernel's -inf there is the
    correctly rounded answer, and a finite answer is not; bf16 and float64 keep it finite."""
    ref = np.array([[-88344.9, 1.0, 65519.0, 65520.0]])
    assert_close_rowwise(np.array([[-np.inf, 1.0, 65504.0, np.inf]], np.float16), ref, DType.F16)
    with pytest.raises(AssertionError, match="infinities differ"):
        assert_close_rowwise(np.array([[65504.0, 1.0, 65504.0, np.inf]], np.float16), ref, DType.F16)
    with pytest.raises(AssertionError, match="infinities differ"):
        assert_close_rowwise(np.array([[-np.inf, 1.0, 1.0, 1.0]], np.float64), ref, DType.F64)
