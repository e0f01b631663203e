"""FlashAttn's blocked f32 forward as one job: the online softmax of `flash_attn.forward_block` (its row
functions, OpenBLAS's sgemm for both products, called from the task) with no Python between the blocks.

An item is one (group, query block): its queries of every head in the group are stacked into one
`[G·bq, D]` operand, then for each block of BK keys `S = Q·Kᵀ` (sgemm), the row pass
(`flash_attn_rows.online_row`) and `acc += P·V` (sgemm, beta 1), then the rows are normalised into the
output (`flash_attn_rows.store_row`). Items are cut finer than the NumPy steps' (at least ITEMS of them,
by the call's shape only), so that a few groups still spread over the threads (see
docs/performance/attention.md, "blocked f32 task"). Which thread runs an item never changes its bytes;
the item size can, by ulps (OpenBLAS picks its kernels by the product's size), and it is fixed by the
shape. sgemm runs one-threaded inside the task (the BLAS policy of `fuel.runtime.threads`), so its bytes
are those of the same call made through NumPy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from numba import carray, njit

from fuel.cpu.attention.flash_attn_rows import FASTMATH, online_row, store_row, window_keys
from fuel.cpu.simd.sgemm import sgemm
from fuel.runtime import jobs, pool, threads
from fuel.runtime.atomics import claim_slot, pointer, release_slot
from fuel.runtime.buffers import POOL
from fuel.runtime.jobs import ADDRESS, INT, REAL, record_at

if TYPE_CHECKING:
    from fuel.cpu.attention.flash_attn import Problem

ITEMS = 8  # (group, query block) items a call is cut into at least, where its groups are fewer
FLOPS_PER_SECOND = 30e9  # one core's rate at these sizes (products and row passes), for the part count

ATTEND_ARGS = jobs.record(q=ADDRESS, k=ADDRESS, v=ADDRESS, out=ADDRESS, slopes=ADDRESS, groups=INT, heads=INT,
                          sq=INT, sk=INT, d=INT, kl=INT, left=INT, right=INT, scale=REAL, softcap=REAL, bq=INT,
                          bk=INT, qblocks=INT, sgemm=ADDRESS, scratch=ADDRESS, slot_floats=INT, slots=INT,
                          claims=ADDRESS)


def item_rows(n: int, sq: int, most: int) -> int:
    """Queries per item for n groups of sq queries: where the groups are fewer than ITEMS, a multiple of
    16 that makes at least ITEMS items in all; otherwise whole groups of up to `most` queries. Fixed by
    the shape, never by the thread count."""
    if n >= ITEMS:
        return min(most, sq)
    blocks = -(-ITEMS // n)
    return min(most, max(16, 16 * (sq // (16 * blocks))))


def attend_job(p: Problem, out: np.ndarray, bq_most: int, bk: int) -> jobs.Job | None:
    """The job of out [n, G, Sq, D] <- attention of every query block (at most bq_most queries, keys in
    blocks of bk), f32 q, k, v and out (all C-contiguous, K and V `[n, Sk, D]`); None where there is no
    sgemm to call from jitted code. Its scratch holds a slot per thread that may run a part at once."""
    address = threads.blas_sgemm_address()
    if not address:
        return None
    n, g, sq, d = p.q.shape
    bq = item_rows(n, sq, bq_most)
    qblocks = -(-sq // bq)
    lo, hi = p.win.keys(0, sq)
    slots = threads.get_num_threads()
    rows = g * bq
    slot_floats = 2 * rows * d + 2 * rows + rows * min(bk, max(1, hi - lo))
    scratch = POOL.empty((slots * slot_floats,), np.dtype(np.float32))
    claims = np.zeros(slots, np.int64)
    argv = jobs.argv_of(ATTEND_ARGS)
    a = argv[0]
    a["q"], a["k"], a["v"], a["out"], a["slopes"] = (x.ctypes.data for x in (p.q, p.k, p.v, out, p.slopes))
    a["groups"], a["heads"], a["sq"], a["sk"], a["d"] = n, g, sq, p.k.shape[1], d
    a["kl"], a["left"], a["right"], a["scale"], a["softcap"] = p.win.kl, p.win.left, p.win.right, p.scale, p.softcap
    a["bq"], a["bk"], a["qblocks"], a["sgemm"] = bq, bk, qblocks, address
    a["scratch"], a["slot_floats"] = scratch.ctypes.data, slot_floats
    a["slots"], a["claims"] = slots, claims.ctypes.data
    work = 4.0 * n * g * sq * max(1, hi - lo) * d
    return jobs.job(_attend, argv, work / FLOPS_PER_SECOND, n * qblocks, keep=(scratch, claims))


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _item(a: Any, scale: Any, softcap: Any, base: int, grp: int, i0: int) -> None:
    """The item (group grp, queries [i0, i0 + bq)) in the scratch slot at `base`."""
    n, g, sq, sk, d, kl, left, right = a.groups, a.heads, a.sq, a.sk, a.d, a.kl, a.left, a.right
    i1 = min(sq, i0 + a.bq)
    br = i1 - i0
    rows = g * br
    q = carray(pointer(a.q, np.float32), (n, g, sq, d))
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
    slopes = carray(pointer(a.slopes, np.float32), (n, g))[grp:grp + 1]
    lo, hi = window_keys(i0, i1, kl, sq, left, right)
    for j0 in range(lo, hi, a.bk):
        cols = min(hi, j0 + a.bk) - j0
        rows_at = 4 * (grp * sk + j0) * d
        sgemm(a.sgemm, 1, 0, rows, cols, d, base, d, a.k + rows_at, d, at, cols)
        s = carray(pointer(at, np.float32), (1, rows, cols))
        for t in range(rows):
            online_row(s, m, l, acc, t, i0, br, j0, kl, sq, left, right, scale, softcap, slopes)
        # the first block's product is the accumulator (it was all zeros)
        sgemm(a.sgemm, 0, int(j0 > lo), rows, d, cols, at, cols, a.v + rows_at, d, base + 4 * rows * d, d)
    out = carray(pointer(a.out, np.float32), (n, g, sq, d))[grp:grp + 1]
    for t in range(rows):
        store_row(acc, l, out, i0, t)


@pool.task(fastmath=FASTMATH)
def _attend(part: int, parts: int, argv: int) -> None:
    """Part `part` of the call: its share of the (group, query block) items, in one scratch slot."""
    a = record_at(argv, ATTEND_ARGS)
    scale, softcap = np.float32(a.scale), np.float32(a.softcap)
    slot = claim_slot(a.claims, a.slots)
    base = a.scratch + 4 * slot * a.slot_floats
    items = a.groups * a.qblocks
    for item in range(part * items // parts, (part + 1) * items // parts):
        _item(a, scale, softcap, base, item // a.qblocks, (item % a.qblocks) * a.bq)
    release_slot(a.claims, a.slots, slot)
