"""Batch invariance (issue 43): every kernel the server's batched step runs gives each output row the same
bytes whatever the number of rows M, the row's position and the other rows, within each kind of step: a
decode step (1..ROW_INVARIANT_ROWS rows: row r equals that row computed alone, bit for bit) and a prompt
step (ROW_INVARIANT_ROWS + 1..PROMPT_ROWS rows: QMatMul's tile path, row r the same bytes at any such row
count), so a request's tokens never depend on what else is in the batch. The values themselves are checked
against float64 references (gguf-py's dequantisation, torch), per element or per row, so that no test passes
on a wrong answer shared by both sides."""

from __future__ import annotations

import math
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.cpu.prims.gemv import GEMV_MAX_ROWS
from fuel.cpu.quant import gguf_decode
from fuel.cpu.quant.qmatmul import ROW_INVARIANT_ROWS
from fuel.dtype import DType
from fuel.quant import QuantType, dequantize_rows_into
from fuel.serve.batch_model import PROMPT_ROWS
from fuel.testing.oracle import assert_close_contraction
from fuel.testing.reference.qmatmul import random_weight

M = st.integers(2, ROW_INVARIANT_ROWS)
STEP_M = st.integers(2, 40) | st.just(PROMPT_ROWS)  # either kind of step's rows, for the per-row kernels

# ---- QMatMul: each host's decode kernels, forced on any host (`gguf_decode.HOST_WAYS`) --------------------


def gguf_f64(raw: np.ndarray, qt: QuantType) -> np.ndarray:
    """W [n, k] in float64 by gguf-py (Q8_1, whose 36-byte block gguf-py reads as 40: d·q by hand)."""
    if qt is QuantType.Q8_1:
        blocks = raw.reshape(-1, 36)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float64)
        return (d * blocks[:, 4:].view(np.int8)).reshape(raw.shape[0], -1)
    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qt.ggml_name]), np.float64)


def decode(qt: QuantType, a: np.ndarray, raw: np.ndarray) -> np.ndarray:
    out = np.full((a.shape[0], raw.shape[0]), np.nan, np.float32)
    gguf_decode.gemv(qt, a, raw, out)
    return out


@pytest.mark.parametrize("way", list(gguf_decode.HOST_WAYS))
@pytest.mark.parametrize("qt", list(QuantType), ids=lambda q: q.ggml_name)
@settings(max_examples=6)
@given(m=M, n=st.integers(1, 9), blocks=st.integers(1, 3), seed=st.integers(0, 2**16), data=st.data())
def test_qmatmul_rows_are_the_one_row_bytes(qt: QuantType, way: str, m: int, n: int, blocks: int, seed: int,
                                            data: st.DataObject) -> None:
    """Each row of a [m, k] @ dequant(W)ᵀ at 2 <= m <= ROW_INVARIANT_ROWS is that row's one-row product, bit
    for bit, wherever it sits (one row also moved to another position, the others changed), and within
    the contraction bound of float64 gguf-py."""
    k = blocks * (256 if qt.block_elements == 256 else 64)
    rng = np.random.default_rng(seed)
    raw = random_weight(rng, qt, n, k)
    a = (rng.standard_normal((m, k)) * rng.choice([1e-3, 1.0, 50.0], (m, 1))).astype(np.float32)
    with gguf_decode.host_way(way):
        batch = decode(qt, a, raw)
        alone = np.concatenate([decode(qt, a[r:r + 1].copy(), raw) for r in range(m)])
        assert batch.tobytes() == alone.tobytes()
        r, at = data.draw(st.integers(0, m - 1), "row"), data.draw(st.integers(0, m - 1), "position")
        other = rng.standard_normal((m, k)).astype(np.float32)
        other[at] = a[r]
        assert decode(qt, other, raw)[at].tobytes() == alone[r].tobytes()
    w64 = gguf_f64(raw, qt)
    assert_close_contraction(batch, a.astype(np.float64) @ w64.T, np.abs(a.astype(np.float64)) @ np.abs(w64).T,
                             DType.F32)


