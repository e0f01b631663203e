"""`A @ dequant(W)ᵀ` for a weight kept compressed (GGUF blocks, NF4) when A has many rows: tiles of W's
rows are dequantised into a reused f32 scratch and each is multiplied into its output columns. The tiles
are fixed by the weight's shape and run on fuel's threads (`split_work`), so the bytes never depend on the
thread count.

How a tile is multiplied (`MODE`):
- OWN, on AVX-512 and AVX2 hosts for up to `OWN_MAX_ROWS` activation rows: fuel's register-blocked
  kernel (`tile_gemm`), `tile @ Aᵀ` into a [tile rows, Rp] scratch copied transposed into the output, Aᵀ
  packed once per call. Nothing is repacked per tile, where OpenBLAS repacks both operands on every call:
  105-116 GFLOP/s a core against OpenBLAS's 70-95 at R = 64-128 on AVX-512, 88-96 against 84-87 on
  Zen 3 (AVX2), where NF4's 4096² product at R = 64 fell from 14.8-15.4 to 13.4-14.2 ms.
- Otherwise (and wherever `OWN_KERNEL` is switched off) one one-thread OpenBLAS sgemm a tile, every
  output element one sgemm's dot over all of K.
  For up to `FLIP_ROWS` activation rows and at least `FLIP_MIN_N` weight rows the tile is the sgemm's
  left operand (FLIPPED: `tile @ Aᵀ`, stored transposed), otherwise the right one (DIRECT: `A @ tileᵀ`
  straight into the output columns). Measured here (OpenBLAS 0.3.31, 2 threads, interleaved medians),
  the flipped form's time over the direct one's: K = N = 4096 0.67 at R = 32, 0.76-0.82 at 64, 0.86-0.91
  at 128, 0.98-1.04 at 256; [1536, 576] (K, N) 0.80 / 0.90 / 0.95 at R = 32 / 64 / 128; [2048, 1024]
  0.77 at 32, 0.95 at 64; but with N = 576, K = 1536-2048 1.07-1.24 at R = 64.

Tiles of about `TILE_BYTES` (at most 256 rows): at K = 4096, 4 MiB tiles (in L3) ran 5-9% faster than
1 MiB ones (in L2) with OpenBLAS. Fuel's kernel, which repacks nothing per tile, runs best on tiles of
`OWN_TILE_BYTES`: NF4 4096² at R = 64 on Zen 3 (interleaved medians) took 13.6 / 14.3-15.0 ms with 1 MiB
tiles against 13.9 / 15.2-16.7 with 4 MiB, and 15.6-16.7 with 2 MiB or 512 KiB.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.quant.tile_gemm import AVAILABLE as OWN_KERNEL
from fuel.cpu.quant.tile_gemm import (
    PANEL,
    pack_activations,
    padded_width,
    tile_times_at,
    tile_times_at_checked,
    transpose_into,
)
from fuel.cpu.simd.sgemm import sgemm
from fuel.runtime import pool, threads
from fuel.runtime.atomics import claim_slot as claim
from fuel.runtime.atomics import pointer
from fuel.runtime.atomics import release_slot as release
from fuel.runtime.buffers import POOL
from fuel.runtime.threads import split_work

TILE_BYTES = 4 << 20  # f32 bytes of one dequantised tile multiplied by OpenBLAS
OWN_TILE_BYTES = 1 << 20  # ... by fuel's kernel (OWN mode)
TILE_GROUPS = 4  # tile counts are multiples of this, so 2 or 4 threads get equal shares
OWN_MAX_ROWS = 512  # activation rows up to which fuel's kernel multiplies the tiles (OWN mode)
FLIP_ROWS = 64  # activation rows up to which the tile is the left operand ...
FLIP_MIN_N = 1024  # ... for weights of at least this many rows

F32 = np.dtype(np.float32)
FLOPS_PER_SECOND = 60e9  # one core's sgemm rate at these shapes, for the pool's part count

DIRECT, FLIPPED, OWN = range(3)  # how a tile is multiplied (the module's docstring)

# The job's argv (int64) as the tile tasks read it: the generic fields, then the weight's own from WEIGHT.
# A_T is Aᵀ's address ([K, A_T_COLS], or its panels in OWN mode; 0 in DIRECT mode), C_SCRATCH the slots'
# [TILE, A_T_COLS] products.
A, ROWS, K, A_T, A_T_COLS, N, OUT, TILE, TILES, SCRATCH, C_SCRATCH, SLOTS, CLAIMS, SGEMM, MODE, WEIGHT = range(16)

# fill(r0, r1, tile): dequantise W rows [r0, r1) into tile[:r1 - r0] (a C-contiguous f32 [rows, k] buffer)
Fill = Callable[[int, int, np.ndarray], None]


def tile_rows(k: int, n: int | None = None, budget: int | None = None) -> int:
    """Rows of W per dequantised tile: at most about `budget` (TILE_BYTES by default) of f32, a multiple of
    16, 16..256. Given the weight's n rows, the tiles are evened out to a count divisible by TILE_GROUPS
    (fixed by the shape, never by the thread count): [576, 576] in three tiles of 256, 256, 64 left one of
    two threads idle a third of the time, in four of 144 neither."""
    most = min(256, max(16, (TILE_BYTES if budget is None else budget) // (4 * max(k, 1)) // 16 * 16))
    if n is None or n <= 0:
        return most
    tiles = math.ceil(n / most)
    tiles += -tiles % TILE_GROUPS
    return min(most, 16 * math.ceil(math.ceil(n / tiles) / 16))


def own_mode(rows: int) -> bool:
    """Whether fuel's kernel multiplies the tiles for R = rows: where it has a geometry for the host, up to
    OWN_MAX_ROWS. Its packed Aᵀ and each slot's product scale with R, and from about 512 rows OpenBLAS's
    straight product is as fast (at R = 512, K = 4096: 100 against 95 GFLOP/s a core on AVX-512, 85-89
    against 86-89 on Zen 3)."""
    return OWN_KERNEL and rows <= OWN_MAX_ROWS


def flipped(rows: int, n: int) -> bool:
    """Whether `tiled_product` makes the tile the sgemm's left operand for R = rows and a weight of n rows."""
    return rows <= FLIP_ROWS and n >= FLIP_MIN_N


