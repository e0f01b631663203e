"""FlashAttn (entry 12) against torch float64 (SDPA, and the softcap/ALiBi/window math written out in torch):
every option, GQA, bottom-right alignment against k_len, large logits, edge shapes, build and realize
errors, decomposition, bit-stability."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry import FusedOps
from fuel.graph.registry.flash_attn import decompose
from fuel.testing.contract import fuel_threads
from fuel.testing.oracle import ATTENTION, assert_close_attention
from tests.graph.registry.attention_oracle import bottom_right, large, sdpa_with_slack, torch_attention

Win = tuple[int | None, int | None]
WINDOWS: list[Win] = [(None, None), (3, 2), (0, 0), (None, 1), (2, None)]
HEADS = [(4, 4), (6, 2), (4, 1), (8, 1)]


def make_inputs(seed: int, dt: DType, b: int, hq: int, hkv: int, sq: int, sk: int, d: int, alibi: bool = False,
                q_scale: float = 1.0) -> dict[str, Any]:
    """q, k, v rounded to dt (the oracle reads these rounded values) and ALiBi slopes in the accumulation type."""
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {
        "q": (rng.standard_normal((b, hq, sq, d)) * q_scale).astype(dt.np),
        "k": rng.standard_normal((b, hkv, sk, d)).astype(dt.np),
        "v": rng.standard_normal((b, hkv, sk, d)).astype(dt.np),
        "alibi": None,
    }
    if alibi:
        out["alibi"] = rng.uniform(0.05, 0.6, hq).astype(np.float64 if dt is DType.F64 else np.float32)
    return out


def reference(x: dict[str, Any], scale: float, causal: bool = False, window: Win = (None, None),
              softcap: float | None = None, k_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(output, its per-element scale Σ p·|v|) from the rounded inputs, by torch in float64 with the
    softcap and ALiBi written out (`attention_oracle.torch_attention`)."""
    mask, aq = bottom_right(x["q"].shape[2], x["k"].shape[2], k_len, causal, *window)
    return torch_attention(x["q"], x["k"], x["v"], scale, mask, aq, softcap, x["alibi"])


def run(x: dict[str, Any], **opts: Any) -> np.ndarray:
    y = fl.ops.flash_attn(x["q"], x["k"], x["v"], alibi=x["alibi"], **opts)
    assert y.shape == x["q"].shape and y.dtype.np == x["q"].dtype
    with fl.trace() as t:
        out = y.numpy()
    impls = [r.impl for r in t.records]
    assert any(i.startswith("FlashAttn[cpu:") for i in impls) and not any("matmul" in i for i in impls), impls
    return out


def sdpa(x: dict[str, Any], scale: float, causal: bool, window: Win, k_len: int | None) -> np.ndarray:
    """torch float64 SDPA on K/V sliced to the live length, with a bool mask (which gives 0 on empty rows)."""
    q, k, v = (torch.from_numpy(np.asarray(x[n], np.float64)) for n in "qkv")
    kl = k.shape[2] if k_len is None else k_len
    mask, _ = bottom_right(q.shape[2], kl, None, causal, *window)
    out = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :kl], v[:, :, :kl], attn_mask=mask,
                                                           scale=scale, enable_gqa=True)
    return out.numpy()


SDPA_CONFIGS = [  # (b, hq, hkv, sq, sk, d, causal, window, k_len)
    (2, 4, 4, 7, 13, 32, False, (None, None), None),
    (1, 6, 2, 13, 13, 64, True, (None, None), None),
    (2, 4, 1, 13, 7, 32, True, (None, None), None),      # Sq > Sk: the first rows see no key
    (1, 8, 1, 7, 13, 32, False, (3, 2), 10),
    (2, 6, 2, 9, 20, 16, True, (4, None), 15),
    (1, 4, 2, 16, 16, 128, False, (0, 0), 9),            # rows past the live keys are empty
]


@pytest.mark.parametrize("cfg", SDPA_CONFIGS, ids=str)
def test_matches_torch_sdpa(float_dtype: DType, cfg: tuple[Any, ...]) -> None:
    b, hq, hkv, sq, sk, d, causal, window, k_len = cfg
    x = make_inputs(1, float_dtype, b, hq, hkv, sq, sk, d)
    scale = 0.3
    want = sdpa(x, scale, causal, window, k_len)
    ref, s = reference(x, scale, causal, window, k_len=k_len)
    np.testing.assert_allclose(ref, want, rtol=1e-12, atol=1e-13)  # the two oracles agree
    got = run(x, softmax_scale=scale, causal=causal, window_size=window, k_len=k_len)
    assert_close_attention(got, want, float_dtype, s)


