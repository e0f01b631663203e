"""ConvTranspose2D (entry 11) on the CPU: the flipped-kernel gather at stride 1, col2im otherwise.

Stride 1: the transposed convolution is the Conv2D of x with each group's kernel turned by 180 degrees
(channels swapped) and top/left padding `d·(K − 1) − p` (negative: a crop), so it runs Conv2D's
gather blocks on BLAS at Conv2D's speed. Other strides: `cols = wᵀ · x` per (image, group) on BLAS,
blocks of input positions read straight from x, scattered (col2im) into the output by a Numba pass,
instead of gathering over an input with inserted zeros (most taps would multiply a zero). The
col2im tasks are (image, group, chunk of output channels), so no two tasks write the same element,
and each task scatters its blocks in order.

Every block size is a function of the shapes only and each product is one one-thread BLAS call (the call
np.matmul makes, `conv2d_tasks.product`), so results are the same bytes at any part count. bf16/f16 are
widened exactly to f32 once, computed in f32 and rounded once on store; f64 runs in f64. NaN or ±inf
weights reach the output through zero inputs (IEEE products, as torch; upstream's scatter skips zero
inputs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.conv.conv2d import SECONDS_PER_FLOP, acc_dtype, block_columns, conv2d_into, working
from fuel.cpu.conv.conv2d_tasks import product
from fuel.cpu.simd.half import narrow_into
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
from fuel.runtime import jobs, pool, threads
from fuel.runtime.atomics import pointer
from fuel.runtime.buffers import POOL
from fuel.runtime.jobs import ADDRESS, INT, record_at

CT_ROWS = 256  # rows of wᵀ (output channels · taps) per col2im task


@njit(cache=True, nogil=True)
def _col2im(res: Any, out: Any, n: int, c0: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int,
            pt: int, pl: int, w_in: int, p0: int, p1: int) -> None:
    """out[n, c0 + co, ih·sh + a·dh − pt, iw·sw + b·dw − pl] += res[(co, a, b), p − p0] for the input
    positions p = (ih, iw) in [p0, p1); positions outside out are dropped. The block is cut into runs
    along input rows first (no division per element), as in _im2col."""
    ho, wo = out.shape[2], out.shape[3]
    taps = kh * kw
    nr = (p1 - p0) // w_in + 2
    runs = np.empty((nr, 4), np.int64)  # ih, first iw, length, first column
    p, k = p0, 0
    ih = p // w_in
    iw = p - ih * w_in
    while p < p1:
        length = min(w_in - iw, p1 - p)
        runs[k, 0], runs[k, 1], runs[k, 2], runs[k, 3] = ih, iw, length, p - p0
        k += 1
        p += length
        iw = 0
        ih += 1
    for r in range(res.shape[0]):
        co = r // taps
        a = (r - co * taps) // kw
        b = r - co * taps - a * kw
        src = res[r]
        plane = out[n, c0 + co]
        for i in range(k):
            oh = runs[i, 0] * sh + a * dh - pt
            if oh < 0 or oh >= ho:
                continue
            length = runs[i, 2]
            seg = src[runs[i, 3]:runs[i, 3] + length]
            orow = plane[oh]
            base = runs[i, 1] * sw + b * dw - pl
            lo = 0 if base >= 0 else min(length, (sw - 1 - base) // sw)
            hi = max(lo, 0 if base >= wo else min(length, (wo - 1 - base) // sw + 1))
            for t in range(lo, hi):
                orow[base + t * sw] += seg[t]


def _flipped(w: np.ndarray, g: int) -> np.ndarray:
    """ConvTranspose2D's w [Cin, Cout/g, Kh, Kw] as the Conv2D weight [Cout, Cin/g, Kh, Kw] of its
    stride-1 form: per group, channels swapped and the kernel turned by 180 degrees."""
    cin, m, kh, kw = w.shape
    wg = w.reshape(g, cin // g, m, kh, kw).transpose(0, 2, 1, 3, 4)[:, :, :, ::-1, ::-1]
    return np.ascontiguousarray(wg).reshape(g * m, cin // g, kh, kw)


CT_ARGS = jobs.record(x=ADDRESS, w=ADDRESS, out=ADDRESS, gemm=ADDRESS, gemv=ADDRESS, nb=INT, cin=INT, h=INT, wd=INT,
                      m=INT, kh=INT, kw=INT, ho=INT, wo=INT, sh=INT, sw=INT, dh=INT, dw=INT, pt=INT, pl=INT,
                      groups=INT, per=INT, chunks=INT, pb=INT)


@njit(inline="always", cache=True)
def _scatter(part: int, parts: int, argv: int, dt: Any, wide: bool) -> None:
    """Items [part·I/parts, (part+1)·I/parts) of the I = N·groups·chunks (image, group, chunk of output
    channels): zero the chunk's planes, then per block of input positions `wᵀ·x` and its col2im."""
    a = record_at(argv, CT_ARGS)
    nb, cin, h, wd, m, kh, kw, g, per, chunks, pb = a.nb, a.cin, a.h, a.wd, a.m, a.kh, a.kw, a.groups, a.per, \
        a.chunks, a.pb
    taps = kh * kw
    cg = cin // g
    size = 8 if wide else 4
    out = carray(pointer(a.out, dt), (nb, g * m, a.ho, a.wo))
    res = np.empty((per * taps, pb), dt)
    for t in range(part * nb * g * chunks // parts, (part + 1) * nb * g * chunks // parts):
        n, rest = t // (g * chunks), t % (g * chunks)
        gi, ch = rest // chunks, rest % chunks
        co0, co1 = ch * per, min(m, (ch + 1) * per)
        c0 = gi * m + co0
        out[n, c0:gi * m + co1] = 0
        if cg == 0:
            continue
        rows = (co1 - co0) * taps
        w_at = a.w + size * (gi * cg * m * taps + co0 * taps)  # wᵀ [rows, cg]: column-major, stride m·taps
        for p0 in range(0, h * wd, pb):
            p1 = min(h * wd, p0 + pb)
            x_at = a.x + size * ((n * cin + gi * cg) * h * wd + p0)
            product(a.gemm, a.gemv, wide, rows, p1 - p0, cg, w_at, 1, m * taps, x_at, h * wd, 1, res.ctypes.data,
                    pb, dt)
            _col2im(res[:rows, :p1 - p0], out, n, c0, kh, kw, a.sh, a.sw, a.dh, a.dw, a.pt, a.pl, wd, p0, p1)


@pool.task()
def _scatter_f32_part(part: int, parts: int, argv: int) -> None:
    _scatter(part, parts, argv, np.float32, False)


@pool.task()
def _scatter_f64_part(part: int, parts: int, argv: int) -> None:
    _scatter(part, parts, argv, np.float64, True)


def _scatter_here(x: np.ndarray, w: np.ndarray, out: np.ndarray, params: Any, per: int, chunks: int,
                  pb: int) -> None:
    """The scatter task's items in this thread, each product a NumPy call on a one-thread BLAS."""
    nb, cin, h, wd = x.shape
    m, kh, kw = w.shape[1], w.shape[2], w.shape[3]
    g, taps, cg = params.groups, kh * kw, cin // params.groups
    (sh, sw), (dh, dw) = params.stride, params.dilation
    (pt, _), (pl, _) = params.padding
    wt = w.reshape(g, cg, m * taps).transpose(0, 2, 1)  # wᵀ per group: [m·taps, cg]
    xs = x.reshape(nb, g, cg, h * wd)
    res = np.empty((per * taps, pb), out.dtype)
    with threads.one_blas_thread():
        for t in range(nb * g * chunks):
            n, rest = divmod(t, g * chunks)
            gi, ch = divmod(rest, chunks)
            co0, co1 = ch * per, min(m, (ch + 1) * per)
            out[n, gi * m + co0:gi * m + co1] = 0
            for p0 in range(0, h * wd if cg else 0, pb):
                p1 = min(h * wd, p0 + pb)
                dst = res[:(co1 - co0) * taps, :p1 - p0]
                np.matmul(wt[gi, co0 * taps:co1 * taps], xs[n, gi, :, p0:p1], out=dst)
                _col2im(dst, out, n, gi * m + co0, kh, kw, sh, sw, dh, dw, pt, pl, wd, p0, p1)


def _conv_transpose2d(x: np.ndarray, w: np.ndarray, out: np.ndarray, params: Any) -> None:
    """out (f32/f64, contiguous) <- conv_transpose2d of x and w in out's type.

    Stride 1: the Conv2D of x with the flipped kernel and padding d·(K − 1) − p (the gather form, no
    zero taps). Otherwise `wᵀ·x` products scattered by col2im (the strided gather would multiply by
    the inserted zeros), one pool task over (image, group, chunk of output channels), every product a
    one-thread BLAS call from jitted code (`conv2d_tasks.product`)."""
    nb, cin, h, wd = x.shape
    m, kh, kw = w.shape[1], w.shape[2], w.shape[3]
    g = params.groups
    (sh, sw), (dh, dw) = params.stride, params.dilation
    (pt, _), (pl, _) = params.padding
    if (sh, sw) == (1, 1):
        conv2d_into(x, _flipped(w, g), None, out, g, (1, 1), (dh, dw), dh * (kh - 1) - pt, dw * (kw - 1) - pl)
        return
    taps = kh * kw
    chunks = max(1, min(m, -(-m * taps // CT_ROWS)))
    per = -(-m // chunks)
    chunks = -(-m // per)
    pb = block_columns(per * taps + cin // g, out.itemsize, h * wd)
    f64 = out.dtype == np.float64
    if taps == 1 and (per == 1 or m % per == 1) and (pb == 1 or h * wd % pb == 1):
        # a one-channel 1x1 block of one position is NumPy's dot, which the task does not make: these
        # (tiny) shapes run their products as NumPy calls here
        _scatter_here(x, w, out, params, per, chunks, pb)
        return
    argv = jobs.argv_of(CT_ARGS)
    argv[0] = (x.ctypes.data, w.ctypes.data, out.ctypes.data, threads.blas_address("dgemm" if f64 else "sgemm"),
               threads.blas_address("dgemv" if f64 else "sgemv"), nb, cin, h, wd, m, kh, kw, out.shape[2],
               out.shape[3], sh, sw, dh, dw, pt, pl, g, per, chunks, pb)
    seconds = 2 * x.size * m * taps * SECONDS_PER_FLOP
    with threads.one_blas_thread():
        jobs.run(jobs.job(_scatter_f64_part if f64 else _scatter_f32_part, argv, seconds, nb * g * chunks))


def conv_transpose2d_kernel(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    if out.size == 0:
        return
    acc = acc_dtype(out)
    x, w = working(inputs[0], acc), working(inputs[1], acc)
    if out.dtype == acc:
        _conv_transpose2d(x, w, out, params)
        return
    tmp = POOL.empty(out.shape, acc)
    _conv_transpose2d(x, w, tmp, params)
    narrow_into(tmp, out)


def conv_transpose2d_cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: Any) -> CostEstimate:
    """2·Cout/groups·Kh·Kw flops per input element; every operand moves once."""
    x, w = shapes[0], shapes[1]
    flops = 2 * math.prod(x) * w[1] * w[2] * w[3]
    moved = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
    return CostEstimate(flops=flops, bytes_moved=moved)


# |out - ref| <= max_relative·|ref| + max_absolute·S with S the same transposed convolution of |x| and
# |w| per output element. Twice the worst error `python -m fuel.testing.measure ConvTranspose2D` found
# over seeds 0-59 of fuel.testing.reference.conv; the relative part is at least the output's unit
# roundoff, and the half types' absolute part is the f32 impl's.
CONV_TRANSPOSE2D_PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 1.2e-6, 2.9e-7, "stride 1: flipped-kernel gather, else col2im; f32"),
    DType.F64: PrecisionGuarantee(True, None, 2.2e-15, 5.0e-16, "stride 1: flipped-kernel gather, else col2im; f64"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, 2.9e-7, "exact widening, f32 as for f32, one RNE store"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, 2.9e-7, "exact widening, f32 as for f32, one RNE store"),
}


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(conv_transpose2d_kernel)
    for dt in FLOAT_DTYPES:
        registry.register(BackendImpl(FusedOps.CONV_TRANSPOSE2D, "cpu", conv_transpose2d_kernel, (dt, dt, dt),
                                      conv_transpose2d_cost, CONV_TRANSPOSE2D_PRECISION[dt], CONTIGUOUS_ONLY, rev))
