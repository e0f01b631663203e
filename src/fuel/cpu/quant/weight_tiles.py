"""`A @ dequant(W)ᵀ` for a weight kept compressed (GGUF blocks, NF4) when A has many rows: tiles of W's
rows are dequantised into a reused f32 scratch and each is multiplied into its output columns. The tiles
are fixed by the weight's shape, so the bytes never depend on the thread count or on which part runs a
tile.

The product is two jobs of the pool (`tiles_jobs`): a prep job packing Aᵀ into scratch the job owns and
resetting the tile counter, then the weight's own tile task (NF4's, or one per GGUF type), whose parts
each hold a scratch slot and claim tiles one at a time (`next_tile`) until none is left, so the threads
end at most a tile apart whatever the part count (`each_tile`: the loop; a task gives how a tile is
filled). The tasks read one typed record, `TILE_ARGS`: the generic fields, then the weight's own
(`weight`, `weight_cols`, `scales`, `scale_cols`, `table`).

How a tile is multiplied (`MODE`):
- OWN, on AVX-512 and AVX2 hosts for up to `OWN_MAX_ROWS` activation rows: fuel's register-blocked
  kernel (`tile_gemm`), `tile @ Aᵀ` into a [tile rows, Rp] scratch copied transposed into the output, Aᵀ
  packed once per call. Nothing is repacked per tile, where OpenBLAS repacks both operands on every call
  (docs/performance/nf4.md, "weight_tiles").
- Otherwise (and wherever `OWN_KERNEL` is switched off) one one-thread OpenBLAS sgemm a tile, every
  output element one sgemm's dot over all of K. For up to `FLIP_ROWS` activation rows and at least
  `FLIP_MIN_N` weight rows the tile is the sgemm's left operand (FLIPPED: `tile @ Aᵀ`, stored
  transposed), otherwise the right one (DIRECT: `A @ tileᵀ` straight into the output columns). A tile
  job calling sgemm runs with OpenBLAS on one thread (`threads.one_blas_thread`): its bytes are then
  those of the same call made through NumPy.

Tiles of about `TILE_BYTES` (at most 256 rows) for OpenBLAS, `OWN_TILE_BYTES` for fuel's kernel.
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
    pack_panels,
    padded_width,
    tile_times_at,
    tile_times_at_checked,
    transpose_into,
)
from fuel.cpu.simd.sgemm import sgemm
from fuel.runtime import jobs, pool, threads
from fuel.runtime.atomics import claim_slot as claim
from fuel.runtime.atomics import fetch_add, pointer, store
from fuel.runtime.atomics import release_slot as release
from fuel.runtime.buffers import POOL
from fuel.runtime.jobs import ADDRESS, INT, record_at

TILE_BYTES = 4 << 20  # f32 bytes of one dequantised tile multiplied by OpenBLAS (fits L3)
OWN_TILE_BYTES = 1 << 20  # ... by fuel's kernel, which repacks nothing per tile (fits L2)
TILE_GROUPS = 4  # tile counts are multiples of this, so 2 or 4 threads get equal shares
OWN_MAX_ROWS = 512  # activation rows up to which fuel's kernel multiplies the tiles (OWN mode)
FLIP_ROWS = 64  # activation rows up to which the tile is the left operand ...
FLIP_MIN_N = 1024  # ... for weights of at least this many rows

F32 = np.dtype(np.float32)
FLOPS_PER_SECOND = 60e9  # one core's sgemm rate at these shapes, for the pool's part count
SECONDS_PER_VALUE = 0.5e-9  # one core's time to pack a value of Aᵀ

DIRECT, FLIPPED, OWN = range(3)  # how a tile is multiplied (the module's docstring)

# A tile job's record. a_t: Aᵀ ([k, a_t_cols], or its panels in OWN mode; 0 in DIRECT mode); scratch: the
# slots' [tile, k] tiles; c_scratch: their [tile, a_t_cols] products; claims: the slots' claim words
# (int64 [slots]); counter: the next unclaimed tile (int64); sgemm: OpenBLAS's address (0: none). The
# weight's own fields follow, as its task reads them (GGUF: weight, weight_cols = row bytes; NF4: all).
TILE_ARGS = jobs.record(a=ADDRESS, rows=INT, k=INT, a_t=ADDRESS, a_t_cols=INT, n=INT, out=ADDRESS, tile=INT,
                        tiles=INT, scratch=ADDRESS, c_scratch=ADDRESS, slots=INT, claims=ADDRESS, sgemm=ADDRESS,
                        mode=INT, weight=ADDRESS, weight_cols=INT, scales=ADDRESS, scale_cols=INT, table=ADDRESS,
                        counter=ADDRESS)
WEIGHT_FIELDS = ("weight", "weight_cols", "scales", "scale_cols", "table")
# Positions a task may index the record by (`v[N]`) or its argv words by (`WEIGHT`: the weight's first).
N = jobs.word(TILE_ARGS, "n")  # every field is one word: its word is its position
WEIGHT = jobs.word(TILE_ARGS, "weight")

# The prep job's record: a [rows, k] packed into ap as panels of `panel` activations, `width` wide in all;
# the tile counter at `counter` reset to 0.
PACK_ARGS = jobs.record(a=ADDRESS, rows=INT, k=INT, ap=ADDRESS, width=INT, panel=INT, counter=ADDRESS)

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
    straight product is as fast (docs/performance/nf4.md, "weight_tiles")."""
    return OWN_KERNEL and rows <= OWN_MAX_ROWS