REF_CONFIGS = [  # (hq, hkv, sq, sk, d, causal, window, softcap, alibi, k_len)
    (4, 2, 7, 13, 32, False, (None, None), 5.0, False, None),
    (6, 2, 13, 13, 64, True, (None, None), None, True, None),
    (4, 1, 5, 20, 32, False, (3, 2), 2.0, True, 14),
    (8, 1, 13, 7, 32, True, (2, None), 5.0, True, 6),
    (4, 4, 9, 30, 64, False, (None, 1), None, True, 0),  # no live key: zeros
]


@pytest.mark.parametrize("cfg", REF_CONFIGS, ids=str)
def test_softcap_alibi_window_match_torch(float_dtype: DType, cfg: tuple[Any, ...]) -> None:
    hq, hkv, sq, sk, d, causal, window, softcap, alibi, k_len = cfg
    x = make_inputs(2, float_dtype, 2, hq, hkv, sq, sk, d, alibi=alibi, q_scale=3.0)
    scale = 1 / math.sqrt(d)
    ref, s = reference(x, scale, causal, window, softcap, k_len)
    got = run(x, causal=causal, window_size=window, softcap=softcap, k_len=k_len)  # the default scale
    assert_close_attention(got, ref, float_dtype, s)
    if (softcap is not None or alibi) and k_len != 0:  # the option changes the answer: a kernel ignoring it would fail
        plain, _ = reference(dict(x, alibi=None), scale, causal, window, None, k_len)
        assert np.abs(plain - ref).max() > 1e-2


def draw(i: int) -> tuple[Any, ...]:
    """Configuration i of the random grid (deterministic); large D only at short sequences."""
    r = np.random.default_rng(100 + i)
    sq, sk = (int(a) for a in r.choice([1, 7, 13, 64], 2))
    hq, hkv = HEADS[r.integers(4)]
    d = int(r.choice([32, 64, 128, 256] if max(sq, sk) <= 13 else [32, 64]))
    k_len = None if r.integers(2) else int(r.integers(0, sk + 1))
    return (FLOAT_DTYPES[i % len(FLOAT_DTYPES)], int(r.integers(1, 3)), hq, hkv, sq, sk, d, bool(r.integers(2)),
            WINDOWS[r.integers(len(WINDOWS))], [None, 5.0][r.integers(2)], bool(r.integers(2)), k_len)


GRID = [draw(i) for i in range(40)]


