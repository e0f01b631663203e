"""Realising inside an `fl.jit` trace (`fuel.graph.traced`): refused for what depends on an argument or a
writable captured array, naming the call; allowed for constants."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import fuel as fl

# ---- fn must not realise what can change -----------------------------------------------------------------

_REALISES: dict[str, Callable[[Any], Any]] = {
    ".numpy()": lambda t: t.numpy(),
    ".item()": lambda t: t.item(),
    "float()": float,
    "int()": lambda t: int(t.cast(fl.i64)),
    "bool()": lambda t: bool(t > 0),
    "operator.index()": lambda t: range(10)[t.cast(fl.i64)],
    "np.asarray()": np.asarray,
    "fl.realize()": fl.realize,
    ".realize()": lambda t: t.realize(),
}


@pytest.mark.parametrize("on", ["the argument", "a value computed from it"])
@pytest.mark.parametrize("how", list(_REALISES))
def test_realising_what_depends_on_an_argument_inside_fn_is_an_error(how: str, on: str) -> None:
    """The value would be baked into the capture: a RealizeInTrace naming the call and the argument."""
    realise = _REALISES[how]

    def fn(x: fl.Tensor) -> fl.Tensor:
        v = x if on == "the argument" else (x * 2.0).sum()
        realise(v)
        return x + 1.0

    with pytest.raises(fl.RealizeInTrace, match=re.escape(f"jit: fn must not realise inside fl.jit, but it called "
                                                          f"{how} of a ") + r".* depends on argument 0 \(\[\] f32\)"):
        fl.jit(fn)(np.float32(1.5))
    np.testing.assert_array_equal(fl.tensor(np.ones(2, np.float32)).numpy(), [1, 1])  # realising works again after


def test_python_branching_on_a_value_inside_fn_is_an_error() -> None:
    def fn(x: fl.Tensor, y: fl.Tensor) -> fl.Tensor:
        return x * 2.0 if (y.sum() > 0) else x  # bool() of a value of argument 1

    with pytest.raises(fl.RealizeInTrace, match=r"bool\(\) of a \[\] u8 tensor .* argument 1 \(\[3\] f32\)"):
        fl.jit(fn)(np.ones(3, np.float32), np.ones(3, np.float32))


def test_a_jitted_call_inside_fn_is_an_error() -> None:
    inner = fl.jit(lambda x: x * 2.0)
    with pytest.raises(fl.RealizeInTrace, match="depends on argument 0"):
        fl.jit(lambda x: inner(x * 1.0) + 1.0)(np.ones(3, np.float32))


def test_realising_constants_inside_fn_is_allowed_and_a_writable_capture_is_not() -> None:
    """A constant's value is the same at every call (what the capture would fold anyway): fn may read it,
    e.g. to pick a branch. A writable captured array may change between calls: reading it is an error."""
    tc = fl.tensor(np.array([1.0, 2.0, 3.0], np.float32), const=True)

    def fn(x: fl.Tensor) -> fl.Tensor:
        scale = float(tc.sum()) + float(fl.full((), 0.5) * 2.0)  # 6 + 1
        return x * scale if bool(tc[0] > 0) else x

    f = fl.jit(fn)
    for v in (1.0, 2.0):
        np.testing.assert_array_equal(f(np.full(2, v, np.float32)).numpy(), [7.0 * v] * 2)
    w = np.array([1.0, 2.0], np.float32)
    tw = fl.tensor(w)
    for how, realise in _REALISES.items():
        with pytest.raises(fl.RealizeInTrace, match=re.escape(f"called {how} of a ") + r".*reads a writable "
                           r"captured array \(\[2\] f32\) that may change between calls.*const=True"):
            fl.jit(lambda x, r=realise: x + r(tw.sum()))(np.ones(2, np.float32))  # type: ignore[misc]
