"""PagedAttn (entry 13) against torch float64 SDPA on the gathered pages: kernels, rules, errors, jit."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.cpu.attention import paged_attn as kernel_module
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry import NOT_DIFFERENTIABLE, FusedOpFamily, FusedOps, default_registry
from fuel.graph.registry.paged_attn import PagedAttnParams, decompose, paged_attn
from fuel.runtime.pool import SPIN_MIN_SECONDS
from fuel.runtime.threads import SERIAL_BYTES_PER_SECOND, SERIAL_FLOPS_PER_SECOND, serial
from fuel.testing.contract import fuel_threads, output_for, verify
from fuel.testing.oracle import ROWWISE, assert_close_rowwise
from fuel.testing.reference.paged_attn import DEAD_BLOCK, paged_inputs
from tests.graph.registry.attention_oracle import large, sdpa_with_slack, torch_attention

DTYPES = pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)
ENTRY = default_registry().entry(FusedOps.PAGED_ATTN)

# (b, hq, hkv, sq, d, block_size, lens, options)
Config = tuple[int, int, int, int, int, int, tuple[int, ...], dict[str, Any]]
CONFIGS: list[Config] = [
    (3, 4, 1, 1, 32, 16, (1, 17, 40), {}),                        # decode, GQA 4/1
    (2, 6, 2, 1, 64, 16, (33, 5), {"shared_prefix": True}),      # decode, GQA 6/2, a shared block
    (1, 8, 2, 1, 128, 16, (257,), {"q_scale": 2.0}),              # long decode, D 128
    (2, 4, 4, 5, 64, 16, (12, 30), {}),                           # prefill chunk, MHA
    (2, 6, 2, 7, 128, 16, (7, 23), {}),                           # the whole prompt / a chunk, GQA
    (2, 4, 2, 3, 32, 1, (7, 3), {}),                              # block size 1
    (3, 4, 2, 4, 32, 4, (2, 0, 6), {}),                           # L < Sq and L = 0: rows of zeros
    (2, 2, 1, 6, 32, 16, (0, 0), {}),                             # no key anywhere
    (2, 6, 2, 2, 24, 8, (19, 70), {}),                            # D 24: the scalar tiles, G 3
]


def _t64(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, np.float64))


def torch_gather(cache: np.ndarray, bt: np.ndarray, cl: np.ndarray) -> torch.Tensor:
    """`[B,Hkv,Lmax,D]` float64 by torch indexing; dead table entries (past the live length) are
    replaced by block 0 before indexing, as they may hold anything."""
    bs = cache.shape[1]
    lmax = bt.shape[1] * bs
    t = torch.arange(lmax)
    lens = torch.from_numpy(cl.astype(np.int64))
    blocks = torch.from_numpy(bt.astype(np.int64))[:, t // bs]
    blocks = torch.where(t[None, :] < lens[:, None], blocks, 0)
    return _t64(cache)[blocks, t % bs].permute(0, 2, 1, 3)


def admissible(sq: int, lmax: int, cl: np.ndarray) -> torch.Tensor:
    """Bool `[B,1,Sq,Lmax]`: key t < L and t <= i + L − Sq (bottom-right causal)."""
    lens = torch.from_numpy(cl.astype(np.int64))[:, None, None]
    t = torch.arange(lmax)[None, None, :]
    i = torch.arange(sq)[None, :, None]
    return ((t < lens) & (t <= i + lens - sq))[:, None]


def window_mask(sq: int, lmax: int, cl: np.ndarray, window: int | None) -> torch.Tensor:
    """`admissible` and, with a window, key t >= aq − window: written out in torch, FlashAttn's left window."""
    mask = admissible(sq, lmax, cl)
    if window is None:
        return mask
    aq = torch.arange(sq)[:, None] + torch.from_numpy(cl.astype(np.int64))[:, None, None] - sq
    return mask & (torch.arange(lmax)[None, None, :] >= aq - window)[:, None]


