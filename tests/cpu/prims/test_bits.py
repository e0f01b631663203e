"""The bit primitives' kernels (`fuel.cpu.prims.bits`) against NumPy's own operators: `>>`, `&` and `.view`,
over shapes, integer dtypes and broadcast operands, eagerly and replayed by fl.jit (which writes into a
planned buffer)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.dtype import from_numpy

INTS = [np.uint8, np.uint32, np.uint64, np.int64]
ALL = [*INTS, np.float16, np.float32, np.float64, ml_dtypes.bfloat16]
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)


def _draw(rng: np.random.Generator, shape: list[int], dtype: Any) -> np.ndarray:
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


def _same(got: np.ndarray, want: Any) -> None:
    want = np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@settings(max_examples=60)
@given(seed=st.integers(0, 2**32 - 1), shape=shapes, dtype=st.sampled_from(INTS), op=st.sampled_from([">>", "&"]),
       broadcast=st.booleans())
def test_shift_and_mask_match_numpy(seed: int, shape: list[int], dtype: Any, op: str, broadcast: bool) -> None:
    """x >> s and x & m, elementwise or with a broadcast operand, shifts past the width included."""
    rng = np.random.default_rng(seed)
    x = _draw(rng, shape, dtype)
    bits = np.dtype(dtype).itemsize * 8
    other_shape = [1] * len(shape) if broadcast else shape
    y = (rng.integers(0, bits + 2, other_shape).astype(dtype) if op == ">>" else _draw(rng, other_shape, dtype))
    got = (fl.tensor(x) >> fl.tensor(y)) if op == ">>" else (fl.tensor(x) & fl.tensor(y))
    _same(got.numpy(), (x >> y) if op == ">>" else (x & y))


@settings(max_examples=30)
@given(seed=st.integers(0, 2**32 - 1), shape=shapes, dtype=st.sampled_from(INTS), k=st.integers(0, 7))
def test_python_int_operands_take_the_tensors_dtype(seed: int, shape: list[int], dtype: Any, k: int) -> None:
    rng = np.random.default_rng(seed)
    x = _draw(rng, shape, dtype)
    _same((fl.tensor(x) >> k).numpy(), x >> dtype(k))
    _same((fl.tensor(x) & 0x5A).numpy(), x & dtype(0x5A))
    _same((0x5A & fl.tensor(x)).numpy(), dtype(0x5A) & x)


@settings(max_examples=80)
@given(seed=st.integers(0, 2**32 - 1), lead=st.lists(st.integers(0, 4), max_size=2), words=st.integers(0, 4),
       src=st.sampled_from(ALL), dst=st.sampled_from(ALL), transposed=st.booleans())
def test_bitcast_matches_numpy_view(seed: int, lead: list[int], words: int, src: Any, dst: Any,
                                    transposed: bool) -> None:
    """The last axis's bytes reread as dst: a contiguous input, or a transposed one (copied first)."""
    rng = np.random.default_rng(seed)
    a, b = np.dtype(src).itemsize, np.dtype(dst).itemsize
    last = words * max(a, b) // a  # a whole number of both types' items
    raw = rng.integers(0, 256, (*lead, last * a), dtype=np.uint8).view(src)
    x = np.swapaxes(np.ascontiguousarray(np.swapaxes(raw, -1, 0)), -1, 0) if transposed and lead else raw
    got = fl.tensor(x).bitcast(from_numpy(np.dtype(dst)))
    _same(got.numpy(), np.ascontiguousarray(x).view(dst))


def test_bitcast_leaves_its_input_alone_and_replays() -> None:
    """The bytes come out right from a captured step too (written into its planned buffer), and writing
    the input afterwards does not change a result already returned."""
    w = np.arange(6, dtype=np.uint32) * np.uint32(0x01020304)
    f = fl.jit(lambda t: t.bitcast(fl.u8) & 0x0F)
    for _ in range(3):
        got = f(w).numpy()
        _same(got, w.view(np.uint8) & np.uint8(0x0F))
    eager = fl.tensor(w).bitcast(fl.u8).numpy()
    w[1] = 0
    assert eager[4:8].tolist() == [4, 3, 2, 1]
