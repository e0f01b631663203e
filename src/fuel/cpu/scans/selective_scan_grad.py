"""SelectiveScan's gradient (`selective_scan_grad`, the SELECTIVE_SCAN_GRAD primitive): the reverse scan.

Each (batch row, block of DB channels) item recomputes the forward, keeping the state only at every
`CHUNK`-th step, then walks the chunks backwards: each chunk's states and decays are recomputed into a
CHUNK×N×DB buffer and the adjoint runs over them (no [L, N] history per channel). du and ddelta are
the item's own channels; db and dc (sums over channels) are summed per item in a fixed order into one
partial per channel block, and da (a sum over the batch) into one partial per batch row; a second task
adds the partials in index order, each sum rounded once. Both are pool tasks over fixed items, so the
bytes do not depend on the part count. Timings: docs/performance/conv.md, "selective_scan".
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.scans.selective_math import (
    DB,
    FASTMATH,
    SCAN_SECONDS_PER_STATE_STEP,
    channel,
    exp64,
    kernel_out,
    kernel_view,
    load_a,
    load_step,
    scan_inputs,
    softplus_slope,
)
from fuel.cpu.simd.vecmath import narrow64, widen64
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, record_at

CHUNK = 32  # steps between the gradient's state checkpoints
SUM_SECONDS_PER_VALUE = 0.5e-9  # one core's time per partial added, for the part count

GRAD_ARGS = jobs.record(u=ADDRESS, delta=ADDRESS, a=ADDRESS, b=ADDRESS, c=ADDRESS, dy=ADDRESS, dlast=ADDRESS,
                        du=ADDRESS, dd=ADDRESS, da_part=ADDRESS, db_part=ADDRESS, dc_part=ADDRESS, batch=INT,
                        length=INT, dim=INT, n=INT, softplus=INT)
SUM_ARGS = jobs.record(part=ADDRESS, out=ADDRESS, count=INT, size=INT)


@njit(inline="always", cache=True, fastmath=FASTMATH, error_model="numpy")
def _dot8(x: Any, z: Any, p: Any) -> float:
    """Σ_j x[j]·z[j] over DB lanes with eight fixed partial sums (no latency chain, a fixed order)."""
    p[:] = 0.0
    for j0 in range(0, DB, 8):
        for k in range(8):
            p[k] += x[j0 + k] * z[j0 + k]
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))


@njit(inline="always", cache=True, fastmath=FASTMATH, error_model="numpy")
def _backward_items(part: int, parts: int, argv: int, din: Any, dout: Any) -> None:
    """Items [part·I/parts, (part+1)·I/parts) of the I = B·ceil(dim/DB) (batch row, channel block) items of
    the reverse scan. Inputs and dy [B, L, dim], dlast [B, dim, N] of type din; du, dd [B, L, dim] of
    type dout; da_part [B, dim, N], db_part and dc_part [blocks, B, L, N] f64 partials (this item's block
    and batch row)."""
    r = record_at(argv, GRAD_ARGS)
    nb, seq, dim, ns, softplus = r.batch, r.length, r.dim, r.n, r.softplus != 0
    u, delta, a, bm, cm = scan_inputs(r, din)
    dy = carray(pointer(r.dy, din), (nb, seq, dim))
    dlast = carray(pointer(r.dlast, din), (nb, dim, ns))
    du = carray(pointer(r.du, dout), (nb, seq, dim))
    dd = carray(pointer(r.dd, dout), (nb, seq, dim))
    nblk = (dim + DB - 1) // DB
    da_part = carray(pointer(r.da_part, np.float64), (nb, dim, ns))
    db_part = carray(pointer(r.db_part, np.float64), (nblk, nb, seq, ns))
    dc_part = carray(pointer(r.dc_part, np.float64), (nblk, nb, seq, ns))
    nck = (seq + CHUNK - 1) // CHUNK
    for job in range(part * nb * nblk // parts, (part + 1) * nb * nblk // parts):
        bi, blk = job // nblk, job % nblk
        d0 = blk * DB
        w = min(DB, dim - d0)
        at = np.zeros((ns, DB))
        load_a(a, d0, w, at)
        # Pass 1: the forward, keeping the state before every chunk.
        ckpt = np.empty((nck, ns, DB))
        h = np.zeros((ns, DB))
        dts, us, dtus = np.zeros((CHUNK, DB)), np.zeros((CHUNK, DB)), np.zeros((CHUNK, DB))
        for t in range(seq):
            if t % CHUNK == 0:
                ckpt[t // CHUNK] = h
            load_step(u, delta, bi, t, d0, w, softplus, dts[0], us[0], dtus[0])
            dt0, dtu0 = dts[0], dtus[0]
            for n in range(ns):
                bn = widen64(bm[bi, t, n])
                hn, an = h[n], at[n]
                for j in range(DB):
                    hn[j] = exp64(dt0[j] * an[j]) * hn[j] + dtu0[j] * bn
        # Pass 2: chunks in reverse; g is the adjoint of the state, seeded with dlast.
        g = np.zeros((ns, DB))
        for j in range(w):
            for n in range(ns):
                g[n, j] = widen64(dlast[bi, d0 + j, n])
        hs = np.empty((CHUNK + 1, ns, DB))
        decay = np.empty((CHUNK, ns, DB))
        gy, ddv, duv, gda, p8 = np.zeros(DB), np.zeros(DB), np.zeros(DB), np.zeros((ns, DB)), np.zeros(8)
        for ck in range(nck - 1, -1, -1):
            t0 = ck * CHUNK
            t1 = min(seq, t0 + CHUNK)
            hs[0] = ckpt[ck]
            for t in range(t0, t1):
                k = t - t0
                load_step(u, delta, bi, t, d0, w, softplus, dts[k], us[k], dtus[k])
                dtk, dtuk = dts[k], dtus[k]
                for n in range(ns):
                    bn = widen64(bm[bi, t, n])
                    hp, hn, dk, an = hs[k, n], hs[k + 1, n], decay[k, n], at[n]
                    for j in range(DB):
                        e = exp64(dtk[j] * an[j])
                        dk[j] = e
                        hn[j] = e * hp[j] + dtuk[j] * bn
            for t in range(t1 - 1, t0 - 1, -1):
                k = t - t0
                for j in range(w):
                    gy[j] = widen64(dy[bi, t, channel(d0, j)])
                ddv[:] = 0.0
                duv[:] = 0.0
                dtk, uk, dtuk = dts[k], us[k], dtus[k]
                for n in range(ns):
                    bn, cn = widen64(bm[bi, t, n]), widen64(cm[bi, t, n])
                    gn, hp, hn, dk, an, gdn = g[n], hs[k, n], hs[k + 1, n], decay[k, n], at[n], gda[n]
                    dc_part[blk, bi, t, n] = _dot8(gy, hn, p8)  # y_t = Σ_n h_t·c_t
                    for j in range(DB):
                        gn[j] += gy[j] * cn
                    db_part[blk, bi, t, n] = _dot8(gn, dtuk, p8)  # h_t = e·h_{t−1} + d·u·b_t
                    for j in range(DB):
                        gh = gn[j]
                        x = gh * hp[j] * dk[j]  # the adjoint of d·a inside exp(d·a)
                        ddv[j] += x * an[j] + gh * uk[j] * bn
                        gdn[j] += x * dtk[j]
                        duv[j] += gh * bn
                        gn[j] = gh * dk[j]
                for j in range(w):
                    du[bi, t, channel(d0, j)] = narrow64(duv[j] * dtk[j], du)
                if softplus:
                    for j in range(w):
                        ddv[j] *= softplus_slope(widen64(delta[bi, t, channel(d0, j)]))
                for j in range(w):
                    dd[bi, t, channel(d0, j)] = narrow64(ddv[j], dd)
        for j in range(w):
            for n in range(ns):
                da_part[bi, d0 + j, n] = gda[n, j]


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _backward_f32_part(part: int, parts: int, argv: int) -> None:
    _backward_items(part, parts, argv, np.float32, np.float32)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _backward_f64_part(part: int, parts: int, argv: int) -> None:
    _backward_items(part, parts, argv, np.float64, np.float64)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _backward_bf16_part(part: int, parts: int, argv: int) -> None:
    _backward_items(part, parts, argv, np.uint16, np.uint16)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _backward_f32_to_f64_part(part: int, parts: int, argv: int) -> None:
    """f16's form: inputs widened exactly to f32, du and dd in f64 buffers."""
    _backward_items(part, parts, argv, np.float32, np.float64)