def torch_paged(inputs: tuple[np.ndarray, ...], p: PagedAttnParams) -> tuple[np.ndarray, np.ndarray]:
    """(SDPA output, S = Σ p·|v| per element) in float64, GQA through enable_gqa; p's window in the mask."""
    q, kc, vc, bt, cl = inputs
    k, v = torch_gather(kc, bt, cl), torch_gather(vc, bt, cl)
    mask = window_mask(q.shape[2], k.shape[2], cl, p.window_size)
    tq = _t64(q)
    out = torch.nn.functional.scaled_dot_product_attention(tq, k, v, attn_mask=mask, scale=p.softmax_scale,
                                                           enable_gqa=True)
    g = q.shape[1] // k.shape[1]
    s = (tq @ k.repeat_interleave(g, 1).transpose(-2, -1)) * p.softmax_scale
    probs = torch.nan_to_num(torch.softmax(s.masked_fill(~mask, -math.inf), -1), nan=0.0)
    return out.numpy(), (probs @ v.abs().repeat_interleave(g, 1)).numpy()


def run(inputs: tuple[np.ndarray, ...], p: PagedAttnParams) -> np.ndarray:
    q, kc, vc, bt, cl = inputs[:5]
    alibi = inputs[5] if len(inputs) == 6 else None
    y = paged_attn(q, kc, vc, bt, cl, softmax_scale=p.softmax_scale, softcap=p.softcap, alibi=alibi)
    assert y.shape == q.shape and y.dtype.np == q.dtype
    with fl.trace() as tr:
        out = y.numpy()
    assert any(r.impl.startswith("PagedAttn[") for r in tr.records)
    return out


@DTYPES
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}x{c[1]}/{c[2]}x{c[3]}x{c[4]}-bs{c[5]}-{c[6]}")
def test_matches_torch_sdpa(dt: DType, config: Config) -> None:
    b, hq, hkv, sq, d, bs, lens, opts = config
    inputs, p = paged_inputs(np.random.default_rng(11), dt, b, hq, hkv, sq, d, bs, lens, **opts)
    ref, scale = torch_paged(inputs, p)
    assert_close_rowwise(run(inputs, p), ref, dt, scale=scale)


@DTYPES
@settings(max_examples=30)
@given(seed=st.integers(0, 2**32 - 1), size=st.floats(0, 1), scale=st.floats(0.01, 2) | st.floats(-2, -0.01),
       sq=st.sampled_from([1, 3, 9]), bs=st.sampled_from([1, 4, 16]), heads=st.sampled_from([(4, 4), (6, 2), (8, 1)]),
       d=st.sampled_from([8, 16, 64]), lens=st.lists(st.integers(0, 60), min_size=1, max_size=3))
def test_large_logits_match_torch_sdpa(dt: DType, seed: int, size: float, scale: float, sq: int, bs: int,
                                       heads: tuple[int, int], d: int, lens: list[int]) -> None:
    """q and k cache of 1e3-1e6 (logits far past exp's range), decode and prefill chunks, against torch's
    float64 SDPA on the gathered pages, within what rounded scores allow (`attention_oracle`: ~0 wherever
    a row's largest score stands clear, so such rows must come out one-hot)."""
    hq, hkv = heads
    rng = np.random.default_rng(seed)
    (_, _, vc, bt, cl), _ = paged_inputs(rng, dt, len(lens), hq, hkv, sq, d, bs, lens)
    q, kc = large(rng, (len(lens), hq, sq, d), dt, size), large(rng, vc.shape, dt, size)
    k, v = torch_gather(kc, bt, cl), torch_gather(vc, bt, cl)
    want, s, slack = sdpa_with_slack(q, k.numpy(), v.numpy(), scale, admissible(sq, k.shape[2], cl), dt)
    got = run((q, kc, vc, bt, cl), PagedAttnParams(scale, bs, None))
    assert_close_rowwise(got, want, dt, scale=s + slack / ROWWISE[dt][1])


def reference_with(inputs: tuple[np.ndarray, ...], p: PagedAttnParams) -> tuple[np.ndarray, np.ndarray]:
    """(output, S = Σ p·|v|) by torch in float64 on the torch-gathered pages, with the softcap and the
    ALiBi −slope·|i + L − Sq − t| written out (`attention_oracle.torch_attention`)."""
    q, kc, vc, bt, cl = inputs[:5]
    alibi = inputs[5] if len(inputs) == 6 else None
    k, v = torch_gather(kc, bt, cl), torch_gather(vc, bt, cl)
    sq = q.shape[2]
    aq = torch.arange(sq)[None, None, :] + torch.from_numpy(cl.astype(np.int64))[:, None, None] - sq
    return torch_attention(q, k.numpy(), v.numpy(), p.softmax_scale, admissible(sq, k.shape[2], cl), aq,
                           p.softcap, alibi)


