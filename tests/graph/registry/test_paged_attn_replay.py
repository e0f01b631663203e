"""PagedAttn (entry 13) in native replay, and its left window: against torch float64 SDPA with explicit
masks on the gathered pages (helpers from test_paged_attn)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry.paged_attn import PagedAttnParams, decompose, paged_attn
from fuel.testing.oracle import assert_close_rowwise
from fuel.testing.reference.paged_attn import DEAD_BLOCK, paged_inputs
from tests.graph.registry.attention_oracle import torch_attention
from tests.graph.registry.test_paged_attn import torch_gather, torch_paged, window_mask

DTYPES = pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)


def _python_steps(f: Any, *args: Any) -> list[Any]:
    """The steps of f's capture for these arguments that replay runs from Python (none: all native)."""
    cap = f.capture_for(*args)
    assert cap is not None and cap.native is not None
    return [item for item in cap.native.items if len(item) != 2]


@pytest.mark.parametrize("window", [None, 7], ids=["causal", "window 7"])
def test_native_replay_reads_each_calls_table_and_lengths(window: int | None) -> None:
    """One capture (as the server's step: M rows of one query each, q computed in the graph) runs as
    native jobs only, and each call's new table and lengths are read (and checked) afresh: every call
    matches torch float64 SDPA with an explicit mask, and the bytes of the eager call."""
    rng = np.random.default_rng(22)
    b, hq, hkv, d, bs, width, nb = 4, 9, 3, 64, 16, 8, 40
    kc, vc = (rng.standard_normal((nb, bs, hkv, d)).astype(np.float32) for _ in range(2))

    def fn(x: fl.Tensor, bt: fl.Tensor, lens: fl.Tensor) -> fl.Tensor:
        return paged_attn(x * 0.5, kc, vc, bt, lens, **({} if window is None else {"window_size": window}))

    f = fl.jit(fn)
    for call in range(4):
        lens = rng.integers(1, width * bs + 1, b).astype(np.uint32)
        bt = rng.permutation(nb)[:b * width].reshape(b, width).astype(np.uint32)
        x = rng.standard_normal((b, hq, 1, d)).astype(np.float32)
        got = f(x, bt, lens).numpy()
        if call == 0:  # the second call of a capture replays it
            got = f(x, bt, lens).numpy()
            assert _python_steps(f, x, bt, lens) == []
        want = fn(fl.tensor(x), fl.tensor(bt), fl.tensor(lens)).numpy()
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
        p = PagedAttnParams(1.0 / math.sqrt(d), bs, None, window)
        ref, scale = torch_paged((x * np.float32(0.5), kc, vc, bt, lens), p)
        assert_close_rowwise(got, ref, DType.F32, scale=scale)


def test_native_replay_raises_bad_ids_and_lengths_after_the_stretch() -> None:
    """A replayed call whose table names a block outside the cache, or whose length passes the table,
    raises IndexOutOfRange naming it (found by the check job inside the native program); the next good
    call is right again."""
    rng = np.random.default_rng(23)
    inputs, _ = paged_inputs(rng, DType.F32, 2, 4, 2, 1, 32, 4, (5, 9), spare_blocks=2)
    q, kc, vc, bt, cl = inputs
    bt = np.where(bt == DEAD_BLOCK, 0, bt).astype(np.uint32)
    f = fl.jit(lambda x, t, n: paged_attn(x + 0.0, kc, vc, t, n))
    good = f(q, bt, cl).numpy()
    f(q, bt, cl)
    assert _python_steps(f, q, bt, cl) == []
    bad = bt.copy()
    bad[1, 2] = kc.shape[0] + 5
    with pytest.raises(fl.IndexOutOfRange) as info:
        f(q, bad, cl)
    assert (f"paged_attn: block_table[1, 2] = {kc.shape[0] + 5} is not a block of the cache (num_blocks = "
            f"{kc.shape[0]}); sequence 1 has context length 9, so its first 3 blocks are read") in str(info.value)
    cap = bt.shape[1] * 4
    with pytest.raises(fl.IndexOutOfRange, match=f"context_lens\\[0\\] = {cap + 1} exceeds the block table's "
                                                 f"capacity of {bt.shape[1]} blocks × block_size 4 = {cap} tokens"):
        f(q, bt, np.array([cap + 1, 9], np.uint32))
    assert np.array_equal(f(q, bt, cl).numpy(), good)


@DTYPES
@settings(max_examples=25)
@given(seed=st.integers(0, 2**32 - 1), sq=st.sampled_from([1, 2, 5]), bs=st.sampled_from([1, 4, 16]),
       heads=st.sampled_from([(9, 3), (4, 1), (4, 4)]), d=st.sampled_from([24, 64, 256]),
       window=st.integers(0, 40), lens=st.lists(st.integers(0, 70), min_size=1, max_size=4),
       opts=st.sampled_from([{}, {"softcap": 4.0}, {"alibi": True}]))
