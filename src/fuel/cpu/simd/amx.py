"""Intel AMX tiles for jitted kernels: whether this process may use them, and the tile instructions.

AMX (Sapphire Rapids and later Xeons) adds eight tile registers of up to 16 rows x 64 bytes and a unit
that multiplies them: `tdpbf16ps` adds a [16, 32] bf16 tile times a [32, 16] bf16 tile (stored as 16
rows of 16 bf16 pairs, "VNNI" order) into a [16, 16] f32 tile, 16 x 16 x 32 products in about 16 cycles,
where an AVX-512 core does 32 f32 products a cycle. The products of two bf16 are exact in f32 and each
sum is rounded to nearest even, as an f32 FMA chain would, but with denormal inputs and results taken as
zero (DAZ, FTZ), so callers keep their values away from the denormal range.

Linux hands out the tile state only to processes that ask (`arch_prctl(ARCH_REQ_XCOMP_PERM)`);
`available()` asks once and says whether the host has the instructions and the kernel granted them.
The instructions are emitted as inline assembly (LLVM's own AMX intrinsics need a tile-shape pass that
Numba's pipeline does not run), so the native assembly parser is initialised here on AMX hosts. A kernel loads its
tile configuration (`tile_config`) in each thread that runs it and releases it (`tile_release`) after.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any

import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.extending import intrinsic

from fuel.runtime.buffers import POOL

_HOST = binding.get_host_cpu_features()
_HAS_AMX_BF16 = bool(_HOST.get("amx-bf16")) and bool(_HOST.get("amx-tile"))
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18
TILES = 8
ROWS, ROW_BYTES = 16, 64  # every tile of this module's configuration: 16 rows of 64 bytes (1 KiB)

if _HAS_AMX_BF16:  # only AMX hosts compile the tile instructions
    binding.initialize_native_asmparser()


@functools.cache
def available() -> bool:
    """True where this process may run AMX bf16 instructions: the host has them and Linux granted the
    tile state (asked once)."""
    if not _HAS_AMX_BF16 or not sys.platform.startswith("linux"):  # the syscall number is Linux's x86-64 one
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


def config() -> np.ndarray:
    """The 64-byte tile configuration (palette 1) with all eight tiles 16 rows x 64 bytes."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    cfg[16:16 + 2 * TILES].view(np.uint16)[:] = ROW_BYTES
    cfg[48:48 + TILES] = ROWS
    return cfg


def aligned_empty(count: int, dtype: type, align: int = 64) -> np.ndarray:
    """An uninitialised 1-D array whose data starts on an `align`-byte boundary: tile loads and stores of
    rows that straddle cache lines are several times slower (docs/performance/runtime.md, "amx"). Large
    ones come from the buffer pool, so a call's scratch does not fault in fresh pages each time."""
    size = np.dtype(dtype).itemsize
    raw = POOL.empty((count * size + align,), np.dtype(np.uint8))
    at = -raw.ctypes.data % align
    return raw[at:at + count * size].view(dtype)


def _emit(builder: Any, text: str, constraints: str, args: list[Any]) -> None:
    fnty = ir.FunctionType(ir.VoidType(), [a.type for a in args])
    builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), args)


def _literal(t: Any) -> int | None:
    return int(t.literal_value) if isinstance(t, types.IntegerLiteral) and 0 <= t.literal_value < TILES else None


@intrinsic
def _tile_config(typingctx: Any, address: Any) -> Any:
    """ldtilecfg: load the 64-byte configuration at `address` (an int64)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        _emit(builder, "ldtilecfg ($0)", "r,~{memory}", [args[0]])
        return context.get_dummy_value()

    return types.void(address), codegen


@intrinsic
def _tile_release(typingctx: Any) -> Any:
    """tilerelease: hand the tile state back (the configuration is lost)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        _emit(builder, "tilerelease", "~{memory}", [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic(prefer_literal=True)
def _tile_zero(typingctx: Any, t: Any) -> Any:
    """tilezero: tile t (a literal) <- 0."""
    tile = _literal(t)
    if tile is None:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        _emit(builder, f"tilezero %tmm{tile}", "~{memory}", [])
        return context.get_dummy_value()

    return types.void(t), codegen


def _addressed(text: str) -> Any:
    """An intrinsic (tile t, a literal; address; stride, int64 bytes) emitting `text`, whose {tile} is t and
    whose memory operand is ($0,$1,1): the rows at address + i·stride."""

    @intrinsic(prefer_literal=True)
    def addressed(typingctx: Any, t: Any, address: Any, stride: Any) -> Any:
        tile = _literal(t)
        if tile is None:
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            _emit(builder, text.format(tile=tile), "r,r,~{memory}", [args[1], args[2]])
            return context.get_dummy_value()

        return types.void(t, address, stride), codegen

    return addressed


@intrinsic(prefer_literal=True)
def _tile_dot_bf16(typingctx: Any, c: Any, a: Any, b: Any) -> Any:
    """tdpbf16ps: tile c (f32 [16, 16]) += tile a (bf16 [16, 32]) @ tile b (bf16 [32, 16] in VNNI order:
    row r holds the pairs (b[2r, j], b[2r + 1, j]) for j = 0..15). c, a and b literals."""
    tc, ta, tb = _literal(c), _literal(a), _literal(b)
    if tc is None or ta is None or tb is None:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        _emit(builder, f"tdpbf16ps %tmm{tb}, %tmm{ta}, %tmm{tc}", "~{memory}", [])
        return context.get_dummy_value()

    return types.void(c, a, b), codegen


tile_config: Any = _tile_config
tile_release: Any = _tile_release
tile_zero: Any = _tile_zero
tile_load: Any = _addressed("tileloadd ($0,$1,1), %tmm{tile}")  # tile t <- its rows at address + i·stride
tile_store: Any = _addressed("tilestored %tmm{tile}, ($0,$1,1)")  # tile t's rows -> address + i·stride
tile_dot_bf16: Any = _tile_dot_bf16
