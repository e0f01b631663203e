"""`C = tile @ Aᵀ` for a dequantised weight tile on AVX-512 hosts: fuel's own register-blocked f32 GEMM,
used by `weight_tiles` in place of a one-thread OpenBLAS sgemm (`AVAILABLE`; other hosts keep OpenBLAS).

Why: the tile products are sgemm calls of modest size (a few hundred weight rows, R activation rows),
where OpenBLAS repacks both operands on every call. Here the activations are transposed and packed once a
call (`pack_activations`: panels of 64 activations, each `[K, 64]` contiguous, zero beyond R) and the
tile is read as dequantised. The inner block holds a 4 × 16·mv block of C in 4·mv zmm accumulators: each
k step loads mv vectors of the panel's row k and broadcasts 4 tile values, for 4·mv fused multiply-adds.
K is walked in blocks of `KC` (the panels' block stays in L2, the tile rows' block in L1); each block's
sum is a chain from zero, added to C once.

Measured here (one core, 144-256 tile rows), GFLOP/s: 114-116 at K = 576-1536, R = 128, and 105-113 at
K = 4096, R = 64, where one-thread OpenBLAS sgemm on the same tiles reached 70-95 (its better operand
order). Two threads reach about 195 together (OpenBLAS's large sgemm: 200). The code is plain LLVM vector
IR, so it also runs without AVX-512 (tests run it everywhere), but there 16 accumulators spill.

Every C element is the same sequence of f32 operations whatever the tiling, padding or thread count: a
sequential FMA chain over each block of KC k's, in order, the blocks' sums added in k order. Its bytes
depend only on the inputs; the blocked sum's error grows with √KC + √(K/KC) rather than √K.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from fuel.dispatch.cpu.simd16 import _F32, _VF, _W, _fma, _ptr, _splat

AVAILABLE = bool(binding.get_host_cpu_features().get("avx512f"))  # 32 vector registers hold the block
ROWS_PER_BLOCK = 4  # tile rows of one inner block
KC = 256  # k per pass over C
MC = 256  # activations per pass over the tile rows (a [KC, MC] block of Aᵀ is 256 KiB, in L2)
PANEL = 4 * _W  # activations per panel of packed Aᵀ (`pack_activations`): one inner block's width


def _f32_c(*tys: Any) -> bool:
    """The intrinsics address f32 arrays by flat offsets: only C-contiguous ones type-check."""
    return all(isinstance(t, types.Array) and t.layout == "C" and t.dtype == types.float32 for t in tys)


def _vec_at(builder: ir.IRBuilder, base: Any, offset: Any) -> Any:
    """A 16-float vector pointer at element `offset` of the float pointer base."""
    return builder.bitcast(builder.gep(base, [offset]), _VF.as_pointer())


def _make_block(mv: int) -> Any:
    """An intrinsic: c[c_off + i·ldc + 16j + l] += Σ_{k<kc} w[w_off + i·ldw + k] · at[at_off + k·ldat + 16j + l]
    for i < 4, j < mv, l < 16 (flat offsets into C-contiguous f32 arrays), the sum a sequential FMA chain
    from zero, added to c once."""

    def block(typingctx: Any, w: Any, w_off: Any, ldw: Any, at: Any, at_off: Any, ldat: Any, c: Any, c_off: Any,
              ldc: Any, kc: Any) -> Any:
        if not _f32_c(w, at, c):
            return None
        sig = types.void(w, w_off, ldw, at, at_off, ldat, c, c_off, ldc, kc)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            t = signature.args
            i64 = ir.IntType(64)
            wp = _ptr(context, builder, t[0], args[0], args[1], _F32)
            ap = _ptr(context, builder, t[3], args[3], args[4], _F32)
            cp = _ptr(context, builder, t[6], args[6], args[7], _F32)
            ldw, ldat, ldc, kc = (context.cast(builder, args[i], t[i], types.int64) for i in (2, 5, 8, 9))

            def c_at(i: int, j: int) -> Any:
                offset = builder.add(builder.mul(ldc, ir.Constant(i64, i)), ir.Constant(i64, _W * j))
                return _vec_at(builder, cp, offset)

            zero = ir.Constant(_VF, [0.0] * _W)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(mv)] for _ in range(ROWS_PER_BLOCK)]
            rows = [builder.gep(wp, [builder.mul(ldw, ir.Constant(i64, i))]) for i in range(ROWS_PER_BLOCK)]
            with cgutils.for_range(builder, kc) as loop:
                k = loop.index
                arow = builder.gep(ap, [builder.mul(k, ldat)])
                a = [builder.load(_vec_at(builder, arow, ir.Constant(i64, _W * j)), align=4) for j in range(mv)]
                for i in range(ROWS_PER_BLOCK):
                    b = _splat(builder, builder.load(builder.gep(rows[i], [k])), _VF)
                    for j in range(mv):
                        builder.store(_fma(builder, b, a[j], builder.load(accs[i][j])), accs[i][j])
            for i in range(ROWS_PER_BLOCK):
                for j in range(mv):
                    at_c = c_at(i, j)
                    builder.store(builder.fadd(builder.load(at_c, align=4), builder.load(accs[i][j])), at_c, align=4)
            return context.get_dummy_value()

        return sig, codegen

    block.__name__ = block.__qualname__ = f"_tile_block{mv}"
    return intrinsic(block)


_block1, _block2, _block3, _block4 = (_make_block(mv) for mv in range(1, 5))


def _transpose16_ir(typingctx: Any, src: Any, s_off: Any, lds: Any, dst: Any, d_off: Any, ldd: Any) -> Any:
    """dst[d_off + j·ldd + i] <- src[s_off + i·lds + j] for i, j < 16: 16 row loads, four rounds of 16
    two-source shuffles (round b swaps bit b of the row and column indices), 16 row stores."""
    if not _f32_c(src, dst):
        return None
    sig = types.void(src, s_off, lds, dst, d_off, ldd)

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        t = signature.args
        i64 = ir.IntType(64)
        sp = _ptr(context, builder, t[0], args[0], args[1], _F32)
        dp = _ptr(context, builder, t[3], args[3], args[4], _F32)
        lds, ldd = (context.cast(builder, args[i], t[i], types.int64) for i in (2, 5))

        def row(base: Any, ld: Any, i: int) -> Any:
            return _vec_at(builder, base, builder.mul(ld, ir.Constant(i64, i)))

        rows = [builder.load(row(sp, lds, i), align=4) for i in range(_W)]
        mask = ir.VectorType(ir.IntType(32), _W)
        for b in (1, 2, 4, 8):
            low = ir.Constant(mask, [c if not c & b else _W + c - b for c in range(_W)])  # the row with bit b clear
            high = ir.Constant(mask, [c + b if not c & b else _W + c for c in range(_W)])  # its partner, bit b set
            nxt = list(rows)
            for i in range(_W):
                if not i & b:
                    nxt[i] = builder.shuffle_vector(rows[i], rows[i + b], low)
                    nxt[i + b] = builder.shuffle_vector(rows[i], rows[i + b], high)
            rows = nxt
        for i in range(_W):
            builder.store(rows[i], row(dp, ldd, i), align=4)
        return context.get_dummy_value()

    return sig, codegen


_transpose16: Any = intrinsic(_transpose16_ir)


@njit(inline="always", cache=True)
def transpose_into(src: Any, s_off: int, lds: int, rows: int, cols: int, dst: Any, d_off: int, ldd: int) -> None:
    """dst[d_off + j·ldd + i] <- src[s_off + i·lds + j] for i < rows, j < cols (flat offsets into C-contiguous
    f32 arrays), by 16 x 16 blocks transposed in registers. Element by element down a column, rows 6-16 KiB
    apart share a few cache sets and missed on every read: 0.42 / 0.73 ms at [128, 1536] / [64, 4096]."""
    r16, c16 = rows // _W * _W, cols // _W * _W
    for i0 in range(0, r16, _W):
        for j0 in range(0, c16, _W):
            _transpose16(src, s_off + i0 * lds + j0, lds, dst, d_off + j0 * ldd + i0, ldd)
        for i in range(i0, i0 + _W):
            for j in range(c16, cols):
                dst[d_off + j * ldd + i] = src[s_off + i * lds + j]
    for i in range(r16, rows):
        for j in range(cols):
            dst[d_off + j * ldd + i] = src[s_off + i * lds + j]


@njit(cache=True)
def pack_activations(a: Any, ap: Any, rp: int) -> None:
    """ap (flat, K·Rp f32) <- a [R, K] as panels of Aᵀ, Rp >= R a multiple of 16: panel p holds activations
    64p.. (width w = min(64, Rp - 64p)) as [K, w] at offset 64p·K, activations R..Rp-1 zero. A panel's
    K-block the inner block reads is then contiguous: in one [K, Rp] matrix its rows were Rp·4 bytes
    apart, which at Rp = 768 fell on a quarter of L1's sets (two threads: 128-149 GFLOP/s at [768, 384]
    x [384, 384-1536], 172-195 as panels)."""
    rows, k = a.shape
    flat = a.reshape(-1)
    for m0 in range(0, rp, PANEL):
        width = min(PANEL, rp - m0)
        if m0 + width > rows:
            ap[m0 * k:(m0 + width) * k] = 0.0
        if m0 < rows:
            transpose_into(flat, m0 * k, k, min(width, rows - m0), k, ap, m0 * k, width)


def padded_width(rows: int) -> int:
    """Packed Aᵀ's width for R = rows: the next multiple of 16."""
    return -(-rows // _W) * _W


@njit(inline="always", cache=True)
def tile_times_at(tile: Any, rows: int, ap: Any, c: Any) -> None:
    """c[:rows] <- tile[:rows] @ Aᵀ (tile [t, K], ap Aᵀ's panels (`pack_activations`), c [t, Rp], f32
    C-contiguous, t a multiple of 4 >= rows). Tile rows rows..(rows rounded up to 4) are zeroed, so the
    last block reads no garbage."""
    k, rp = tile.shape[1], c.shape[1]
    r4 = -(-rows // ROWS_PER_BLOCK) * ROWS_PER_BLOCK
    tile[rows:r4] = 0.0
    c[:r4] = 0.0
    for k0 in range(0, k, KC):
        kc = min(KC, k - k0)
        for m1 in range(0, rp, MC):
            for n0 in range(0, r4, ROWS_PER_BLOCK):
                w_off, c_row = n0 * k + k0, n0 * rp
                for m0 in range(m1, min(rp, m1 + MC), PANEL):
                    width = min(PANEL, rp - m0)
                    a_off = m0 * k + k0 * width
                    if width == 64:
                        _block4(tile, w_off, k, ap, a_off, width, c, c_row + m0, rp, kc)
                    elif width == 48:
                        _block3(tile, w_off, k, ap, a_off, width, c, c_row + m0, rp, kc)
                    elif width == 32:
                        _block2(tile, w_off, k, ap, a_off, width, c, c_row + m0, rp, kc)
                    else:
                        _block1(tile, w_off, k, ap, a_off, width, c, c_row + m0, rp, kc)


def tile_times_at_checked(tile: np.ndarray, rows: int, ap: np.ndarray, c: np.ndarray) -> None:
    """`tile_times_at` from Python (the tiles on Python threads, tests): the same kernel without the GIL,
    its preconditions asserted."""
    assert tile.dtype == ap.dtype == c.dtype == np.float32 and ap.ndim == 1
    assert ap.size == tile.shape[1] * c.shape[1] and c.shape[1] % _W == 0
    assert rows <= tile.shape[0] and tile.shape[0] % ROWS_PER_BLOCK == 0 and c.shape[0] >= tile.shape[0]
    _tile_times_at(tile, rows, ap, c)


@njit(cache=True, nogil=True)
def _tile_times_at(tile: Any, rows: int, ap: Any, c: Any) -> None:
    tile_times_at(tile, rows, ap, c)
