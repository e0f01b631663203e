"""The ERF primitive against torch's float64 erf (the oracle, rounded to each dtype): every dtype,
special values, layouts, `fl.jit` arenas, and its gradient against torch autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.node import Op
from fuel.runtime import threads
from fuel.testing.check import ulp_error

# |fuel - erf| / ulp(erf) at most: f32 is the rounding of a 2.6e-9-relative f64 value (0.55 ulp measured);
# bf16/f16 round that f32 once more; f64 is libm's erf, torch's another implementation.
ULPS = {DType.F32: 0.6, DType.F64: 2.0, DType.BF16: 1.0, DType.F16: 1.0}
SPECIAL = [0.0, -0.0, 1e-30, -1e-38, 1e-45, 0.25, -0.5, 1.0, 2.0, 3.0, 3.9, -3.92, 4.0, 4.5, -6.0, 30.0, 1e30,
           np.inf, -np.inf, np.nan]


def oracle(x: np.ndarray, dt: DType) -> np.ndarray:
    """torch's float64 erf of the values fuel sees (x already in dt)."""
    return torch.erf(torch.from_numpy(np.asarray(x, np.float64))).numpy()


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)
def test_matches_torch_float64(dt: DType) -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(20000) * 2, rng.uniform(-5, 5, 20000), np.array(SPECIAL)])
    with np.errstate(over="ignore"):  # 1e30 is inf in f16
        xd = x.astype(dt.np)
    got = fl.tensor(xd).erf().numpy()
    assert got.dtype == dt.np and got.shape == x.shape
    assert ulp_error(got, oracle(xd, dt), dt) <= ULPS[dt]


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)
def test_special_values(dt: DType) -> None:
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 4.0, -1e4], dt.np)
    got = np.asarray(fl.tensor(x).erf().numpy(), np.float64)
    assert np.signbit(got[1]) and not np.signbit(got[0]) and got[0] == 0 and got[1] == 0
    assert got[2] == 1 and got[3] == -1 and np.isnan(got[4]) and got[6] == -1
    assert got[5] == (1.0 if dt is not DType.F64 else oracle(np.array([4.0]), dt)[0])


def test_layouts_and_sizes() -> None:
    rng = np.random.default_rng(1)
    base = rng.standard_normal((5, 7)).astype(np.float32)
    for x in (base.T, base[:, ::2], np.broadcast_to(base[:1], (4, 7)), base[:0], np.float32(0.75)):
        got = fl.tensor(x).erf().numpy()
        assert got.shape == np.shape(x)
        assert ulp_error(got, oracle(np.asarray(x), DType.F32), DType.F32) <= ULPS[DType.F32]
    assert fl.tensor(base).erf().node.op is Op.ERF


def test_input_not_mutated_and_jit_replays() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    keep = x.copy()
    f = fl.jit(lambda t: (t * 2.0).erf() + 1.0)
    first = f(x).numpy().copy()
    y = rng.standard_normal((3, 64)).astype(np.float32)
    second = f(y).numpy()
    np.testing.assert_array_equal(x, keep)
    np.testing.assert_array_equal(first, fl.tensor(x * 2).erf().numpy() + np.float32(1))
    np.testing.assert_array_equal(second, fl.tensor(y * 2).erf().numpy() + np.float32(1))


def test_integer_input_is_an_error() -> None:
    with pytest.raises(fl.DTypeError, match="erf: needs a float input, got i64"):
        fl.tensor(np.arange(3)).erf()


@pytest.mark.parametrize(("x", "out"), [
    (np.ones(40000, np.float16), np.zeros(40000, np.float16)),  # past one piece: the task would read f16 as f32
    (np.ones(40000, np.int64), np.zeros(40000, np.int64)),
    (np.ones(8, np.float32), np.zeros(8, np.float64)),
    (np.ones(8, np.float32), np.zeros(4, np.float32)),
    (np.ones((8, 2), np.float32), np.zeros((2, 8), np.float32).T),
], ids=["f16", "i64", "f32-into-f64", "short-out", "strided-out"])
def test_the_kernel_refuses_what_it_would_read_as_the_wrong_type(x: np.ndarray, out: np.ndarray) -> None:
    from fuel.cpu.prims.erf import erf_into

    keep = out.copy()
    with pytest.raises(fl.KernelError, match=rf"erf: has a kernel for x and out both float32 or both float64 .*"
                                            rf"got x {x.dtype} \[.*\] and out {out.dtype}"):
        erf_into(x, out)
    np.testing.assert_array_equal(out, keep)


def test_gradient_matches_torch_autograd() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 9)) * 2
    w = rng.standard_normal((4, 9))
    t = fl.tensor(x)
    (g,) = fl.grad((t.erf() * fl.tensor(w)).sum(), [t])
    tx = torch.tensor(x, requires_grad=True)
    (torch.erf(tx) * torch.from_numpy(w)).sum().backward()
    assert tx.grad is not None
    np.testing.assert_allclose(g.numpy(), tx.grad.numpy(), rtol=1e-14, atol=1e-300)


@settings(max_examples=200, deadline=None)
@given(v=st.floats(width=32, allow_nan=True, allow_infinity=True))
def test_property_any_f32(v: float) -> None:
    x = np.array([v], np.float32)
    assert ulp_error(fl.tensor(x).erf().numpy(), oracle(x, DType.F32), DType.F32) <= ULPS[DType.F32]


@pytest.mark.parametrize("dt", [DType.F32, DType.F64], ids=lambda d: d.value)
def test_same_bytes_at_one_and_two_threads(dt: DType) -> None:
    """Large arrays run on the spinning pool in parts; each value is computed alone, whatever the cut."""
    x = np.random.default_rng(5).standard_normal(300_001).astype(dt.np) * 3
    before, outs = threads.get_num_threads(), []
    try:
        for n in (1, 2):
            threads.set_num_threads(n)
            outs.append(fl.tensor(x).erf().numpy().tobytes())
    finally:
        threads.set_num_threads(before)
    assert outs[0] == outs[1]
    assert ulp_error(np.frombuffer(outs[0], dt.np), oracle(x, dt), dt) <= ULPS[dt]
