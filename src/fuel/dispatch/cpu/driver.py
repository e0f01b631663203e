"""The shared row driver: every parallel Numba kernel gets a serial twin, and the executor picks one.

A kernel is written once, as a function whose outer loop is `prange` over independent rows (or
chunks of rows, see `chunk_count`/`chunk_bounds`), and decorated with `row_kernel(...)` instead of
`njit(parallel=True)`. The decorator compiles the same source twice: with `parallel=True`, and
without, where `prange` is a plain `range` run in the calling thread. Each row's arithmetic is the
same code in both, so both paths give the same bytes (the tests check every impl at both). Which
one runs is decided per plan step from the impl's own cost (`fuel.dispatch.threads`), never by the
kernel's author.

The twin is a copy of the Python function under another qualified name, so Numba's on-disk cache
keeps the two compilations apart (its index is keyed by module and qualified name, not by flags).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from numba import njit

from fuel.dispatch.threads import MODE

CHUNKS = 256


class RowKernel:
    """A parallel Numba kernel and its serial twin; calling it runs the one the executor chose."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]) -> None:
        self.parallel = njit(cache=True, parallel=True, **options)(fn)
        self.serial = njit(cache=True, **options)(_twin(fn))
        self.__wrapped__ = fn
        self.__name__ = fn.__name__
        self.__qualname__ = fn.__qualname__
        self.__module__ = fn.__module__
        self.__doc__ = fn.__doc__

    def __call__(self, *args: Any) -> Any:
        return (self.serial if MODE.serial else self.parallel)(*args)


def row_kernel(**options: Any) -> Callable[[Callable[..., Any]], RowKernel]:
    """Decorate a `prange` kernel: Numba options as for `njit` (e.g. `fastmath`), `parallel` implied."""

    def wrap(fn: Callable[..., Any]) -> RowKernel:
        return RowKernel(fn, options)

    return wrap


def _twin(fn: Callable[..., Any]) -> Callable[..., Any]:
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__, fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + "_serial"
    twin.__module__ = fn.__module__
    return twin


@njit(inline="always", cache=True)
def chunk_count(rows: int) -> int:
    """How many chunks a kernel with per-chunk scratch splits `rows` into (a fixed number: the split,
    and so the scratch each row sees, does not depend on the thread count)."""
    return min(rows, CHUNKS)


@njit(inline="always", cache=True)
def chunk_bounds(c: int, rows: int, chunks: int) -> tuple[int, int]:
    """Rows [lo, hi) of chunk c."""
    return c * rows // chunks, (c + 1) * rows // chunks