_BACKWARD = {(np.dtype(np.float32),) * 2: _backward_f32_part, (np.dtype(np.float64),) * 2: _backward_f64_part,
             (np.dtype(np.uint16),) * 2: _backward_bf16_part,
             (np.dtype(np.float32), np.dtype(np.float64)): _backward_f32_to_f64_part}


@njit(inline="always", cache=True)
def _sum_items(part: int, parts: int, argv: int, dout: Any) -> None:
    """out[i] = Σ_k part[k, i] in k order, rounded once (part [K, M] f64, out [M] of type dout), for the
    items i of this part."""
    r = record_at(argv, SUM_ARGS)
    src = carray(pointer(r.part, np.float64), (r.count, r.size))
    out = carray(pointer(r.out, dout), (r.size,))
    for i in range(part * r.size // parts, (part + 1) * r.size // parts):
        s = 0.0
        for k in range(r.count):
            s += src[k, i]
        out[i] = narrow64(s, out)


@pool.task()
def _sum_f32_part(part: int, parts: int, argv: int) -> None:
    _sum_items(part, parts, argv, np.float32)


@pool.task()
def _sum_f64_part(part: int, parts: int, argv: int) -> None:
    _sum_items(part, parts, argv, np.float64)


@pool.task()
def _sum_bf16_part(part: int, parts: int, argv: int) -> None:
    _sum_items(part, parts, argv, np.uint16)


_SUMS = {np.dtype(np.float32): _sum_f32_part, np.dtype(np.float64): _sum_f64_part,
         np.dtype(np.uint16): _sum_bf16_part}


@njit(cache=True)
def _fill(u: Any, delta: Any, a: Any, b: Any, c: Any, dy: Any, dlast: Any, softplus: bool, du: Any, dd: Any,
          da_part: Any, db_part: Any, dc_part: Any, argv: Any) -> None:
    r = argv[0]
    r.u, r.delta, r.a, r.b, r.c = u.ctypes.data, delta.ctypes.data, a.ctypes.data, b.ctypes.data, c.ctypes.data
    r.dy, r.dlast, r.du, r.dd = dy.ctypes.data, dlast.ctypes.data, du.ctypes.data, dd.ctypes.data
    r.da_part, r.db_part, r.dc_part = da_part.ctypes.data, db_part.ctypes.data, dc_part.ctypes.data
    r.batch, r.length, r.dim, r.n, r.softplus = u.shape[0], u.shape[1], u.shape[2], a.shape[1], 1 if softplus else 0


def _sum_job(part: np.ndarray, out: np.ndarray) -> jobs.Job:
    argv = jobs.argv_of(SUM_ARGS)
    argv[0] = (part.ctypes.data, out.ctypes.data, part.shape[0], out.size)
    return jobs.job(_SUMS[out.dtype], argv, part.size * SUM_SECONDS_PER_VALUE, out.size)


def selective_scan_grad(inputs: list[np.ndarray], params: Any) -> tuple[np.ndarray, ...]:
    """(u, delta, a, b, c, dy, dlast_state) -> (du, ddelta, da, db, dc), each in its input's dtype."""
    nb, seq, dim = inputs[0].shape
    ns = inputs[2].shape[1]
    nblk = (dim + DB - 1) // DB
    outs = tuple(np.zeros(x.shape, x.dtype) for x in inputs[:5])
    bufs = [kernel_out(o) for o in outs]
    (du, _), (dd, _), (da, _), (db, _), (dc, _) = bufs
    da_part = np.zeros((nb, dim, ns))
    db_part = np.zeros((nblk, nb, seq, ns))
    dc_part = np.zeros((nblk, nb, seq, ns))
    if du.size or da_part.size:
        views = [kernel_view(x) for x in inputs]  # alive until the job has run
        argv = jobs.argv_of(GRAD_ARGS)
        u, delta, a, b, c, dy, dlast = views
        _fill(u, delta, a, b, c, dy, dlast, bool(params.delta_softplus), du, dd, da_part, db_part, dc_part, argv)
        seconds = 3 * nb * seq * dim * (ns + 2) * SCAN_SECONDS_PER_STATE_STEP
        jobs.run(jobs.job(_BACKWARD[views[0].dtype, du.dtype], argv, seconds, nb * nblk))
    for part, o in ((da_part, da), (db_part, db), (dc_part, dc)):
        if o.size:  # an empty sum leaves the zeros
            jobs.run(_sum_job(part.reshape(part.shape[0], o.size), o.reshape(o.size)))
    for (buf, copy), o in zip(bufs, outs, strict=True):
        if copy:
            np.copyto(o, buf, casting="unsafe")
    return outs
