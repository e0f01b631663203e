"""Nf4Matmul's one-row decode by table (AVX-512 and AVX2 hosts; `nf4_matmul` dispatches, the portable path is there).

Each block's codes are looked up 16 bytes at a time (`nibble_tables.nibble_lookup32`: a vpermps of the
NF4 table per 8 bytes on AVX-512, byte shuffles on AVX2), or on AVX2 32 bytes at a time where blocks hold
a multiple of 64 codes (`decode_table64`, `nibble_lookup64`: one load and one index build for two
lookups), dotted with the activations permuted once a call to the lanes' order (a job of its own), and
the block's absmax applied once to their sum, where the portable path splits the codes by k's parity and
scales every value (docs/performance/nf4.md, "nf4_table"). Each output is one row's fixed sequence of
operations, in fixed chunks of rows, so its bytes never depend on the thread count.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.quant.nibble_tables import (
    BYTE_LUT,
    LOOKUP64_LANES,
    LUT16,
    lookup32_lanes,
    nibble_lookup32,
    nibble_lookup64,
    permute_job,
)
from fuel.cpu.simd.driver import ahead_of, chunk_bounds, chunk_count, pair_bounds, pair_chunk_count
from fuel.cpu.simd.simd16 import fma, fmas, hsum, prefetch, vadd, vload, vmul, vzero
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, record_at

# An NF4 byte holds elements 2b (high nibble) and 2b + 1: the element of `lookup32_lanes`' lane j, 16 bytes.
TABLE_ORDER = np.array([2 * b + 1 - h for b, h in lookup32_lanes()])
TABLE_ORDER64 = np.array([2 * b + 1 - h for b, h in LOOKUP64_LANES])  # `decode_table64`'s, 32 bytes
# One core decodes and multiplies about this many NF4 weights a second per activation row.
WEIGHTS_PER_SECOND = 10e9


# The record of a decode job (the table tasks' and `nf4_matmul`'s portable decode task): x the activations
# as the task reads them (permuted to the table's order, or split by k's parity), rows of them, K/2 bytes a
# weight row, n weight rows, `blocks` absmax a row, the 16-entry table, out [rows, n], `block` codes a block.
DECODE_ARGS = jobs.record(x=ADDRESS, rows=INT, half_k=INT, w=ADDRESS, n=INT, absmax=ADDRESS, blocks=INT,
                          lut=ADDRESS, out=ADDRESS, block=INT)


@njit(cache=True)
def fill_decode(x: Any, rows: int, w: Any, absmax: Any, lut: Any, out: Any, bs: int, argv: Any) -> None:
    """argv (a `DECODE_ARGS` record) <- the addresses and sizes of a decode job's arrays."""
    a = argv[0]
    a.x, a.rows, a.half_k, a.w, a.n = x.ctypes.data, rows, w.shape[1], w.ctypes.data, w.shape[0]
    a.absmax, a.blocks, a.lut, a.out, a.block = absmax.ctypes.data, absmax.shape[1], lut.ctypes.data, \
        out.ctypes.data, bs


