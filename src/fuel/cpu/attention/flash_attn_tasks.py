"""FlashAttn's blocked forward as one job: the online softmax of `flash_attn_steps.forward_block` (its row
functions, OpenBLAS's sgemm or dgemm for both products, called from the task) with no Python between blocks.

An item is one (group, query block): its queries of every head in the group are stacked into one
`[G·bq, D]` operand (half types widened exactly to f32 as they are copied), then for each block of BK
keys `S = Q·Kᵀ` (gemm), the row pass (`flash_attn_rows.online_row`) and `acc += P·V` (gemm), then the
rows are normalised into the output (`flash_attn_rows.store_row`). Half-type K and V are widened a key
block at a time into the slot. Which thread runs an item never changes its bytes. BLAS runs one-threaded
inside the task (the BLAS policy of `fuel.runtime.threads`), so each product's bytes are those of the same
call made through NumPy.

Two forms of the same item (`attend_job`'s `apart`):
- f32 (`apart` False): items cut finer than the NumPy steps' (at least ITEMS of them, by the call's shape
  only) so that a few groups still spread over the threads, and P·V added by the gemm itself (beta 1);
  see docs/performance/attention.md, "blocked f32 task".
- f64 and the half types (`apart` True): the NumPy steps' blocks (`flash_attn_steps.steps`) and their
  arithmetic: each block's P·V is its own product, added to the accumulator as NumPy's `acc += P·V`
  does, so the bytes are the steps'; see docs/performance/attention.md, "products in tasks".
NumPy computes a product with a dimension of 1 without gemm (a dot, a gemv or its own loop), so a call
with such a block (`degenerate`) is left to the steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from numba import carray, njit

from fuel.cpu.attention.flash_attn_rows import FASTMATH, online_row, store_row, window_keys
from fuel.cpu.attention.flash_attn_steps import ONLINE_ARGS, ONLINE_TASKS, STORE_ARGS, STORE_TASKS
from fuel.cpu.simd.sgemm import gemm
from fuel.cpu.simd.vecmath import widen
from fuel.dtype import DType
from fuel.runtime import jobs, pool, threads
from fuel.runtime.atomics import call_task, claim_slot, pointer, release_slot
from fuel.runtime.buffers import POOL
from fuel.runtime.jobs import ADDRESS, INT, REAL, record_at

if TYPE_CHECKING:
    from fuel.cpu.attention.flash_attn_steps import Problem

ITEMS = 8  # (group, query block) items an f32 call is cut into at least, where its groups are fewer
FLOPS_PER_SECOND = 30e9  # one core's rate at these sizes (products and row passes), for the part count

# q [n, G, sq, d] and out in their storage types; k, v rows of d values, kgroup/vgroup values apart per
# group; slopes [n, G] in the accumulation type; `cols` the widest key block, which sizes the slot.
ATTEND_ARGS = jobs.record(q=ADDRESS, k=ADDRESS, v=ADDRESS, out=ADDRESS, slopes=ADDRESS, groups=INT, heads=INT,
                          sq=INT, kgroup=INT, vgroup=INT, d=INT, kl=INT, left=INT, right=INT, scale=REAL,
                          softcap=REAL, bq=INT, bk=INT, cols=INT, qblocks=INT, gemm=ADDRESS, online=ADDRESS,
                          store=ADDRESS, scratch=ADDRESS, slot_size=INT, records=ADDRESS, slots=INT, claims=ADDRESS)
RECORD_BYTES = 256  # a slot's words for the records of the row-pass tasks an item calls


def item_rows(n: int, sq: int, most: int) -> int:
    """Queries per f32 item for n groups of sq queries: where the groups are fewer than ITEMS, a multiple of
    16 that makes at least ITEMS items in all; otherwise whole groups of up to `most` queries. Fixed by
    the shape, never by the thread count."""
    if n >= ITEMS:
        return min(most, sq)
    blocks = -(-ITEMS // n)
    return min(most, max(16, 16 * (sq // (16 * blocks))))


def degenerate(p: Problem, bq: int, bk: int) -> bool:
    """Whether some block product of the steps with query blocks of bq and key blocks of bk has a dimension
    of 1 (one stacked query row, one key, or D 1), which NumPy computes without gemm."""
    g, sq, d = p.q.shape[1], p.q.shape[2], p.q.shape[3]
    if d == 1:
        return True
    for i0 in range(0, sq, bq):
        i1 = min(sq, i0 + bq)
        lo, hi = p.win.keys(i0, i1)
        if hi > lo and (g * (i1 - i0) == 1 or (hi - lo) % bk == 1):
            return True
    return False


@njit(cache=True)
def slot_of(rows: int, d: int, cols: int) -> int:
    """Values of one part's scratch slot (`_item`'s layout): qb, acc and P·V [rows, d]; m and l [rows];
    the scores [rows, cols]; widened K and V blocks [cols, d]."""
    return 3 * rows * d + 2 * rows + rows * cols + 2 * cols * d


def attend_job(p: Problem, out: np.ndarray, bq: int, bk: int, apart: bool) -> jobs.Job | None:
    """The job of out [n, G, Sq, D] <- attention of every query block of bq queries (f32: `item_rows` of at
    most bq), keys in blocks of bk: q, k and v in one storage type (f32, f64, bf16 or f16; K and V
    `[n, kl.., D]` with contiguous rows), out in f32, f64 or bf16 bits. None where there is no gemm to
    call from jitted code, or where the call is `degenerate`. Its scratch holds a slot per thread that
    may run a part at once."""
    acc = p.slopes.dtype
    address = threads.blas_sgemm_address() if acc == np.float32 else threads.blas_address("dgemm")
    stored = _BITS.get(p.q.dtype, p.q.dtype)
    task = _TASKS.get((stored, out.dtype, apart))
    n, g, sq, d = p.q.shape
    rows_contiguous = all(x.strides[1:] == (d * x.itemsize, x.itemsize) for x in (p.k, p.v))
    if not address or task is None or not rows_contiguous or not p.k.dtype == p.v.dtype == p.q.dtype:
        return None
    if not apart:
        bq = item_rows(n, sq, bq)
    elif degenerate(p, bq, bk):
        return None
    qblocks = -(-sq // bq)
    lo, hi = p.win.keys(0, sq)
    cols = min(bk, max(1, hi - lo))
    slots = threads.get_num_threads()
    slot_size = slot_of(g * bq, d, cols)
    scratch = POOL.empty((slots * slot_size,), acc)
    claims = np.zeros(slots, np.int64)
    records = np.zeros(slots * RECORD_BYTES // 8, np.int64)
    argv = jobs.argv_of(ATTEND_ARGS)
    a = argv[0]
    a["q"], a["k"], a["v"], a["out"], a["slopes"] = (x.ctypes.data for x in (p.q, p.k, p.v, out, p.slopes))
    a["groups"], a["heads"], a["sq"], a["d"] = n, g, sq, d
    a["kgroup"], a["vgroup"] = p.k.strides[0] // p.k.itemsize, p.v.strides[0] // p.v.itemsize
    a["kl"], a["left"], a["right"], a["scale"], a["softcap"] = p.win.kl, p.win.left, p.win.right, p.scale, p.softcap
    a["bq"], a["bk"], a["cols"], a["qblocks"], a["gemm"] = bq, bk, cols, qblocks, address
    a["online"], a["store"] = ONLINE_TASKS[acc].address, STORE_TASKS[acc, out.dtype].address
    a["scratch"], a["slot_size"], a["records"] = scratch.ctypes.data, slot_size, records.ctypes.data
    a["slots"], a["claims"] = slots, claims.ctypes.data
    work = 4.0 * n * g * sq * max(1, hi - lo) * d
    return jobs.job(task, argv, work / FLOPS_PER_SECOND, n * qblocks, keep=(scratch, claims, records))


@njit(inline="always", cache=True)
def _widen_rows(src: Any, dst: Any, at: int, count: int, d: int) -> None:
    """dst [count, d] <- count rows of d values of the flat src from `at`, each widened exactly."""
    for j in range(count):
        for c in range(d):
            dst[j, c] = widen(src[at + j * d + c])


@njit(inline="always", cache=True, fastmath=FASTMATH)
def forward_item(a: Any, base: int, rec: int, grp: int, i0: int, i1: int, src: Any, dt: Any, w: int, half: bool,
                 apart: bool) -> None:
    """The online softmax of group grp's queries [i0, i1) in the scratch slot at `base` (`slot_of`'s
    layout; rec: RECORD_BYTES of scratch for a called task's record), leaving there the stacked queries qb,
    the unnormalised output acc and each row's max m and sum l: q, k, v read as src (half: bits widened to
    dt), computed in dt (w bytes a value). `a` is a record with ATTEND_ARGS's fields."""
    n, g, sq, d, kl, left, right = a.groups, a.heads, a.sq, a.d, a.kl, a.left, a.right
    scale, softcap = dt(a.scale), dt(a.softcap)
    br = i1 - i0
    rows = g * br
    q = carray(pointer(a.q, src), (n, g, sq, d))
    qb = carray(pointer(base, dt), (rows, d))
    for h in range(g):
        for r in range(br):
            for c in range(d):
                qb[h * br + r, c] = widen(q[grp, h, i0 + r, c])
    at_acc = base + w * rows * d
    at_pv = at_acc + w * rows * d
    at_m = at_pv + w * rows * d
    at_s = at_m + 2 * w * rows
    at_kb = at_s + w * rows * a.cols
    at_vb = at_kb + w * a.cols * d
    acc = carray(pointer(at_acc, dt), (1, rows, d))
    m = carray(pointer(at_m, dt), (1, rows))
    l = carray(pointer(at_m + w * rows, dt), (1, rows))
    acc[:] = 0
    m[:] = -np.inf
    l[:] = 0
    slopes = carray(pointer(a.slopes, dt), (n, g))[grp:grp + 1]
    lo, hi = window_keys(i0, i1, kl, sq, left, right)
    for j0 in range(lo, hi, a.bk):
        cols = min(hi, j0 + a.bk) - j0
        if half:  # this block of K and V, widened into the slot
            _widen_rows(carray(pointer(a.k, src), (n * a.kgroup,)), carray(pointer(at_kb, dt), (cols, d)),
                        grp * a.kgroup + j0 * d, cols, d)
            _widen_rows(carray(pointer(a.v, src), (n * a.vgroup,)), carray(pointer(at_vb, dt), (cols, d)),
                        grp * a.vgroup + j0 * d, cols, d)
            kb, vb = at_kb, at_vb
        else:
            kb, vb = a.k + w * (grp * a.kgroup + j0 * d), a.v + w * (grp * a.vgroup + j0 * d)
        gemm(w, a.gemm, 1, 0, rows, cols, d, base, d, kb, d, at_s, cols)
        s = carray(pointer(at_s, dt), (1, rows, cols))
        if apart:  # the steps' own row-pass task (`flash_attn_steps.ONLINE_TASKS`), called with one part
            r = record_at(rec, ONLINE_ARGS)
            r.s, r.m, r.l, r.acc, r.slopes = at_s, at_m, at_m + w * rows, at_acc, a.slopes + w * grp * g
            r.n, r.rows, r.cols, r.d, r.heads = 1, rows, cols, d, g
            r.i0, r.bq, r.j0, r.kl, r.sq, r.left, r.right = i0, br, j0, kl, sq, left, right
            r.scale, r.softcap = a.scale, a.softcap
            call_task(a.online, 0, 1, rec)
        else:
            for t in range(rows):
                online_row(s, m, l, acc, t, i0, br, j0, kl, sq, left, right, scale, softcap, slopes)
        if j0 == lo or not apart:  # the first block's product is the accumulator (it was all zeros)
            gemm(w, a.gemm, 0, int(j0 > lo), rows, d, cols, at_s, cols, vb, d, at_acc, d)
        else:
            gemm(w, a.gemm, 0, 0, rows, d, cols, at_s, cols, vb, d, at_pv, d)
            pv = carray(pointer(at_pv, dt), (1, rows, d))
            for t in range(rows):
                for c in range(d):
                    acc[0, t, c] += pv[0, t, c]


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _item(a: Any, base: int, rec: int, grp: int, i0: int, src: Any, dt: Any, st: Any, w: int, sw: int, half: bool,
          apart: bool) -> None:
    """The item (group grp, queries [i0, i0 + bq)) in the scratch slot at `base`, normalised into out
    (stored as st, sw bytes a value)."""
    i1 = min(a.sq, i0 + a.bq)
    forward_item(a, base, rec, grp, i0, i1, src, dt, w, half, apart)
    g, sq, d = a.heads, a.sq, a.d
    rows = g * (i1 - i0)
    at_acc, at_l = base + w * rows * d, base + w * (3 * rows * d + rows)
    if apart:  # the steps' own store task (`flash_attn_steps.STORE_TASKS`), called with one part
        r = record_at(rec, STORE_ARGS)
        r.acc, r.l, r.out = at_acc, at_l, a.out + sw * grp * g * sq * d
        r.n, r.rows, r.d, r.heads, r.sq, r.i0 = 1, rows, d, g, sq, i0
        call_task(a.store, 0, 1, rec)
        return
    acc = carray(pointer(at_acc, dt), (1, rows, d))
    l = carray(pointer(at_l, dt), (1, rows))
    out = carray(pointer(a.out, st), (a.groups, g, sq, d))[grp:grp + 1]
    for t in range(rows):
        store_row(acc, l, out, i0, t)


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _items(part: int, parts: int, argv: int, src: Any, dt: Any, st: Any, w: int, sw: int, half: bool,
           apart: bool) -> None:
    """Part `part` of the call: its share of the (group, query block) items, in one scratch slot."""
    a = record_at(argv, ATTEND_ARGS)
    slot = claim_slot(a.claims, a.slots)
    base = a.scratch + w * slot * a.slot_size
    rec = a.records + RECORD_BYTES * slot
    items = a.groups * a.qblocks
    for item in range(part * items // parts, (part + 1) * items // parts):
        _item(a, base, rec, item // a.qblocks, (item % a.qblocks) * a.bq, src, dt, st, w, sw, half, apart)
    release_slot(a.claims, a.slots, slot)


@pool.task(fastmath=FASTMATH)
def _attend_f32(part: int, parts: int, argv: int) -> None:
    _items(part, parts, argv, np.float32, np.float32, np.float32, 4, 4, False, False)


@pool.task(fastmath=FASTMATH)
def _attend_f64(part: int, parts: int, argv: int) -> None:
    _items(part, parts, argv, np.float64, np.float64, np.float64, 8, 8, False, True)


@pool.task(fastmath=FASTMATH)
def _attend_bf16(part: int, parts: int, argv: int) -> None:
    """bf16 bits in, f32 compute, bf16 bits out (rounded once)."""
    _items(part, parts, argv, np.uint16, np.float32, np.uint16, 4, 2, True, True)


@pool.task(fastmath=FASTMATH)
def _attend_f16(part: int, parts: int, argv: int) -> None:
    """f16 bits (int16) in, f32 compute and out."""
    _items(part, parts, argv, np.int16, np.float32, np.float32, 4, 4, True, True)


# (storage of q, k and v as the task reads it, of out, apart) -> task: bf16 as uint16 bits, f16 as int16 bits
# (`vecmath.widen`), a bf16 out as its bits.
_BITS = {np.dtype(DType.BF16.np): np.dtype(np.uint16), np.dtype(np.float16): np.dtype(np.int16)}
_TASKS = {(np.dtype(np.float32), np.dtype(np.float32), False): _attend_f32,
          (np.dtype(np.float64), np.dtype(np.float64), True): _attend_f64,
          (np.dtype(np.uint16), np.dtype(np.uint16), True): _attend_bf16,
          (np.dtype(np.int16), np.dtype(np.float32), True): _attend_f16}
