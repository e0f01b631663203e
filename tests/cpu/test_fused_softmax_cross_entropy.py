"""The cross-entropy gradient's bytes do not depend on where the buffer pool puts its output: an output just
past the logits once took the vectoriser's scalar fallback in the loop that stores and sums each row's
exponentials, which summed them in another order."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from fuel.cpu.fused_softmax_cross_entropy import cross_entropy_grad
from fuel.dtype import DType
from fuel.graph.registry.fused_softmax_cross_entropy import FusedSoftmaxCrossEntropyParams
from fuel.testing.oracle import assert_close_rowwise
from fuel.testing.placement import GAPS, Placement, pool_placed

DTYPES = [DType.F32, DType.F64, DType.F16, DType.BF16]


@given(dt=st.sampled_from(DTYPES), rows=st.integers(1, 3), v=st.integers(2, 40), seed=st.integers(0, 2**16),
       reduction=st.sampled_from(["mean", "sum"]))
def test_the_gradient_ignores_where_the_pool_puts_it(dt: DType, rows: int, v: int, seed: int,
                                                     reduction: str) -> None:
    """Small rows (the loop's distance check spans 128 f32 or 256 f64 bytes) with the output 0-256 bytes
    past the logits, and far from them: one set of bytes, within the gradient's rounding of torch."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, v)) * 3).astype(dt.np)
    t = rng.integers(0, v, rows)
    g = np.asarray(0.7, np.float32)
    params = FusedSoftmaxCrossEntropyParams(ignore_index=-100, reduction=reduction)
    got = set()
    for gap in (*GAPS, 4096):
        layout = Placement(gap, "after", 1 << 16)
        placed = layout.caller(x)
        with pool_placed(layout):
            out = cross_entropy_grad([placed, t, g], params)
        assert layout.taken  # the output came from the pool, right after the logits
        got.add(out.tobytes())
    assert len(got) == 1
    x64 = torch.tensor(x.astype(np.float64), requires_grad=True)
    (F.cross_entropy(x64, torch.from_numpy(t), reduction=reduction) * float(g)).backward()
    assert x64.grad is not None
    assert_close_rowwise(np.frombuffer(got.pop(), dt.np).reshape(x.shape), x64.grad.numpy(), dt, backward=True)


@given(dt=st.sampled_from(DTYPES), rows=st.integers(1, 3), v=st.integers(2, 40), seed=st.integers(0, 2**16))
def test_the_gradient_goes_into_a_given_buffer(dt: DType, rows: int, v: int, seed: int) -> None:
    """A capture hands its arena buffer (`out`): the gradient is written there, no second logits-sized
    array is made, and its bytes are those of a fresh output; an `out` of another layout is left alone."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, v)) * 3).astype(dt.np)
    t = rng.integers(0, v, rows)
    g = np.asarray(0.7, np.float32)
    params = FusedSoftmaxCrossEntropyParams(ignore_index=-100, reduction="mean")
    fresh = cross_entropy_grad([x, t, g], params)
    out = np.full(x.shape, np.nan, dt.np)
    assert cross_entropy_grad([x, t, g], params, out) is out and out.tobytes() == fresh.tobytes()
    wrong = np.full((rows, 2 * v), np.nan, dt.np)[:, ::2]  # not contiguous: a fresh array instead
    got = cross_entropy_grad([x, t, g], params, wrong)
    assert got is not wrong and got.tobytes() == fresh.tobytes() and np.isnan(wrong.astype(np.float32)).all()
