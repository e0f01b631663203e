"""The machine side of bench_quant: its read bandwidth (the roofline's), cache flushes and evictions, and
the cold-cache interleaved timing built on `timing.timed_ms`. quant_cases' docstring says how the
benchmark uses each."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from benchmarks import timing
from benchmarks.bench_ops import machine_limits
from fuel.cpu.simd.simd16 import hsum, vadd, vload, vzero
from fuel.runtime import pool as spinning_pool

FLUSH_BYTES = 64 << 20  # twice this machine's L3

# ---------------------------------------------------------------------------------------------- machine

@njit(parallel=True, cache=True)
def _parallel_sum(a: np.ndarray) -> float:  # pragma: no cover (compiled)
    chunks = 64
    step = a.size // chunks
    part = np.zeros(chunks)
    for c in prange(chunks):
        s = 0.0
        for i in range(c * step, (c + 1) * step):
            s += a[i]
        part[c] = s
    return float(part.sum())


STREAM_THREADS = 2


@njit(nogil=True, cache=True)
def _stream_sum(a: np.ndarray, lo: int, hi: int) -> float:  # pragma: no cover (compiled)
    """Σ a[lo:hi] (f32, hi - lo a multiple of 128) as two sequential streams, 16-float vector loads into
    four independent accumulators per stream: a read that memory, not the adds, limits."""
    half = (hi - lo) // 2
    s0, s1, s2, s3 = vzero(), vzero(), vzero(), vzero()
    for i in range(lo, lo + half, 64):
        j = i + half
        s0 = vadd(s0, vadd(vload(a, i), vload(a, j)))
        s1 = vadd(s1, vadd(vload(a, i + 16), vload(a, j + 16)))
        s2 = vadd(s2, vadd(vload(a, i + 32), vload(a, j + 32)))
        s3 = vadd(s3, vadd(vload(a, i + 48), vload(a, j + 48)))
    return hsum(vadd(vadd(s0, s1), vadd(s2, s3)))


def _threaded_stream_sum(a: np.ndarray, pool: ThreadPoolExecutor) -> float:
    step = a.size // STREAM_THREADS
    return sum(f.result() for f in [pool.submit(_stream_sum, a, t * step, (t + 1) * step)
                                    for t in range(STREAM_THREADS)])


def _median_s(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(repeat: int = 5, nbytes: int = 256 << 20) -> dict[str, float]:
    """Read-only bandwidth (bytes read / time) over `nbytes` (8 times this machine's L3, so from memory),
    the fastest of three reads: `_stream_sum` on two threads (vector loads, two streams a thread), a
    two-thread Numba scalar sum and a NumPy sum. The scalar sum's chain of dependent adds, and NumPy's
    single thread, reach about half of what the vector read does here (15-19 against 31-33 GB/s on a
    Zen 3), and memory-bound kernels such as Q8_0's one-row product stream faster than that; a roofline
    taken from them alone would credit a kernel with twice its real fraction."""
    a = np.ones(nbytes // 8, np.float64)
    f32 = a.view(np.float32)[: a.size * 2 // (128 * STREAM_THREADS) * 128 * STREAM_THREADS]
    with ThreadPoolExecutor(STREAM_THREADS) as pool:
        vector_s = _median_s(lambda: _threaded_stream_sum(f32, pool), repeat)
    numba_s = _median_s(lambda: _parallel_sum(a), repeat)
    numpy_s = _median_s(lambda: np.add.reduce(a), repeat)
    return {"read_vector_gbs": f32.nbytes / vector_s / 1e9, "read_numba_gbs": a.nbytes / numba_s / 1e9,
            "read_numpy_gbs": a.nbytes / numpy_s / 1e9,
            "read_gbs": max(f32.nbytes / vector_s, a.nbytes / numba_s, a.nbytes / numpy_s) / 1e9}


def measure_limits() -> dict[str, float]:
    """read_gbs (the roofline's), copy bandwidth_gbs (read + write bytes) and the sgemm peak."""
    limits = dict(machine_limits())
    limits.update(read_bandwidth())
    return limits


_FLUSH: list[np.ndarray] = []


def flush_cache() -> None:
    """Read FLUSH_BYTES (twice this machine's L3) so the next call finds its weight in memory, not cache."""
    if not _FLUSH:
        _FLUSH.append(np.ones(FLUSH_BYTES // 4, np.float32))
    np.add.reduce(_FLUSH[0])


_I8P = ir.IntType(8).as_pointer()


def _x86_call(builder: Any, name: str, args: list[Any]) -> None:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [a.type for a in args]),
                                        f"llvm.x86.sse2.{name}")
    builder.call(fn, args)


@intrinsic
def _clflush_intrinsic(typingctx: Any, address: Any) -> Any:
    """Write back and drop the cache line holding the byte at `address`, from every level."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        _x86_call(builder, "clflush", [builder.inttoptr(args[0], _I8P)])
        return context.get_dummy_value()

    return types.void(address), codegen


@intrinsic
def _mfence_intrinsic(typingctx: Any) -> Any:
    """Order the flushes before what follows."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        _x86_call(builder, "mfence", [])
        return context.get_dummy_value()

    return types.void(), codegen


_clflush: Any = _clflush_intrinsic  # Numba intrinsics, typed for their jitted callers only
_mfence: Any = _mfence_intrinsic
_CLFLUSH = platform.machine().lower() in ("x86_64", "amd64")


@njit(cache=True)
def _evict_lines(address: int, nbytes: int) -> None:  # pragma: no cover (compiled)
    for i in range(0, nbytes, 64):
        _clflush(address + i)
    if nbytes:
        _clflush(address + nbytes - 1)
    _mfence()


def evict(*arrays: np.ndarray) -> None:
    """Write back and drop these (contiguous) arrays' cache lines from every level (clflush), nothing
    else; where the host is not x86, the whole-cache flush instead."""
    if not _CLFLUSH:
        flush_cache()
        return
    for a in arrays:
        if not a.flags.c_contiguous:
            raise ValueError("evict: a contiguous array is needed (a copy would be evicted instead)")
        _evict_lines(a.ctypes.data, a.nbytes)


def weight_cold(weight_arrays: tuple[np.ndarray, ...], x: np.ndarray) -> None:
    """EVICT_WAY's preparation: the weight and x evicted, then the pool's workers woken (see the module
    docstring)."""
    evict(*weight_arrays, x)
    spinning_pool.wake()


def timed_ms(fns: dict[str, Callable[[], Any]], repeat: int, budget_s: float = 60.0,
             cold: bool = True, warm: frozenset[str] = frozenset(),
             before: dict[str, Callable[[], None]] | None = None) -> tuple[dict[str, float], int]:
    """`timing.timed_ms` with each call after an untimed cache flush (`cold`, except the names in `warm`,
    and those in `before`, which run their own preparation instead)."""
    def flush(name: str) -> None:
        if before and name in before:
            before[name]()
        elif cold and name not in warm:
            flush_cache()
    return timing.timed_ms(fns, repeat, budget_s, flush)