def flipped(rows: int, n: int) -> bool:
    """Whether the tile is the sgemm's left operand for R = rows and a weight of n rows."""
    return rows <= FLIP_ROWS and n >= FLIP_MIN_N


class _Layout:
    """How one call multiplies its tiles: the mode, tile rows, and the width `a_t_cols` of Aᵀ (R, or R
    padded to 16 in OWN mode's panels; 0 without one)."""

    def __init__(self, rows: int, k: int, n: int) -> None:
        self.rows, self.k = rows, k
        own = own_mode(rows)
        self.tile = tile_rows(k, n, OWN_TILE_BYTES if own else TILE_BYTES)
        self.mode = OWN if own else FLIPPED if flipped(rows, n) else DIRECT
        self.a_t_cols = padded_width(rows) if own else rows if self.mode == FLIPPED else 0
        self.panel = PANEL if own else rows  # FLIPPED: Aᵀ as one panel, [k, R]


def tiled_product(a2: np.ndarray, n: int, fill: Fill, out: np.ndarray) -> None:
    """out [R, n] <- a2 [R, k] @ dequant(W)ᵀ, all f32 (a2 and out C-contiguous), W's rows from `fill` (a
    Python function): the tiles in order in the calling thread, each multiplied as the tile task does
    (fuel's kernel, or one one-thread sgemm through NumPy), so the bytes are the tile jobs'. For hosts
    whose tiles need OpenBLAS and whose NumPy has no sgemm jitted code can call, and for tests."""
    lay = _Layout(a2.shape[0], a2.shape[1], n)
    t, k = lay.tile, lay.k
    a_t = None
    if lay.mode != DIRECT:
        a_t = POOL.empty((k * lay.a_t_cols,), F32)
        pack_activations(a2, a_t, lay.a_t_cols, lay.panel)
    tile = POOL.empty((t, k), F32)
    c = None if a_t is None else POOL.empty((t, lay.a_t_cols), F32)
    with threads.one_blas_thread():
        for r0 in range(0, n, t):
            r1 = min(n, r0 + t)
            fill(r0, r1, tile)
            if a_t is None or c is None:
                np.matmul(a2, tile[:r1 - r0].T, out=out[:, r0:r1])
                continue
            if lay.mode == OWN:
                tile_times_at_checked(tile, r1 - r0, a_t, c)
            else:
                np.matmul(tile[:r1 - r0], a_t.reshape(k, lay.a_t_cols), out=c[:r1 - r0])
            out[:, r0:r1] = c[:r1 - r0, :lay.rows].T


# ---- the product as jobs of the pool (no Python between the tiles) ----------------------------------

