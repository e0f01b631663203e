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
from numba import prange

from fuel.cpu.conv.conv2d_gather import (
    im2col,
    im2col_unit,
    im2row,
    pad_planes,
    store_cols,
    store_rows,
    store_unit,
)
from fuel.cpu.simd.driver import row_kernel
from fuel.cpu.simd.half import narrow_into, widened
from fuel.dispatch.impls import (
    CONTIGUOUS_ONLY,
    BackendImpl,
    CostEstimate,
    FusedKernelRegistry,
    PrecisionGuarantee,
    revision_of,
)
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.node import Shape
from fuel.graph.registry import FusedOps
from fuel.runtime import threads
from fuel.runtime.buffers import POOL
from fuel.runtime.threads import split_work

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
            pad_planes(x, xp, pt, pl)
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
                    im2row(x, gi * cg, r0, r1, kh, kw, sh, sw, dh, dw, pt, pl, ho, wo, q0, q1, cols)
                    np.matmul(cols[:nq, :r1 - r0], wm[gi, :, r0:r1].T, out=dst[:nq])
                    if kk:
                        np.add(res[:nq], part[:nq], out=res[:nq])
                    continue
                if unit:
                    im2col_unit(src, gi * cg, r0, r1, kh, kw, dh, dw, wp, qimg, q0, q1, cols)
                else:
                    im2col(x, gi * cg, r0, r1, kh, kw, sh, sw, dh, dw, pt, pl, ho, wo, q0, q1, cols)
                np.matmul(wm[gi, :, r0:r1], cols[:r1 - r0, :nq], out=dst[:, :nq])
                if kk:
                    np.add(res[:, :nq], part[:, :nq], out=res[:, :nq])
            if transposed:
                store_rows(res[:nq], flat, b, has_bias, gi * m, q0, q1)
            elif unit:
                store_unit(res[:, :nq], out, b, has_bias, gi * m, q0, q1, wp, qimg)
            else:
                store_cols(res[:, :nq], flat, b, has_bias, gi * m, q0, q1)

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
