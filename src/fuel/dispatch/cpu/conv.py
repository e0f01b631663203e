"""Conv2D (entry 6) on the CPU: im2col blocks onto OpenBLAS, a direct Numba loop for depthwise shapes.

Per group the convolution is one product `out[co, q] = Σ_k w[co, k] · cols[k, q]`, k = (ci, kh, kw) and
q = (n, oh, ow) running over the whole batch. It is cut into blocks of PB columns (and KB rows of k
when k is long) sized so a block of `cols` stays in L2: a Numba pass gathers the block, BLAS multiplies
it into a scratch block, and a Numba pass stores that into `out` with the bias (K blocks are summed in
order first). The gather takes one of three forms:
- unit stride: x is copied once into zero-padded planes, and q runs over the padded width
  (q = n·Q + oh·Wp + ow, the Wp − Wo columns between output rows are computed and dropped, at most
  1/8 extra), so each row of a block is one contiguous copy;
- other strides: runs along output rows, with zero heads and tails where a tap reads padding;
- a kernel wider than the output (the weight gradient, a Conv2D of x against the upstream gradient):
  the transpose, `cols[q, k]`, with runs along the kernel's rows, and `out[q, co] = cols @ wᵀ`.
With few output channels per group (depthwise) or few taps, where the gather would cost as much as
the product, a direct loop over (image, output channel) planes runs instead: the bias, then the taps.

The blocks are independent tasks split over fuel's threads, each running a one-thread BLAS
(`threads.split_work`). Every block size is a function of the shapes only, and OpenBLAS splits
products over M and N, never K, so results are the same bytes at any thread count. bf16/f16 are
widened exactly to f32 once, computed in f32 and rounded once on store; f64 runs in f64.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from numba import njit, prange

from fuel.dispatch import threads
from fuel.dispatch.buffers import POOL
from fuel.dispatch.cpu.driver import row_kernel
from fuel.dispatch.cpu.half import narrow_into, widened
from fuel.dispatch.fused import (
    CONTIGUOUS_ONLY,
    BackendImpl,
    CostEstimate,
    FusedKernelRegistry,
    PrecisionGuarantee,
    revision_of,
)
from fuel.dispatch.threads import split_work
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.node import Shape
from fuel.graph.registry import FusedOps

BLOCK_BYTES = 1 << 20  # one gathered block (and its product) stays in L2 (measured best of 128 KiB-4 MiB)
KB_MAX = 2048  # longest reduction run in one product; longer ones are summed block by block
PB_ALIGN = 16
PB_MIN = 64  # narrower products run BLAS far below its speed
MIN_BLOCKS = 8  # a product of this many PB_MIN columns or more is cut into at least this many tasks
UNIT_MAX_WASTE = 8  # the padded-plane form computes (Wp − Wo)/Wo extra columns: at most 1/8 of them
DIRECT_MAX_M = 4  # output channels per group up to which the direct loop runs (no gather)
DIRECT_MAX_K = 8  # taps (Cin/groups · Kh · Kw) up to which the direct loop runs


def acc_dtype(out: np.ndarray) -> np.dtype[Any]:
    return np.dtype(np.float64) if out.dtype == np.float64 else np.dtype(np.float32)


def working(a: np.ndarray, acc: np.dtype[Any]) -> np.ndarray:
    """An input in the working type: itself (f32/f64), or an exact f32 copy (bf16/f16)."""
    return a if a.dtype == acc else widened(a)


def block_columns(rows: int, itemsize: int, total: int) -> int:
    """Columns per block for `rows` rows: about BLOCK_BYTES, a multiple of PB_ALIGN, at least PB_MIN,
    at most `total`."""
    pb = max(PB_MIN, BLOCK_BYTES // max(1, rows * itemsize) // PB_ALIGN * PB_ALIGN)
    # enough tasks for the threads (a fixed count: the split never depends on how many there are)
    pb = min(pb, max(PB_MIN, -(-total // MIN_BLOCKS // PB_ALIGN) * PB_ALIGN))
    return max(1, min(pb, total))


def run_tasks(fn: Callable[[Iterable[int]], None], total: int) -> None:
    """Run `fn` over the task ids [0, total) on fuel's threads (`threads.split_work`), each thread taking
    the next id when it is done with one (a core slowed by other work takes fewer), every product on a
    one-thread BLAS, also when the tasks run inline (one task, a serial step): OpenBLAS splits one
    product over its threads with other roundings for some shapes (a dgemm [16, 72] @ [72, 1678]
    differed), so the bytes would otherwise depend on its thread count. A task's bytes never depend
    on which thread runs it."""
    ids = itertools.count()

    def pull() -> Iterator[int]:
        for t in ids:  # next() on a shared count is atomic under the GIL
            if t >= total:
                return
            yield t

    def part(_: range) -> None:
        fn(pull())

    with threads.one_blas_thread():  # also when split_work runs the parts inline
        split_work(part, total)


@njit(cache=True, nogil=True)
def _im2col(x: Any, c0: int, r0: int, r1: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int,
            pt: int, pl: int, ho: int, wo: int, q0: int, q1: int, cols: Any) -> None:
    """cols[r − r0, q − q0] = x[n, c0 + ci, oh·sh + a·dh − pt, ow·sw + b·dw − pl] (0 outside x) for the
    rows r = (ci, a, b) in [r0, r1) and the columns q = (n, oh, ow) in [q0, q1).

    The block's columns are first cut into runs along output rows (one division per block, none per
    element); each row of cols is then a few contiguous copies with zero heads and tails."""
    h, w = x.shape[2], x.shape[3]
    p = ho * wo
    taps = kh * kw
    nr = (q1 - q0) // wo + 2
    runs = np.empty((nr, 5), np.int64)  # n, oh, first ow, length, first column
    q, k = q0, 0
    n = q // p
    oh = (q - n * p) // wo
    ow = q - n * p - oh * wo
    while q < q1:
        length = min(wo - ow, q1 - q)
        runs[k, 0], runs[k, 1], runs[k, 2], runs[k, 3], runs[k, 4] = n, oh, ow, length, q - q0
        k += 1
        q += length
        ow = 0
        oh += 1
        if oh == ho:
            oh = 0
            n += 1
    for r in range(r0, r1):
        ci = r // taps
        a = (r - ci * taps) // kw
        b = r - ci * taps - a * kw
        row = cols[r - r0]
        for i in range(k):
            length = runs[i, 3]
            seg = row[runs[i, 4]:runs[i, 4] + length]
            ih = runs[i, 1] * sh + a * dh - pt
            if ih < 0 or ih >= h:
                for t in range(length):
                    seg[t] = 0
                continue
            src = x[runs[i, 0], c0 + ci, ih]
            iw0 = runs[i, 2] * sw + b * dw - pl
            lo = 0 if iw0 >= 0 else min(length, (sw - 1 - iw0) // sw)
            hi = max(lo, 0 if iw0 >= w else min(length, (w - 1 - iw0) // sw + 1))
            for t in range(lo):
                seg[t] = 0
            if sw == 1:  # slices indexed from 0: LLVM sees no negative index and vectorises the copy
                s1, d1 = src[iw0 + lo:iw0 + hi], seg[lo:hi]
                for t in range(hi - lo):
                    d1[t] = s1[t]
            else:
                for t in range(lo, hi):
                    seg[t] = src[iw0 + t * sw]
            for t in range(hi, length):
                seg[t] = 0


@njit(cache=True, nogil=True)
def _store(res: Any, out: Any, bias: Any, has_bias: bool, co0: int, q0: int, q1: int) -> None:
    """out[n, co0 + co, s] = res[co, q − q0] (+ bias[co0 + co]) for q = (n, s) in [q0, q1); out [N, Cout, P]."""
    p = out.shape[2]
    q = q0
    while q < q1:
        n = q // p
        s = q - n * p
        run = min(p - s, q1 - q)
        j = q - q0
        for co in range(res.shape[0]):
            dst = out[n, co0 + co]
            src = res[co]
            if has_bias:
                bv = bias[co0 + co]
                for t in range(run):
                    dst[s + t] = src[j + t] + bv
            else:
                for t in range(run):
                    dst[s + t] = src[j + t]
        q += run


@njit(cache=True, nogil=True)
def _im2row(x: Any, c0: int, r0: int, r1: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int,
            pt: int, pl: int, ho: int, wo: int, q0: int, q1: int, cols: Any) -> None:
    """The transpose of _im2col, for kernels wider than the output (a weight gradient's form):
    cols[q − q0, r − r0] with each column q's taps copied as runs along the kernel width."""
    h, w = x.shape[2], x.shape[3]
    p = ho * wo
    taps = kh * kw
    n = q0 // p
    oh = (q0 - n * p) // wo
    ow = q0 - n * p - oh * wo
    for q in range(q0, q1):
        dst = cols[q - q0]
        r = r0
        while r < r1:
            ci = r // taps
            a = (r - ci * taps) // kw
            b0 = r - ci * taps - a * kw
            length = min(kw - b0, r1 - r)
            seg = dst[r - r0:r - r0 + length]
            ih = oh * sh + a * dh - pt
            if ih < 0 or ih >= h:
                for t in range(length):
                    seg[t] = 0
            else:
                src = x[n, c0 + ci, ih]
                iw0 = ow * sw + b0 * dw - pl
                lo = 0 if iw0 >= 0 else min(length, (dw - 1 - iw0) // dw)
                hi = max(lo, 0 if iw0 >= w else min(length, (w - 1 - iw0) // dw + 1))
                for t in range(lo):
                    seg[t] = 0
                if dw == 1:
                    s1, d1 = src[iw0 + lo:iw0 + hi], seg[lo:hi]
                    for t in range(hi - lo):
                        d1[t] = s1[t]
                else:
                    for t in range(lo, hi):
                        seg[t] = src[iw0 + t * dw]
                for t in range(hi, length):
                    seg[t] = 0
            r += length
        ow += 1
        if ow == wo:
            ow = 0
            oh += 1
            if oh == ho:
                oh = 0
                n += 1


@njit(cache=True, nogil=True)
def _store_rows(res: Any, out: Any, bias: Any, has_bias: bool, co0: int, q0: int, q1: int) -> None:
    """out[n, co0 + co, s] = res[q − q0, co] (+ bias) for q = (n, s) in [q0, q1); out [N, Cout, P]."""
    p = out.shape[2]
    for q in range(q0, q1):
        n = q // p
        s = q - n * p
        src = res[q - q0]
        for co in range(src.shape[0]):
            out[n, co0 + co, s] = src[co] + bias[co0 + co] if has_bias else src[co]


@row_kernel()
def _pad_planes(x: Any, xp: Any, pt: int, pl: int) -> None:
    """xp[n, c, i, j] = x[n, c, i − pt, j − pl], 0 outside x (pt, pl may be negative: a crop)."""
    nb, cin, hp, wp = xp.shape
    h, w = x.shape[2], x.shape[3]
    for r in prange(nb * cin * hp):
        nc = r // hp
        i = r - nc * hp
        n = nc // cin
        c = nc - n * cin
        dst = xp[n, c, i]
        ih = i - pt
        lo = min(wp, max(0, pl))
        hi = max(lo, min(wp, w + pl))
        if ih < 0 or ih >= h:
            lo = hi = wp
        for j in range(lo):
            dst[j] = 0
        if hi > lo:
            src = x[n, c, ih, lo - pl:hi - pl]
            seg = dst[lo:hi]
            for j in range(hi - lo):
                seg[j] = src[j]
        for j in range(hi, wp):
            dst[j] = 0


@njit(cache=True, nogil=True)
def _im2col_unit(xp: Any, c0: int, r0: int, r1: int, kh: int, kw: int, dh: int, dw: int, wp: int, qimg: int,
                 q0: int, q1: int, cols: Any) -> None:
    """Unit stride over padded planes xp [N, C, Hp·Wp]: column q = n·qimg + oh·Wp + ow (ow < Wp, those
    past Wo are discarded by _store_unit), so row r = (ci, a, b) of a block is one contiguous copy of
    xp[n, c0 + ci] from a·dh·Wp + b·dw per image the block touches."""
    taps = kh * kw
    for r in range(r0, r1):
        ci = r // taps
        a = (r - ci * taps) // kw
        b = r - ci * taps - a * kw
        off = a * dh * wp + b * dw
        row = cols[r - r0]
        q = q0
        while q < q1:
            n = q // qimg
            s0 = q - n * qimg
            length = min(qimg - s0, q1 - q)
            src = xp[n, c0 + ci, off + s0:off + s0 + length]
            dst = row[q - q0:q - q0 + length]
            for t in range(length):
                dst[t] = src[t]
            q += length


@njit(cache=True, nogil=True)
def _store_unit(res: Any, out: Any, bias: Any, has_bias: bool, co0: int, q0: int, q1: int, wp: int,
                qimg: int) -> None:
    """out[n, co0 + co, oh, ow] = res[co, q − q0] (+ bias) for the columns q = n·qimg + oh·Wp + ow of
    [q0, q1) with ow < Wo (the others fall between output rows)."""
    wo = out.shape[3]
    q = q0
    while q < q1:
        n = q // qimg
        s0 = q - n * qimg
        oh = s0 // wp
        ow = s0 - oh * wp
        length = min(wp - ow, q1 - q, qimg - s0)
        keep = max(0, min(length, wo - ow))
        j = q - q0
        for co in range(res.shape[0]):
            dst = out[n, co0 + co, oh, ow:ow + keep]
            src = res[co, j:j + keep]
            if has_bias:
                bv = bias[co0 + co]
                for t in range(keep):
                    dst[t] = src[t] + bv
            else:
                for t in range(keep):
                    dst[t] = src[t]
        q += length


@row_kernel()
def _conv_direct(x: Any, w: Any, bias: Any, out: Any, sh: int, sw: int, dh: int, dw: int, pt: int, pl: int,
                 groups: int) -> None:
    """One (image, output channel) plane per row: the bias (zeros without one), then every tap in
    (ci, kh, kw) order."""
    nb, cout, ho, wo = out.shape
    h, wd = x.shape[2], x.shape[3]
    cg, kh, kw = w.shape[1], w.shape[2], w.shape[3]
    m = cout // groups
    for r in prange(nb * cout):
        n = r // cout
        co = r - n * cout
        c0 = (co // m) * cg
        o = out[n, co]
        init = bias[co]
        for oh in range(ho):
            for ow in range(wo):
                o[oh, ow] = init
        for ci in range(cg):
            for a in range(kh):
                for oh in range(ho):
                    ih = oh * sh + a * dh - pt
                    if ih < 0 or ih >= h:
                        continue
                    src = x[n, c0 + ci, ih]
                    orow = o[oh]
                    for b in range(kw):
                        wv = w[co, ci, a, b]
                        iw0 = b * dw - pl
                        lo = 0 if iw0 >= 0 else min(wo, (sw - 1 - iw0) // sw)
                        hi = 0 if iw0 >= wd else min(wo, (wd - 1 - iw0) // sw + 1)
                        for ow in range(lo, hi):
                            orow[ow] += wv * src[iw0 + ow * sw]


def uses_direct(x_shape: Shape, w_shape: Shape, groups: int) -> bool:
    """Whether a Conv2D runs the direct loop (few output channels per group, or few taps)."""
    cout, cg, kh, kw = w_shape
    return cout // groups <= DIRECT_MAX_M or cg * kh * kw <= DIRECT_MAX_K


def conv2d_into(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, out: np.ndarray, g: int,
            stride: tuple[int, int], dilation: tuple[int, int], pt: int, pl: int) -> None:
    """out (f32/f64, contiguous) <- conv2d of x, w, bias in out's type; the top/left padding may be
    negative (a crop: ConvTranspose2D's stride-1 form), the output size is out's."""
    nb, cout, ho, wo = out.shape
    cg, kh, kw = w.shape[1], w.shape[2], w.shape[3]
    (sh, sw), (dh, dw) = stride, dilation
    has_bias = bias is not None
    b = bias if bias is not None else np.zeros(cout, out.dtype)
    kdim = cg * kh * kw
    if kdim == 0:
        out[...] = b.reshape(1, cout, 1, 1)
        return
    if uses_direct(x.shape, w.shape, g):
        _conv_direct(x, w, b, out, sh, sw, dh, dw, pt, pl, g)
        return
    m = cout // g
    wm = w.reshape(g, m, kdim)
    # Three forms of the gather: padded planes (unit stride, rows of cols are contiguous copies), runs
    # along output rows (other strides), or the transpose with runs along the kernel rows (a kernel
    # wider than the output: a weight gradient).
    unit = (sh, sw) == (1, 1) and dw * (kw - 1) * UNIT_MAX_WASTE <= wo
    transposed = not unit and kw > wo
    if unit:  # padded planes: every row of a block is a contiguous copy (the padding is already there)
        hp, wp = ho + dh * (kh - 1), wo + dw * (kw - 1)
        xp = x
        if (pt, pl, x.shape[2], x.shape[3]) != (0, 0, hp, wp):
            xp = POOL.empty((nb, x.shape[1], hp, wp), out.dtype)
            _pad_planes(x, xp, pt, pl)
        src = xp.reshape(nb, x.shape[1], hp * wp)
        qimg = (ho - 1) * wp + wo
        total = nb * qimg
    else:
        total = nb * ho * wo
    kb = min(kdim, KB_MAX)
    nkb = -(-kdim // kb)
    pb = block_columns(kb, out.itemsize, total)
    nblocks = -(-total // pb)
    flat = out.reshape(nb, cout, ho * wo)

    def blocks(tasks: Iterable[int]) -> None:
        cols = POOL.empty((pb, kb) if transposed else (kb, pb), out.dtype)  # scratch per thread, reused
        res = POOL.empty((pb, m) if transposed else (m, pb), out.dtype)
        part = POOL.empty(res.shape, out.dtype) if nkb > 1 else res
        for t in tasks:
            gi, blk = divmod(t, nblocks)
            q0 = blk * pb
            q1 = min(total, q0 + pb)
            nq = q1 - q0
            for kk in range(nkb):
                r0, r1 = kk * kb, min(kdim, (kk + 1) * kb)
                dst = res if kk == 0 else part
                if transposed:  # [nq, m] = cols [nq, k] @ wᵀ [k, m]
                    _im2row(x, gi * cg, r0, r1, kh, kw, sh, sw, dh, dw, pt, pl, ho, wo, q0, q1, cols)
                    np.matmul(cols[:nq, :r1 - r0], wm[gi, :, r0:r1].T, out=dst[:nq])
                    if kk:
                        np.add(res[:nq], part[:nq], out=res[:nq])
                    continue
                if unit:
                    _im2col_unit(src, gi * cg, r0, r1, kh, kw, dh, dw, wp, qimg, q0, q1, cols)
                else:
                    _im2col(x, gi * cg, r0, r1, kh, kw, sh, sw, dh, dw, pt, pl, ho, wo, q0, q1, cols)
                np.matmul(wm[gi, :, r0:r1], cols[:r1 - r0, :nq], out=dst[:, :nq])
                if kk:
                    np.add(res[:, :nq], part[:, :nq], out=res[:, :nq])
            if transposed:
                _store_rows(res[:nq], flat, b, has_bias, gi * m, q0, q1)
            elif unit:
                _store_unit(res[:, :nq], out, b, has_bias, gi * m, q0, q1, wp, qimg)
            else:
                _store(res[:, :nq], flat, b, has_bias, gi * m, q0, q1)

    run_tasks(blocks, g * nblocks)


def conv2d_kernel(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    if out.size == 0:
        return
    acc = acc_dtype(out)
    x, w = working(inputs[0], acc), working(inputs[1], acc)
    bias = working(inputs[2], acc) if len(inputs) == 3 else None
    geometry = (params.groups, params.stride, params.dilation, params.padding[0][0], params.padding[1][0])
    if out.dtype == acc:
        conv2d_into(x, w, bias, out, *geometry)
        return
    tmp = POOL.empty(out.shape, acc)
    conv2d_into(x, w, bias, tmp, *geometry)
    narrow_into(tmp, out)


def conv2d_cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: Any) -> CostEstimate:
    """2·Cin/groups·Kh·Kw flops per output element (+1 with a bias); every operand moves once."""
    w, out = shapes[1], shapes[-1]
    flops = math.prod(out) * (2 * w[1] * w[2] * w[3] + (1 if len(shapes) == 4 else 0))
    moved = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
    return CostEstimate(flops=flops, bytes_moved=moved)


# ---- registration ----------------------------------------------------------------------------------

# |out - ref| <= max_relative·|ref| + max_absolute·S with S the same convolution of |x| and |w| (+ |bias|)
# per output element. Twice the worst error `python -m fuel.testing.measure Conv2D ConvTranspose2D` found
# over seeds 0-59 of fuel.testing.reference.conv; the relative part is at least the output's unit
# roundoff. The half types widen exactly and compute as f32, so their absolute part is the f32 impl's.
CONV2D_PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 9.1e-7, 3.4e-7, "im2col + sgemm (or the direct loop), f32"),
    DType.F64: PrecisionGuarantee(True, None, 2.1e-15, 7.3e-16, "im2col + dgemm (or the direct loop), f64"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, 3.4e-7, "exact widening, f32 as for f32, one RNE store"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, 3.4e-7, "exact widening, f32 as for f32, one RNE store"),
}
def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(conv2d_kernel)
    for dt in FLOAT_DTYPES:
        for arity in (2, 3):
            registry.register(BackendImpl(FusedOps.CONV2D, "cpu", conv2d_kernel, (dt,) * (arity + 1), conv2d_cost,
                                          CONV2D_PRECISION[dt], CONTIGUOUS_ONLY, rev))
