"""Run a kernel with its arrays and its pooled scratch at chosen distances from each other.

A loop that reads one array and writes another gets a runtime check of the distance (or overlap) between
them when the compiler cannot prove they are apart; where it fails, the loop takes its scalar fallback. A
reduction in such a loop sums in another order there, so its bytes follow where the buffer pool, malloc
or an arena happened to put the arrays. `Placement` lays out a call's arrays (the caller's inputs and
outputs, and every buffer the kernel takes from `fuel.runtime.buffers.POOL`) in one buffer, `gap` bytes
apart, so a test can put scratch just before or just after what the kernel reads and writes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuel.errors import ParamError
from fuel.runtime.buffers import POOL

ALIGN = 64  # the first caller array starts on a cache line; everything else is placed relative to it
# Byte gaps covering a vectoriser's distance checks (up to 4 unrolled 64-byte vectors, 256 bytes) and the
# offsets that are not a whole vector (any multiple of 2 keeps half types aligned; 8 and up, f64 too).
GAPS = (0, 4, 8, 24, 40, 64, 136, 200, 256)
# (scratch side, caller order): the pool's buffers just below the caller's arrays, or just above them, with
# the outputs or the inputs nearest the scratch.
LAYOUTS = (("before", "outputs"), ("before", "inputs"), ("after", "outputs"), ("after", "inputs"))


def _aligned(at: int, itemsize: int) -> int:
    return at + (-at) % itemsize


@dataclass
class Placement:
    """One layout: `side` "before" puts the pool's buffers downward from `gap` bytes below the first
    caller array, "after" upward from `gap` bytes past the last; consecutive arrays lie `gap` bytes apart
    (rounded up to their alignment). `taken` counts the pool buffers handed out."""

    gap: int
    side: str
    size: int
    taken: int = 0

    def __post_init__(self) -> None:
        if self.side not in ("before", "after"):
            raise ParamError(f"Placement: side must be 'before' or 'after', got {self.side!r}")
        if self.gap < 0:
            raise ParamError(f"Placement: gap must be at least 0 bytes, got {self.gap}")
        self._buf = np.zeros(2 * self.size + 4 * ALIGN, np.uint8)
        self._mid = self.size + 2 * ALIGN - self._buf.ctypes.data % ALIGN
        self._up = self._mid
        self._down = self._mid - self.gap

    def _view(self, at: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        n = int(np.prod(shape)) * dtype.itemsize
        if at < 0 or at + n > self._buf.size:
            raise ParamError(f"Placement: {n} bytes do not fit in the {self.size}-byte layout")
        return self._buf[at:at + n].view(dtype).reshape(shape)

    def caller(self, like: np.ndarray) -> np.ndarray:
        """A C-contiguous copy of `like` in the caller's region, after the arrays placed before it."""
        at = _aligned(self._up, like.dtype.itemsize)
        x = self._view(at, like.shape, like.dtype)
        x[...] = like
        self._up = at + like.nbytes + self.gap
        return x

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any], min_bytes: int = 0) -> np.ndarray:
        """`BufferPool.empty`'s contract (uninitialised, C-contiguous), placed by the layout at any size."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        self.taken += 1
        if self.side == "before":
            at = self._down - n
            at -= at % dtype.itemsize
            self._down = at - self.gap
        else:
            at = _aligned(self._up, dtype.itemsize)
            self._up = at + n + self.gap
        x = self._view(at, tuple(shape), dtype)
        x.fill(0xA5 if dtype.kind in "iu" else np.nan)  # stale contents: a kernel must not read what it did not write
        return x


@contextmanager
def pool_placed(layout: Placement) -> Iterator[Placement]:
    """Every `POOL.empty` inside the block comes from `layout` (the kernels import the one POOL instance)."""
    before = POOL.__dict__.get("empty")
    POOL.empty = layout.empty  # type: ignore[method-assign]
    try:
        yield layout
    finally:
        if before is None:
            del POOL.empty
        else:
            POOL.empty = before  # type: ignore[method-assign]


def placed_call(kernel: Any, inputs: Sequence[np.ndarray], outs: Sequence[np.ndarray], params: Any, gap: int,
                side: str, first: str, pack: Any = None) -> tuple[bytes, int]:
    """Run `kernel(inputs, out(s), params)` on copies of inputs and outputs placed with their scratch by one
    layout (`first` "inputs" or "outputs": which lie nearer the scratch); returns the outputs' bytes and
    how many pool buffers the kernel took. `pack` turns the placed outputs into the kernel's argument
    (default: the one output, or the tuple of them)."""
    size = sum(a.nbytes for a in (*inputs, *outs))
    layout = Placement(gap, side, 8 * size + (1 << 22))
    near, far = (outs, inputs) if (first == "outputs") == (side == "before") else (inputs, outs)
    placed: dict[int, np.ndarray] = {}
    for a in (*near, *far):
        placed[id(a)] = layout.caller(a)
    xs = [placed[id(a)] for a in inputs]
    ys = [placed[id(a)] for a in outs]
    arg = pack(ys) if pack is not None else (ys[0] if len(ys) == 1 else tuple(ys))
    with pool_placed(layout):
        kernel(xs, arg, params)
    return b"".join(y.tobytes() for y in ys), layout.taken