@pool.task()
def _prep_part(part: int, parts: int, argv: int) -> None:
    """Part `part` of the prep job: its share of Aᵀ's panels; part 0 also resets the tile counter."""
    p = record_at(argv, PACK_ARGS)
    if part == 0:
        store(carray(pointer(p.counter, np.int64), (1,)), 0, 0)
    if p.width == 0:
        return
    a = carray(pointer(p.a, np.float32), (p.rows, p.k))
    ap = carray(pointer(p.ap, np.float32), (p.k * p.width,))
    panels = -(-p.width // p.panel)
    pack_panels(a, ap, p.width, p.panel, part * panels // parts, (part + 1) * panels // parts)


@njit(cache=True)
def _fill(a2: Any, out: Any, a_t: Any, scratch: Any, c_scratch: Any, claims: Any, rows: int, k: int, n: int,
          cols: int, tile: int, tiles: int, slots: int, sgemm_at: int, mode: int, argv: Any, prep: Any) -> None:
    v = argv[0]
    v.a, v.rows, v.k, v.a_t, v.a_t_cols, v.n, v.out = a2.ctypes.data, rows, k, a_t.ctypes.data, cols, n, out.ctypes.data
    v.tile, v.tiles, v.scratch, v.c_scratch, v.slots = tile, tiles, scratch.ctypes.data, c_scratch.ctypes.data, slots
    v.claims, v.counter, v.sgemm, v.mode = claims.ctypes.data, claims.ctypes.data + 8 * slots, sgemm_at, mode
    p = prep[0]
    p.a, p.rows, p.k, p.ap, p.width, p.counter = a2.ctypes.data, rows, k, a_t.ctypes.data, cols, v.counter


def tiles_jobs(task: pool.Task, a2: np.ndarray, n: int, out: np.ndarray,
               weight: Sequence[int]) -> tuple[jobs.Job, jobs.Job] | None:
    """The jobs of out [R, n] <- a2 [R, k] @ dequant(W)ᵀ (f32, C-contiguous) by `task`, W's own fields (its
    arrays' addresses and sizes, in `WEIGHT_FIELDS` order) given: the prep job, then the tile job. None
    where the tiles need OpenBLAS and NumPy's has no ILP64 sgemm to call (the caller then runs
    `tiled_product`). Run them with one BLAS thread (`run_tiles`) unless the mode is OWN."""
    if len(weight) > len(WEIGHT_FIELDS):
        raise ValueError(f"tiles_jobs: {len(weight)} weight fields, the record has {len(WEIGHT_FIELDS)}")
    address = threads.blas_sgemm_address()
    rows, k = a2.shape
    if not (address or own_mode(rows)):
        return None
    lay = _Layout(rows, k, n)
    t = lay.tile
    tiles = -(-n // t)
    slots = min(tiles, threads.get_num_threads())  # a part holds one; more parts at once wait for one
    scratch = POOL.empty((slots, t, k), F32, 0)  # pooled at any size: a repeated product allocates nothing
    a_t = POOL.empty((k * lay.a_t_cols,), F32, 0)
    c_scratch = POOL.empty((slots, t, lay.a_t_cols), F32, 0)
    claims = np.zeros(slots + 1, np.int64)  # the slots' claim words, then the tile counter
    argv, prep = jobs.argv_of(TILE_ARGS), jobs.argv_of(PACK_ARGS)
    for name, value in zip(WEIGHT_FIELDS, weight, strict=False):
        argv[0][name] = value
    prep[0]["panel"] = max(lay.panel, 1)
    _fill(a2, out, a_t, scratch, c_scratch, claims, rows, k, n, lay.a_t_cols, t, tiles, slots, address, lay.mode,
          argv, prep)
    panels = -(-lay.a_t_cols // max(lay.panel, 1))
    return (jobs.job(_prep_part, prep, k * lay.a_t_cols * SECONDS_PER_VALUE, max(panels, 1), keep=(a_t, claims)),
            jobs.job(task, argv, 2 * rows * n * k / FLOPS_PER_SECOND, tiles, keep=(scratch, c_scratch, claims, a_t)))


def calls_blas(tile_job: jobs.Job) -> bool:
    """Whether a tile job multiplies by OpenBLAS (any mode but OWN): it must then run with one BLAS thread."""
    return int(tile_job.argv[0]["mode"]) != OWN


def run_tiles(tile_jobs: tuple[jobs.Job, jobs.Job]) -> None:
    """Run a product's prep and tile jobs, OpenBLAS on one thread meanwhile where the tiles call it."""
    if calls_blas(tile_jobs[1]):
        with threads.one_blas_thread():
            jobs.run(tile_jobs)
    else:
        jobs.run(tile_jobs)


def post_tiles(task: pool.Task, a2: np.ndarray, n: int, out: np.ndarray, weight: Sequence[int]) -> bool:
    """Run `tiles_jobs(task, a2, n, out, weight)` (the arrays W's fields address alive until this returns);
    False, doing nothing, where there are none (the caller then runs `tiled_product`)."""
    found = tiles_jobs(task, a2, n, out, weight)
    if found is None:
        return False
    run_tiles(found)
    return True


@njit(inline="always", cache=True)
def tile_args(argv: int) -> Any:
    """The record of a tile job (`TILE_ARGS`), read by name, at argv."""
    return record_at(argv, TILE_ARGS)


job = tile_args  # the name GGUF's tile tasks call it by


@njit(inline="always", cache=True)
def next_tile(v: Any) -> int:
    """The next tile no part has claimed (`v.tiles` or more: none left); the prep job reset the counter."""
    return fetch_add(carray(pointer(v.counter, np.int64), (1,)), 0, 1)


@njit(inline="always", cache=True)
def first_claim(v: Any) -> tuple[int, int, Any]:
    """(the first tile a part claims, the scratch slot it then holds, that slot's f32 tile), or (a tile past the
    last, -1, slot 0's tile, unused): a part that finds no tile left takes no slot. Its later tiles come from
    `next_tile`; `release_slot` at the end."""
    i = next_tile(v)
    if i >= v.tiles:
        return i, -1, tile_of(v, 0)
    slot = claim_slot(v)
    return i, slot, tile_of(v, slot)


@njit(inline="always", cache=True)
def claim_slot(v: Any) -> int:
    """A scratch slot no other running part holds."""
    return claim(v.claims, v.slots)


@njit(inline="always", cache=True)
def release_slot(v: Any, slot: int) -> None:
    release(v.claims, v.slots, slot)


@njit(inline="always", cache=True)
def tile_of(v: Any, slot: int) -> Any:
    """The f32 [tile, k] scratch tile of a slot."""
    t, k = v.tile, v.k
    return carray(pointer(v.scratch + 4 * slot * t * k, np.float32), (t, k))


@njit(inline="always", cache=True)
def multiply_tile(v: Any, slot: int, r0: int, r1: int) -> None:
    """out[:, r0:r1] <- a @ tile[:r1 - r0]ᵀ: straight into the output columns (DIRECT), or tile @ Aᵀ into
    the slot's [tile rows, a_t_cols] scratch by OpenBLAS (FLIPPED) or fuel's kernel (OWN), then stored
    transposed."""
    rows, k, n, t, cols = v.rows, v.k, v.n, v.tile, v.a_t_cols
    tile = v.scratch + 4 * slot * t * k
    if v.mode == DIRECT:
        sgemm(v.sgemm, 1, 0, rows, r1 - r0, k, v.a, k, tile, k, v.out + 4 * r0, n)
        return
    at = v.c_scratch + 4 * slot * t * cols
    c = carray(pointer(at, np.float32), (t, cols))
    if v.mode == OWN:
        tile_times_at(carray(pointer(tile, np.float32), (t, k)), r1 - r0,
                      carray(pointer(v.a_t, np.float32), (k * cols,)), c)
    else:
        sgemm(v.sgemm, 0, 0, r1 - r0, rows, k, tile, k, v.a_t, cols, at, cols)
    transpose_into(c.reshape(-1), 0, cols, r1 - r0, rows, carray(pointer(v.out, np.float32), (rows * n,)), r0, n)


@njit(inline="always", cache=True)
def tile_span(v: Any, i: int) -> tuple[int, int]:
    """The W rows [r0, r1) of tile i."""
    return i * v.tile, min(v.n, (i + 1) * v.tile)


@njit(inline="always", cache=True)
def each_tile(v: Any, fill: Any, how: Any, state: Any) -> None:
    """A tile task's part: tiles claimed one at a time (`next_tile`, so the threads end at most a tile apart),
    each written into the part's scratch slot by `fill(tile, r0, r1, how, state)` (its W rows [r0, r1) as
    f32 rows; `how` a function it calls, or unused) and multiplied; the slot is released at the end."""
    i, slot, tile = first_claim(v)
    if slot < 0:
        return
    while i < v.tiles:
        r0, r1 = tile_span(v, i)
        fill(tile, r0, r1, how, state)
        multiply_tile(v, slot, r0, r1)
        i = next_tile(v)
    release_slot(v, slot)
