"""InplaceAffine's live pattern: `fl.assign(x, x * mul + add)` (and `x * mul`, `x + add`) runs as the in-place
kernel, by `fuel.trace()`, eager and in a captured training step; x's own memory holds torch's float64
result rounded once to x's dtype. Other writes stay a CACHE_WRITE."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.graph.node import Op
from fuel.graph.passes.fuse import fuse
from fuel.graph.registry import FusedOps, default_registry
from fuel.graph.registry.inplace_affine import InplaceAffineParams

FUSED = "InplaceAffine["
TORCH = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16}


def _ran(*tensors: fl.Tensor) -> set[str]:
    with fl.trace() as tr:
        fl.realize(*tensors)
    return {r.impl for r in tr.records}


def _torch_affine(x: np.ndarray, mul: float, add: float) -> np.ndarray:
    out = torch.tensor(x.astype(np.float64)) * mul + add
    return out.to(TORCH[x.dtype.name]).numpy()


@settings(max_examples=20)
@given(st.lists(st.integers(1, 6), min_size=0, max_size=3), st.sampled_from(["float32", "float64", "float16"]),
       st.floats(-4, 4), st.floats(-4, 4), st.sampled_from(["affine", "scale", "shift"]), st.integers(0, 2**31))
def test_assign_of_an_affine_update_runs_in_place(shape: list[int], dt: str, mul: float, add: float,
                                                  spelling: str, seed: int) -> None:
    w = np.asarray(np.random.default_rng(seed).standard_normal(shape) * 3, dtype=dt)
    before = w.copy()
    t = fl.tensor(w)
    value = {"affine": t * mul + add, "scale": t * mul, "shift": t + add}[spelling]
    mul, add = (mul, 0.0) if spelling == "scale" else (1.0, add) if spelling == "shift" else (mul, add)
    if dt != "float64":  # the spelling's primitives compute in f32 with the scalars rounded to it
        mul, add = float(np.float32(mul)), float(np.float32(add))
    out = fl.assign(t, value)
    (root,) = fuse([out.node], default_registry())
    assert root.op is Op.FUSED and root.arg == (FusedOps.INPLACE_AFFINE, InplaceAffineParams(mul, add))
    assert any(i.startswith(FUSED) for i in _ran(out)), "InplaceAffine did not run"
    np.testing.assert_array_equal(w, _torch_affine(before, mul, add))
    assert np.shares_memory(out.numpy(), w)


def test_captured_training_step_decays_in_place() -> None:
    """SGD with momentum on least squares, written with fl.assign: the momentum decay `m * 0.9` and the
    weight decay `w * (1 - lr·wd)` run as InplaceAffine at every replay; against torch's same steps."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    m = np.zeros((3, 4), np.float32)
    x, y = rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    lr, wd = 0.05, 0.1

    def step(xs: fl.Tensor, ys: fl.Tensor) -> fl.Tensor:
        tw, tm = fl.tensor(w), fl.tensor(m)
        err = xs @ tw.transpose(0, 1) - ys
        loss = (err * err).mean()
        (g,) = fl.grad(loss, [tw])
        fl.assign(tm, tm * 0.9)
        fl.assign(tw, tw * (1.0 - lr * wd))
        return (loss + (g * 0.0).sum()).reshape(1)  # g is read before either write

    f = fl.jit(step)
    tw = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    tm = torch.zeros((3, 4), dtype=torch.float64)
    for _ in range(3):
        with fl.trace() as tr:
            loss = float(f(x, y).numpy()[0])
        assert sum(r.impl.startswith(FUSED) for r in tr.records) == 2, [r.impl for r in tr.records]
        err = torch.tensor(x, dtype=torch.float64) @ tw.T - torch.tensor(y, dtype=torch.float64)
        want = (err * err).mean()
        assert loss == pytest.approx(float(want.detach()), rel=1e-5)
        with torch.no_grad():
            tm.mul_(0.9)
            tw.mul_(1.0 - lr * wd)
    np.testing.assert_allclose(w, tw.detach().numpy(), rtol=1e-6)
    np.testing.assert_array_equal(m, tm.numpy().astype(np.float32))


def test_other_writes_stay_primitive() -> None:
    rng = np.random.default_rng(2)
    w, v = rng.standard_normal((2, 5)).astype(np.float32), rng.standard_normal((2, 5)).astype(np.float32)
    scale = rng.standard_normal((2, 5)).astype(np.float32)
    tw, tv = fl.tensor(w.copy()), fl.tensor(v.copy())
    cases = {
        "another target": fl.assign(tv, tw * 2.0 + 1.0),           # writes v from w
        "a tensor factor": fl.assign(tw, tw * fl.tensor(scale) + 1.0),  # not a scalar affine map
    }
    for what, out in cases.items():
        (root,) = fuse([out.node], default_registry())
        assert root.op is Op.CACHE_WRITE, what
    assert not any(i.startswith(FUSED) for i in _ran(*cases.values()))
    np.testing.assert_array_equal(tv.numpy(), _torch_affine(w, 2.0, 0.0) + np.float32(1.0))


def test_a_value_read_elsewhere_stays_primitive() -> None:
    """The new value is also an output: fusing would compute it twice (once in place, once kept)."""
    w = np.random.default_rng(3).standard_normal((4, 3)).astype(np.float32)
    before = w.copy()
    t = fl.tensor(w)
    value = t * 0.5 + 2.0
    out = fl.assign(t, value)
    assert not any(i.startswith(FUSED) for i in _ran(out, value))
    want = (torch.tensor(before) * 0.5 + 2.0).numpy()  # float32, rounded after each op as the spelling is
    np.testing.assert_array_equal(w, want)
    np.testing.assert_array_equal(value.numpy(), want)
