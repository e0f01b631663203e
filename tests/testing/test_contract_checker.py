"""`verify_impl` itself: it fails wrong outputs and thread-dependent kernels, and uses each entry's scale."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import pytest
import torch

import fuel as fl
from fuel.dispatch.impls import BackendImpl
from fuel.dtype import DType
from fuel.graph.registry import FusedOps, default_registry
from fuel.graph.registry.fused_linear import FusedLinearParams
from fuel.testing.contract import precision_excess, verify_impl
from fuel.testing.measure import measure_impl
from fuel.testing.reference import reference, scale

SOFTMAX = default_registry().entry(FusedOps.SOFTMAX_LAST_DIM)


def _impl(dt: DType) -> BackendImpl:
    impl = fl.kernels().lookup(FusedOps.SOFTMAX_LAST_DIM, "cpu", (dt, dt))
    assert impl is not None
    return impl


def _with_kernel(impl: BackendImpl, kernel: Any) -> BackendImpl:
    return dataclasses.replace(impl, kernel=kernel)


def test_the_real_impl_passes() -> None:
    assert verify_impl(SOFTMAX, _impl(DType.BF16)).ok


def test_an_impl_that_zeroes_small_elements_fails() -> None:
    impl = _impl(DType.BF16)

    def zero_small(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
        impl.kernel(inputs, out, params)
        if out.size:
            out[out.astype(np.float64) < 0.01 * out.astype(np.float64).max(-1, keepdims=True)] = 0

    result = verify_impl(SOFTMAX, _with_kernel(impl, zero_small))
    assert not result.ok and result.worst > 1.0 and not result.error


def test_an_impl_whose_bytes_depend_on_the_thread_count_is_not_bit_stable() -> None:
    impl = _impl(DType.F64)

    def by_threads(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
        impl.kernel(inputs, out, params)
        if out.size and fl.get_num_threads() == 1:
            out.flat[0] = np.nextafter(out.flat[0], np.inf)  # one ulp: well inside the precision bound

    before = fl.get_num_threads()
    result = verify_impl(SOFTMAX, _with_kernel(impl, by_threads))
    assert fl.get_num_threads() == before
    assert result.worst <= 1.0 and not result.bit_stable and "1 thread(s)" in result.unstable


def test_an_impl_whose_bytes_change_between_calls_is_not_bit_stable() -> None:
    impl = _impl(DType.F64)
    calls = itertools.count()

    def drifting(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
        impl.kernel(inputs, out, params)
        if out.size and next(calls) % 5 == 4:
            out.flat[0] = np.nextafter(out.flat[0], np.inf)

    result = verify_impl(SOFTMAX, _with_kernel(impl, drifting))
    assert not result.bit_stable and "between calls" in result.unstable


def test_fewer_repeats_still_catch_a_second_call_that_differs() -> None:
    impl = _impl(DType.F64)
    calls = itertools.count()

    def second_differs(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
        impl.kernel(inputs, out, params)
        if out.size and next(calls) == 1:
            out.flat[0] = np.nextafter(out.flat[0], np.inf)

    result = verify_impl(SOFTMAX, _with_kernel(impl, second_differs), repeats=2)
    assert not result.bit_stable and "between calls" in result.unstable
    with pytest.raises(fl.ParamError, match=r"verify_impl: repeats must be at least 1 \(the call measured\), got 0"):
        verify_impl(SOFTMAX, impl, repeats=0)


def test_fused_linear_is_scaled_per_element_by_the_sum_of_absolute_terms() -> None:
    rng = np.random.default_rng(2)
    a, b, bias = rng.standard_normal((4, 30)), rng.standard_normal((30, 6)), rng.standard_normal(6)
    b[:, 0] *= 1e-6  # one output column far smaller than the rest of its row
    bias[0] *= 1e-6
    ref = reference("FusedLinear", [a, b, bias], FusedLinearParams())
    s = scale("FusedLinear", [a, b, bias], FusedLinearParams(), ref)
    ta, tb, tbias = (torch.from_numpy(x).abs() for x in (a, b, bias))
    np.testing.assert_allclose(s, (ta @ tb + tbias).numpy(), rtol=1e-14)
    p = fl.kernels().lookup(FusedOps.FUSED_LINEAR, "cpu", (DType.F32,) * 4).precision  # type: ignore[union-attr]
    wrong = ref.copy()
    wrong[:, 0] += 1e-7 * np.abs(ref).max(-1)  # tiny against the row, huge against column 0's own terms
    assert precision_excess(wrong, ref, p) <= 1.0  # a row scale would let it through
    assert precision_excess(wrong, ref, p, s) > 1.0


def test_measure_reports_what_the_bound_is_set_from() -> None:
    entry = default_registry().entry(FusedOps.ROPE)
    impl = fl.kernels().lookup(FusedOps.ROPE, "cpu", (DType.BF16,) * 4)
    assert impl is not None
    m = measure_impl(entry, impl, range(2))
    assert m.worst_relative >= 2.0**-9  # at least bf16's unit roundoff
    rel, abs_ = m.suggested()
    assert rel >= 2 * m.worst_relative and abs_ >= 2 * m.absolute_needed
    assert impl.precision.max_relative is not None and impl.precision.max_relative >= m.worst_relative
