"""FlashAttn's blocked f32 forward as a task of the spinning pool: the same online softmax as
`attention.forward_block` (its row functions, OpenBLAS's sgemm for both products, called from jitted
code), with no Python between the blocks.

Through `split_work` each step of a block is a NumPy or Numba call from Python, and the two Python
threads hand the GIL to each other through the operating system at every one of them: SmolLM2's
128-token prefill attention (3 kv groups of 3 heads) took 570-700 µs a layer on 2 threads against
600 µs for its three groups one after another in one thread. Here an item is one (group, query block):
its queries of every head in the group are stacked into one `[G·bq, D]` operand, then for each block of
BK keys `S = Q·Kᵀ` (sgemm), the row pass (`attention_rows.online_row`) and `acc += P·V` (sgemm, beta 1),
then the rows are normalised into the output (`attention_rows.store_row`). Items are cut finer than
`attention`'s (at least ITEMS of them, by the call's shape only), so that a few groups still spread
over the threads. A step the executor runs inline (estimated under 150 µs: MiniLM at batch 1) runs its
items here, one after another: after a projection on OpenBLAS's threads their spinning worker would
share a core with the pool's (MiniLM batch 1, 16 sentences: attention 12.2 ms before, 14-18 on the
pool, 10-12 inline). Which thread runs an item never changes its bytes; the item size can, by ulps (OpenBLAS
picks its kernels by the product's size), and it is fixed by the shape. Measured on 2 cores, f32, against
the NumPy steps on `split_work`: SmolLM2's prefill (3 groups of 3 heads, 128 queries, D 64) 803 -> 449 µs,
Gemma-3's (1 group of 4 heads, D 256) 819 -> 522 µs, MiniLM's batch of 32 (384 groups of 24) 931 -> 780 µs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from numba import carray, njit

from fuel.cpu.attention.flash_attn_rows import FASTMATH, online_row, store_row, window_keys
from fuel.cpu.simd.sgemm import sgemm
from fuel.runtime import pool, threads
from fuel.runtime.atomics import claim_slot, pointer, release_slot
from fuel.runtime.buffers import POOL

if TYPE_CHECKING:
    from fuel.cpu.attention.flash_attn import Problem

ITEMS = 8  # (group, query block) items a call is cut into at least, where its groups are fewer
FLOPS_PER_SECOND = 30e9  # one core's rate at these sizes (products and row passes), for the part count
(Q, K, V, OUT, SLOPES, GROUPS, HEADS, SQ, SK, D, KL, LEFT, RIGHT, SCALE, SOFTCAP, BQ, BK, QBLOCKS, SGEMM, SCRATCH,
 SLOT_FLOATS, SLOTS, CLAIMS, FIELDS) = range(24)


def item_rows(n: int, sq: int, most: int) -> int:
    """Queries per item for n groups of sq queries: where the groups are fewer than ITEMS, a multiple of
    16 that makes at least ITEMS items in all; otherwise whole groups of up to `most` queries. Fixed by
    the shape, never by the thread count."""
    if n >= ITEMS:
        return min(most, sq)
    blocks = -(-ITEMS // n)
    return min(most, max(16, 16 * (sq // (16 * blocks))))


def attend(p: Problem, out: np.ndarray, bq_most: int, bk: int) -> bool:
    """out [n, G, Sq, D] <- attention of every query block (at most bq_most queries, keys in blocks of bk),
    f32 q, k, v and out (all C-contiguous, K and V `[n, Sk, D]`); False, doing nothing, where there is no
    sgemm to call from jitted code."""
    address = threads.blas_sgemm_address()
    if not address:
        return False
    n, g, sq, d = p.q.shape
    bq = item_rows(n, sq, bq_most)
    qblocks = -(-sq // bq)
    lo, hi = p.win.keys(0, sq)
    work = 4.0 * n * g * sq * max(1, hi - lo) * d
    parts = 1 if threads.MODE.inline else pool.parts_for(work / FLOPS_PER_SECOND, n * qblocks)
    slots = min(parts, threads.get_num_threads())
    rows = g * bq
    slot_floats = 2 * rows * d + 2 * rows + rows * min(bk, max(1, hi - lo))
    scratch = POOL.empty((slots * slot_floats,), np.dtype(np.float32))
    claims = np.zeros(slots, np.int64)
    argv = np.zeros(FIELDS, np.int64)
    argv[:SCALE] = (p.q.ctypes.data, p.k.ctypes.data, p.v.ctypes.data, out.ctypes.data, p.slopes.ctypes.data, n,
                    g, sq, p.k.shape[1], d, p.win.kl, p.win.left, p.win.right)
    argv[BQ:] = (bq, bk, qblocks, address, scratch.ctypes.data, slot_floats, slots, claims.ctypes.data)
    halves = argv.view(np.float32)  # the two float fields in their slots' first 4 bytes (little-endian)
    halves[2 * SCALE], halves[2 * SOFTCAP] = p.scale, p.softcap
    with threads.one_blas_thread():
        pool.run(_attend, argv, parts)
    return True


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _item(v: Any, scale: Any, softcap: Any, base: int, grp: int, i0: int) -> None:
    """The item (group grp, queries [i0, i0 + bq)) in the scratch slot at `base`."""
    n, g, sq, sk, d, kl, left, right = v[GROUPS], v[HEADS], v[SQ], v[SK], v[D], v[KL], v[LEFT], v[RIGHT]
    i1 = min(sq, i0 + v[BQ])
    br = i1 - i0
    rows = g * br
    q = carray(pointer(v[Q], np.float32), (n, g, sq, d))
    qb = carray(pointer(base, np.float32), (rows, d))
    for h in range(g):
        qb[h * br:(h + 1) * br] = q[grp, h, i0:i1]
    acc = carray(pointer(base + 4 * rows * d, np.float32), (1, rows, d))
    m = carray(pointer(base + 8 * rows * d, np.float32), (1, rows))
    l = carray(pointer(base + 8 * rows * d + 4 * rows, np.float32), (1, rows))
    at = base + 8 * rows * d + 8 * rows  # the scores
    acc[:] = 0
    m[:] = -np.inf
    l[:] = 0
    slopes = carray(pointer(v[SLOPES], np.float32), (n, g))[grp:grp + 1]
    lo, hi = window_keys(i0, i1, kl, sq, left, right)
    for j0 in range(lo, hi, v[BK]):
        cols = min(hi, j0 + v[BK]) - j0
        rows_at = 4 * (grp * sk + j0) * d
        sgemm(v[SGEMM], 1, 0, rows, cols, d, base, d, v[K] + rows_at, d, at, cols)
        s = carray(pointer(at, np.float32), (1, rows, cols))
        for t in range(rows):
            online_row(s, m, l, acc, t, i0, br, j0, kl, sq, left, right, scale, softcap, slopes)
        # the first block's product is the accumulator (it was all zeros)
        sgemm(v[SGEMM], 0, int(j0 > lo), rows, d, cols, at, cols, v[V] + rows_at, d, base + 4 * rows * d, d)
    out = carray(pointer(v[OUT], np.float32), (n, g, sq, d))[grp:grp + 1]
    for t in range(rows):
        store_row(acc, l, out, i0, t)


@pool.task(fastmath=FASTMATH)
def _attend(part: int, parts: int, argv: int) -> None:
    """Part `part` of the call: its share of the (group, query block) items, in one scratch slot."""
    v = carray(pointer(argv, np.int64), (FIELDS,))
    halves = carray(pointer(argv, np.float32), (2 * FIELDS,))
    scale, softcap = halves[2 * SCALE], halves[2 * SOFTCAP]
    slot = claim_slot(v[CLAIMS], v[SLOTS])
    base = v[SCRATCH] + 4 * slot * v[SLOT_FLOATS]
    items = v[GROUPS] * v[QBLOCKS]
    for item in range(part * items // parts, (part + 1) * items // parts):
        _item(v, scale, softcap, base, item // v[QBLOCKS], (item % v[QBLOCKS]) * v[BQ])
    release_slot(v[CLAIMS], v[SLOTS], slot)
