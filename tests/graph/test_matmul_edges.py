"""Matmul at the edges: zero-size dims anywhere, mixed dtypes, and their gradients (torch as oracle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fuel as fl
from fuel.dtype import FLOAT_DTYPES, DType


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
