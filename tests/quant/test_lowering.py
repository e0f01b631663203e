"""QMatMul's lowering (`fuel.quant.lowering`, `qmatmul.decompose`): the dequantised weight built from bit
primitives equals `gguf.quants.dequantize` bit for bit for every block type, and the lowered product is
within QMatMul's declared precision of the fused kernel, both forms."""

from __future__ import annotations

import gguf
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.cpu.quant.qmatmul import PRECISION
from fuel.graph.registry import FusedOps, default_registry
from fuel.graph.registry.qmatmul import QMatMulParams, decompose, qmatmul
from fuel.quant import QuantType
from fuel.quant.lowering import dequantize
from fuel.testing.contract import precision_excess
from fuel.testing.reference.qmatmul import as_words, gguf_type, qmatmul_scale, random_weight


def _oracle(raw: np.ndarray, qt: QuantType, n: int, k: int) -> np.ndarray:
    """gguf-py's values; Q8_1, which gguf-py does not decode, by NumPy: f16 d times int8 q, exact in f32."""
    with np.errstate(all="ignore"):  # NaN and infinite scales in arbitrary bytes
        if qt is QuantType.Q8_1:
            b = raw.reshape(-1, qt.block_bytes)
            d = b[:, :2].copy().view(np.float16).astype(np.float64)
            return (d * b[:, 4:].view(np.int8)).astype(np.float32).reshape(n, k)
        return np.asarray(gguf.quants.dequantize(raw, gguf_type(qt)), np.float32).reshape(n, k)


def _lowered(t: fl.Tensor) -> np.ndarray:
    """Realised without the fusion pass, so the primitives run (no pattern turns them back into QMatMul)."""
    return fl.realize(t, fuse=False)[0].numpy()


@settings(max_examples=40)
@given(qt=st.sampled_from(list(QuantType)), n=st.integers(1, 3), kb=st.integers(1, 2), seed=st.integers(0, 2**32 - 1),
       any_bytes=st.booleans())
def test_lowered_dequantisation_is_gguf_bit_for_bit(qt: QuantType, n: int, kb: int, seed: int,
                                                    any_bytes: bool) -> None:
    """Weights as quantised (or random blocks with finite scales), and blocks of arbitrary bytes: NaN,
    infinite and subnormal f16 scales included, every bit pattern decodes as gguf decodes it."""
    rng = np.random.default_rng(seed)
    k = kb * qt.block_elements
    raw = (rng.integers(0, 256, (n, kb * qt.block_bytes), dtype=np.uint8) if any_bytes
           else random_weight(rng, qt, n, k))
    got = _lowered(dequantize(fl.tensor(as_words(raw)), qt, n, k))
    want = _oracle(raw, qt, n, k)
    assert got.dtype == np.float32 and got.shape == (n, k)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), qt


def test_every_type_has_a_lowering_and_the_padding_is_ignored() -> None:
    """Q4_0's 18-byte blocks: an odd block count pads the stream to whole words; the pad bytes are not read."""
    rng = np.random.default_rng(3)
    raw = random_weight(rng, QuantType.Q4_0, 1, 32)
    words = as_words(raw)
    words[-1] |= np.uint32(0xFFFF0000)  # bytes 18 and 19: padding
    assert np.array_equal(_lowered(dequantize(fl.tensor(words), QuantType.Q4_0, 1, 32)),
                          _oracle(raw, QuantType.Q4_0, 1, 32))
    assert default_registry().entry(FusedOps.QMATMUL).decompose is decompose


@settings(max_examples=22)
@given(qt=st.sampled_from(list(QuantType)), lead=st.sampled_from([(1,), (5,), (2, 3), (20,)]),
       transpose=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_lowered_product_is_within_declared_precision_of_the_kernel(qt: QuantType, lead: tuple[int, ...],
                                                                    transpose: bool, seed: int) -> None:
    """Per element against the fused kernel, with QMatMul's declared bound and its local scale |a|·|W|ᵀ."""
    rng = np.random.default_rng(seed)
    n, k = 7, 2 * qt.block_elements
    p = QMatMulParams(qt, k, n, transpose)
    w = as_words(random_weight(rng, qt, n, k))
    a = rng.standard_normal((*lead, n if transpose else k)).astype(np.float32)
    fused = qmatmul(a, w, qt, k, n, transpose).numpy()
    lowered = _lowered(decompose([fl.tensor(a), fl.tensor(w)], p))
    s = qmatmul_scale([a.astype(np.float64), w], p)
    assert precision_excess(lowered, fused.astype(np.float64), PRECISION, s) <= 1.0