@DTYPES
@pytest.mark.parametrize(("config", "softcap", "alibi"), [
    ((2, 4, 2, 3, 64, 16, (20, 3)), 2.0, False),
    ((2, 6, 2, 2, 32, 16, (19, 40)), None, True),
    ((2, 4, 1, 1, 128, 16, (50, 1)), 5.0, True),
    ((2, 4, 2, 5, 32, 1, (3, 9)), None, True),
], ids=["softcap", "alibi", "softcap+alibi decode", "alibi L<Sq bs1"])
def test_softcap_and_alibi_match_torch(dt: DType, config: tuple[int, int, int, int, int, int, tuple[int, ...]],
                                           softcap: float | None, alibi: bool) -> None:
    b, hq, hkv, sq, d, bs, lens = config
    inputs, p = paged_inputs(np.random.default_rng(12), dt, b, hq, hkv, sq, d, bs, lens, softcap=softcap,
                             alibi=alibi, q_scale=3.0)
    ref, scale = reference_with(inputs, p)
    assert_close_rowwise(run(inputs, p), ref, dt, scale=scale)
    if softcap is not None:  # the cap changes the answer: the test would catch a kernel ignoring it
        plain, _ = reference_with(inputs, PagedAttnParams(p.softmax_scale, p.block_size, None))
        assert np.abs(plain - ref).max() > 1e-2


@DTYPES
def test_zero_sizes(dt: DType) -> None:
    for b, hq, hkv, sq, d, lens in [(0, 4, 2, 1, 32, ()), (2, 4, 2, 0, 32, (3, 0)), (1, 2, 1, 3, 0, (4,))]:
        inputs, _ = paged_inputs(np.random.default_rng(13), dt, b, hq, hkv, sq, d, 16, lens, alibi=True)
        q, kc, vc, bt, cl, slopes = inputs
        out = paged_attn(q, kc, vc, bt, cl, alibi=slopes).numpy()
        assert out.shape == (b, hq, sq, d) and out.dtype == dt.np


def test_defaults_and_params() -> None:
    inputs, _ = paged_inputs(np.random.default_rng(14), DType.F32, 2, 4, 2, 1, 32, 8, (5, 9))
    q, kc, vc, bt, cl = inputs
    y = paged_attn(q, kc, vc, bt, cl, alibi=np.linspace(0.1, 0.5, 4))  # float64 slopes are cast once to f32
    assert y.node.arg == (FusedOps.PAGED_ATTN, PagedAttnParams(1.0 / math.sqrt(32), 8, None))
    assert y.node.inputs[5].dtype is DType.F32
    assert fl.ops.paged_attn is paged_attn
    assert ENTRY.family is FusedOpFamily.ATTENTION and ENTRY.backward is NOT_DIFFERENTIABLE
    assert ENTRY.vjp is None and ENTRY.pattern is None and ENTRY.arity == (5, 6)
    tq = fl.tensor(q)
    with pytest.raises(fl.NotDifferentiable, match="PagedAttn"):
        fl.grad(paged_attn(tq, kc, vc, bt, cl).sum(), [tq])


def _bad(**change: Any) -> dict[str, Any]:
    f32, u32 = np.float32, np.uint32
    args: dict[str, Any] = {"q": np.zeros((2, 8, 1, 16), f32), "k_cache": np.zeros((6, 4, 2, 16), f32),
                            "v_cache": np.zeros((6, 4, 2, 16), f32), "block_table": np.zeros((2, 3), u32),
                            "context_lens": np.ones(2, u32)}
    args.update(change)
    return args


F32, U32 = np.float32, np.uint32