def test_grid_covers_the_options() -> None:
    assert any(c[4] > c[5] for c in GRID) and any(c[11] is not None and c[11] < c[5] for c in GRID)
    assert {c[2] // c[3] for c in GRID} == {1, 3, 4, 8} and {c[6] for c in GRID} == {32, 64, 128, 256}
    assert {c[8] for c in GRID} == set(WINDOWS) and all(any(c[j] for c in GRID) for j in (7, 9, 10))


@pytest.mark.parametrize("cfg", GRID, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_random_grid(cfg: tuple[Any, ...]) -> None:
    dt, b, hq, hkv, sq, sk, d, causal, window, softcap, alibi, k_len = cfg
    x = make_inputs(3, dt, b, hq, hkv, sq, sk, d, alibi=alibi, q_scale=2.0)
    ref, s = reference(x, 0.2, causal, window, softcap, k_len)
    got = run(x, softmax_scale=0.2, causal=causal, window_size=window, softcap=softcap, k_len=k_len)
    assert_close_attention(got, ref, dt, s)
    if softcap is None and not alibi and k_len != 0:
        np.testing.assert_allclose(sdpa(x, 0.2, causal, window, k_len), ref, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)
@settings(max_examples=40)
@given(seed=st.integers(0, 2**32 - 1), size=st.floats(0, 1), scale=st.floats(0.01, 2) | st.floats(-2, -0.01),
       causal=st.booleans(), sq=st.sampled_from([1, 3, 5, 20, 130]), sk=st.sampled_from([1, 7, 40, 600]),
       heads=st.sampled_from(HEADS), d=st.sampled_from([8, 16, 64]))
@example(seed=0, size=1.0, scale=1.3, causal=False, sq=20, sk=40, heads=(4, 4), d=64)  # logits past 2^33
def test_large_logits_match_torch_sdpa(dt: DType, seed: int, size: float, scale: float, causal: bool, sq: int,
                                       sk: int, heads: tuple[int, int], d: int) -> None:
    """q and k of 1e3-1e6 (logits far past exp's range): decode and prefill, one key block and several,
    against torch's float64 SDPA, within what rounded scores allow (`attention_oracle`: ~0 wherever a
    row's largest score stands clear, so such rows must come out one-hot)."""
    hq, hkv = heads
    rng = np.random.default_rng(seed)
    x = {"q": large(rng, (1, hq, sq, d), dt, size), "k": large(rng, (1, hkv, sk, d), dt, size),
         "v": rng.standard_normal((1, hkv, sk, d)).astype(dt.np), "alibi": None}
    want, s, slack = sdpa_with_slack(x["q"], x["k"], x["v"], scale, bottom_right(sq, sk, None, causal)[0], dt)
    got = run(x, softmax_scale=scale, causal=causal)
    assert_close_attention(got, want, dt, s + slack / ATTENTION[dt][1])


def test_long_sequence_spans_key_blocks() -> None:
    """Sk 1100 > 2·BK keys, Sq 260 > 2·BQ queries, causal, GQA: the online softmax across blocks."""
    x = make_inputs(4, DType.F32, 1, 4, 2, 260, 1100, 32, alibi=False)
    ref, s = reference(x, 0.18, causal=True, k_len=1050)
    assert_close_attention(run(x, softmax_scale=0.18, causal=True, k_len=1050), ref, DType.F32, s)
    ref, s = reference(x, 0.18, window=(700, 0))
    assert_close_attention(run(x, softmax_scale=0.18, window_size=(700, 0)), ref, DType.F32, s)


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1, 1), (2, 3, 1, 4, 5, 1), (0, 4, 2, 3, 5, 8), (2, 4, 2, 0, 5, 8),
                                   (2, 4, 2, 3, 0, 8), (1, 2, 1, 3, 4, 0)], ids=str)
def test_edge_shapes(float_dtype: DType, shape: tuple[int, ...]) -> None:
    b, hq, hkv, sq, sk, d = shape
    x = make_inputs(5, float_dtype, b, hq, hkv, sq, sk, d, alibi=True)
    for causal in (False, True):
        got = run(x, causal=causal, softmax_scale=0.7)
        ref, s = reference(x, 0.7, causal)
        assert_close_attention(got, ref, float_dtype, s)
        if sk == 0:
            assert not np.asarray(got, np.float64).any()


def test_k_len_zero_and_empty_rows(float_dtype: DType) -> None:
    x = make_inputs(6, float_dtype, 2, 4, 2, 6, 9, 16, alibi=True)
    assert not np.asarray(run(x, k_len=0), np.float64).any()
    for opts in ({"window_size": (0, 0), "k_len": 4}, {"causal": True, "k_len": 3, "window_size": (1, None)}):
        got = np.asarray(run(x, **opts), np.float64)
        kl = opts["k_len"]
        empty = np.arange(6) + kl - 6 < 0  # the diagonal before key 0: no admissible key
        assert empty.any() and (got[:, :, empty] == 0).all() and np.isfinite(got).all()
        ref, s = reference(x, 0.25, opts.get("causal", False), opts["window_size"], k_len=kl)
        assert_close_attention(run(x, softmax_scale=0.25, **opts), ref, float_dtype, s)


def test_non_contiguous_and_broadcast_inputs(float_dtype: DType) -> None:
    rng = np.random.default_rng(7)
    dt = float_dtype
    q_bshd = rng.standard_normal((2, 9, 6, 16)).astype(dt.np)  # [B, Sq, Hq, D]
    k_one = rng.standard_normal((1, 2, 11, 16)).astype(dt.np)  # one batch, broadcast to two
    v_big = rng.standard_normal((2, 2, 11, 48)).astype(dt.np)
    q = fl.tensor(q_bshd).transpose(1, 2)
    k = fl.tensor(k_one).broadcast_to(2, 2, 11, 16)
    v = fl.tensor(v_big)[..., 8:24]
    y = fl.ops.flash_attn(q, k, v, causal=True, softmax_scale=0.3)
    x = {"q": q_bshd.transpose(0, 2, 1, 3), "k": np.broadcast_to(k_one, (2, 2, 11, 16)), "v": v_big[..., 8:24],
         "alibi": None}
    ref, s = reference(x, 0.3, causal=True)
    got = y.numpy()
    assert_close_attention(got, ref, dt, s)
    dense = {n: np.ascontiguousarray(a) for n, a in x.items() if a is not None}
    assert np.array_equal(got.view(np.uint8), run(dict(dense, alibi=None), causal=True, softmax_scale=0.3)
                          .view(np.uint8))


