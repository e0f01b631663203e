"""fl.assign (an in-place copy, torch's `copy_` with equal shapes and dtypes) and the effects of an
fl.jit trace: destructive ops run at every call even when no output reads them."""

import numpy as np
import pytest

import fuel as fl


def test_assign_writes_the_targets_memory_after_its_other_readers() -> None:
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    before = w.copy()
    t = fl.tensor(w)
    read_before = t * 2.0
    out = fl.assign(t, t + 1.0)
    fl.realize(read_before, out)
    np.testing.assert_array_equal(w, before + 1.0)
    np.testing.assert_array_equal(read_before.numpy(), before * 2.0)  # ran before the write
    assert np.shares_memory(out.numpy(), w)


def test_assign_scalar_target() -> None:
    s = np.zeros((), np.float64)
    fl.assign(fl.tensor(s), fl.tensor(s) + 2.5).realize()
    assert s == 2.5


@pytest.mark.parametrize(("value", "message"), [
    (np.zeros((3, 2), np.float32), r"assign: value is \[3, 2\], the target is \[2, 3\]"),
    (np.zeros((2, 3), np.float64), "assign: value is f64, the target is f32"),
])
def test_assign_refuses_a_mismatch(value: np.ndarray, message: str) -> None:
    with pytest.raises(fl.FuelError, match=message):
        fl.assign(fl.tensor(np.zeros((2, 3), np.float32)), fl.tensor(value))


def test_assign_refuses_a_lazy_target() -> None:
    t = fl.tensor(np.zeros(3, np.float32)) + 1.0
    with pytest.raises(fl.ParamError, match="assign: the target must be a realised tensor"):
        fl.assign(t, t)


def test_jit_runs_unread_writes_at_every_call() -> None:
    """An SGD step on least squares: fn returns only the loss, its updates are effects. Checked against the
    same steps in float64 NumPy."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    total = np.zeros((), np.float32)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    y = rng.standard_normal((5, 3)).astype(np.float32)

    def step(xs: fl.Tensor, ys: fl.Tensor) -> fl.Tensor:
        tw, tt = fl.tensor(w), fl.tensor(total)
        err = fl.matmul(xs, tw.transpose(0, 1)) - ys
        loss = (err * err).mean()
        (g,) = fl.grad(loss, [tw])
        fl.assign(tw, tw - g * 0.1)
        fl.assign(tt, tt + loss)
        return loss

    f = fl.jit(step)
    w64, total64 = w.astype(np.float64), 0.0
    for _ in range(4):
        loss = float(f(x, y).numpy())
        err = x @ w64.T - y
        want = float((err * err).mean())
        w64 = w64 - 0.1 * (2.0 / err.size) * err.T @ x
        total64 += want
        assert loss == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(w, w64, rtol=1e-5, atol=1e-6)
    assert total == pytest.approx(total64, rel=1e-5)
