"""SsdChunkScan (entry 20) on the CPU: a float64 sequential scan per (batch, head, block of P).

The state h `[P, N]` is kept rescaled, g = h / D with D the product of the decays since the last
renormalisation, so one step is `g += (dt·x/D) ⊗ b` and `y = D · (g · c)`: two fused multiply-adds
per state element instead of three operations (the decay is a scalar). D is folded back into g (one
pass) whenever it would leave [2^-300, 2^300] (or is not finite), so g never overflows and a decay
that underflows to zero resets the state exactly as the plain recurrence does. The state lives as
`[N, P-block]` so every inner loop runs along P, vectorised without reassociating any sum; y is
rounded once from float64 (bf16 through round-to-odd f32, which makes the two roundings one; f16 via a
float64 buffer and NumPy's correctly rounded cast).

Each (batch, head, P-block) is one item of a pool task: the bytes never depend on the part count.
This is the fewest flops of the SSD forms for Mamba-2 sizes (the chunked matmul form does QN + QP + 2NP
multiply-adds per step against 2NP here; see docs/performance/conv.md, "ssd_chunk_scan").

The gradient (`ssd_chunk_scan_grad`, the `SSD_CHUNK_SCAN_GRAD` primitive) is a reverse scan in float64
per (batch, head), a task of its own: the states are checkpointed every CHECKPOINT steps on a forward
pass and each segment's states recomputed from its checkpoint on the way back (memory O(L/K + K)·P·N
per unit).
da's sum over batch and time runs in a fixed order (time within a unit, then batch ascending).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.simd.half import bits
from fuel.cpu.simd.vecmath import f64_to_bf16, narrow64, widen64
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
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, record_at

FASTMATH = {"contract"}  # FMAs only: no sum is reordered
PBLOCK = 64  # state columns per work unit: 128 x 64 float64 = 64 KiB, within L2
LOW, HIGH = 2.0**-300, 2.0**300  # the range D stays in before it is folded into g
CHECKPOINT = 64  # gradient: steps between stored states


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _fold(g: Any, f: float) -> None:
    for n in range(g.shape[0]):
        for j in range(g.shape[1]):
            g[n, j] *= f


SSD_ARGS = jobs.record(x=ADDRESS, dt=ADDRESS, a=ADDRESS, b=ADDRESS, c=ADDRESS, y=ADDRESS, last=ADDRESS,
                       batch=INT, length=INT, heads=INT, p=INT, n=INT)
SECONDS_PER_STATE_STEP = 0.5e-9  # one core's time per state element and step, for the part count


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _forward_units(part: int, parts: int, argv: int, dt_in: Any, dt_out: Any) -> None:
    """Units [part·U/parts, (part+1)·U/parts) of the U = B·H·ceil(P/PBLOCK) (batch, head, P-block)
    units: inputs of type dt_in, y and last of type dt_out."""
    r = record_at(argv, SSD_ARGS)
    nb, length, nh, p_dim, n_dim = r.batch, r.length, r.heads, r.p, r.n
    x = carray(pointer(r.x, dt_in), (nb, length, nh, p_dim))
    dt = carray(pointer(r.dt, dt_in), (nb, length, nh))
    a = carray(pointer(r.a, dt_in), (nh,))
    b = carray(pointer(r.b, dt_in), (nb, length, nh, n_dim))
    c = carray(pointer(r.c, dt_in), (nb, length, nh, n_dim))
    y = carray(pointer(r.y, dt_out), (nb, length, nh, p_dim))
    last = carray(pointer(r.last, dt_out), (nb, nh, p_dim, n_dim))
    blocks = (p_dim + PBLOCK - 1) // PBLOCK
    units = nb * nh * blocks
    for unit in range(part * units // parts, (part + 1) * units // parts):
        bi, hi, p0 = unit // (nh * blocks), unit // blocks % nh, unit % blocks * PBLOCK
        m = min(PBLOCK, p_dim - p0)
        g = np.zeros((n_dim, m))
        w = np.empty(m)
        acc = np.empty(m)
        ah = widen64(a[hi])
        scale = 1.0
        for t in range(length):
            d = widen64(dt[bi, t, hi])
            nd = scale * np.exp(d * ah)
            if nd >= LOW and nd <= HIGH:
                scale = nd
            else:  # fold D in before it leaves the range (or became 0, inf or NaN)
                _fold(g, nd)
                scale = 1.0
            s = d / scale
            for j in range(m):
                w[j] = s * widen64(x[bi, t, hi, p0 + j])
                acc[j] = 0.0
            for n in range(n_dim):
                bn = widen64(b[bi, t, hi, n])
                cn = widen64(c[bi, t, hi, n])
                gr = g[n]
                for j in range(m):
                    v = gr[j] + bn * w[j]
                    gr[j] = v
                    acc[j] += v * cn
            for j in range(m):
                y[bi, t, hi, p0 + j] = narrow64(scale * acc[j], y)
        for j in range(m):
            for n in range(n_dim):
                last[bi, hi, p0 + j, n] = narrow64(scale * g[n, j], last)


@pool.task(fastmath=FASTMATH)
def _forward_f32_part(part: int, parts: int, argv: int) -> None:
    _forward_units(part, parts, argv, np.float32, np.float32)


@pool.task(fastmath=FASTMATH)
def _forward_f64_part(part: int, parts: int, argv: int) -> None:
    _forward_units(part, parts, argv, np.float64, np.float64)


@pool.task(fastmath=FASTMATH)
def _forward_bf16_part(part: int, parts: int, argv: int) -> None:
    _forward_units(part, parts, argv, np.uint16, np.uint16)


@pool.task(fastmath=FASTMATH)
def _forward_f32_to_f64_part(part: int, parts: int, argv: int) -> None:
    """f16's form: inputs widened exactly to f32, outputs in float64 buffers."""
    _forward_units(part, parts, argv, np.float32, np.float64)


