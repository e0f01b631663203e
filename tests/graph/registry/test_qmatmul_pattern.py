"""QMatMul's live pattern, derived from its own lowering: `a @ dequantize(w)ᵀ` (or `a @ dequantize(w)`)
written with `fuel.quant.lowering` runs as one QMatMul, within its declared precision of the float64
product of gguf's dequantised weight; a second reader of the weight, an altered decode or a plain weight
stay primitive."""

from __future__ import annotations

import numpy as np
import pytest

import fuel as fl
from fuel.cpu.quant.qmatmul import PRECISION
from fuel.graph.registry.qmatmul import QMatMulParams, qmatmul
from fuel.quant import QuantType
from fuel.quant.lowering import dequantize, dequantize_blocks
from fuel.testing.contract import precision_excess
from fuel.testing.reference.qmatmul import as_words, qmatmul64, qmatmul_scale, random_weight


def _run(*ts: fl.Tensor) -> tuple[list[str], list[np.ndarray]]:
    with fl.trace() as t:
        outs = [x.numpy() for x in fl.realize(*ts)]
    return [r.impl for r in t.records], outs


def _weight(qt: QuantType, n: int, k: int, seed: int = 0) -> np.ndarray:
    return as_words(random_weight(np.random.default_rng(seed), qt, n, k))


@pytest.mark.parametrize("qt", [QuantType.Q4_0, QuantType.Q5_1, QuantType.Q8_1, QuantType.Q3K, QuantType.Q6K],
                         ids=lambda q: q.ggml_name)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("lead", [(3,), (2, 4)], ids=str)
def test_the_lowering_runs_as_one_qmatmul(qt: QuantType, transpose: bool, lead: tuple[int, ...]) -> None:
    n, k = 5, 2 * qt.block_elements
    w = _weight(qt, n, k)
    a = np.random.default_rng(1).standard_normal((*lead, n if transpose else k)).astype(np.float32)
    deq = dequantize(fl.tensor(w), qt, n, k)
    impls, (out,) = _run(fl.tensor(a) @ (deq if transpose else deq.T))
    assert impls == ["QMatMul[cpu:f32,u32,f32]"], impls
    p = QMatMulParams(qt, k, n, transpose)
    xs = [a.astype(np.float64), w]
    assert precision_excess(out, qmatmul64(xs, p), PRECISION, qmatmul_scale(xs, p)) <= 1.0
    assert np.array_equal(out, qmatmul(a, w, qt, k, n, transpose).numpy())


def test_a_weight_read_elsewhere_stays_primitive() -> None:
    """The dequantised weight has a second reader: fusing would decode it twice, so nothing fuses."""
    qt, n, k = QuantType.Q4_0, 4, 64
    deq = dequantize(fl.tensor(_weight(qt, n, k)), qt, n, k)
    y = fl.tensor(np.ones((2, k), np.float32)) @ deq.T
    impls, _ = _run(y, deq.sum())
    assert not any(i.startswith("QMatMul") for i in impls)


def test_an_altered_decode_stays_primitive() -> None:
    """The same stream decoded with an extra mask, or the weight scaled before the product: not QMatMul's
    lowering, so not QMatMul (each value still computed as written)."""
    qt, n, k = QuantType.Q4_1, 3, 32
    w = _weight(qt, n, k)
    raw = (fl.tensor(w).bitcast(fl.u8)[:n * qt.block_bytes] & 0x7F).reshape(n, qt.block_bytes)
    masked = dequantize_blocks(raw, qt).reshape(n, k)
    a = np.random.default_rng(2).standard_normal((2, k)).astype(np.float32)
    scaled = dequantize(fl.tensor(w), qt, n, k) * 1.5
    impls, (_, o2) = _run(fl.tensor(a) @ masked.T, fl.tensor(a) @ scaled.T)
    assert not any(i.startswith("QMatMul") for i in impls)
    w64 = qmatmul64([np.eye(k), w], QMatMulParams(qt, k, n)).T * 1.5  # gguf's W, scaled, in float64
    a64 = a.astype(np.float64)
    assert np.all(np.abs(o2 - a64 @ w64.T) <= 1e-6 * (np.abs(a64) @ np.abs(w64).T))


def test_a_float_weight_is_not_a_qmatmul() -> None:
    a, b = np.ones((2, 32), np.float32), np.ones((32, 4), np.float32)
    impls, _ = _run(fl.tensor(a) @ (fl.tensor(b) * 2.0))
    assert not any(i.startswith("QMatMul") for i in impls)
