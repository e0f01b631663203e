"""Integer, bool and slice indexing, and iteration, with NumPy as the reference of record."""

from __future__ import annotations

import re

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


_IDX = np.array([1, 0])


@pytest.mark.parametrize("key", [
    _IDX, [1, 0], (0, _IDX), (slice(None), [2, 0]), (Ellipsis, _IDX), (_IDX, Ellipsis), (None, _IDX), ((0, 1),),
    np.array([[0, 1]]), np.array([True, False]), [True, False], (0, np.array([True, False, True])),
], ids=repr)
def test_an_array_or_list_index_is_a_fuel_error_pointing_to_index_select_and_gather(key: object) -> None:
    """NumPy's advanced indexing is not basic indexing: a FuelError naming the ops that do it, never NumPy's
    own ValueError from comparing the array with `...`."""
    x = _x()
    x[key]  # type: ignore[index]  # NumPy takes it: only Fuel refuses
    with pytest.raises(fl.ShapeError, match=r"advanced indexing.*t\.index_select\(axis, idx\).*t\.gather\(axis, idx\)"):
        fl.tensor(x)[key]


@pytest.mark.parametrize("key", [np.array([True, False]), [False, True], (0, np.array([True, False, True]))], ids=repr)
def test_a_bool_mask_index_names_its_indices_for_index_select(key: object) -> None:
    with pytest.raises(fl.ShapeError, match=r"a bool mask .*np\.flatnonzero\(mask\)"):
        fl.tensor(_x())[key]


@pytest.mark.parametrize("place", ["alone", "after an int", "after a slice", "after ..."])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_index_is_a_fuel_error_pointing_to_index_select_and_gather(place: str, rank: int) -> None:
    """A Tensor index, even a one-element one, is refused at build time (using it would realise it)."""
    idx = fl.tensor(np.array([1, 0]) if rank else np.array(1))
    key = {"alone": idx, "after an int": (0, idx), "after a slice": (slice(None), idx), "after ...": (Ellipsis, idx)}
    with pytest.raises(fl.ShapeError, match=r"a Tensor index .*t\.index_select\(axis, idx\).*t\.gather"):
        fl.tensor(_x())[key[place]]


@pytest.mark.parametrize("key", [np.array(1), np.array(-1), (np.array(0), slice(1, None)), (Ellipsis, np.array(2)),
                                 np.array(True), (np.array(False), 0), (0, np.int64(1), np.array(True))], ids=repr)
def test_zero_d_integer_and_bool_arrays_index_as_numpy_scalars_do(key: object) -> None:
    x = _x()
    got = fl.tensor(x)[key].numpy()
    want = x[key]  # type: ignore[index]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("key", "what"), [(1.5, "1.5 (float)"), ("a", "'a' (str)"), ((0, 1.0), "1.0 (float)"),
                                           (np.array(1.0), "array(1.) (ndarray)")], ids=repr)
def test_any_other_index_is_a_fuel_error_naming_what_came(key: object, what: str) -> None:
    with pytest.raises(fl.ShapeError, match=re.escape(f"getitem: unsupported index {what}; an index is an integer")):
        fl.tensor(_x())[key]