def test_dyn_k_len() -> None:
    x = make_inputs(8, DType.F32, 2, 4, 2, 5, 12, 32, alibi=True)
    n = fl.dyn("k_len")
    y = fl.ops.flash_attn(x["q"], x["k"], x["v"], alibi=x["alibi"], causal=True, softmax_scale=0.3, k_len=n)
    for kl in (12, 7, 3, 0):
        ref, s = reference(x, 0.3, causal=True, k_len=kl)
        got = y.numpy(env={"k_len": kl})
        assert_close_attention(got, ref, DType.F32, s)
        assert np.array_equal(got, run(x, causal=True, softmax_scale=0.3, k_len=kl))
    for bad in (13, -1):
        with pytest.raises(fl.FuelError) as info:
            fl.ops.flash_attn(x["q"], x["k"], x["v"], k_len=n).numpy(env={"k_len": bad})
        assert isinstance(info.value, fl.IndexOutOfRange)
        assert f"flash_attn: k_len {bad} is outside the cache capacity [0, 12]" in str(info.value)


F32 = np.float32


def _args(**change: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"q": np.zeros((2, 8, 4, 16), F32), "k": np.zeros((2, 4, 6, 16), F32),
                            "v": np.zeros((2, 4, 6, 16), F32)}
    args.update(change)
    return args


@pytest.mark.parametrize(("args", "error", "words"), [
    (_args(q=np.zeros((8, 4, 16), F32)), fl.ShapeError,
     "flash_attn: q must be [batch, heads, seq, head_dim], got [8, 4, 16]"),
    (_args(k=np.zeros((2, 4, 6, 16, 1), F32)), fl.ShapeError, "flash_attn: k must be [batch, heads, seq, head_dim]"),
    (_args(v=np.zeros((4, 6, 16), F32)), fl.ShapeError, "flash_attn: v must be [batch, heads, seq, head_dim]"),
    (_args(k=np.zeros((3, 4, 6, 16), F32)), fl.ShapeError, "flash_attn: batch sizes differ: q 2, k 3, v 2"),
    (_args(k=np.zeros((2, 3, 6, 16), F32), v=np.zeros((2, 3, 6, 16), F32)), fl.ShapeError,
     "flash_attn: k has 3 heads, which does not divide q's 8 heads"),
    (_args(k=np.zeros((2, 0, 6, 16), F32), v=np.zeros((2, 0, 6, 16), F32)), fl.ShapeError,
     "flash_attn: k has 0 heads, which does not divide q's 8 heads"),
    (_args(v=np.zeros((2, 2, 6, 16), F32)), fl.ShapeError, "flash_attn: k has 4 heads, v has 2"),
    (_args(v=np.zeros((2, 4, 5, 16), F32)), fl.ShapeError, "flash_attn: k has 6 positions, v has 5"),
    (_args(k=np.zeros((2, 4, 6, 8), F32)), fl.ShapeError, "flash_attn: head dims differ: q 16, k 8, v 16"),
    (_args(alibi=np.zeros(4, F32)), fl.ShapeError, "flash_attn: alibi must be [8] (one slope per query head), got [4]"),
    (_args(k_len=7), fl.ParamError, "flash_attn: k_len 7 is outside the cache capacity [0, 6] of k and v"),
    (_args(k_len=-1), fl.ParamError, "flash_attn: k_len -1 is outside the cache capacity"),
    (_args(k_len=True), fl.ParamError, "flash_attn: k_len must be None, an int or a DynScalar, got True"),
    (_args(window_size=(-1, 2)), fl.ParamError, "flash_attn: window_size left must be a non-negative int or None"),
    (_args(window_size=(None, -3)), fl.ParamError, "flash_attn: window_size right must be a non-negative int"),
    (_args(window_size=3), fl.ParamError, "flash_attn: window_size must be a pair (left, right), got 3"),
    (_args(softcap=0.0), fl.ParamError, "flash_attn: softcap must be a positive finite number or None, got 0.0"),
    (_args(softcap=-2.0), fl.ParamError, "flash_attn: softcap must be a positive finite number"),
    (_args(softcap=math.inf), fl.ParamError, "flash_attn: softcap must be a positive finite number"),
    (_args(softmax_scale=math.nan), fl.ParamError, "flash_attn: softmax_scale must be finite, got nan"),
    (_args(q=np.zeros((2, 8, 4, 16), np.int64), k=np.zeros((2, 4, 6, 16), np.int64),
           v=np.zeros((2, 4, 6, 16), np.int64)), fl.DTypeError, "flash_attn: q must be a float tensor, got i64"),
    (_args(k=np.zeros((2, 4, 6, 16), np.float64)), fl.DTypeError, "flash_attn: k must have q's dtype f32, got f64"),
    (_args(v=np.zeros((2, 4, 6, 16), np.float16)), fl.DTypeError, "flash_attn: v must have q's dtype f32, got f16"),
    (_args(alibi=np.zeros(8, np.uint32)), fl.DTypeError, "flash_attn: alibi must be float slopes, got u32"),
])
def test_build_errors(args: dict[str, Any], error: type[Exception], words: str) -> None:
    with pytest.raises(error) as info:
        fl.ops.flash_attn(**args)
    assert words in str(info.value)