@pytest.mark.parametrize("qt", list(QuantType), ids=lambda q: q.ggml_name)
@settings(max_examples=3, deadline=None)
@given(m=st.integers(ROW_INVARIANT_ROWS + 1, PROMPT_ROWS), n=st.integers(1, 40), blocks=st.integers(1, 3),
       seed=st.integers(0, 2**16), data=st.data())
def test_qmatmul_prompt_step_rows_are_the_same_bytes_at_any_row_count(qt: QuantType, m: int, n: int, blocks: int,
                                                                      seed: int, data: st.DataObject) -> None:
    """Past ROW_INVARIANT_ROWS (the tile path, up to PROMPT_ROWS): a row's bytes are the same at any other
    prompt-step row count and position, whatever the other rows; and within the contraction bound of float64
    gguf-py."""
    k = blocks * (256 if qt.block_elements == 256 else 64)
    rng = np.random.default_rng(seed)
    raw = random_weight(rng, qt, n, k)
    words = np.zeros(-(-raw.size // 4), np.uint32)
    words.view(np.uint8)[:raw.size] = raw.reshape(-1)

    def product(a: np.ndarray) -> np.ndarray:
        return fl.ops.qmatmul(fl.tensor(a), fl.tensor(words), qt.ggml_name, k, n).numpy()

    a = (rng.standard_normal((m, k)) * rng.choice([1e-3, 1.0, 50.0], (m, 1))).astype(np.float32)
    batch = product(a)
    m2 = data.draw(st.integers(ROW_INVARIANT_ROWS + 1, PROMPT_ROWS), "other row count")
    r, at = data.draw(st.integers(0, m - 1), "row"), data.draw(st.integers(0, m2 - 1), "position")
    other = rng.standard_normal((m2, k)).astype(np.float32)
    other[at] = a[r]
    assert product(other)[at].tobytes() == batch[r].tobytes()
    w64 = gguf_f64(raw, qt)
    assert_close_contraction(batch, a.astype(np.float64) @ w64.T, np.abs(a.astype(np.float64)) @ np.abs(w64).T,
                             DType.F32)


@settings(max_examples=12, deadline=None)
@given(transposed=st.booleans(), n=st.integers(1, 70), k=st.integers(1, 300), seed=st.integers(0, 2**16),
       data=st.data())
def test_fused_linear_rows_are_the_same_bytes_at_any_row_count(transposed: bool, n: int, k: int, seed: int,
                                                               data: st.DataObject) -> None:
    """An f32 `x @ w.T + b` (a [n, k] weight, BERT's layers) at any row count, or `x @ W + b` (a contiguous
    [k, n] weight) past GEMV_MAX_ROWS (up to it, the gemv's rows: test_gemv): row r the same bytes at any
    other such row count and position (fuel's tile GEMM, `dense_tiles`; chunks of OWN_MAX_ROWS past it), and
    within the contraction bound of torch float64 per element."""
    low = 1 if transposed else GEMV_MAX_ROWS + 1
    m, m2 = (data.draw(st.integers(low, 700), name) for name in ("rows", "other rows"))
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k) if transposed else (k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)

    def linear(x: np.ndarray) -> np.ndarray:
        weight = fl.tensor(w).T if transposed else fl.tensor(w)
        return (fl.tensor(x) @ weight + fl.tensor(bias)).numpy()

    a = rng.standard_normal((m, k)).astype(np.float32)
    batch = linear(a)
    r, at = data.draw(st.integers(0, m - 1), "row"), data.draw(st.integers(0, m2 - 1), "position")
    other = rng.standard_normal((m2, k)).astype(np.float32)
    other[at] = a[r]
    assert linear(other)[at].tobytes() == batch[r].tobytes()
    w64 = torch.from_numpy((w.T if transposed else w).astype(np.float64))
    a64 = torch.from_numpy(a.astype(np.float64))
    b64 = torch.from_numpy(bias.astype(np.float64))
    assert_close_contraction(batch, (a64 @ w64 + b64).numpy(), (a64.abs() @ w64.abs() + b64.abs()).numpy(),
                             DType.F32)


def test_row_invariant_rows_is_the_decode_bound() -> None:
    from fuel.cpu.quant.gguf_gemv import DECODE_ROWS

    assert ROW_INVARIANT_ROWS == DECODE_ROWS >= 16


# ---- the other kernels of the batched step, through the graph ----------------------------------------------


def rows_alone(f: Any, x: np.ndarray, *more: np.ndarray) -> np.ndarray:
    """f of each row of x (and of the arrays given per row) alone, stacked."""
    return np.concatenate([f(x[r:r + 1], *(t[r:r + 1] for t in more)) for r in range(x.shape[0])])


def per_row_close(got: np.ndarray, ref: np.ndarray, rtol: float) -> None:
    """|got - ref| <= rtol·max|ref| of the row (a row's scale, not the tensor's)."""
    g, r = got.reshape(got.shape[0], -1), ref.reshape(ref.shape[0], -1)
    bound = rtol * np.maximum(np.abs(r).max(axis=1, keepdims=True), 1e-30)
    assert (np.abs(g - r) <= bound).all()


WIDTH = st.sampled_from([8, 37, 64, 576])  # a tail shorter than a vector, odd, whole vectors, a model's width


@settings(max_examples=25)
@given(m=STEP_M, d=WIDTH, seed=st.integers(0, 2**16))
def test_rms_norm_rows(m: int, d: int, seed: int) -> None:
    x = np.random.default_rng(seed).standard_normal((m, d)).astype(np.float32) * 3

    def norm(t: np.ndarray) -> np.ndarray:
        return fl.ops.rms_norm_last_dim(t, 1e-6).numpy()

    batch = norm(x)
    assert batch.tobytes() == rows_alone(norm, x).tobytes()
    x64 = x.astype(np.float64)
    per_row_close(batch, x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6), 1e-6)