_TASKS = {(np.dtype(np.float32),) * 2: _forward_f32_part, (np.dtype(np.float64),) * 2: _forward_f64_part,
          (DType.BF16.np,) * 2: _forward_bf16_part,
          (np.dtype(np.float32), np.dtype(np.float64)): _forward_f32_to_f64_part}


@njit(cache=True)
def _fill(x: Any, dt: Any, a: Any, b: Any, c: Any, y: Any, last: Any, argv: Any) -> None:
    r = argv[0]
    r.x, r.dt, r.a, r.b, r.c = x.ctypes.data, dt.ctypes.data, a.ctypes.data, b.ctypes.data, c.ctypes.data
    r.y, r.last = y.ctypes.data, last.ctypes.data
    r.batch, r.length, r.heads, r.p, r.n = x.shape[0], x.shape[1], x.shape[2], x.shape[3], b.shape[3]


def _forward_job(inputs: list[np.ndarray], y: np.ndarray, last: np.ndarray) -> jobs.Job | None:
    """The forward over C-contiguous inputs of one dtype and outputs of one (a pair `_TASKS` holds)."""
    task = _TASKS.get((inputs[0].dtype, y.dtype))
    if task is None or last.dtype != y.dtype or not all(
            v.flags.c_contiguous and v.dtype == inputs[0].dtype for v in inputs) or not (
            y.flags.c_contiguous and last.flags.c_contiguous):
        return None
    bf = y.dtype == DType.BF16.np  # the task reads and writes the bits
    x, dt, a, b, c = (bits(v) for v in inputs) if bf else inputs
    argv = jobs.argv_of(SSD_ARGS)
    _fill(x, dt, a, b, c, bits(y) if bf else y, bits(last) if bf else last, argv)
    nb, length, nh, p_dim = x.shape
    seconds = nb * length * nh * p_dim * (b.shape[3] + 1) * SECONDS_PER_STATE_STEP
    return jobs.job(task, argv, seconds, nb * nh * -(-p_dim // PBLOCK))


def ssd_chunk_scan_job(inputs: list[np.ndarray], out: Any, params: Any) -> jobs.Jobs | None:
    """f32, f64 and bf16: read as stored, float64 state, each output rounded once into its slot. An
    empty state (N = 0 or an empty batch, head or P) serves no job: the kernel zeroes y itself."""
    if not isinstance(out, tuple) or len(out) != 2:
        return None  # a step that does not hand over both outputs
    y, last = out
    if last.size == 0:
        return None if y.size else ()
    return _forward_job(inputs, y, last)


def _run(inputs: list[np.ndarray], y: np.ndarray, last: np.ndarray) -> None:
    if last.size == 0:  # no state: y is all zeros
        y[...] = 0
        return
    found = _forward_job(inputs, y, last)
    if found is None:
        raise RuntimeError("ssd_chunk_scan: no task for a call its impl is registered for")
    jobs.run(found)


def ssd_chunk_scan_f32(inputs: list[np.ndarray], out: tuple[np.ndarray, ...], params: Any) -> None:
    """f32, f64 and bf16: the job (which native replay posts too)."""
    _run(inputs, *out)


jobs.replays(ssd_chunk_scan_f32)(ssd_chunk_scan_job)
ssd_chunk_scan_f64 = ssd_chunk_scan_f32
ssd_chunk_scan_bf16 = ssd_chunk_scan_f32


def ssd_chunk_scan_f16(inputs: list[np.ndarray], out: tuple[np.ndarray, ...], params: Any) -> None:
    """f16: inputs widened exactly to f32, results in float64 buffers, one correctly rounded cast."""
    wide = tuple(np.empty(o.shape, np.float64) for o in out)
    _run([v.astype(np.float32) for v in inputs], *wide)
    for o, w in zip(out, wide, strict=True):
        np.copyto(o, w, casting="unsafe")




# --- gradient -------------------------------------------------------------------------------------

@njit(inline="always", cache=True, fastmath=FASTMATH)
def _step(prev: Any, nxt: Any, e: float, u: Any, bt: Any) -> None:
    """nxt[n, p] = e·prev[n, p] + b[n]·u[p] (the plain recurrence, as the reference)."""
    for n in range(prev.shape[0]):
        bn = bt[n]
        for j in range(prev.shape[1]):
            nxt[n, j] = e * prev[n, j] + bn * u[j]


SSD_GRAD_ARGS = jobs.record(x=ADDRESS, dt=ADDRESS, a=ADDRESS, b=ADDRESS, c=ADDRESS, dy=ADDRESS, dlast=ADDRESS,
                            dx=ADDRESS, ddt=ADDRESS, db=ADDRESS, dc=ADDRESS, da_part=ADDRESS, batch=INT, length=INT,
                            heads=INT, p=INT, n=INT, checkpoint=INT)


@pool.task(fastmath=FASTMATH)
def _backward_part(part: int, parts: int, argv: int) -> None:
    """Units [part·U/parts, (part+1)·U/parts) of the U = B·H (batch, head) units, all float64.
    da_part[b, h] = Σ_t dL/da_h of batch b (time descending)."""
    r = record_at(argv, SSD_GRAD_ARGS)
    nb, length, nh, p_dim, n_dim, k = r.batch, r.length, r.heads, r.p, r.n, r.checkpoint
    x = carray(pointer(r.x, np.float64), (nb, length, nh, p_dim))
    dt = carray(pointer(r.dt, np.float64), (nb, length, nh))
    a = carray(pointer(r.a, np.float64), (nh,))
    b = carray(pointer(r.b, np.float64), (nb, length, nh, n_dim))
    c = carray(pointer(r.c, np.float64), (nb, length, nh, n_dim))
    dy = carray(pointer(r.dy, np.float64), (nb, length, nh, p_dim))
    dlast = carray(pointer(r.dlast, np.float64), (nb, nh, p_dim, n_dim))
    dx = carray(pointer(r.dx, np.float64), (nb, length, nh, p_dim))
    ddt = carray(pointer(r.ddt, np.float64), (nb, length, nh))
    db = carray(pointer(r.db, np.float64), (nb, length, nh, n_dim))
    dc = carray(pointer(r.dc, np.float64), (nb, length, nh, n_dim))
    da_part = carray(pointer(r.da_part, np.float64), (nb, nh))
    segments = (length + k - 1) // k
    for unit in range(part * nb * nh // parts, (part + 1) * nb * nh // parts):
        bi, hi = unit // nh, unit % nh
        ah = a[hi]
        ck = np.empty((segments, n_dim, p_dim))
        hs = np.empty((k, n_dim, p_dim))
        h = np.zeros((n_dim, p_dim))
        u = np.empty(p_dim)
        for t in range(length):  # forward: the state before each segment
            if t % k == 0:
                ck[t // k] = h
            d = dt[bi, t, hi]
            for j in range(p_dim):
                u[j] = d * x[bi, t, hi, j]
            _step(h, h, np.exp(d * ah), u, b[bi, t, hi])
        lam = np.empty((n_dim, p_dim))
        for n in range(n_dim):
            for j in range(p_dim):
                lam[n, j] = dlast[bi, hi, j, n]
        slb = np.empty(p_dim)
        dev = np.empty(p_dim)
        da = 0.0
        for s in range(segments - 1, -1, -1):
            t0, t1 = s * k, min(length, s * k + k)
            for t in range(t0, t1):  # recompute the segment's states from its checkpoint
                d = dt[bi, t, hi]
                for j in range(p_dim):
                    u[j] = d * x[bi, t, hi, j]
                _step(ck[s] if t == t0 else hs[t - t0 - 1], hs[t - t0], np.exp(d * ah), u, b[bi, t, hi])
            for t in range(t1 - 1, t0 - 1, -1):
                d = dt[bi, t, hi]
                e = np.exp(d * ah)
                ht, hp = hs[t - t0], (ck[s] if t == t0 else hs[t - t0 - 1])
                xt, dyt = x[bi, t, hi], dy[bi, t, hi]
                for j in range(p_dim):
                    slb[j] = 0.0
                    dev[j] = 0.0
                for n in range(n_dim):
                    cn, bn = c[bi, t, hi, n], b[bi, t, hi, n]
                    sdc = 0.0
                    sdb = 0.0
                    for j in range(p_dim):
                        lv = lam[n, j] + cn * dyt[j]  # λ_t = e_{t+1}·λ_{t+1} + c_t ⊗ dy_t
                        lam[n, j] = lv
                        sdc += dyt[j] * ht[n, j]
                        sdb += lv * xt[j]
                        slb[j] += lv * bn
                        dev[j] += lv * hp[n, j]
                    dc[bi, t, hi, n] = sdc
                    db[bi, t, hi, n] = d * sdb
                de = 0.0
                sx = 0.0
                for j in range(p_dim):
                    dx[bi, t, hi, j] = d * slb[j]
                    de += dev[j]
                    sx += xt[j] * slb[j]
                ge = de * e  # dL/d(dt·a)
                ddt[bi, t, hi] = sx + ge * ah
                da += ge * d
                _fold(lam, e)
        da_part[bi, hi] = da


@njit(cache=True)
def _fill_grad(x: Any, dt: Any, a: Any, b: Any, c: Any, dy: Any, dlast: Any, dx: Any, ddt: Any, db: Any, dc: Any,
               da_part: Any, k: int, argv: Any) -> None:
    r = argv[0]
    r.x, r.dt, r.a, r.b, r.c = x.ctypes.data, dt.ctypes.data, a.ctypes.data, b.ctypes.data, c.ctypes.data
    r.dy, r.dlast, r.dx, r.ddt = dy.ctypes.data, dlast.ctypes.data, dx.ctypes.data, ddt.ctypes.data
    r.db, r.dc, r.da_part = db.ctypes.data, dc.ctypes.data, da_part.ctypes.data
    r.batch, r.length, r.heads, r.p, r.n, r.checkpoint = x.shape[0], x.shape[1], x.shape[2], x.shape[3], b.shape[3], k


@njit(cache=True)
def _round_bf16(src: Any, dst: Any) -> None:
    for i in range(src.shape[0]):
        dst[i] = f64_to_bf16(src[i])


def _narrow_to(src: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A float64 array rounded once to `dtype` (a fresh array)."""
    if dtype == np.float64:
        return src
    out = np.empty(src.shape, dtype)
    if dtype == DType.BF16.np:
        _round_bf16(src.reshape(-1), bits(out).reshape(-1))
    else:
        np.copyto(out, src, casting="unsafe")
    return out


def ssd_chunk_scan_grad(inputs: list[np.ndarray], params: Any) -> tuple[np.ndarray, ...]:
    """(dx, ddt, da, db, dc) from (x, dt, a, b, c, dy, dlast_state), each in the inputs' dtype."""
    dtype = inputs[0].dtype
    x, dt, a, b, c, dy, dlast = (np.ascontiguousarray(v, dtype=np.float64) for v in inputs)
    nb, length, nh, _ = x.shape
    dx, ddt, db, dc = (np.zeros(v.shape) for v in (x, dt, b, c))
    da_part = np.zeros((nb, nh))
    if length and x.size and b.size:  # otherwise every gradient is 0 (or empty)
        argv = jobs.argv_of(SSD_GRAD_ARGS)
        _fill_grad(x, dt, a, b, c, dy, dlast, dx, ddt, db, dc, da_part, max(1, min(CHECKPOINT, length)), argv)
        seconds = 3 * x.size * b.shape[3] * SECONDS_PER_STATE_STEP
        jobs.run(jobs.job(_backward_part, argv, seconds, nb * nh))
    da = np.zeros(nh)
    for bi in range(nb):  # batch ascending, a fixed order
        da += da_part[bi]
    return tuple(_narrow_to(g, dtype) for g in (dx, ddt, da, db, dc))


# --- registration ---------------------------------------------------------------------------------

def ssd_chunk_scan_cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: Any) -> CostEstimate:
    """Four flops per state element and step (two FMAs), plus an exp per (batch, step, head); every
    operand and both outputs move once."""
    nb, length, nh, p = shapes[0]
    n = shapes[3][3]
    flops = 4 * nb * length * nh * p * n + 20 * nb * length * nh
    size = dtypes[0].itemsize
    moved = sum(math.prod(s) for s in shapes[:5]) * size + (nb * length * nh * p + nb * nh * p * n) * size
    return CostEstimate(flops=flops, bytes_moved=moved)


# |out - ref| <= max_relative·|ref| + max_absolute·S, S per element = the same recurrence on |x|·|dt|,
# |b| and |c| (the sum of the |terms|). Twice the worst error `python -m fuel.testing.measure
# SsdChunkScan` found over seeds 0-59: the relative part is one rounding of a float64 result (1 ulp
# allowed), the absolute part the float64 state's own error (measured on the f64 impl) in every dtype.
SSD_PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 1.2e-7, 8e-16, "float64 rescaled state, one rounding"),
    DType.F64: PrecisionGuarantee(True, None, 2.3e-15, 8e-16, "float64 rescaled state"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, 8e-16, "float64 state, round-to-odd f32 then RNE"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, 8e-16, "float64 state, one correctly rounded cast"),
}


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(ssd_chunk_scan_f32)
    kernels = {DType.F32: ssd_chunk_scan_f32, DType.F64: ssd_chunk_scan_f64, DType.BF16: ssd_chunk_scan_bf16,
               DType.F16: ssd_chunk_scan_f16}
    for dt in FLOAT_DTYPES:
        registry.register(BackendImpl(FusedOps.SSD_CHUNK_SCAN, "cpu", kernels[dt], (dt,) * 6, ssd_chunk_scan_cost,
                                      SSD_PRECISION[dt], CONTIGUOUS_ONLY, rev))
