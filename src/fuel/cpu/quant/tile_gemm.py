"""`C = tile @ Aᵀ` for a dequantised weight tile: fuel's own register-blocked f32 GEMM, used by
`weight_tiles` in place of a one-thread OpenBLAS sgemm on hosts with AVX-512 or AVX2 and FMA (`AVAILABLE`;
others keep OpenBLAS).

Why: the tile products are sgemm calls of modest size (a few hundred weight rows, R activation rows),
where OpenBLAS repacks both operands on every call. Here the activations are transposed and packed once a
call (`pack_activations`: panels of `PANEL` activations, each `[K, PANEL]` contiguous, zero beyond R) and
the tile is read as dequantised. The inner block holds a rows × 16·mv block of C in accumulators: each k
step loads mv 16-float vectors of the panel's row k and broadcasts `rows` tile values, for rows·mv fused
multiply-adds. Two geometries, by the host's registers:
- WIDE (AVX-512, 32 zmm): 4 rows × 64 activations, 16 zmm accumulators, panels of 64.
- NARROW (AVX2, 16 ymm): 6 rows × 16 activations, 12 ymm accumulators, panels of 16; the last rows of a
  tile in one block of 1-5 rows.
K is walked in blocks of `KC` (the panels' block stays in L2, the tile rows' block in L1); each block's
sum is a chain from zero, added to C once.

On the hosts measured it outruns a one-thread OpenBLAS sgemm on the same tiles (docs/performance/nf4.md,
"tile_gemm"); the wide geometry on an AVX2 host spills its accumulators.

Every C element is the same sequence of f32 operations whatever the geometry, tiling, padding or thread
count: a sequential FMA chain over each block of KC k's, in order, the blocks' sums added in k order. Its
bytes depend only on the inputs; the blocked sum's error grows with √KC + √(K/KC) rather than √K.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from fuel.cpu.simd.simd16 import IR_F32, IR_VF, LANES, element_pointer, fma_lanes, splat_lanes

_FEATURES = binding.get_host_cpu_features()
WIDE = bool(_FEATURES.get("avx512f"))  # the host's geometry (module docstring)
AVAILABLE = WIDE or bool(_FEATURES.get("avx2") and _FEATURES.get("fma"))
WIDE_ROWS, WIDE_PANEL = 4, 4 * LANES
NARROW_ROWS, NARROW_PANEL = 6, LANES
ROWS_PER_BLOCK, PANEL = (WIDE_ROWS, WIDE_PANEL) if WIDE else (NARROW_ROWS, NARROW_PANEL)
KC = 256  # k per pass over C
MC = 256  # activations per pass over the tile rows (a [KC, MC] block of Aᵀ is 256 KiB, in L2)


def _f32_c(*tys: Any) -> bool:
    """The intrinsics address f32 arrays by flat offsets: only C-contiguous ones type-check."""
    return all(isinstance(t, types.Array) and t.layout == "C" and t.dtype == types.float32 for t in tys)


def _vec_at(builder: ir.IRBuilder, base: Any, offset: Any) -> Any:
    """A 16-float vector pointer at element `offset` of the float pointer base."""
    return builder.bitcast(builder.gep(base, [offset]), IR_VF.as_pointer())


def _make_block(n: int, mv: int) -> Any:
    """An intrinsic: c[c_off + i·ldc + 16j + l] += Σ_{k<kc} w[w_off + i·ldw + k] · at[at_off + k·ldat + 16j + l]
    for i < n, j < mv, l < 16 (flat offsets into C-contiguous f32 arrays), the sum a sequential FMA chain
    from zero, added to c once."""

    def block(typingctx: Any, w: Any, w_off: Any, ldw: Any, at: Any, at_off: Any, ldat: Any, c: Any, c_off: Any,
              ldc: Any, kc: Any) -> Any:
        if not _f32_c(w, at, c):
            return None
        sig = types.void(w, w_off, ldw, at, at_off, ldat, c, c_off, ldc, kc)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            t = signature.args
            i64 = ir.IntType(64)
            wp = element_pointer(context, builder, t[0], args[0], args[1], IR_F32)
            ap = element_pointer(context, builder, t[3], args[3], args[4], IR_F32)
            cp = element_pointer(context, builder, t[6], args[6], args[7], IR_F32)
            ldw, ldat, ldc, kc = (context.cast(builder, args[i], t[i], types.int64) for i in (2, 5, 8, 9))

            def c_at(i: int, j: int) -> Any:
                offset = builder.add(builder.mul(ldc, ir.Constant(i64, i)), ir.Constant(i64, LANES * j))
                return _vec_at(builder, cp, offset)

            zero = ir.Constant(IR_VF, [0.0] * LANES)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(mv)] for _ in range(n)]
            rows = [builder.gep(wp, [builder.mul(ldw, ir.Constant(i64, i))]) for i in range(n)]
            with cgutils.for_range(builder, kc) as loop:
                k = loop.index
                arow = builder.gep(ap, [builder.mul(k, ldat)])
                a = [builder.load(_vec_at(builder, arow, ir.Constant(i64, LANES * j)), align=4) for j in range(mv)]
                for i in range(n):
                    b = splat_lanes(builder, builder.load(builder.gep(rows[i], [k])), IR_VF)
                    for j in range(mv):
                        builder.store(fma_lanes(builder, b, a[j], builder.load(accs[i][j])), accs[i][j])
            for i in range(n):
                for j in range(mv):
                    at_c = c_at(i, j)
                    builder.store(builder.fadd(builder.load(at_c, align=4), builder.load(accs[i][j])), at_c, align=4)
            return context.get_dummy_value()

        return sig, codegen

    block.__name__ = block.__qualname__ = f"_tile_block{n}x{mv}"
    return intrinsic(block)


_block1, _block2, _block3, _block4 = (_make_block(WIDE_ROWS, mv) for mv in range(1, 5))  # WIDE, by panel width
_rows1, _rows2, _rows3, _rows4, _rows5, _rows6 = (_make_block(n, 1) for n in range(1, NARROW_ROWS + 1))  # NARROW


def _transpose16_ir(typingctx: Any, src: Any, s_off: Any, lds: Any, dst: Any, d_off: Any, ldd: Any) -> Any:
    """dst[d_off + j·ldd + i] <- src[s_off + i·lds + j] for i, j < 16: 16 row loads, four rounds of 16
    two-source shuffles (round b swaps bit b of the row and column indices), 16 row stores."""
    if not _f32_c(src, dst):
        return None
    sig = types.void(src, s_off, lds, dst, d_off, ldd)

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        t = signature.args
        i64 = ir.IntType(64)
        sp = element_pointer(context, builder, t[0], args[0], args[1], IR_F32)
        dp = element_pointer(context, builder, t[3], args[3], args[4], IR_F32)
        lds, ldd = (context.cast(builder, args[i], t[i], types.int64) for i in (2, 5))

        def row(base: Any, ld: Any, i: int) -> Any:
            return _vec_at(builder, base, builder.mul(ld, ir.Constant(i64, i)))

        rows = [builder.load(row(sp, lds, i), align=4) for i in range(LANES)]
        mask = ir.VectorType(ir.IntType(32), LANES)
        for b in (1, 2, 4, 8):
            # the row with bit b clear, and its partner, bit b set
            low = ir.Constant(mask, [c if not c & b else LANES + c - b for c in range(LANES)])
            high = ir.Constant(mask, [c + b if not c & b else LANES + c for c in range(LANES)])
            nxt = list(rows)
            for i in range(LANES):
                if not i & b:
                    nxt[i] = builder.shuffle_vector(rows[i], rows[i + b], low)
                    nxt[i + b] = builder.shuffle_vector(rows[i], rows[i + b], high)
            rows = nxt
        for i in range(LANES):
            builder.store(rows[i], row(dp, ldd, i), align=4)
        return context.get_dummy_value()

    return sig, codegen


_transpose16: Any = intrinsic(_transpose16_ir)


@njit(inline="always", cache=True)
def transpose_into(src: Any, s_off: int, lds: int, rows: int, cols: int, dst: Any, d_off: int, ldd: int) -> None:
    """dst[d_off + j·ldd + i] <- src[s_off + i·lds + j] for i < rows, j < cols (flat offsets into C-contiguous
    f32 arrays), by 16 x 16 blocks transposed in registers: element by element down a column, rows 6-16 KiB
    apart share a few cache sets and miss on every read."""
    r16, c16 = rows // LANES * LANES, cols // LANES * LANES
    for i0 in range(0, r16, LANES):
        for j0 in range(0, c16, LANES):
            _transpose16(src, s_off + i0 * lds + j0, lds, dst, d_off + j0 * ldd + i0, ldd)
        for i in range(i0, i0 + LANES):
            for j in range(c16, cols):
                dst[d_off + j * ldd + i] = src[s_off + i * lds + j]
    for i in range(r16, rows):
        for j in range(cols):
            dst[d_off + j * ldd + i] = src[s_off + i * lds + j]


@njit(inline="always", cache=True)
def pack_panels(a: Any, ap: Any, rp: int, panel: int, p0: int, p1: int) -> None:
    """Panels [p0, p1) of `pack_activations`' layout (each panel is written by its own: any split of the
    panels packs the same bytes)."""
    rows, k = a.shape
    flat = a.reshape(-1)
    for p in range(p0, p1):
        m0 = p * panel
        width = min(panel, rp - m0)
        if m0 + width > rows:
            ap[m0 * k:(m0 + width) * k] = 0.0
        if m0 < rows:
            transpose_into(flat, m0 * k, k, min(width, rows - m0), k, ap, m0 * k, width)


@njit(cache=True)
def pack_activations(a: Any, ap: Any, rp: int, panel: int) -> None:
    """ap (flat, K·Rp f32) <- a [R, K] as panels of Aᵀ, Rp >= R: panel p holds activations p·panel.. (width
    w = min(panel, Rp - p·panel)) as [K, w] at offset p·panel·K, activations R..Rp-1 zero. A panel's
    K-block the inner block reads is then contiguous: in one [K, Rp] matrix its rows were Rp·4 bytes
    apart, which at Rp = 768 fell on a quarter of L1's sets (docs/performance/nf4.md, "tile_gemm")."""
    pack_panels(a, ap, rp, panel, 0, -(-rp // panel))


def padded_width(rows: int) -> int:
    """Packed Aᵀ's width for R = rows: the next multiple of 16."""
    return -(-rows // LANES) * LANES


@njit(inline="always", cache=True)
def _wide_block(tile: Any, w_off: int, k: int, ap: Any, a_off: int, width: int, c: Any, c_off: int, rp: int,
                kc: int, left: int) -> None:
    """One WIDE block: 4 tile rows against a panel of `width` (16-64) activations."""
    if width == 64:
        _block4(tile, w_off, k, ap, a_off, width, c, c_off, rp, kc)
    elif width == 48:
        _block3(tile, w_off, k, ap, a_off, width, c, c_off, rp, kc)
    elif width == 32:
        _block2(tile, w_off, k, ap, a_off, width, c, c_off, rp, kc)
    else:
        _block1(tile, w_off, k, ap, a_off, width, c, c_off, rp, kc)


@njit(inline="always", cache=True)
def _narrow_block(tile: Any, w_off: int, k: int, ap: Any, a_off: int, width: int, c: Any, c_off: int, rp: int,
                  kc: int, left: int) -> None:
    """One NARROW block: min(6, left) tile rows against a panel of 16 activations."""
    if left >= 6:
        _rows6(tile, w_off, k, ap, a_off, width, c, c_off, rp, kc)
    elif left == 5:
        _rows5(tile, w_off, k, ap, a_off, width, c, c_off, rp, kc)
    elif left == 4:
        _rows4(tile, w_off, k, ap, a_off, width, c, c_off, rp, kc)
    elif left == 3:
        _rows3(tile, w_off, k, ap, a_off, width, c, c_off, rp, kc)
    elif left == 2:
        _rows2(tile, w_off, k, ap, a_off, width, c, c_off, rp, kc)
    else:
        _rows1(tile, w_off, k, ap, a_off, width, c, c_off, rp, kc)


@njit(inline="always", cache=True)
def _times_at(block: Any, tile: Any, row_end: int, ap: Any, c: Any, step: int, panel: int) -> None:
    """c[:row_end] += tile[:row_end] @ Aᵀ by `block`s of `step` tile rows against panels of `panel`: K in
    blocks of KC, activations in passes of MC, then tile rows, then panels."""
    k, rp = tile.shape[1], c.shape[1]
    for k0 in range(0, k, KC):
        kc = min(KC, k - k0)
        for m1 in range(0, rp, MC):
            for n0 in range(0, row_end, step):
                w_off, c_row = n0 * k + k0, n0 * rp
                for m0 in range(m1, min(rp, m1 + MC), panel):
                    width = min(panel, rp - m0)
                    block(tile, w_off, k, ap, m0 * k + k0 * width, width, c, c_row + m0, rp, kc, row_end - n0)


@njit(inline="always", cache=True)
def wide_times_at(tile: Any, rows: int, ap: Any, c: Any) -> None:
    """c[:rows] <- tile[:rows] @ Aᵀ in the WIDE geometry (tile [t, K], ap Aᵀ's panels of WIDE_PANEL
    (`pack_activations`), c [t, Rp], f32 C-contiguous, t a multiple of 4 >= rows). Tile rows rows..(rows
    rounded up to 4) are zeroed, so the last block reads no garbage."""
    r4 = -(-rows // WIDE_ROWS) * WIDE_ROWS
    tile[rows:r4] = 0.0
    c[:r4] = 0.0
    _times_at(_wide_block, tile, r4, ap, c, WIDE_ROWS, WIDE_PANEL)


@njit(inline="always", cache=True)
def narrow_times_at(tile: Any, rows: int, ap: Any, c: Any) -> None:
    """c[:rows] <- tile[:rows] @ Aᵀ in the NARROW geometry (tile [t, K], ap Aᵀ's panels of NARROW_PANEL
    (`pack_activations`), c [t, Rp], f32 C-contiguous, t >= rows): blocks of 6 rows, the last of 1-5, so
    no row past `rows` is read."""
    c[:rows] = 0.0
    _times_at(_narrow_block, tile, rows, ap, c, NARROW_ROWS, NARROW_PANEL)


tile_times_at = wide_times_at if WIDE else narrow_times_at  # the host's, called from the tile tasks


def tile_times_at_checked(tile: np.ndarray, rows: int, ap: np.ndarray, c: np.ndarray, wide: bool = WIDE) -> None:
    """`tile_times_at` from Python (the tiles on Python threads, tests; `wide` picks the geometry, the
    host's by default, packed Aᵀ's panels of its width): the same kernel without the GIL, its
    preconditions asserted."""
    assert tile.dtype == ap.dtype == c.dtype == np.float32 and ap.ndim == 1
    assert ap.size == tile.shape[1] * c.shape[1] and c.shape[1] % LANES == 0
    assert rows <= tile.shape[0] and c.shape[0] >= tile.shape[0]
    if wide:
        assert tile.shape[0] % WIDE_ROWS == 0
        _wide_times_at(tile, rows, ap, c)
    else:
        _narrow_times_at(tile, rows, ap, c)


@njit(cache=True, nogil=True)
def _wide_times_at(tile: Any, rows: int, ap: Any, c: Any) -> None:
    wide_times_at(tile, rows, ap, c)


@njit(cache=True, nogil=True)
def _narrow_times_at(tile: Any, rows: int, ap: Any, c: Any) -> None:
    narrow_times_at(tile, rows, ap, c)