def test_defaults_and_alibi_cast() -> None:
    y = fl.ops.flash_attn(**_args(alibi=np.linspace(0.1, 0.8, 8)))  # float64 slopes cast once to f32
    p = y.node.arg[1]
    assert y.node.arg[0] == FusedOps.FLASH_ATTN and p.softmax_scale == 0.25 and not p.causal
    assert (p.window_size_left, p.window_size_right, p.softcap, p.k_len) == (None, None, None, None)
    assert y.node.inputs[3].dtype is DType.F32
    z = fl.ops.flash_attn(**_args(q=np.zeros((2, 8, 4, 16)), k=np.zeros((2, 4, 6, 16)), v=np.zeros((2, 4, 6, 16)),
                                  alibi=np.ones(8, F32)))
    assert z.node.inputs[3].dtype is DType.F64


@pytest.mark.parametrize("dt", [DType.F64, DType.F32], ids=lambda d: d.value)
@pytest.mark.parametrize("opts", [{}, {"causal": True, "k_len": 9, "softcap": 3.0, "alibi": True},
                                  {"window_size": (2, 1), "k_len": 4}, {"window_size": (None, 0), "alibi": True}],
                         ids=["plain", "causal-softcap-alibi-klen", "window-klen", "window-alibi"])
def test_decomposition_matches_kernel(dt: DType, opts: dict[str, Any]) -> None:
    opts = dict(opts)
    x = make_inputs(9, dt, 2, 6, 2, 7, 12, 32, alibi=opts.pop("alibi", False), q_scale=2.0)
    y = fl.ops.flash_attn(x["q"], x["k"], x["v"], alibi=x["alibi"], softmax_scale=0.3, **opts)
    params = y.node.arg[1]
    lowered = decompose([fl.tensor(a) for a in (x["q"], x["k"], x["v"], x["alibi"]) if a is not None], params)
    with fl.trace() as t:
        got = fl.realize(lowered, fuse=False)[0].numpy()
    assert not any(r.impl.startswith("FlashAttn[") for r in t.records)
    ref, s = reference(x, 0.3, opts.get("causal", False), opts.get("window_size", (None, None)),
                       opts.get("softcap"), opts.get("k_len"))
    assert_close_attention(got, ref, dt, s)
    assert_close_attention(y.numpy(), got, dt, s)
    dyn = fl.ops.flash_attn(x["q"], x["k"], x["v"], k_len=fl.dyn("n")).node.arg[1]
    with pytest.raises(fl.NoDecomposition, match="DynScalar k_len"):
        decompose([fl.tensor(x[n]) for n in "qkv"], dyn)


@pytest.mark.parametrize(("dt", "sq", "sk"), [(DType.F32, 300, 300), (DType.BF16, 300, 300), (DType.F32, 140, 600),
                                               (DType.F64, 140, 600)], ids=str)
