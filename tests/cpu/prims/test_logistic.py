"""SIGMOID, SILU and TANH against torch's float64 sigmoid, silu and tanh (the oracle, of the values fuel
sees): every dtype, special values, layouts and `fl.jit` arenas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fuel as fl
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.testing.check import ulp_error
from fuel.testing.contract import thread_counts

# |fuel - ref| / ulp(ref) at most where the result is a normal number: f32 is the Cephes exponential
# (~1 ulp) and three roundings; bf16/f16 round that f32 once more; f64 is NumPy's four-pass spelling.
ULPS = {DType.F32: 3.0, DType.F64: 4.0, DType.BF16: 1.0, DType.F16: 1.0}
SPECIAL = [0.0, -0.0, 1e-30, -1e-38, 1e-45, 0.25, -0.5, 1.0, -1.0, 10.0, -10.0, 17.0, -17.0, 30.0, -30.0,
           80.0, -80.0, 87.0, -87.0, 88.0, 1e4, 1e30, np.inf, np.nan]
ORACLES = {"sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu, "tanh": torch.tanh}
NAMES = list(ORACLES)


def oracle(name: str, x: np.ndarray) -> np.ndarray:
    return ORACLES[name](torch.from_numpy(np.asarray(x, np.float64))).numpy()


def values(dt: DType) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(20000) * 4, rng.uniform(-90, 90, 20000), np.array(SPECIAL)])
    with np.errstate(over="ignore"):  # 1e30 is inf in f16
        return x.astype(dt.np)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)
def test_matches_torch_float64(dt: DType, name: str) -> None:
    xd = values(dt)
    got = getattr(fl.tensor(xd), name)().numpy()
    assert got.dtype == dt.np and got.shape == xd.shape
    ref = oracle(name, xd)
    # Where the exact result is below the normal range (v < -87.3) the f32 kernel gives a signed 0, as
    # the f32 exponential underflows there: within the smallest normal, checked apart.
    tiny = np.finfo(np.float32).tiny
    deep = np.abs(ref) < tiny
    assert ulp_error(got[~deep], ref[~deep], dt) <= ULPS[dt]
    assert (np.abs(np.asarray(got[deep], np.float64) - ref[deep]) <= tiny).all()


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)
def test_special_values(dt: DType) -> None:
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -200.0], dt.np)
    s = np.asarray(fl.tensor(x).sigmoid().numpy(), np.float64)
    assert s[0] == 0.5 and s[1] == 0.5 and s[2] == 1 and s[3] == 0 and np.isnan(s[4])
    y = np.asarray(fl.tensor(x).silu().numpy(), np.float64)
    assert y[0] == 0 and not np.signbit(y[0]) and y[1] == 0 and np.signbit(y[1])
    assert y[2] == np.inf and np.isnan(y[3]) and np.isnan(y[4]) and np.signbit(y[5])
    if dt is DType.F64:  # e^-200 is a normal f64
        np.testing.assert_allclose([s[5], y[5]], [oracle("sigmoid", x[5:])[0], oracle("silu", x[5:])[0]], rtol=1e-14)
    else:  # below every half type's and f32's range: a signed 0
        assert s[5] == 0 and y[5] == 0
    assert np.isnan(oracle("silu", np.array([-np.inf])))[0]  # torch agrees: -inf·sigmoid(-inf) = -inf·0


def test_tanh_f32_within_one_and_a_half_ulp_over_a_sweep_of_bit_patterns() -> None:
    """Every 251st positive f32 bit pattern and its negation (both branches, the switch at 0.625, the range
    where tanh rounds to ±1), and the special values: -0 stays -0, ±inf gives ±1, NaN stays NaN."""
    pos = np.arange(0, 0x7F800000, 251, dtype=np.uint32).view(np.float32)
    x = np.concatenate([pos, -pos, np.array([0.625, np.nextafter(np.float32(0.625), np.float32(0))], np.float32)])
    got = fl.tensor(x).tanh().numpy()
    assert ulp_error(got, oracle("tanh", x), DType.F32) <= 1.5
    special = fl.tensor(np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45], np.float32)).tanh().numpy()
    assert special[:4].tolist() == [0.0, 0.0, 1.0, -1.0] and np.signbit(special[1]) and not np.signbit(special[0])
    assert np.isnan(special[4]) and special[5:].tolist() == [np.float32(1e-45), np.float32(-1e-45)]


@pytest.mark.parametrize("name", NAMES)
def test_layouts_and_sizes(name: str) -> None:
    rng = np.random.default_rng(1)
    base = (rng.standard_normal((5, 7)) * 6).astype(np.float32)
    wide = (rng.standard_normal((2, 6, 16)) * 6).astype(np.float32)
    # transposed, strided, broadcast rows, empty, 0-d, and rows of unit stride that are not adjacent (a
    # stacked projection's half, 2-D and 3-D)
    for x in (base.T, base[:, ::2], np.broadcast_to(base[:1], (4, 7)), base[:0], np.float32(-1.75),
              wide[0, :, 3:10], wide[:, 1:, 8:], wide[:, :, :0]):
        got = getattr(fl.tensor(x), name)().numpy()
        assert got.shape == np.shape(x)
        assert ulp_error(got, oracle(name, np.asarray(x)), DType.F32) <= ULPS[DType.F32]


@pytest.mark.parametrize("name", NAMES)
def test_input_not_mutated_and_jit_replays_into_the_arena(name: str) -> None:
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 64)) * 5).astype(np.float32)
    keep = x.copy()
    f = fl.jit(lambda t: getattr(t * 2.0, name)() + 1.0)
    first = f(x).numpy().copy()
    y = (rng.standard_normal((3, 64)) * 5).astype(np.float32)
    second = f(y).numpy()
    np.testing.assert_array_equal(x, keep)
    eager = [getattr(fl.tensor(v * 2), name)().numpy() + np.float32(1) for v in (x, y)]
    np.testing.assert_array_equal(first, eager[0])
    np.testing.assert_array_equal(second, eager[1])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(1, 50000), (96, 1536)], ids=str)
def test_large_tensors_split_over_threads_give_the_same_bytes(name: str, shape: tuple[int, int]) -> None:
    """A prefill-sized tensor runs on the spinning pool, by rows (here a stacked projection's strided
    half) or one row by chunks; each value alone, so any thread count gives the same bytes."""
    rng = np.random.default_rng(3)
    stacked = (rng.standard_normal((shape[0], 2 * shape[1])) * 6).astype(np.float32)
    x = stacked[:, :shape[1]]
    before, outs = fl.get_num_threads(), []
    try:
        for n in thread_counts():
            fl.set_num_threads(n)
            outs.append(getattr(fl.tensor(x), name)().numpy())
    finally:
        fl.set_num_threads(before)
    assert outs[0].tobytes() == outs[-1].tobytes()
    assert ulp_error(outs[-1], oracle(name, x), DType.F32) <= ULPS[DType.F32]


@pytest.mark.parametrize("name", NAMES)
def test_a_nan_gives_itself_bit_for_bit_eager_and_replayed(name: str) -> None:
    """Every NaN (either sign, any payload, signalling too) comes out as its own bits, from the eager kernel
    and from the native replay's task alike (two compiled copies, which had ordered a NaN product's operands
    differently)."""
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7FC12345, 0xFF812345, 0x7F800001], np.uint32).view(np.float32)
    x = np.concatenate([nans, np.linspace(-5, 5, 59, dtype=np.float32)])
    alone = getattr(fl.tensor(x), name)().numpy()
    assert alone[:5].view(np.uint32).tolist() == nans.view(np.uint32).tolist()

    def fn(t: fl.Tensor) -> fl.Tensor:
        return getattr(t * 1.0, name)() * 1.0

    eager = fn(fl.tensor(x)).numpy()
    f = fl.jit(fn)
    for _ in range(3):  # capture, the checked first replay, then the native steady state
        assert f(x).numpy().tobytes() == eager.tobytes()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("x", "out"), [
    (np.ones((64, 4096), np.float64), None),  # many rows: the pool's task would read f64 as f32
    (np.ones((64, 4096), np.float16), np.zeros((64, 4096), np.float16)),
    (np.ones(8, np.float32), np.zeros(8, np.float64)),
    (np.ones(8, np.float32), np.zeros(4, np.float32)),
], ids=["f64", "f16", "f32-into-f64", "short-out"])
def test_the_kernels_refuse_what_they_would_read_as_the_wrong_type(name: str, x: np.ndarray,
                                                                   out: np.ndarray | None) -> None:
    from fuel.cpu.prims import logistic

    keep = None if out is None else out.copy()
    with pytest.raises(fl.KernelError, match=rf"{name}: has a kernel for x and out both float32 .*got x {x.dtype}"):
        getattr(logistic, f"{name}_f32")(x, out)
    if out is not None:
        np.testing.assert_array_equal(out, keep)
