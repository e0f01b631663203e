"""DynScalar bindings at realize: integers of any kind bind, anything else is a ParamError (never truncated)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import fuel as fl


def _written_at(pos: object) -> np.ndarray:
    cache = np.zeros((4, 2), np.float32)
    fl.realize(fl.cache_write(fl.tensor(cache), fl.tensor(np.ones((1, 2), np.float32)), fl.dyn("pos")),
               env={"pos": pos})  # type: ignore[dict-item]
    return cache


@pytest.mark.parametrize("bad", [2.0, 2.7, np.float32(2.0), True, np.array(2.5), "2"], ids=repr)
def test_realize_binds_integers_and_refuses_anything_else(bad: object) -> None:
    want = np.zeros((4, 2), np.float32)
    want[2] = 1.0
    for pos in (2, np.int64(2), np.uint8(2), np.array(2), np.array(2, np.uint32)):
        np.testing.assert_array_equal(_written_at(pos), want)
    message = re.escape(f"realize: dynamic scalar 'pos' must be an integer (a Python or NumPy integer, or a 0-d "
                        f"integer array), got {bad!r} ({type(bad).__name__})")
    with pytest.raises(fl.ParamError, match=message):
        _written_at(bad)
