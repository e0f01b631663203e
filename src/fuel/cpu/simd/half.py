"""Half-precision plumbing for Numba kernels: bf16 as uint16 bits, widened and rounded by hand.

Numba has no half arithmetic. bf16 widens exactly with a 16-bit shift and narrows with
round-to-nearest-even on the f32 bits (NaN stays NaN); f16 goes through NumPy's exact casts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.simd.driver import chunk_bounds, chunk_count
from fuel.cpu.simd.vecmath import bf16_to_f32, f32_to_bf16
from fuel.dtype import DType
from fuel.errors import KernelError
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.buffers import POOL
from fuel.runtime.jobs import ADDRESS, INT, record_at

SECONDS_PER_VALUE = 0.25e-9  # one core's time to convert a value (memory speed), for the part count


@njit(inline="always", cache=True)
def widen_bf16_row(src: Any, dst_bits: Any) -> None:
    """dst_bits (uint32) <- src (uint16 bf16 bits) << 16; view dst_bits as float32 to read it."""
    wide = dst_bits.view(np.float32)
    for j in range(src.shape[0]):
        wide[j] = bf16_to_f32(src[j])


@njit(inline="always", cache=True)
def narrow_bf16_row(src_bits: Any, dst: Any) -> None:
    """dst (uint16) <- round-to-nearest-even of src_bits (float32 bits as uint32); NaN stays a quiet NaN."""
    src = src_bits.view(np.float32)
    for j in range(src.shape[0]):
        dst[j] = f32_to_bf16(src[j])


def bits(a: np.ndarray) -> np.ndarray:
    """The uint16 bits of a bf16 array (no copy)."""
    return a.view(np.uint16)


def rows2d(a: np.ndarray) -> np.ndarray:
    """A contiguous array seen as [outer, last] (rank 0 and 1 included)."""
    if a.ndim == 2 and a.shape[1]:
        return a
    last = a.shape[-1] if a.ndim else 1
    return a.reshape(-1, last) if last else a.reshape(0, 0)


def via_f32(kernel: Callable[[list[np.ndarray], np.ndarray, Any], None]) -> Callable[..., None]:
    """Run an f32 kernel for f16 data: widen inputs exactly into C-contiguous copies (whatever their layout,
    so a kernel that reads strided input can take the wrapper's), compute in f32, round once into out."""

    def run(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
        wide = [a.astype(np.float32, order="C") if a.dtype == DType.F16.np else a for a in inputs]
        tmp = POOL.empty(out.shape, np.dtype(np.float32))
        kernel(wide, tmp, params)
        np.copyto(out, tmp, casting="unsafe")

    run.__wrapped__ = kernel  # type: ignore[attr-defined]
    return run


# A conversion job: `size` values from `src` into `dst`, as bits (bf16 uint16, f32 as uint32).
CONVERT_ARGS = jobs.record(src=ADDRESS, dst=ADDRESS, size=INT)


@njit(inline="always", cache=True)
def _convert_part(part: int, parts: int, argv: int, widen: bool) -> None:
    """This part's fixed chunks of a `CONVERT_ARGS` job: widened (bf16 bits to f32 bits) or narrowed."""
    a = record_at(argv, CONVERT_ARGS)
    n = a.size
    chunks = chunk_count(n)
    for c in range(part * chunks // parts, (part + 1) * chunks // parts):
        lo, hi = chunk_bounds(c, n, chunks)
        if widen:
            src, dst = carray(pointer(a.src, np.uint16), (n,)), carray(pointer(a.dst, np.uint32), (n,))
            widen_bf16_row(src[lo:hi], dst[lo:hi])
        else:
            wide, bits16 = carray(pointer(a.src, np.uint32), (n,)), carray(pointer(a.dst, np.uint16), (n,))
            narrow_bf16_row(wide[lo:hi], bits16[lo:hi])


@pool.task()
def widen_bf16_part(part: int, parts: int, argv: int) -> None:
    """dst (uint32, flat) <- bf16 bits (uint16, flat) << 16: exact."""
    _convert_part(part, parts, argv, True)


@pool.task()
def narrow_bf16_part(part: int, parts: int, argv: int) -> None:
    """dst (bf16 bits, flat) <- nearest-even rounding of src (float32 bits as uint32, flat)."""
    _convert_part(part, parts, argv, False)


def convert_job(task: pool.Task, src: np.ndarray, dst: np.ndarray) -> jobs.Job:
    """A job of `widen_bf16_part` or `narrow_bf16_part` from src to dst (flat, one size; dst contiguous); it
    keeps both alive. A strided src (a flat view of evenly strided rows, which reshape(-1) makes without a
    copy) is gathered first: the task reads consecutive values."""
    src = np.ascontiguousarray(src)
    if not dst.flags.c_contiguous:
        raise KernelError(f"{task.__name__}: the destination must be contiguous")
    argv = jobs.argv_of(CONVERT_ARGS)
    argv[0] = (src.ctypes.data, dst.ctypes.data, src.size)
    return jobs.job(task, argv, src.size * SECONDS_PER_VALUE, chunk_count(src.size), keep=(src, dst))


def widened(x: np.ndarray) -> np.ndarray:
    """An exact f32 copy of a bf16/f16 array, in a pooled buffer, in x's own matrix order.

    A column-major x (a transposed weight) is widened as its contiguous transpose and handed back
    transposed, so BLAS reads it with its trans flag instead of us gathering it element by element.
    """
    if not x.flags.c_contiguous and x.ndim >= 2 and x.swapaxes(-1, -2).flags.c_contiguous:
        return widened(x.swapaxes(-1, -2)).swapaxes(-1, -2)
    wide = POOL.empty(x.shape, np.dtype(np.float32))
    if x.dtype == DType.BF16.np:
        if x.size:  # flat in C order, matching wide's layout (convert_job gathers a strided view)
            jobs.run(convert_job(widen_bf16_part, bits(x).reshape(-1), wide.reshape(-1).view(np.uint32)))
    else:
        np.copyto(wide, x, casting="safe")
    return wide


def narrow_into(src: np.ndarray, out: np.ndarray) -> None:
    """out (bf16 or f16, contiguous) <- src (f32, contiguous, same shape) rounded once to nearest-even."""
    if out.dtype == DType.BF16.np:
        if out.size:
            jobs.run(convert_job(narrow_bf16_part, src.reshape(-1).view(np.uint32), bits(out).reshape(-1)))
    else:
        np.copyto(out, src, casting="unsafe")