def test_window_matches_torch_sdpa_with_a_mask(dt: DType, seed: int, sq: int, bs: int, heads: tuple[int, int],
                                               d: int, window: int, lens: list[int], opts: dict[str, Any]) -> None:
    """A left window against torch float64 SDPA (through `torch_attention`, softcap and ALiBi written out) with
    the window in an explicit mask; the blocks wholly left of every window are DEAD_BLOCK ids (never read)."""
    hq, hkv = heads
    inputs, p = paged_inputs(np.random.default_rng(seed), dt, len(lens), hq, hkv, sq, d, bs, lens, window=window,
                             q_scale=2.0, **opts)
    q, kc, vc, bt, cl = inputs[:5]
    alibi = inputs[5] if len(inputs) == 6 else None
    k, v = (torch_gather(c, np.where(bt == DEAD_BLOCK, 0, bt), cl) for c in (kc, vc))
    aq = torch.arange(sq)[None, None, :] + torch.from_numpy(cl.astype(np.int64))[:, None, None] - sq
    ref, scale = torch_attention(q, k.numpy(), v.numpy(), p.softmax_scale, window_mask(sq, k.shape[2], cl, window),
                                 aq, p.softcap, alibi)
    got = paged_attn(q, kc, vc, bt, cl, softmax_scale=p.softmax_scale, softcap=p.softcap, alibi=alibi,
                     window_size=window).numpy()
    assert_close_rowwise(got, ref, dt, scale=scale)


@DTYPES
def test_window_reads_no_key_left_of_it(dt: DType) -> None:
    """Cache rows left of every query's window hold NaN, and the table entries wholly left of it name no
    block: the output is the same bytes as with clean rows, and the window changes the answer."""
    rng = np.random.default_rng(24)
    inputs, _ = paged_inputs(rng, dt, 2, 8, 2, 3, 64, 4, (30, 13), window=6)
    q, kc, vc, bt, cl = inputs
    out = paged_attn(q, kc, vc, bt, cl, window_size=6).numpy()
    dirty_k, dirty_v = kc.copy(), vc.copy()
    for b, n in enumerate(int(x) for x in cl):
        for t in range(n - 3 - 6):  # left of the first query's window (aq = n − 3)
            if bt[b, t // 4] != DEAD_BLOCK:
                dirty_k[bt[b, t // 4], t % 4] = dirty_v[bt[b, t // 4], t % 4] = np.nan
    again = paged_attn(q, dirty_k, dirty_v, bt, cl, window_size=6).numpy()
    assert np.array_equal(again.view(np.uint8), out.view(np.uint8))
    full = np.where(bt == DEAD_BLOCK, 0, bt).astype(np.uint32)
    assert not np.allclose(paged_attn(q, kc, vc, full, cl).numpy().astype(np.float64), out.astype(np.float64))


def test_window_in_params_rules_and_lowering() -> None:
    """window_size reaches the params, bad values are ParamErrors naming it, and the primitive lowering
    applies it (against torch)."""
    inputs, p = paged_inputs(np.random.default_rng(25), DType.F64, 3, 4, 2, 4, 32, 4, (20, 2, 9), window=3)
    q, kc, vc, bt, cl = inputs
    assert paged_attn(q, kc, vc, bt, cl, window_size=3).node.arg[1].window_size == 3
    for bad in (-1, 2.5, True):
        with pytest.raises(fl.ParamError, match=f"paged_attn: window_size must be a non-negative int or None, got "
                                                f"{bad!r}"):
            paged_attn(q, kc, vc, bt, cl, window_size=bad)  # type: ignore[arg-type]
    lowered = fl.realize(decompose([fl.tensor(a) for a in inputs], p), fuse=False)[0].numpy()
    k, v = (torch_gather(c, np.where(bt == DEAD_BLOCK, 0, bt), cl) for c in (kc, vc))
    aq = torch.arange(4)[None, None, :] + torch.from_numpy(cl.astype(np.int64))[:, None, None] - 4
    ref, scale = torch_attention(q, k.numpy(), v.numpy(), p.softmax_scale, window_mask(4, k.shape[2], cl, 3), aq)
    assert_close_rowwise(lowered, ref, DType.F64, scale=scale)


def test_window_checks_only_the_blocks_it_reads() -> None:
    """A bad id inside the window is an IndexOutOfRange naming the span read; one wholly left of it is not read."""
    inputs, _ = paged_inputs(np.random.default_rng(26), DType.F32, 1, 4, 2, 1, 32, 4, (20,), window=5)
    q, kc, vc, bt, cl = inputs
    assert (bt[0, :3] == DEAD_BLOCK).all()  # aq = 19: keys 14..19 live in blocks 3 and 4
    bad = bt.copy()
    bad[0, 3] = kc.shape[0]
    with pytest.raises(fl.IndexOutOfRange, match="sequence 0 has context length 20, so its blocks 3 to 4 "
                                                 "\\(the window\\) are read"):
        paged_attn(q, kc, vc, bad, cl, window_size=5).numpy()