@settings(max_examples=25)
@given(m=STEP_M, d=WIDTH, seed=st.integers(0, 2**16))
def test_elementwise_prims_rows(m: int, d: int, seed: int) -> None:
    """Llama's SwiGLU (silu(g)·u + residual) and Gemma's tanh-GELU, as the models spell them."""
    rng = np.random.default_rng(seed)
    g, u, res = (rng.standard_normal((m, d)).astype(np.float32) * 4 for _ in range(3))

    def step(g: np.ndarray, u: np.ndarray, res: np.ndarray) -> np.ndarray:
        tg = fl.tensor(g)
        swiglu = tg.silu() * fl.tensor(u) + fl.tensor(res)
        gelu = 0.5 * tg * (1.0 + ((tg + 0.044715 * tg * tg * tg) * math.sqrt(2 / math.pi)).tanh())
        return np.stack([swiglu.numpy(), gelu.numpy()], axis=1)

    batch = step(g, u, res)
    assert batch.tobytes() == rows_alone(step, g, u, res).tobytes()
    t, tu, tr = (torch.from_numpy(v.astype(np.float64)) for v in (g, u, res))
    ref = np.stack([(torch.nn.functional.silu(t) * tu + tr).numpy(),
                    torch.nn.functional.gelu(t, approximate="tanh").numpy()], axis=1)
    per_row_close(batch, ref, 1e-5)