@pytest.mark.parametrize(("args", "error", "words"), [
    (_bad(q=np.zeros((2, 8, 16), F32)), fl.ShapeError,
     "paged_attn: q must be [batch, heads, seq, head_dim], got [2, 8, 16]"),
    (_bad(k_cache=np.zeros((6, 4, 32), F32)), fl.ShapeError, "paged_attn: k_cache must be [num_blocks, block_size"),
    (_bad(v_cache=np.zeros((6, 4, 2), F32)), fl.ShapeError, "paged_attn: v_cache must be [num_blocks"),
    (_bad(block_table=np.zeros(6, U32)), fl.ShapeError,
     "paged_attn: block_table must be [batch, max_blocks], got [6]"),
    (_bad(context_lens=np.zeros((2, 1), U32)), fl.ShapeError, "paged_attn: context_lens must be [batch], got [2, 1]"),
    (_bad(v_cache=np.zeros((7, 4, 2, 16), F32)), fl.ShapeError,
     "paged_attn: k_cache is [6, 4, 2, 16] but v_cache is [7, 4, 2, 16]"),
    (_bad(k_cache=np.zeros((6, 0, 2, 16), F32), v_cache=np.zeros((6, 0, 2, 16), F32)), fl.ShapeError,
     "paged_attn: the caches' block_size (axis 1) must be >= 1, got [6, 0, 2, 16]"),
    (_bad(k_cache=np.zeros((6, 4, 2, 8), F32), v_cache=np.zeros((6, 4, 2, 8), F32)), fl.ShapeError,
     "paged_attn: head dims differ: q 16, k_cache 8"),
    (_bad(k_cache=np.zeros((6, 4, 3, 16), F32), v_cache=np.zeros((6, 4, 3, 16), F32)), fl.ShapeError,
     "paged_attn: k_cache has 3 heads, which does not divide q's 8 heads"),
    (_bad(k_cache=np.zeros((6, 4, 0, 16), F32), v_cache=np.zeros((6, 4, 0, 16), F32)), fl.ShapeError,
     "paged_attn: k_cache has 0 heads, which does not divide q's 8 heads"),
    (_bad(block_table=np.zeros((3, 3), U32)), fl.ShapeError,
     "paged_attn: batch sizes differ: q 2, block_table 3, context_lens 2"),
    (_bad(context_lens=np.zeros(1, U32)), fl.ShapeError,
     "paged_attn: batch sizes differ: q 2, block_table 2, context_lens 1"),
    (_bad(alibi=np.zeros(2, F32)), fl.ShapeError,
     "paged_attn: alibi must be [8] (one slope per query head), got [2]"),
    (_bad(block_table=np.zeros((2, 3), np.int32)), fl.DTypeError, "paged_attn: block_table must be u32, got int32"),
    (_bad(block_table=fl.tensor(np.zeros((2, 3), np.int64))), fl.DTypeError,
     "paged_attn: block_table must be u32, got i64"),
    (_bad(context_lens=[1, 1]), fl.DTypeError, "paged_attn: context_lens must be u32, got int64"),
    (_bad(context_lens=fl.tensor(np.ones(2, F32))), fl.DTypeError, "paged_attn: context_lens must be u32, got f32"),
    (_bad(k_cache=np.zeros((6, 4, 2, 16), np.float64)), fl.DTypeError,
     "paged_attn: k_cache must have q's dtype f32, got f64"),
    (_bad(v_cache=np.zeros((6, 4, 2, 16), np.float16)), fl.DTypeError,
     "paged_attn: v_cache must have q's dtype f32, got f16"),
    (_bad(q=np.zeros((2, 8, 1, 16), U32)), fl.DTypeError, "paged_attn: q must be a float tensor, got u32"),
    (_bad(alibi=np.zeros(8, U32)), fl.DTypeError, "paged_attn: alibi must be float slopes, got u32"),
    (_bad(softcap=0.0), fl.ParamError, "paged_attn: softcap must be a positive finite number or None, got 0.0"),
    (_bad(softcap=-1.0), fl.ParamError, "paged_attn: softcap must be a positive finite number"),
    (_bad(softcap=math.inf), fl.ParamError, "paged_attn: softcap must be a positive finite number"),
    (_bad(softmax_scale=math.nan), fl.ParamError, "paged_attn: softmax_scale must be finite, got nan"),
    (_bad(softmax_scale="0.5"), fl.ParamError, "paged_attn: softmax_scale must be a number, got '0.5'"),
    (_bad(softcap=True), fl.ParamError, "paged_attn: softcap must be a number, got True"),
])
def test_build_errors(args: dict[str, Any], error: type[Exception], words: str) -> None:
    with pytest.raises(error) as info:
        paged_attn(**args)
    assert words in str(info.value)


def test_param_errors_through_fused_node() -> None:
    """Params built by hand (not by the builder) are checked too."""
    from fuel.graph.registry import fused_node

    nodes = [fl.tensor(a).node for a in _bad().values()]
    with pytest.raises(fl.ParamError, match="paged_attn: params say block_size 8, the caches have 4"):
        fused_node(FusedOps.PAGED_ATTN, nodes, PagedAttnParams(0.25, 8, None))
    with pytest.raises(fl.ParamError, match="paged_attn: block_size must be an int >= 1, got 0"):
        fused_node(FusedOps.PAGED_ATTN, nodes, PagedAttnParams(0.25, 0, None))
    alibi64 = fl.tensor(np.zeros(8, np.float64)).node
    with pytest.raises(fl.DTypeError, match="paged_attn: alibi must be f32 for f32 attention, got f64"):
        fused_node(FusedOps.PAGED_ATTN, [*nodes, alibi64], PagedAttnParams(0.25, 4, None))


