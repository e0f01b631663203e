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

The blocks are the items of one pool task (`conv2d_tasks`), each product a one-thread BLAS call made from
jitted code; the padded-plane copy and the direct loop are tasks too. Every block size is a function of
the shapes only, so results are the same bytes at any part count. bf16/f16 are
widened exactly to f32 once, computed in f32 and rounded once on store; f64 runs in f64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import njit

from fuel.cpu.conv.conv2d_tasks import (
    BLOCK_ARGS,
    ROWS,
    TRANSPOSED,
    UNIT,
    blocks_f32_part,
    blocks_f64_part,
    direct_f32_part,
    direct_f64_part,
    pad_f32_part,
    pad_f64_part,
)
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
from fuel.runtime import jobs, threads
from fuel.runtime.buffers import POOL

BLOCK_BYTES = 1 << 20  # a gathered block and its product stay in L2 (docs/performance/conv.md, "conv2d")
KB_MAX = 2048  # longest reduction run in one product; longer ones are summed block by block
PB_ALIGN = 16
PB_MIN = 64  # narrower products run BLAS far below its speed
MIN_BLOCKS = 8  # a product of this many PB_MIN columns or more is cut into at least this many tasks
UNIT_MAX_WASTE = 8  # the padded-plane form computes (Wp − Wo)/Wo extra columns: at most 1/8 of them
DIRECT_MAX_M = 4  # output channels per group up to which the direct loop runs (no gather)
DIRECT_MAX_K = 8  # taps (Cin/groups · Kh · Kw) up to which the direct loop runs
SECONDS_PER_FLOP = 0.05e-9  # one core's time per flop of a block or the direct loop, for the part count
COPY_BYTES_PER_SECOND = 10e9  # one core's rate copying x into padded planes, for the part count


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


@njit(cache=True)
def _fill(x: Any, src: Any, w: Any, bias: Any, out: Any, argv: Any) -> None:
    a = argv[0]
    a.x, a.src, a.w, a.bias, a.out = x.ctypes.data, src.ctypes.data, w.ctypes.data, bias.ctypes.data, out.ctypes.data
    a.nb, a.cin, a.h, a.wd = x.shape[0], x.shape[1], x.shape[2], x.shape[3]
    a.cout, a.cg, a.kh, a.kw = w.shape[0], w.shape[1], w.shape[2], w.shape[3]
    a.ho, a.wo = out.shape[2], out.shape[3]


def _set(argv: np.ndarray, **fields: int) -> None:
    for name, value in fields.items():
        argv[0][name] = int(value)


def uses_direct(x_shape: Shape, w_shape: Shape, groups: int) -> bool:
    """Whether a Conv2D runs the direct loop (few output channels per group, or few taps)."""
    cout, cg, kh, kw = w_shape
    return cout // groups <= DIRECT_MAX_M or cg * kh * kw <= DIRECT_MAX_K


def conv2d_jobs(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, out: np.ndarray, g: int,
                stride: tuple[int, int], dilation: tuple[int, int], pt: int, pl: int) -> tuple[jobs.Job, ...]:
    """The jobs of out (f32/f64, contiguous) <- conv2d of x, w, bias in out's type (kdim > 0): the direct
    loop, or the padded-plane copy (unit stride) and the blocks. The top/left padding may be negative (a
    crop: ConvTranspose2D's stride-1 form); the output size is out's. Run them under one BLAS thread."""
    nb, cout, ho, wo = out.shape
    cg, kh, kw = w.shape[1], w.shape[2], w.shape[3]
    (sh, sw), (dh, dw) = stride, dilation
    b = bias if bias is not None else np.zeros(cout, out.dtype)
    f64 = out.dtype == np.float64
    kdim = cg * kh * kw
    argv = jobs.argv_of(BLOCK_ARGS)
    keep: tuple[np.ndarray, ...] = (b,)
    if uses_direct(x.shape, w.shape, g):
        _fill(x, x, w, b, out, argv)
        _set(argv, sh=sh, sw=sw, dh=dh, dw=dw, pt=pt, pl=pl, groups=g)
        seconds = out.size * 2 * kdim * SECONDS_PER_FLOP
        return (jobs.job(direct_f64_part if f64 else direct_f32_part, argv, seconds, nb * cout, keep=keep),)
    m = cout // g
    # Three forms of the gather: padded planes (unit stride, rows of cols are contiguous copies), runs
    # along output rows (other strides), or the transpose with runs along the kernel rows (a kernel
    # wider than the output: a weight gradient).
    unit = (sh, sw) == (1, 1) and dw * (kw - 1) * UNIT_MAX_WASTE <= wo
    form = UNIT if unit else TRANSPOSED if kw > wo else ROWS
    found: list[jobs.Job] = []
    xp = x
    hp = wp = qimg = 0
    if unit:  # padded planes: every row of a block is a contiguous copy (the padding is already there)
        hp, wp = ho + dh * (kh - 1), wo + dw * (kw - 1)
        if (pt, pl, x.shape[2], x.shape[3]) != (0, 0, hp, wp):
            xp = POOL.empty((nb, x.shape[1], hp, wp), out.dtype)
            keep = (b, xp)
            pad = jobs.argv_of(BLOCK_ARGS)
            _fill(x, xp, w, b, out, pad)
            _set(pad, pt=pt, pl=pl, hp=hp, wp=wp)
            found.append(jobs.job(pad_f64_part if f64 else pad_f32_part, pad, xp.nbytes / COPY_BYTES_PER_SECOND,
                                  nb * x.shape[1] * hp, keep=(xp,)))
        qimg = (ho - 1) * wp + wo
        total = nb * qimg
    else:
        total = nb * ho * wo
    kb = min(kdim, KB_MAX)
    pb = block_columns(kb, out.itemsize, total)
    nblocks = -(-total // pb)
    _fill(x, xp, w, b, out, argv)
    gemm, gemv = (threads.blas_address("dgemm"), threads.blas_address("dgemv")) if f64 else \
        (threads.blas_address("sgemm"), threads.blas_address("sgemv"))
    _set(argv, gemm=gemm, gemv=gemv, sh=sh, sw=sw, dh=dh, dw=dw, pt=pt, pl=pl, groups=g, has_bias=bias is not None,
         form=form, hp=hp, wp=wp, qimg=qimg, total=total, kb=kb, pb=pb, nblocks=nblocks)
    seconds = 2 * m * kdim * total * g * SECONDS_PER_FLOP
    found.append(jobs.job(blocks_f64_part if f64 else blocks_f32_part, argv, seconds, g * nblocks, keep=keep))
    return tuple(found)


def conv2d_into(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, out: np.ndarray, g: int,
                stride: tuple[int, int], dilation: tuple[int, int], pt: int, pl: int) -> None:
    """out (f32/f64, contiguous) <- conv2d of x, w, bias in out's type (`conv2d_jobs`), every product on a
    one-thread BLAS: OpenBLAS splits one product over its threads with other roundings for some shapes,
    so the bytes would otherwise depend on its thread count."""
    if w.shape[1] * w.shape[2] * w.shape[3] == 0:
        out[...] = (bias if bias is not None else np.zeros(out.shape[1], out.dtype)).reshape(1, -1, 1, 1)
        return
    found = conv2d_jobs(x, w, bias, out, g, stride, dilation, pt, pl)
    with threads.one_blas_thread():
        jobs.run(found)


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
