"""Reference for QMatMul (14): float64 `a @ W.T` (or `a @ W`) with W dequantised by the `gguf` package.

gguf-py is the oracle of the dequantised values (bit-exact with ggml's `to_float`). Its Q8_1 size table
says 40 bytes while ggml's block_q8_1 is 36 (f16 d, f16 s, 32 int8), so Q8_1 is decoded here: d·q.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np

from fuel.dtype import DType
from fuel.graph.registry.qmatmul import QMatMulParams, weight_bytes, weight_words
from fuel.quant import QuantType
from fuel.testing.reference import Case, register

# Byte offsets of each K-quant block's f16 scale fields (d, and dmin where the type has one).
K_SCALE_FIELDS: dict[QuantType, tuple[int, ...]] = {
    QuantType.Q2K: (80, 82),
    QuantType.Q3K: (108,),
    QuantType.Q4K: (0, 2),
    QuantType.Q5K: (0, 2),
    QuantType.Q6K: (208,),
}
QUANTIZABLE = (QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1, QuantType.Q8_0)


def gguf_type(qt: QuantType) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[qt.ggml_name]


def weight_u8(w: np.ndarray, p: QMatMulParams) -> np.ndarray:
    """The weight's bytes as uint8 [n, row bytes] (the word stream's padding dropped)."""
    return np.ascontiguousarray(w).view(np.uint8)[:weight_bytes(p)].reshape(p.n, -1)


def dequant64(w: np.ndarray, p: QMatMulParams) -> np.ndarray:
    """W [n, k] in float64, from its u32 word stream."""
    qt = p.quant_type
    if p.n == 0 or p.k == 0:
        return np.zeros((p.n, p.k))
    raw = weight_u8(w, p)
    if qt is QuantType.Q8_1:
        blocks = raw.reshape(-1, qt.block_bytes)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float64)
        return (d * blocks[:, 4:].view(np.int8)).reshape(p.n, p.k)
    return np.asarray(gguf.quants.dequantize(raw, gguf_type(qt)), np.float64).reshape(p.n, p.k)


def _weight_side(xs: list[np.ndarray], p: QMatMulParams, f: Any) -> np.ndarray:
    deq = f(dequant64(xs[1], p))
    return np.matmul(f(xs[0]), deq if p.transpose else deq.T)


def qmatmul64(xs: list[np.ndarray], params: QMatMulParams) -> np.ndarray:
    return _weight_side(xs, params, lambda x: x)


def qmatmul_scale(xs: list[np.ndarray], params: QMatMulParams, ref: np.ndarray | None = None) -> np.ndarray:
    """S = |a| @ |dequant(W)|ᵀ per output element: the size of the terms its sum adds up."""
    return _weight_side(xs, params, np.abs)


def as_words(raw: np.ndarray) -> np.ndarray:
    """Block bytes as the u32 stream QMatMul takes, zero-padded to whole words."""
    flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    padded = np.zeros(-(-flat.size // 4) * 4, np.uint8)
    padded[:flat.size] = flat
    return padded.view(np.uint32)


def random_weight(rng: np.random.Generator, qt: QuantType, n: int, k: int, scale: float = 1.0) -> np.ndarray:
    """Block bytes uint8 [n, row bytes] of a random `[n, k]` weight of type qt: gguf-quantized normal
    values where gguf can quantize; random bytes with finite f16 scales for the K-quants; hand-built
    Q8_1 blocks (d, s = d·Σq, int8 q)."""
    if qt in QUANTIZABLE:
        values = (rng.standard_normal((n, k)) * scale).astype(np.float32)
        return np.asarray(gguf.quants.quantize(values, gguf_type(qt))).reshape(n, -1)
    nblocks = n * (k // qt.block_elements)
    blocks = rng.integers(0, 256, (nblocks, qt.block_bytes), dtype=np.uint8)
    if qt is QuantType.Q8_1:
        q = blocks[:, 4:].view(np.int8).astype(np.float64)
        d = rng.uniform(0.5, 1.5, nblocks) * scale / 127
        blocks[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
        s = d.astype(np.float16).astype(np.float64) * q.sum(axis=1)
        blocks[:, 2:4] = s.astype(np.float16).view(np.uint8).reshape(-1, 2)
    else:
        for off in K_SCALE_FIELDS[qt]:
            f16 = (rng.standard_normal(nblocks) * 0.05 * scale).astype(np.float16)
            blocks[:, off:off + 2] = f16.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


# (rows of a, K in blocks, N, transpose): decode-sized and BLAS-sized rows, one and two blocks, batched.
SHAPES: tuple[tuple[tuple[int, ...], int, int, bool], ...] = (
    ((1,), 1, 1, False),
    ((1,), 2, 64, False),
    ((5,), 2, 7, False),
    ((64,), 1, 7, False),
    ((64,), 2, 64, False),
    ((2, 5), 2, 7, False),
    ((0,), 1, 7, False),
    ((1,), 2, 7, True),
    ((2, 5), 1, 64, True),
    ((64,), 2, 7, True),
)


def _cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    """Always f32 activations (QMatMul's only dtype), whatever float dtype is asked for."""
    out = []
    for qt in QuantType:
        for lead, kb, n, transpose in SHAPES:
            k = kb * qt.block_elements
            p = QMatMulParams(qt, k, n, transpose)
            a = rng.standard_normal((*lead, n if transpose else k)).astype(np.float32)
            label = f"{qt.ggml_name} a{[*lead, a.shape[-1]]} W[{n}, {k}]{'ᵀ' if transpose else ''}"
            out.append(Case(label, (a, as_words(random_weight(rng, qt, n, k))), p, group=qt.ggml_name))
    for n, k in ((0, 32), (5, 0)):
        p = QMatMulParams(QuantType.Q4_0, k, n)
        w = np.zeros(weight_words(p), np.uint32)
        out.append(Case(f"Q4_0 empty W[{n}, {k}]", (rng.standard_normal((3, k)).astype(np.float32), w), p))
    return out


register("QMatMul", qmatmul64, _cases, qmatmul_scale)