def test_block_id_out_of_range() -> None:
    inputs, _ = paged_inputs(np.random.default_rng(15), DType.F32, 2, 4, 2, 1, 32, 4, (5, 9))
    q, kc, vc, bt, cl = inputs
    nb = kc.shape[0]
    bad = bt.copy()
    bad[1, 2] = nb  # sequence 1 has 9 tokens: blocks 0, 1 and 2 are read
    with pytest.raises(fl.IndexOutOfRange) as info:
        paged_attn(q, kc, vc, bad, cl).numpy()
    msg = str(info.value)
    assert f"paged_attn: block_table[1, 2] = {nb}" in msg and f"num_blocks = {nb}" in msg
    assert "sequence 1 has context length 9" in msg


def test_context_len_past_capacity() -> None:
    inputs, _ = paged_inputs(np.random.default_rng(16), DType.F32, 2, 4, 2, 1, 32, 4, (5, 9))
    q, kc, vc, bt, _ = inputs
    cap = bt.shape[1] * 4
    with pytest.raises(fl.IndexOutOfRange) as info:
        paged_attn(q, kc, vc, bt, np.array([3, cap + 1], np.uint32)).numpy()
    assert (f"paged_attn: context_lens[1] = {cap + 1} exceeds the block table's capacity of {bt.shape[1]} "
            f"blocks × block_size 4 = {cap} tokens") in str(info.value)
    full = paged_attn(q, kc, vc, np.where(bt == DEAD_BLOCK, 0, bt).astype(np.uint32),
                      np.array([3, cap], np.uint32)).numpy()  # exactly at capacity is fine
    assert np.isfinite(full).all()


@DTYPES
def test_dead_entries_and_slots_are_not_read(dt: DType) -> None:
    """Table entries past the live length hold garbage ids, and cache slots past the length (in the
    last live block) and blocks only dead entries name hold NaN: none of it reaches the output."""
    rng = np.random.default_rng(17)
    inputs, p = paged_inputs(rng, dt, 3, 4, 2, 3, 32, 4, (6, 3, 0), spare_blocks=2)
    q, kc, vc, bt, cl = inputs
    clean = run(inputs, p)
    live = {int(x) for b in range(3) for x in bt[b, :math.ceil(int(cl[b]) / 4)]}
    spare = sorted(set(range(kc.shape[0])) - live)
    dirty_k, dirty_v, dirty_bt = kc.copy(), vc.copy(), bt.copy()
    for cache in (dirty_k, dirty_v):
        cache[spare] = np.nan
        cache[bt[0, 1], 2:] = np.nan  # sequence 0: tokens 4, 5 live in block bt[0, 1]; slots 2, 3 are not
        cache[bt[1, 0], 3:] = np.nan
    dirty_bt[0, 2:] = spare[0]
    dirty_bt[1, 1:] = 12345
    dirty_bt[2, :] = spare[1]
    out = run((q, dirty_k, dirty_v, dirty_bt, cl), p)
    assert np.array_equal(out.view(np.uint8), clean.view(np.uint8))
    assert not np.isnan(out.astype(np.float64)).any()


def _big_case(dt: DType) -> tuple[tuple[np.ndarray, ...], PagedAttnParams]:
    return paged_inputs(np.random.default_rng(18), dt, 3, 8, 2, 4, 64, 16, (100, 37, 4), alibi=True,
                        softcap=30.0)


@DTYPES
def test_bit_stable_across_threads_and_serial(dt: DType) -> None:
    inputs, p = _big_case(dt)
    impl = fl.kernels().lookup(FusedOps.PAGED_ATTN, "cpu", (*(fl.tensor(a).dtype for a in inputs), dt))
    assert impl is not None
    results = []
    for n in (1, 2):
        with fuel_threads(n):
            results.append(output_for(ENTRY, impl, inputs, p).tobytes())
    with serial():
        results.append(output_for(ENTRY, impl, inputs, p).tobytes())
    results.append(run(inputs, p).tobytes())
    assert len(set(results)) == 1