def test_bit_stable_across_threads_and_runs(dt: DType, sq: int, sk: int) -> None:
    x = make_inputs(10, dt, 1, 4, 2, sq, sk, 32, alibi=True)
    opts = {"causal": True, "softcap": 8.0, "k_len": sk - 5, "window_size": (450, None)}
    results = []
    for n in (1, 2, 1):
        with fuel_threads(n):
            results.append(run(x, **opts).tobytes())
    assert len(set(results)) == 1
    ref, s = reference(x, 1 / math.sqrt(32), True, (450, None), 8.0, sk - 5)
    assert_close_attention(np.frombuffer(results[0], dt.np).reshape(x["q"].shape), ref, dt, s)


@pytest.mark.parametrize("hkv", [1, 2], ids=["one group: query blocks split", "two groups: groups split"])
def test_same_bytes_at_any_fuel_thread_count(hkv: int) -> None:
    """fuel's thread count decides how the work is split over threads (query blocks of one (batch, kv
    head) group, or the groups); no split may change a byte, forward or backward."""
    x = make_inputs(11, DType.F32, 1, 4, hkv, 300, 300, 32, alibi=False)
    before = fl.get_num_threads()
    results = []
    try:
        for n in (1, 2, 1):
            fl.set_num_threads(n)
            q, k, v = (fl.tensor(x[c]) for c in "qkv")
            out = fl.ops.flash_attn(q, k, v, causal=True)
            grads = fl.grad(out, [q, k, v], grad_out=fl.tensor(x["q"][..., ::-1, :].copy()))
            fl.realize(out, *grads)
            results.append(b"".join(t.numpy().tobytes() for t in (out, *grads)))
    finally:
        fl.set_num_threads(before)
    assert len(set(results)) == 1


def test_one_group_is_cut_into_query_blocks_by_its_length_only() -> None:
    """A call with one (batch, kv head) group splits its queries into at least QUERY_TASKS blocks of a
    multiple of 16 rows (a 128-token prefill with one kv head was one block: one thread ran it)."""
    from fuel.cpu.attention.flash_attn import BQ, QUERY_TASKS, query_rows

    for sq in (5, 16, 64, 100, 128, 300, 512, 4096):
        rows = query_rows(sq)
        assert rows % 16 == 0 and 16 <= rows <= BQ
        assert -(-sq // rows) >= min(QUERY_TASKS, -(-sq // 16))


@pytest.mark.parametrize("opts", [{"causal": True}, {"causal": True, "softcap": 8.0, "alibi": True, "k_len": 190,
                                                      "window_size": (100, None)}, {"window_size": (None, 3)}],
                         ids=["causal", "softcap-alibi-window", "right-window"])
@pytest.mark.parametrize("hkv", [1, 3], ids=str)
def test_f32_pool_tasks_and_numpy_steps_both_match(opts: dict[str, Any], hkv: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """f32 runs as spinning-pool tasks calling OpenBLAS's sgemm from jitted code; where NumPy's BLAS has no
    such sgemm, as NumPy steps on Python threads. Both against the float64 reference."""
    from fuel.runtime import threads

    opts = dict(opts)
    x = make_inputs(12, DType.F32, 1, 3 * hkv, hkv, 200, 600, 64, alibi=opts.pop("alibi", False))
    window = opts.get("window_size", (None, None))
    ref, s = reference(x, 0.125, opts.get("causal", False), window, opts.get("softcap"), opts.get("k_len"))
    assert threads.blas_sgemm_address()
    pool = run(x, softmax_scale=0.125, **opts)
    monkeypatch.setattr(threads, "blas_sgemm_address", lambda: 0)
    steps = run(x, softmax_scale=0.125, **opts)
    for got in (pool, steps):
        assert_close_attention(got, ref, DType.F32, s)


def test_pool_items_are_fixed_by_the_shape() -> None:
    """At least ITEMS (group, query block) items where the groups are fewer, a multiple of 16 queries each;
    whole groups (up to 128 queries) where there are enough of them."""
    from fuel.cpu.attention.flash_attn_tasks import ITEMS, item_rows

    for n in (1, 3, 7):
        for sq in (5, 16, 128, 300, 4096):
            rows = item_rows(n, sq, 128)
            assert rows % 16 == 0 and 16 <= rows <= 128
            assert n * -(-sq // rows) >= min(ITEMS, n * -(-sq // 16))
    for n in (ITEMS, 40):  # enough groups: whole groups of up to 128 queries
        assert [item_rows(n, sq, 128) for sq in (5, 20, 128, 300)] == [5, 20, 128, 128]
