"""INDEX_SELECT in native replay (`fuel.cpu.prims.index_select`): a captured step gathers with each
call's indices, checked inside the native program; checked against torch.index_select."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl


def _python_steps(f: Any, *args: Any) -> list[Any]:
    cap = f.capture_for(*args)
    assert cap is not None and cap.native is not None
    return [item for item in cap.native.items if len(item) != 2]


@settings(max_examples=25)
@given(seed=st.integers(0, 2**32 - 1), shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       axis_pick=st.integers(0, 2), m=st.integers(1, 7), dtype=st.sampled_from([np.float32, np.float64, np.float16]),
       index_dtype=st.sampled_from([np.int64, np.uint32]))
def test_replayed_gather_matches_torch(seed: int, shape: list[int], axis_pick: int, m: int, dtype: Any,
                                       index_dtype: Any) -> None:
    """Every call of a replayed capture (all native) gathers with that call's indices, repeats included."""
    rng = np.random.default_rng(seed)
    axis = axis_pick % len(shape)
    f = fl.jit(lambda x, i: x.index_select(axis, i))
    x = rng.standard_normal(shape).astype(dtype)
    for call in range(3):
        idx = rng.integers(0, shape[axis], m).astype(index_dtype)
        got = f(x, idx).numpy()
        if call:
            assert _python_steps(f, x, idx) == []
        want = torch.index_select(torch.from_numpy(x), axis, torch.from_numpy(idx.astype(np.int64))).numpy()
        assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_a_bad_index_in_replay_is_index_out_of_range() -> None:
    """The check job finds an index past the axis in a replayed call: IndexOutOfRange with the eager
    kernel's words, and the next good call is right."""
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    f = fl.jit(lambda a, i: (a * 2.0).index_select(0, i))
    good = np.array([3, 0], np.int64)
    f(x, good)
    f(x, good)
    assert _python_steps(f, x, good) == []
    for bad, value in (([1, 4], 4), ([-1, 0], -1)):
        with pytest.raises(fl.IndexOutOfRange, match=f"index_select: index {value} is out of range for an axis of "
                                                     f"size 4"):
            f(x, np.array(bad, np.int64))
    np.testing.assert_array_equal(f(x, good).numpy(), 2 * x[[3, 0]])