def test_query_chunks_do_not_change_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Splitting a long prompt into query chunks (to bound the score buffer) leaves every row as is."""
    inputs, p = paged_inputs(np.random.default_rng(19), DType.F32, 2, 6, 2, 9, 32, 4, (9, 30), alibi=True)
    whole = run(inputs, p)
    monkeypatch.setattr(kernel_module, "SCORE_BUFFER", 1)
    assert kernel_module.query_chunk(9, 3, 30) == 1
    assert np.array_equal(run(inputs, p).view(np.uint8), whole.view(np.uint8))


def test_jit_replay_with_new_context_lens() -> None:
    rng = np.random.default_rng(20)
    inputs, p = paged_inputs(rng, DType.F32, 2, 8, 2, 1, 64, 16, (40, 40), spare_blocks=4)
    q, kc, vc, bt, _ = inputs
    bt = np.where(bt == DEAD_BLOCK, 0, bt).astype(np.uint32)  # every entry a real block: any length fits
    slopes = np.linspace(0.05, 0.4, 8).astype(np.float32)

    def fn(q: fl.Tensor, lens: fl.Tensor) -> fl.Tensor:
        return paged_attn(q, kc, vc, bt, lens, softcap=20.0, alibi=slopes)

    f = fl.jit(fn)
    for lens in ([1, 48], [17, 0], [33, 2], [48, 48]):
        cl = np.array(lens, np.uint32)
        qn = rng.standard_normal(q.shape).astype(np.float32)
        got = f(qn, cl).numpy()
        want = fn(fl.tensor(qn), fl.tensor(cl)).numpy()
        assert np.array_equal(got, want)
        ref, scale = reference_with((qn, kc, vc, bt, cl, slopes), PagedAttnParams(p.softmax_scale, 16, 20.0))
        assert_close_rowwise(got, ref, DType.F32, scale=scale)


@pytest.mark.parametrize("dt", [DType.F64, DType.F32], ids=lambda d: d.value)
@pytest.mark.parametrize("opts", [{}, {"softcap": 3.0, "alibi": True}], ids=["plain", "softcap+alibi"])
def test_decomposition_matches_the_kernel(dt: DType, opts: dict[str, Any]) -> None:
    """The primitive lowering (the executor's fallback) honours runtime lengths, dead entries and the
    mask, including rows without keys."""
    inputs, p = paged_inputs(np.random.default_rng(21), dt, 3, 4, 2, 4, 32, 4, (6, 2, 0), **opts)
    lowered = decompose([fl.tensor(a) for a in inputs], p)
    assert lowered.shape == inputs[0].shape and lowered.dtype is dt
    got = fl.realize(lowered, fuse=False)[0].numpy()
    ref, scale = reference_with(inputs, p)
    assert_close_rowwise(got, ref, dt, scale=scale)
    assert_close_rowwise(run(inputs, p), ref, dt, scale=scale)


def test_cost_picks_serial_for_small_decode_only() -> None:
    impl = fl.kernels().lookup(FusedOps.PAGED_ATTN, "cpu", (DType.F32,) * 3 + (DType.U32,) * 2 + (DType.F32,))
    assert impl is not None
    small = impl.cost([(1, 4, 1, 64), (8, 16, 1, 64), (8, 16, 1, 64), (1, 4), (1,), (1, 4, 1, 64)],
                      [DType.F32] * 3 + [DType.U32] * 2 + [DType.F32], PagedAttnParams(0.125, 16, None))
    # 8192 keys of 8 kv heads: ~5 ms of work, cut into parts; a few keys run in the calling thread (pool.py)
    big = impl.cost([(1, 32, 1, 64), (512, 16, 8, 64), (512, 16, 8, 64), (1, 512), (1,), (1, 32, 1, 64)],
                    [DType.F32] * 3 + [DType.U32] * 2 + [DType.F32], PagedAttnParams(0.125, 16, None))
    assert big.flops == 4 * 32 * 8192 * 64 and big.bytes_moved == 2 * 8 * 8192 * 64 * 4 + 2 * 32 * 64 * 4
    seconds = [c.bytes_moved / SERIAL_BYTES_PER_SECOND + c.flops / SERIAL_FLOPS_PER_SECOND for c in (small, big)]
    assert seconds[0] < SPIN_MIN_SECONDS < seconds[1]


def test_fuel_verify_passes() -> None:
    results = verify(["PagedAttn"])
    assert len(results) == 2 * len(FLOAT_DTYPES)
    for r in results:
        assert r.ok and r.cases > 0, r

