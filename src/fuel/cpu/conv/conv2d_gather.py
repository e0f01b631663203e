"""Conv2D's Numba passes around each BLAS product (`conv2d_tasks`): gather a block of input columns (three
forms: strided runs, rows of zero-padded planes, or the transposed `cols[q, k]` of a kernel wider than
the output), and store a product block into the output with the bias."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def im2col(x: Any, c0: int, r0: int, r1: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int,
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
def store_cols(res: Any, out: Any, bias: Any, has_bias: bool, co0: int, q0: int, q1: int) -> None:
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
def im2row(x: Any, c0: int, r0: int, r1: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int,
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
def store_rows(res: Any, out: Any, bias: Any, has_bias: bool, co0: int, q0: int, q1: int) -> None:
    """out[n, co0 + co, s] = res[q − q0, co] (+ bias) for q = (n, s) in [q0, q1); out [N, Cout, P]."""
    p = out.shape[2]
    for q in range(q0, q1):
        n = q // p
        s = q - n * p
        src = res[q - q0]
        for co in range(src.shape[0]):
            out[n, co0 + co, s] = src[co] + bias[co0 + co] if has_bias else src[co]


@njit(cache=True, nogil=True)
def im2col_unit(xp: Any, c0: int, r0: int, r1: int, kh: int, kw: int, dh: int, dw: int, wp: int, qimg: int,
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
def store_unit(res: Any, out: Any, bias: Any, has_bias: bool, co0: int, q0: int, q1: int, wp: int,
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
