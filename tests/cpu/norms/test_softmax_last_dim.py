"""Softmax's bytes do not depend on where its output lies: an output just past its input (as a buffer pool
hands out) once took the vectoriser's scalar fallback, which summed the row in another order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fuel as fl
from fuel.dtype import DType
from fuel.graph.registry.softmax_last_dim import SoftmaxLastDimParams
from fuel.testing.oracle import assert_close_rowwise


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shape", [(3, 16), (2, 100), (4, 33)])
def test_the_output_placement_changes_no_byte(shape: tuple[int, int], seed: int) -> None:
    impl = next(i for i in fl.kernels().impls(1) if i.dtypes[0] == DType.F32)
    y = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    n = y.size
    got = set()
    for gap in range(-n - 40, 80, 3):  # out before x, right after it, and far from it (never overlapping)
        buf = np.zeros(4 * n + 400, np.float32)
        start = 2 * n + 200
        x = buf[start:start + n].reshape(shape)
        x[:] = y
        at = start + n + gap if gap >= 0 else start + gap - n
        out = buf[at:at + n].reshape(shape)
        impl.kernel([x], out, SoftmaxLastDimParams())
        got.add(out.tobytes())
    assert len(got) == 1
    want = torch.softmax(torch.from_numpy(y.astype(np.float64)), -1).numpy()
    assert_close_rowwise(np.frombuffer(got.pop(), np.float32).reshape(shape), want, DType.F32)