@njit(inline="always", cache=True)
def _block32(w: Any, o: int, x: Any, xo: int, bs: int, table: Any) -> Any:
    """Σ table[code]·x over the block at byte o of w (activations x[xo:] in `TABLE_ORDER`), 16 bytes at a
    time."""
    first, second = nibble_lookup32(w, o, table)
    inner = fma(second, vload(x, xo + 16), vmul(first, vload(x, xo)))
    for s in range(1, bs // 32):
        first, second = nibble_lookup32(w, o + 16 * s, table)
        inner = fma(second, vload(x, xo + 32 * s + 16), fma(first, vload(x, xo + 32 * s), inner))
    return inner


@njit(inline="always", cache=True)
def _block32_once(w: Any, o: int, x: Any, xo: int, bs: int, table: Any) -> Any:
    """`_block32` for bs = 64 (bitsandbytes' default) on AVX-512, in two chains of two products each, no loop
    over the block (docs/performance/nf4.md, "nf4_table")."""
    f0, s0 = nibble_lookup32(w, o, table)
    f1, s1 = nibble_lookup32(w, o + 16, table)
    low = fma(s0, vload(x, xo + 16), vmul(f0, vload(x, xo)))
    return vadd(low, fma(s1, vload(x, xo + 48), vmul(f1, vload(x, xo + 32))))


@njit(inline="always", cache=True)
def _block64(w: Any, o: int, x: Any, xo: int, bs: int, table: Any) -> Any:
    """`_block32` 32 bytes at a time (bs a multiple of 64, AVX2's `lookup64`), x in `TABLE_ORDER64`."""
    v0, v1, v2, v3 = nibble_lookup64(w, o, table)
    inner = fma(v1, vload(x, xo + 16), vmul(v0, vload(x, xo)))
    inner = fma(v3, vload(x, xo + 48), fma(v2, vload(x, xo + 32), inner))
    for s in range(1, bs // 64):
        v0, v1, v2, v3 = nibble_lookup64(w, o + 32 * s, table)
        inner = fma(v1, vload(x, xo + 64 * s + 16), fma(v0, vload(x, xo + 64 * s), inner))
        inner = fma(v3, vload(x, xo + 64 * s + 48), fma(v2, vload(x, xo + 64 * s + 32), inner))
    return inner


@njit(inline="always", cache=True)
def _block64_once(w: Any, o: int, x: Any, xo: int, bs: int, table: Any) -> Any:
    """`_block64` for bs = 64 (bitsandbytes' default), in two chains of two products each: with no loop
    over the block, LLVM keeps the row's accumulator in registers."""
    v0, v1, v2, v3 = nibble_lookup64(w, o, table)
    low = fma(v1, vload(x, xo + 16), vmul(v0, vload(x, xo)))
    return vadd(low, fma(v3, vload(x, xo + 48), vmul(v2, vload(x, xo + 32))))


@njit(inline="always", cache=True)
def _chunks(n: int) -> int:
    """The fixed chunks of `_rows`: of row pairs where it takes rows two at a time (AVX-512), else of rows."""
    return pair_chunk_count(n) if LUT16 else chunk_count(n)


@njit(inline="always", cache=True)
def _rows(block: Any, part: int, parts: int, argv: int, fixed_bs: int) -> None:
    """Part `part` of `parts` of the rows: each block's `block` sum times its absmax, the row's lanes summed.
    On AVX-512 hosts rows r and r + 1 go together (`_pair`); AVX2 hosts, whose 16 ymm registers the pair's
    blocks would overflow, take a row at a time. `fixed_bs`: the block size where the task is for one (a
    constant, so its offsets and the pair's prefetch fold), else 0 (read from the record)."""
    v = record_at(argv, DECODE_ARGS)
    kh, n, nb = v.half_k, v.n, v.blocks
    bs = fixed_bs if fixed_bs else v.block
    x = carray(pointer(v.x, np.float32), (2 * kh,))
    w = carray(pointer(v.w, np.uint8), (n * kh,))
    absmax = carray(pointer(v.absmax, np.float32), (n * nb,))
    table = vload(carray(pointer(v.lut, np.float32), (16,)), 0)
    out = carray(pointer(v.out, np.float32), (1, n))
    chunks = _chunks(n)
    for c in range(part * chunks // parts, (part + 1) * chunks // parts):
        if LUT16:
            lo, hi = pair_bounds(c, n)
            ahead = ahead_of(2 * kh)
            for r in range(lo, hi, 2):
                r1 = min(r + 1, hi - 1)  # the odd last row as a pair with itself: the same operations
                out[0, r], out[0, r1] = _pair(block, w, absmax, x, table, kh, nb, bs, r, r1, ahead)
            continue
        lo, hi = chunk_bounds(c, n, chunks)
        for r in range(lo, hi):
            acc = vzero()
            for b in range(nb):
                acc = fmas(absmax[r * nb + b], block(w, r * kh + b * bs // 2, x, b * bs, bs, table), acc)
            out[0, r] = hsum(acc)


@njit(inline="always", cache=True)
def _pair(block: Any, w: Any, absmax: Any, x: Any, table: Any, kh: int, nb: int, bs: int, r: int,
          r1: int, ahead: int) -> tuple[Any, Any]:
    """Rows r and r1 (r + 1, or r for an odd last row) as `_rows` takes one, interleaved: two independent
    chains, each row's the same operations. Block b prefetches the bs bytes at r·kh + ahead + bs·b into
    L1, a later pair's (`driver.ahead_of`: the next at K = 4096), one sequential stream, which the
    hardware prefetchers alone do not keep up with (docs/performance/nf4.md, "nf4_table")."""
    a0 = vzero()
    a1 = vzero()
    for b in range(nb):
        for t in range(0, bs, 64):
            prefetch(w, r * kh + ahead + bs * b + t)
        a0 = fmas(absmax[r * nb + b], block(w, r * kh + b * bs // 2, x, b * bs, bs, table), a0)
        a1 = fmas(absmax[r1 * nb + b], block(w, r1 * kh + b * bs // 2, x, b * bs, bs, table), a1)
    return hsum(a0), hsum(a1)


@pool.task()
def decode_table(part: int, parts: int, argv: int) -> None:
    """`nf4_matmul._decode` for one activation row by table (`nibble_tables`): each block's codes looked up 8 bytes
    at a time on AVX-512, 16 on AVX2, dotted with the permuted activations, the block's absmax applied
    once to their sum (where the portable path scales every value)."""
    _rows(_block32, part, parts, argv, 0)


@pool.task()
def decode_table_once(part: int, parts: int, argv: int) -> None:
    """`decode_table` for blocks of exactly 64 codes: each block one step (`_block32_once`)."""
    _rows(_block32_once, part, parts, argv, 64)


@pool.task()
def decode_table64(part: int, parts: int, argv: int) -> None:
    """`decode_table` for blocks of a multiple of 64 codes on AVX2 hosts: each 32 bytes looked up at once
    (`nibble_tables.lookup64`), the activations permuted to `TABLE_ORDER64`."""
    _rows(_block64, part, parts, argv, 0)


@pool.task()
def decode_table64_once(part: int, parts: int, argv: int) -> None:
    """`decode_table64` for blocks of exactly 64 codes: each block one step (`_block64_once`)."""
    _rows(_block64_once, part, parts, argv, 64)


def table_kernel(bs: int) -> tuple[pool.Task, np.ndarray]:
    """The one-row table task for blocks of bs codes and the order it reads the activations in."""
    if BYTE_LUT and bs % 64 == 0:
        return decode_table64_once if bs == 64 else decode_table64, TABLE_ORDER64
    return decode_table_once if bs == 64 else decode_table, TABLE_ORDER


def table_jobs(x: np.ndarray, w: np.ndarray, absmax: np.ndarray, lut: np.ndarray, out: np.ndarray,
               bs: int) -> tuple[jobs.Job, jobs.Job]:
    """out [1, N] <- x [1, K] @ dequant(W)ᵀ by table (f32, contiguous, bs a multiple of 32) as two jobs: the
    row permuted into a scratch of the first job's own, then the table task reading it."""
    task, order = table_kernel(bs)
    permute, scratch, keep = permute_job(x, order)
    argv = jobs.argv_of(DECODE_ARGS)
    fill_decode(scratch[:1], 1, w, absmax, lut, out, bs, argv)
    n = w.shape[0]
    return permute._replace(keep=keep), jobs.job(task, argv, n * x.shape[1] / WEIGHTS_PER_SECOND, _chunks(n))
