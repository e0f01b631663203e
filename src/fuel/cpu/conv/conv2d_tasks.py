"""Conv2D's pool tasks: the im2col blocks (gather, BLAS product from jitted code, store), the padded-plane
copy and the direct loop, each over fixed items, for f32 and f64 (the half types are widened first).

A block's product is the BLAS call NumPy's matmul makes for the same operands (`product`): gemm for a
matrix product, the transposed gemv for a one-column or one-row one, NumPy's own loop (`0 + a·b`) for a
one-deep one, so a block's bytes are those of `np.matmul` on a one-thread BLAS. Whoever posts a block job
sets OpenBLAS to one thread around it (the BLAS policy of `fuel.runtime.threads`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.conv.conv2d_gather import im2col, im2col_unit, im2row, store_cols, store_rows, store_unit
from fuel.cpu.simd.sgemm import dgemm, dgemv_t, sgemm, sgemv_t
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, record_at

ROWS, UNIT, TRANSPOSED = 0, 1, 2  # the gather's forms (conv2d.py's docstring)


@njit(inline="always", cache=True)
def _blasable(stride_major: int, stride_minor: int, minor: int) -> bool:
    """NumPy's test of a 2-D operand BLAS can read with these element strides (`is_blasable2d`)."""
    return stride_minor == 1 and stride_major >= minor


@njit(inline="always", cache=True)
def product(gemm: int, gemv: int, wide: bool, m: int, n: int, k: int, a: int, a_m: int, a_k: int, b: int, b_k: int,
            b_n: int, c: int, ldc: int, dt: Any) -> None:
    """c[m, n] <- a[m, k] @ b[k, n] (addresses; element strides a_m, a_k, b_k, b_n; c row-major, ldc) as
    np.matmul calls the BLAS for them (its order of cases), for A and B each row- or column-major and
    m, n, k >= 1, not both m and n 1 (NumPy's dot: no block here is one)."""
    if m == 1 or n == 1 or k == 1:
        if m == 1 and k > 1 and (_blasable(b_k, b_n, n) or _blasable(b_n, b_k, k)):  # vector @ matrix
            col_major = _blasable(b_n, b_k, k)
            ld = b_n if col_major else b_k
            if wide:
                dgemv_t(gemv, col_major, k, n, b, ld, a, a_k, c, 1)
            else:
                sgemv_t(gemv, col_major, k, n, b, ld, a, a_k, c, 1)
        elif n == 1 and k > 1:  # matrix @ vector: gemv on A, a row-major A read as column-major transposed
            col_major = _blasable(a_m, a_k, k)
            ld = a_m if col_major else a_k
            if wide:
                dgemv_t(gemv, col_major, k, m, a, ld, b, b_k, c, ldc)
            else:
                sgemv_t(gemv, col_major, k, m, a, ld, b, b_k, c, ldc)
        else:  # NumPy's own loop: each element 0 + Σ a·b in k order
            size = 8 if wide else 4
            for i in range(m):
                row = carray(pointer(c + size * i * ldc, dt), (n,))
                for j in range(n):
                    s = dt(0)
                    for r in range(k):
                        s += carray(pointer(a + size * (i * a_m + r * a_k), dt), (1,))[0] * \
                            carray(pointer(b + size * (r * b_k + j * b_n), dt), (1,))[0]
                    row[j] = s
        return
    trans_a = not _blasable(a_m, a_k, k)
    trans_b = not _blasable(b_k, b_n, n)
    lda, ldb = (a_k if trans_a else a_m), (b_n if trans_b else b_k)
    flags = 2 * trans_a + trans_b
    if wide:
        dgemm(gemm, flags, 0, m, n, k, a, lda, b, ldb, c, ldc)
    else:
        sgemm(gemm, flags, 0, m, n, k, a, lda, b, ldb, c, ldc)


