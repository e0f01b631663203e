"""clip_grad_norm against torch.nn.utils.clip_grad_norm_: the total norm, and each clipped element within
1e-6 of torch's relative to that element's unclipped gradient (clipping multiplies it by one coefficient)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.errors import DTypeError, ParamError
from fuel.optim import clip_grad_norm

shapes = st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4)


@settings(max_examples=25)
@given(shapes=shapes, max_norm=st.sampled_from([0.01, 1.0, 1e4]), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([np.float32, np.float64]))
def test_clip_grad_norm_matches_torch(shapes: list[tuple[int, ...]], max_norm: float, seed: int, dtype: type) -> None:
    rng = np.random.default_rng(seed)
    grads = [np.asarray(rng.standard_normal(s) * 10.0 ** rng.integers(-3, 3), dtype) for s in shapes]
    clipped, total = clip_grad_norm([fl.tensor(g) for g in grads], max_norm)
    got = fl.realize(total, *clipped)
    ts = [torch.zeros(g.shape, dtype=torch.from_numpy(g).dtype, requires_grad=True) for g in grads]
    for t, g in zip(ts, grads, strict=True):
        t.grad = torch.from_numpy(g.copy())
    want_total = float(torch.nn.utils.clip_grad_norm_(ts, max_norm, foreach=False))
    tol = 1e-6 if dtype is np.float32 else 1e-13
    assert float(got[0].numpy()) == pytest.approx(want_total, rel=tol)
    for c, t, g in zip(got[1:], ts, grads, strict=True):
        assert t.grad is not None
        err = np.abs(c.numpy().astype(np.float64) - t.grad.numpy()) / np.maximum(np.abs(g.astype(np.float64)), 1e-300)
        assert (err <= tol).all()


def test_none_gradients_stay_none_and_zero_gradients_are_finite() -> None:
    clipped, total = clip_grad_norm([None, fl.tensor(np.zeros(3, np.float32))], 1.0)
    assert clipped[0] is None
    assert clipped[1] is not None
    np.testing.assert_array_equal(clipped[1].numpy(), np.zeros(3, np.float32))
    assert float(total.numpy()) == 0.0


@pytest.mark.parametrize(("grads", "max_norm", "error", "message"), [
    ([np.ones(2, np.float32)], 0.0, ParamError, "clip_grad_norm: max_norm must be a finite number > 0, got 0.0"),
    ([np.ones(2, np.float32)], -1.0, ParamError, "clip_grad_norm: max_norm must be a finite number > 0, got -1.0"),
    ([None], 1.0, ParamError, r"clip_grad_norm: grads has no gradient \(every entry is None\)"),
    ([np.ones(2, np.int64)], 1.0, DTypeError, r"clip_grad_norm: grads\[0\] must be a float Tensor, got i64"),
])
def test_bad_clip_arguments(grads: list[np.ndarray | None], max_norm: float, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        clip_grad_norm([None if g is None else fl.tensor(g) for g in grads], max_norm)
