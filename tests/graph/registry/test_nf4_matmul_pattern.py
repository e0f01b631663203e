"""Nf4Matmul's live pattern: a QLoRA weight dequantised with primitives (nibbles split by floor(b/16), looked
up in the NF4 table, scaled per block) then multiplied runs on the fused kernel, by `fuel.trace()`, against
bitsandbytes' dequantize_4bit of the same bytes in float64; other dequantisations stay primitive."""

from __future__ import annotations

import bitsandbytes.functional as bnbf
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.dtype import DType
from fuel.graph.functions import concat
from fuel.graph.tensor import Tensor
from fuel.testing.oracle import assert_close_contraction

FUSED = "Nf4Matmul["
NF4_BNB = bnbf.get_4bit_type("nf4", device="cpu").numpy().astype(np.float32)


def _quantized(rng: np.random.Generator, n: int, k: int, bs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """bitsandbytes' packed bytes [N, K/2], absmax [N, K/bs] and its float64 dequantisation [N, K]."""
    q, state = bnbf.quantize_4bit(torch.tensor(rng.standard_normal((n, k)) * 0.05, dtype=torch.float32),
                                  blocksize=bs, quant_type="nf4")
    deq = bnbf.dequantize_4bit(q, state).to(torch.float64).numpy()
    return q.numpy().reshape(n, k // 2), state.absmax.numpy().reshape(n, k // bs), deq


def _dequant(w: Tensor, absmax: Tensor, bs: int, table: np.ndarray = NF4_BNB, swap: bool = False) -> Tensor:
    """The user's dequantisation: high nibble first (bitsandbytes' order), a table lookup, a block scale."""
    n, half = w.shape
    b = w.cast("f32")
    hi = (b * 0.0625).floor()
    lo = b - hi * 16.0
    pair = [lo.unsqueeze(-1), hi.unsqueeze(-1)] if swap else [hi.unsqueeze(-1), lo.unsqueeze(-1)]
    codes = concat(pair, -1).reshape(n * 2 * half).cast("u32")
    values = fl.tensor(table).index_select(0, codes).reshape(n, 2 * half).reshape(n, 2 * half // bs, bs)
    return (values * absmax.reshape(n, 2 * half // bs, 1)).reshape(n, 2 * half)


def _run(y: Tensor, *others: Tensor) -> tuple[np.ndarray, set[str]]:
    with fl.trace() as tr:
        out = fl.realize(y, *others)[0].numpy()
    return out, {r.impl for r in tr.records}


@settings(max_examples=10)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=2), st.integers(1, 5), st.sampled_from([64, 128]),
       st.integers(1, 3), st.booleans(), st.sampled_from([DType.F32, DType.BF16]))
def test_dequantise_then_matmul_runs_fused(rows: list[int], n: int, bs: int, blocks: int, transpose: bool,
                                           dt: DType) -> None:
    rng = np.random.default_rng(n * 7 + blocks)
    k = bs * blocks
    w, absmax, deq = _quantized(rng, n, k, bs)
    act = rng.standard_normal((*rows, n if transpose else k)).astype(dt.np)
    weight = _dequant(fl.tensor(w), fl.tensor(absmax), bs)
    a = fl.tensor(act)
    y = a.cast("f32") @ (weight if transpose else weight.T)
    y = y.cast(dt) if dt is not DType.F32 else y
    out, ran = _run(y)
    assert any(i.startswith(FUSED) for i in ran), sorted(ran)
    w64 = deq if transpose else deq.T
    a64 = np.asarray(act, np.float64)
    assert_close_contraction(out, a64 @ w64, np.abs(a64) @ np.abs(w64), dt)


def test_other_dequantisations_and_a_weight_read_elsewhere_stay_primitive() -> None:
    rng = np.random.default_rng(3)
    w, absmax, deq = _quantized(rng, 6, 128, 64)
    act = rng.standard_normal((3, 128)).astype(np.float32)
    fw, fa, fx = fl.tensor(w), fl.tensor(absmax), fl.tensor(act)
    weight = _dequant(fw, fa, 64)
    out, ran = _run(fx @ weight.T, weight.sum())  # the dequantised weight is also read: fusing recomputes it
    assert not any(i.startswith(FUSED) for i in ran)
    np.testing.assert_allclose(out, act.astype(np.float64) @ deq.T, rtol=1e-5, atol=1e-5)
    # low nibble first and a table other than NF4: not bitsandbytes' weights
    codes = np.stack([w & 15, w >> 4], -1).reshape(6, 128)
    swapped = NF4_BNB[codes].astype(np.float64).reshape(6, 2, 64) * absmax[:, :, None]
    doubled = 2.0 * deq
    for weight, want in ((_dequant(fw, fa, 64, swap=True), swapped.reshape(6, 128)),
                         (_dequant(fw, fa, 64, table=NF4_BNB * 2), doubled)):
        out, ran = _run(fx @ weight.T)
        assert not any(i.startswith(FUSED) for i in ran)
        np.testing.assert_allclose(out, act.astype(np.float64) @ want.T, rtol=1e-5, atol=1e-5)
