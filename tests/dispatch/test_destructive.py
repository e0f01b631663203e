"""What the executor guarantees around ops that overwrite an input (InplaceAffine, the KV-cache write):
readers in the same graph run first, and no graph can read a buffer after it was overwritten behind its
back: a reader built before the write, or one that also needs the op's result, is refused (StaleInput)."""

from __future__ import annotations

import numpy as np
import pytest

import fuel as fl


def test_a_reader_built_before_an_in_place_write_is_refused_afterwards() -> None:
    arr = np.arange(4, dtype=np.float32)
    x = fl.tensor(arr)
    doubled = x * 2.0                       # built on x's old contents, not realised yet
    fl.realize(fl.ops.inplace_affine(x, 3.0, 1.0))
    np.testing.assert_array_equal(arr, np.arange(4) * 3 + 1)
    with pytest.raises(fl.StaleInput, match="overwritten"):
        doubled.numpy()
    np.testing.assert_array_equal((x * 2.0).numpy(), (np.arange(4) * 3 + 1) * 2)  # built afterwards: new values


def test_a_reader_realised_with_the_write_sees_the_old_values() -> None:
    arr = np.ones(3, np.float32)
    x = fl.tensor(arr)
    before, after = fl.realize(x * 5.0, fl.ops.inplace_affine(x, 2.0, 0.0))
    np.testing.assert_array_equal(before.numpy(), np.full(3, 5.0))
    np.testing.assert_array_equal(after.numpy(), np.full(3, 2.0))
    assert np.shares_memory(after.numpy(), arr)
    np.testing.assert_array_equal(before.numpy(), np.full(3, 5.0))  # realised values stay valid


def test_a_node_needing_the_input_after_it_is_overwritten_is_refused() -> None:
    x = fl.tensor(np.ones(3, np.float32))
    y = fl.ops.inplace_affine(x, 2.0, 1.0)
    with pytest.raises(fl.StaleInput, match="overwrites in place"):
        fl.realize(y + x)          # y + x would need x's old value after the write
    with pytest.raises(fl.StaleInput):
        fl.realize(y * x.reshape(3))  # through a view of x too


def test_an_in_place_write_through_a_view_orders_readers_of_the_base() -> None:
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = fl.tensor(arr)
    total = x.sum()                                          # reads the base
    written = fl.ops.inplace_affine(x.reshape(6), 1.0, 10.0)  # writes through a view
    s, w = fl.realize(total, written)
    assert s.item() == 15.0
    np.testing.assert_array_equal(w.numpy(), np.arange(6) + 10.0)


def test_the_kv_cache_write_is_guarded_the_same_way() -> None:
    cache = fl.tensor(np.zeros((1, 4, 2), np.float32))
    peek = cache.sum()
    fl.realize(fl.cache_write(cache, np.ones((1, 1, 2), np.float32), 1))
    with pytest.raises(fl.StaleInput):
        peek.item()
    assert cache.sum().item() == 2.0


def test_two_in_place_writes_of_one_buffer_must_be_chained() -> None:
    arr = np.ones(2, np.float32)
    x = fl.tensor(arr)
    with pytest.raises(fl.StaleInput, match="both overwrite"):
        fl.realize(fl.ops.inplace_affine(x, 2.0, 0.0), fl.ops.inplace_affine(x, 3.0, 0.0))
    np.testing.assert_array_equal(arr, np.ones(2))  # refused before anything ran
    chained = fl.ops.inplace_affine(fl.ops.inplace_affine(x, 2.0, 0.0), 3.0, 0.0)
    np.testing.assert_array_equal(chained.numpy(), np.full(2, 6.0))