class _Layout:
    """How one call multiplies its tiles: the mode, tile rows, and Aᵀ (transposed once, alive for the call)
    with its width `a_t_cols` (R, or R padded to 16 in OWN mode's panels; 0 without one)."""

    def __init__(self, a2: np.ndarray, n: int) -> None:
        self.rows, self.k = a2.shape
        own = own_mode(self.rows)
        self.tile = tile_rows(self.k, n, OWN_TILE_BYTES if own else TILE_BYTES)
        self.a_t: np.ndarray | None = None
        self.a_t_cols = 0
        if own:
            self.mode, self.a_t_cols = OWN, padded_width(self.rows)
            self.a_t = POOL.empty((self.k * self.a_t_cols,), F32)
            pack_activations(a2, self.a_t, self.a_t_cols, PANEL)
        elif flipped(self.rows, n):
            self.mode, self.a_t, self.a_t_cols = FLIPPED, np.ascontiguousarray(a2.T), self.rows
        else:
            self.mode = DIRECT


def tiled_product(a2: np.ndarray, n: int, fill: Fill, out: np.ndarray) -> None:
    """out [R, n] <- a2 [R, k] @ dequant(W)ᵀ, all f32 (a2 and out C-contiguous), W's rows from `fill`."""
    lay = _Layout(a2, n)
    t, k = lay.tile, lay.k

    def part(tiles: range) -> None:
        tile = POOL.empty((t, k), F32)
        c = None if lay.a_t is None else POOL.empty((t, lay.a_t_cols), F32)
        for i in tiles:
            r0, r1 = i * t, min(n, i * t + t)
            fill(r0, r1, tile)
            if lay.a_t is None or c is None:
                np.matmul(a2, tile[:r1 - r0].T, out=out[:, r0:r1])
                continue
            if lay.mode == OWN:
                tile_times_at_checked(tile, r1 - r0, lay.a_t, c)
            else:
                np.matmul(tile[:r1 - r0], lay.a_t, out=c[:r1 - r0])
            out[:, r0:r1] = c[:r1 - r0, :lay.rows].T

    split_work(part, -(-n // t))


# ---- the same product as a task of the spinning pool (no Python between the tiles) -------------------

def post_tiles(task: pool.Task, a2: np.ndarray, n: int, out: np.ndarray, weight: Sequence[int]) -> bool:
    """out [R, n] <- a2 [R, k] @ dequant(W)ᵀ by `task`, W's own fields (addresses, sizes) at argv[WEIGHT:]
    (the arrays they address alive until this returns); False, doing nothing, where the tiles need
    OpenBLAS and NumPy's has no ILP64 sgemm to call (the caller then runs `tiled_product`)."""
    address = threads.blas_sgemm_address()
    if not (address or own_mode(a2.shape[0])):
        return False
    lay = _Layout(a2, n)
    rows, k, t = lay.rows, lay.k, lay.tile
    tiles = -(-n // t)
    # one part a tile (0.1-1 ms of work each): claimed dynamically, the threads end at most a tile apart,
    # where 12 tiles in 8 parts of 1 or 2 could leave one thread idle for two (SmolLM2's [3072, 576]: -13%)
    parts = pool.parts_for(2 * rows * n * k / FLOPS_PER_SECOND, tiles, per_thread=tiles)
    slots = min(parts, threads.get_num_threads())
    scratch = POOL.empty((slots, t, k), F32)
    c_scratch = POOL.empty((slots, t, lay.a_t_cols), F32) if lay.a_t is not None else scratch
    claims = np.zeros(slots, np.int64)
    argv = np.empty(WEIGHT + len(weight), np.int64)
    argv[:WEIGHT] = (a2.ctypes.data, rows, k, 0 if lay.a_t is None else lay.a_t.ctypes.data, lay.a_t_cols, n,
                     out.ctypes.data, t, tiles, scratch.ctypes.data, c_scratch.ctypes.data, slots,
                     claims.ctypes.data, address, lay.mode)
    argv[WEIGHT:] = weight
    with threads.one_blas_thread():
        pool.run(task, argv, parts)
    return True


@njit(inline="always", cache=True)
def job(argv: int) -> Any:
    """The generic fields of a tile job (int64 [WEIGHT + weight fields], read through its address)."""
    return carray(pointer(argv, np.int64), (WEIGHT,))


@njit(inline="always", cache=True)
def claim_slot(v: Any) -> int:
    """A scratch slot no other running part holds (there are as many as threads can run parts at once)."""
    return claim(v[CLAIMS], v[SLOTS])


@njit(inline="always", cache=True)
def release_slot(v: Any, slot: int) -> None:
    release(v[CLAIMS], v[SLOTS], slot)


@njit(inline="always", cache=True)
def tile_of(v: Any, slot: int) -> Any:
    """The f32 [TILE, K] scratch tile of a slot."""
    t, k = v[TILE], v[K]
    return carray(pointer(v[SCRATCH] + 4 * slot * t * k, np.float32), (t, k))


@njit(inline="always", cache=True)
def multiply_tile(v: Any, slot: int, r0: int, r1: int) -> None:
    """out[:, r0:r1] <- a @ tile[:r1 - r0]ᵀ: straight into the output columns (DIRECT), or tile @ Aᵀ into
    the slot's [tile rows, A_T_COLS] scratch by OpenBLAS (FLIPPED) or fuel's kernel (OWN), then stored
    transposed."""
    rows, k, n, t, cols = v[ROWS], v[K], v[N], v[TILE], v[A_T_COLS]
    tile = v[SCRATCH] + 4 * slot * t * k
    if v[MODE] == DIRECT:
        sgemm(v[SGEMM], 1, 0, rows, r1 - r0, k, v[A], k, tile, k, v[OUT] + 4 * r0, n)
        return
    at = v[C_SCRATCH] + 4 * slot * t * cols
    c = carray(pointer(at, np.float32), (t, cols))
    if v[MODE] == OWN:
        tile_times_at(carray(pointer(tile, np.float32), (t, k)), r1 - r0,
                      carray(pointer(v[A_T], np.float32), (k * cols,)), c)
    else:
        sgemm(v[SGEMM], 0, 0, r1 - r0, rows, k, tile, k, v[A_T], cols, at, cols)
    transpose_into(c.reshape(-1), 0, cols, r1 - r0, rows, carray(pointer(v[OUT], np.float32), (rows * n,)), r0, n)


@njit(inline="always", cache=True)
def part_tiles(v: Any, part: int, parts: int) -> tuple[int, int]:
    """The tiles [i0, i1) of part `part` of `parts` (fixed by the shape: the bytes never depend on them)."""
    return part * v[TILES] // parts, (part + 1) * v[TILES] // parts


@njit(inline="always", cache=True)
def tile_span(v: Any, i: int) -> tuple[int, int]:
    """The W rows [r0, r1) of tile i."""
    return i * v[TILE], min(v[N], (i + 1) * v[TILE])