BLOCK_ARGS = jobs.record(x=ADDRESS, src=ADDRESS, w=ADDRESS, bias=ADDRESS, out=ADDRESS, gemm=ADDRESS, gemv=ADDRESS,
                         nb=INT, cin=INT, h=INT, wd=INT, cout=INT, cg=INT, kh=INT, kw=INT, ho=INT, wo=INT, sh=INT,
                         sw=INT, dh=INT, dw=INT, pt=INT, pl=INT, groups=INT, has_bias=INT, form=INT, hp=INT, wp=INT,
                         qimg=INT, total=INT, kb=INT, pb=INT, nblocks=INT)


@njit(inline="always", cache=True)
def _blocks(part: int, parts: int, argv: int, dt: Any, wide: bool) -> None:
    """Blocks [part·I/parts, (part+1)·I/parts) of the I = groups·nblocks (group, block of PB columns)."""
    a = record_at(argv, BLOCK_ARGS)
    nb, cout, ho, wo, g, pb, kb = a.nb, a.cout, a.ho, a.wo, a.groups, a.pb, a.kb
    cg, kh, kw = a.cg, a.kh, a.kw
    m = cout // g
    kdim = cg * kh * kw
    nkb = -(-kdim // kb)
    size = 8 if wide else 4
    x = carray(pointer(a.x, dt), (nb, a.cin, a.h, a.wd))
    src = carray(pointer(a.src, dt), (nb, a.cin, a.hp * a.wp))
    bias = carray(pointer(a.bias, dt), (cout,))
    out = carray(pointer(a.out, dt), (nb, cout, ho, wo))
    flat = carray(pointer(a.out, dt), (nb, cout, ho * wo))
    transposed = a.form == TRANSPOSED
    cols = np.empty((pb, kb) if transposed else (kb, pb), dt)
    res = np.empty((pb, m) if transposed else (m, pb), dt)
    acc = np.empty(res.shape, dt)
    has_bias = a.has_bias != 0
    count = g * a.nblocks
    for t in range(part * count // parts, (part + 1) * count // parts):
        gi, blk = t // a.nblocks, t % a.nblocks
        q0 = blk * pb
        q1 = min(a.total, q0 + pb)
        nq = q1 - q0
        for kk in range(nkb):
            r0, r1 = kk * kb, min(kdim, (kk + 1) * kb)
            dst = res if kk == 0 else acc
            w_at = a.w + size * ((gi * m) * kdim + r0)
            if transposed:  # [nq, m] = cols [nq, k] @ wᵀ [k, m]
                im2row(x, gi * cg, r0, r1, kh, kw, a.sh, a.sw, a.dh, a.dw, a.pt, a.pl, ho, wo, q0, q1, cols)
                product(a.gemm, a.gemv, wide, nq, m, r1 - r0, cols.ctypes.data, kb, 1, w_at, 1, kdim,
                        dst.ctypes.data, m, dt)
            else:
                if a.form == UNIT:
                    im2col_unit(src, gi * cg, r0, r1, kh, kw, a.dh, a.dw, a.wp, a.qimg, q0, q1, cols)
                else:
                    im2col(x, gi * cg, r0, r1, kh, kw, a.sh, a.sw, a.dh, a.dw, a.pt, a.pl, ho, wo, q0, q1, cols)
                product(a.gemm, a.gemv, wide, m, nq, r1 - r0, w_at, kdim, 1, cols.ctypes.data, pb, 1,
                        dst.ctypes.data, pb, dt)
            if kk:  # K blocks summed in order
                rows, width = (nq, m) if transposed else (m, nq)
                for i in range(rows):
                    for j in range(width):
                        res[i, j] = res[i, j] + acc[i, j]
        if transposed:
            store_rows(res[:nq], flat, bias, has_bias, gi * m, q0, q1)
        elif a.form == UNIT:
            store_unit(res[:, :nq], out, bias, has_bias, gi * m, q0, q1, a.wp, a.qimg)
        else:
            store_cols(res[:, :nq], flat, bias, has_bias, gi * m, q0, q1)


@pool.task()
def blocks_f32_part(part: int, parts: int, argv: int) -> None:
    _blocks(part, parts, argv, np.float32, False)


@pool.task()
def blocks_f64_part(part: int, parts: int, argv: int) -> None:
    _blocks(part, parts, argv, np.float64, True)


@njit(inline="always", cache=True)
def _direct(part: int, parts: int, argv: int, dt: Any) -> None:
    """(image, output channel) planes [part·I/parts, (part+1)·I/parts) of I = N·Cout: the bias (zeros
    without one), then every tap in (ci, kh, kw) order."""
    a = record_at(argv, BLOCK_ARGS)
    nb, cout, ho, wo, h, wd = a.nb, a.cout, a.ho, a.wo, a.h, a.wd
    cg, kh, kw, sh, sw, dh, dw, pt, pl = a.cg, a.kh, a.kw, a.sh, a.sw, a.dh, a.dw, a.pt, a.pl
    x = carray(pointer(a.x, dt), (nb, a.cin, h, wd))
    w = carray(pointer(a.w, dt), (cout, cg, kh, kw))
    bias = carray(pointer(a.bias, dt), (cout,))
    out = carray(pointer(a.out, dt), (nb, cout, ho, wo))
    m = cout // a.groups
    for r in range(part * nb * cout // parts, (part + 1) * nb * cout // parts):
        n = r // cout
        co = r - n * cout
        c0 = (co // m) * cg
        o = out[n, co]
        init = bias[co]
        for oh in range(ho):
            for ow in range(wo):
                o[oh, ow] = init
        for ci in range(cg):
            for ka in range(kh):
                for oh in range(ho):
                    ih = oh * sh + ka * dh - pt
                    if ih < 0 or ih >= h:
                        continue
                    row = x[n, c0 + ci, ih]
                    orow = o[oh]
                    for kb in range(kw):
                        wv = w[co, ci, ka, kb]
                        iw0 = kb * dw - pl
                        lo = 0 if iw0 >= 0 else min(wo, (sw - 1 - iw0) // sw)
                        hi = 0 if iw0 >= wd else min(wo, (wd - 1 - iw0) // sw + 1)
                        for ow in range(lo, hi):
                            orow[ow] += wv * row[iw0 + ow * sw]


@pool.task()
def direct_f32_part(part: int, parts: int, argv: int) -> None:
    _direct(part, parts, argv, np.float32)


@pool.task()
def direct_f64_part(part: int, parts: int, argv: int) -> None:
    _direct(part, parts, argv, np.float64)


@njit(inline="always", cache=True)
def _pad(part: int, parts: int, argv: int, dt: Any) -> None:
    """Rows [part·I/parts, (part+1)·I/parts) of the I = N·Cin·Hp padded rows: src[n, c, i, j] =
    x[n, c, i − pt, j − pl], 0 outside x (pt, pl may be negative: a crop)."""
    a = record_at(argv, BLOCK_ARGS)
    nb, cin, hp, wp, h, w, pt, pl = a.nb, a.cin, a.hp, a.wp, a.h, a.wd, a.pt, a.pl
    x = carray(pointer(a.x, dt), (nb, cin, h, w))
    xp = carray(pointer(a.src, dt), (nb, cin, hp, wp))
    for r in range(part * nb * cin * hp // parts, (part + 1) * nb * cin * hp // parts):
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
            seg = dst[lo:hi]
            srow = x[n, c, ih, lo - pl:hi - pl]
            for j in range(hi - lo):
                seg[j] = srow[j]
        for j in range(hi, wp):
            dst[j] = 0


@pool.task()
def pad_f32_part(part: int, parts: int, argv: int) -> None:
    _pad(part, parts, argv, np.float32)


@pool.task()
def pad_f64_part(part: int, parts: int, argv: int) -> None:
    _pad(part, parts, argv, np.float64)
