"""Integer, bool and slice indexing, and iteration, with NumPy as the reference of record."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl


def _x() -> np.ndarray:
    return np.arange(24, dtype=np.float32).reshape(2, 3, 4)


def test_iteration_stops_at_the_end_of_the_first_axis() -> None:
    x = _x()
    parts = list(fl.tensor(x))
    assert len(parts) == 2
    for got, want in zip(parts, x, strict=True):
        np.testing.assert_array_equal(got.numpy(), want)
    assert [p.shape for p in fl.tensor(x[0])] == [(4,)] * 3
    assert list(fl.tensor(np.zeros((0, 3), np.float32))) == []


def test_an_out_of_range_integer_index_is_both_a_fuel_and_an_index_error() -> None:
    t = fl.tensor(_x())
    for bad in (2, -3):
        with pytest.raises(IndexError, match=f"getitem: index {bad} is out of range for axis 0 of size 2"):
            t[bad]
    with pytest.raises(fl.AxisIndexError) as info:
        t[:, 3]
    assert isinstance(info.value, fl.FuelError) and isinstance(info.value, fl.ShapeError)


def test_a_rank_zero_tensor_is_not_iterable_and_fails_as_numpy_does() -> None:
    with pytest.raises(TypeError):
        iter(np.array(1.0, np.float32))
    with pytest.raises(fl.RankZeroError, match="iter: a rank-0 tensor cannot be iterated") as info:
        list(fl.tensor(np.float32(1.0)))
    assert isinstance(info.value, TypeError) and isinstance(info.value, fl.ShapeError)


@pytest.mark.parametrize("key", [True, False, np.True_, np.False_, (True, 0), (0, False, 1), (Ellipsis, True),
                                 (None, True, slice(1, None)), (1, True, None, 2)])
def test_a_bool_index_is_a_new_axis_as_in_numpy(key: object) -> None:
    x = _x()
    got = fl.tensor(x)[key].numpy()
    want = x[key]  # type: ignore[index]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(-4, 4), st.booleans(), st.none(),
                          st.builds(slice, st.integers(-5, 5) | st.none(), st.integers(-5, 5) | st.none(),
                                    st.integers(1, 3) | st.none())), max_size=4))
def test_basic_indexing_matches_numpy(key: list[object]) -> None:
    x = _x()
    try:
        want = x[tuple(key)]  # type: ignore[index]
    except IndexError:
        with pytest.raises(IndexError):
            fl.tensor(x)[tuple(key)]
        return
    got = fl.tensor(x)[tuple(key)].numpy()
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_len_of_a_rank_zero_tensor_is_a_type_error_as_in_numpy() -> None:
    with pytest.raises(TypeError, match="len: a rank-0 tensor has no length"):
        len(fl.tensor(np.float32(1.0)))
