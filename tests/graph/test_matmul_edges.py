"""Matmul at the edges: zero-size dims anywhere, mixed dtypes, and their gradients (torch as oracle);
integer products of every size the decode path sees (np.matmul as oracle, exactly)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.dtype import FLOAT_DTYPES, DType

INT_DTYPES = [d for d in DType if d.is_int]  # every integer type Fuel stores (a bool array is stored as u8)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.value)
@pytest.mark.parametrize(("sa", "sb"), [
    ((0, 3, 4), (4, 2)), ((2, 3, 0), (0, 4)), ((3, 0), (0, 5)), ((0, 4), (4, 3)), ((3, 4), (4, 0)),
    ((2, 0, 4), (2, 4, 3)), ((0, 2, 3), (0, 3, 4)), ((4,), (4, 0)), ((0,), (0,)), ((2, 3, 0), (0,)),
])
def test_zero_size_matmul_gives_numpys_empty_or_zero_result(dtype: DType, sa: tuple[int, ...],
                                                             sb: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal(sa).astype(dtype.np)
    b = rng.standard_normal(sb).astype(dtype.np)
    ta, tb = fl.tensor(a), fl.tensor(b)
    y = ta @ tb
    want = torch.tensor(a.astype(np.float64)) @ torch.tensor(b.astype(np.float64))
    assert y.shape == tuple(want.shape) == np.matmul(a, b).shape
    got = y.numpy()
    assert got.dtype == dtype.np
    np.testing.assert_array_equal(got.astype(np.float64), want.numpy())
    if y.ndim:
        ga, gb = fl.grad(y, [ta, tb], grad_out=np.ones(y.shape, dtype.np))
        pa = torch.tensor(a.astype(np.float64), requires_grad=True)
        pb = torch.tensor(b.astype(np.float64), requires_grad=True)
        (pa @ pb).sum().backward()
        np.testing.assert_array_equal(ga.numpy().astype(np.float64), pa.grad.numpy())  # type: ignore[union-attr]
        np.testing.assert_array_equal(gb.numpy().astype(np.float64), pb.grad.numpy())  # type: ignore[union-attr]


def test_mixed_dtype_matmul_promotes_like_numpy() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(3, dtype=np.float64).reshape(3, 1)
    y = fl.tensor(a) @ fl.tensor(b)
    assert y.dtype is fl.f64
    np.testing.assert_array_equal(y.numpy(), a.astype(np.float64) @ b)


def _full_range(rng: np.random.Generator, shape: tuple[int, ...], dtype: DType) -> np.ndarray:
    """Values over the type's whole range, so the products and sums wrap as NumPy's do."""
    info = np.iinfo(dtype.np)
    return rng.integers(int(info.min), int(info.max), size=shape, dtype=dtype.np, endpoint=True)


# (a's shape, b's shape) for `rows` rows, K and N: 2-D, batched a over a 2-D weight, batch against batch, and
# either side broadcast over the other's batch (a [*, K, N] weight broadcast is the decode path's case).
_LAYOUTS = {
    "2d": lambda r, k, n: ((r, k), (k, n)),
    "vector": lambda r, k, n: ((k,), (k, n)),
    "batched_a": lambda r, k, n: ((2, r, k), (k, n)),
    "batched": lambda r, k, n: ((3, r, k), (3, k, n)),
    "broadcast_b": lambda r, k, n: ((3, r, k), (1, k, n)),
    "broadcast_a": lambda r, k, n: ((1, r, k), (2, k, n)),
}


@settings(max_examples=120)
@given(dtype=st.sampled_from(INT_DTYPES), rows=st.integers(1, 8), k=st.integers(1, 300), n=st.integers(1, 300),
       layout=st.sampled_from(sorted(_LAYOUTS)), expand_b=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_integer_matmul_of_few_rows_equals_numpys_exactly(dtype: DType, rows: int, k: int, n: int, layout: str,
                                                          expand_b: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sa, sb = _LAYOUTS[layout](rows, k, n)
    a, b = _full_range(rng, sa, dtype), _full_range(rng, sb, dtype)
    tb = fl.tensor(b)
    if expand_b and len(sa) == 3:  # the weight as a stride-0 broadcast over a's batch, not a matmul broadcast
        b = np.broadcast_to(b[:1], (sa[0], k, n))
        tb = fl.tensor(b[0]).broadcast_to(sa[0], k, n)
    want = np.matmul(a, b)
    got = (fl.tensor(a) @ tb).numpy()
    assert got.dtype == want.dtype == dtype.np and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=lambda d: d.value)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8])
def test_integer_matmul_replayed_into_the_arena_equals_numpys(dtype: DType, rows: int) -> None:
    rng = np.random.default_rng(rows)
    step = fl.jit(lambda x, w: (x @ w) + 1)  # the product is an intermediate: it is written into the arena
    for _ in range(3):  # the first call captures, the later ones replay
        a, b = _full_range(rng, (rows, 200), dtype), _full_range(rng, (200, 96), dtype)
        got = step(a, b).numpy()
        assert got.dtype == dtype.np
        np.testing.assert_array_equal(got, np.matmul(a, b) + 1)