@settings(max_examples=20)
@given(m=STEP_M, heads=st.sampled_from([1, 3, 9]), d=st.sampled_from([8, 64, 96]), seed=st.integers(0, 2**16))
def test_rope_rows(m: int, heads: int, d: int, seed: int) -> None:
    """Rows as decode tokens [m, heads, 1, D] (one table row for all) and as a chunk [1, heads, m, D] (a
    table row per token), against torch's rotate-half in float64."""
    rng = np.random.default_rng(seed)
    pos = rng.integers(0, 4096, m)
    inv = 10000.0 ** (-np.arange(0, d, 2) / d)
    ang = np.concatenate([pos[:, None] * inv] * 2, axis=1)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    x = rng.standard_normal((m, heads, 1, d)).astype(np.float32)

    def tokens(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        return fl.ops.rope(x, cos, sin).numpy()

    one = tokens(x, cos[:1], sin[:1])
    assert one.tobytes() == np.concatenate([tokens(x[r:r + 1], cos[:1], sin[:1]) for r in range(m)]).tobytes()
    chunk = fl.ops.rope(x.transpose(2, 1, 0, 3).copy(), cos, sin).numpy()  # [1, heads, m, d]
    alone = np.concatenate([tokens(x[r:r + 1], cos[r:r + 1], sin[r:r + 1]) for r in range(m)])
    assert chunk.transpose(2, 1, 0, 3).tobytes() == alone.tobytes()
    x64, c64, s64 = (torch.from_numpy(t.astype(np.float64)) for t in (x[:, :, 0], cos, sin))
    rot = torch.cat([-x64[..., d // 2:], x64[..., :d // 2]], -1)
    per_row_close(alone[:, :, 0], (x64 * c64[:, None] + rot * s64[:, None]).numpy(), 1e-6)


@settings(max_examples=25)
@given(m=STEP_M, vocab=st.integers(1, 50), d=WIDTH, seed=st.integers(0, 2**16))
def test_index_select_rows(m: int, vocab: int, d: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((vocab, d)).astype(np.float32)
    ids = rng.integers(0, vocab, m).astype(np.int64)

    def pick(i: np.ndarray) -> np.ndarray:
        return fl.tensor(table).index_select(0, fl.tensor(i)).numpy()

    batch = pick(ids)
    assert batch.tobytes() == rows_alone(pick, ids).tobytes()
    np.testing.assert_array_equal(batch, torch.from_numpy(table)[torch.from_numpy(ids)].numpy())


@settings(max_examples=15)
@given(m=STEP_M, qt=st.sampled_from(list(QuantType)), seed=st.integers(0, 2**16))
def test_embedding_rows_of_quantized_tables(m: int, qt: QuantType, seed: int) -> None:
    """`fuel.quant.dequantize_rows_into` of a token's row, alone or among m consecutive rows: gguf-py's values."""
    rng = np.random.default_rng(seed)
    k = 2 * qt.block_elements
    raw = random_weight(rng, qt, m + 3, k)
    r0 = int(rng.integers(0, 4))
    batch = np.empty((m, k), np.float32)
    dequantize_rows_into(raw, qt, r0, r0 + m, batch)
    alone = np.empty((m, k), np.float32)
    for r in range(m):
        dequantize_rows_into(raw, qt, r0 + r, r0 + r + 1, alone[r:r + 1])
    assert batch.tobytes() == alone.tobytes()
    np.testing.assert_array_equal(batch, gguf_f64(raw, qt)[r0:r0 + m].astype(np.float32))


def paged(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, bt: np.ndarray, cl: np.ndarray) -> np.ndarray:
    return fl.ops.paged_attn(q, kc, vc, bt, cl).numpy()


@settings(max_examples=20)
@given(m=st.integers(2, 40), hkv=st.sampled_from([1, 3]), group=st.sampled_from([1, 3]),
       d=st.sampled_from([16, 24, 64]), bs=st.sampled_from([4, 16]), seed=st.integers(0, 2**16))
def test_paged_attn_decode_rows(m: int, hkv: int, group: int, d: int, bs: int, seed: int) -> None:
    """q [m, Hq, 1, D], every row its own sequence (block table, context length): each row's bytes as that
    sequence alone, and torch float64 attention over its gathered keys."""
    rng = np.random.default_rng(seed)
    hq, nblocks, per = hkv * group, 4 * m + 2, 4
    kc, vc = (rng.standard_normal((nblocks, bs, hkv, d)).astype(np.float32) for _ in range(2))
    bt = np.stack([rng.permutation(nblocks)[:per] for _ in range(m)]).astype(np.uint32)
    cl = rng.integers(1, per * bs + 1, m).astype(np.uint32)
    q = rng.standard_normal((m, hq, 1, d)).astype(np.float32)
    batch = paged(q, kc, vc, bt, cl)
    assert batch.tobytes() == rows_alone(lambda *t: paged(t[0], kc, vc, t[1], t[2]), q, bt, cl).tobytes()
    for r in range(m):
        t = np.arange(cl[r])
        keys, vals = (torch.from_numpy(c[bt[r, t // bs], t % bs].astype(np.float64)).transpose(0, 1) for c in (kc, vc))
        keys, vals = keys.repeat_interleave(group, 0), vals.repeat_interleave(group, 0)
        qr = torch.from_numpy(q[r].astype(np.float64))
        ref = torch.softmax(qr @ keys.transpose(1, 2) / math.sqrt(d), -1) @ vals
        per_row_close(batch[r][None], ref.numpy()[None], 1e-5)
