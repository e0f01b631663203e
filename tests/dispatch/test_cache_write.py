"""cache_write, the destructive KV-cache append: ordering, errors, and a captured decode loop over it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fuel as fl
from fuel.dtype import DType
from fuel.testing.oracle import assert_close_rowwise
from fuel.testing.reference.attention_math import abs_attention64


def _sdpa64(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """torch SDPA in float64 with a bottom-right causal bool mask (True = attend)."""
    sq, sk = q.shape[2], k.shape[2]
    mask = torch.tensor(np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq)
    t = [torch.tensor(a.astype(np.float64)) for a in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.numpy()


def _decode_step(q: fl.Tensor, k: fl.Tensor, v: fl.Tensor, k_cache: fl.Tensor, v_cache: fl.Tensor) -> fl.Tensor:
    pos = fl.dyn("pos")
    kc = fl.cache_write(k_cache, k, pos)
    vc = fl.cache_write(v_cache, v, pos)
    return fl.ops.flash_attn(q, kc, vc, causal=True, k_len=fl.dyn("k_len"))


@pytest.mark.parametrize("dt", [DType.F32, DType.BF16], ids=lambda d: d.value)
def test_captured_decode_loop_equals_full_recomputation(dt: DType, rng: np.random.Generator) -> None:
    """One capture serves k_len = 1…64: each step writes its K/V row and attends over the cache."""
    b, hq, hkv, d, cap = 2, 6, 2, 32, 64
    qs, ks, vs = (rng.standard_normal((b, h, cap, d)).astype(dt.np) for h in (hq, hkv, hkv))
    k_cache, v_cache = np.zeros((b, hkv, cap, d), dt.np), np.zeros((b, hkv, cap, d), dt.np)
    step = fl.jit(_decode_step)
    for t in range(cap):
        one = slice(t, t + 1)
        got = step(qs[:, :, one], ks[:, :, one], vs[:, :, one], k_cache, v_cache, pos=t, k_len=t + 1).numpy()
        pre = [a.astype(np.float64) for a in (qs[:, :, one], ks[:, :, :t + 1], vs[:, :, :t + 1])]
        want = _sdpa64(*pre, scale=d ** -0.5)
        assert_close_rowwise(got, want, dt, scale=abs_attention64(*pre, d ** -0.5, causal=True))
    assert step.captures == 1
    np.testing.assert_array_equal(k_cache, ks)
    np.testing.assert_array_equal(v_cache, vs)


def test_prefill_then_decode_through_realize(rng: np.random.Generator) -> None:
    """A prefill chunk written at offset 0, then single rows, through realize and env bindings."""
    cap, d = 16, 8
    ks, vs, qs = (rng.standard_normal((1, 1, cap, d)).astype(np.float32) for _ in range(3))
    k_cache, v_cache = np.zeros((1, 1, cap, d), np.float32), np.zeros((1, 1, cap, d), np.float32)
    out = _decode_step(fl.tensor(qs[:, :, :5]), fl.tensor(ks[:, :, :5]), fl.tensor(vs[:, :, :5]),
                       fl.tensor(k_cache), fl.tensor(v_cache))
    got = out.numpy(env={"pos": 0, "k_len": 5})
    np.testing.assert_allclose(got, _sdpa64(qs[:, :, :5], ks[:, :, :5], vs[:, :, :5], d ** -0.5), rtol=1e-5, atol=1e-6)
    for t in range(5, 9):
        out = _decode_step(fl.tensor(qs[:, :, t:t + 1]), fl.tensor(ks[:, :, t:t + 1]), fl.tensor(vs[:, :, t:t + 1]),
                           fl.tensor(k_cache), fl.tensor(v_cache))
        got = out.numpy(env={"pos": t, "k_len": t + 1})
        want = _sdpa64(qs[:, :, t:t + 1], ks[:, :, :t + 1], vs[:, :, :t + 1], d ** -0.5)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_earlier_readers_run_before_the_write() -> None:
    """A reader of the cache built before the write sees the old rows; the returned tensor the new ones."""
    cache = np.zeros((1, 4, 2), np.float32)
    tc = fl.tensor(cache)
    before = tc.sum()
    written = fl.cache_write(tc, np.ones((1, 1, 2), np.float32), 2)
    after = written.sum()
    b, a = fl.realize(before, after)
    assert b.item() == 0.0 and a.item() == 2.0
    np.testing.assert_array_equal(cache[0, 2], [1, 1])  # in place: the caller's array holds the rows


def test_bad_writes_are_clear_errors() -> None:
    cache = fl.tensor(np.zeros((1, 2, 8, 4), np.float32))
    with pytest.raises(fl.ParamError, match="offset 6 with 3 rows is outside the cache's 8 positions"):
        fl.cache_write(cache, np.zeros((1, 2, 3, 4), np.float32), 6)
    with pytest.raises(fl.ShapeError, match="must match the cache"):
        fl.cache_write(cache, np.zeros((1, 3, 1, 4), np.float32), 0)
    with pytest.raises(fl.ShapeError, match="do not fit"):
        fl.cache_write(cache, np.zeros((1, 2, 9, 4), np.float32), 0)
    with pytest.raises(fl.DTypeError, match="rows are f64, the cache is f32"):
        fl.cache_write(cache, np.zeros((1, 2, 1, 4)), 0)
    late = fl.cache_write(cache, np.zeros((1, 2, 1, 4), np.float32), fl.dyn("pos"))
    with pytest.raises(fl.IndexOutOfRange, match="offset 8 with 1 rows"):
        late.numpy(env={"pos": 8})
    with pytest.raises(fl.IndexOutOfRange, match="offset -1"):
        late.numpy(env={"pos": -1})
    frozen = np.zeros((1, 2, 8, 4), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(fl.KernelError, match="read-only"):
        fl.cache_write(fl.tensor(frozen), np.zeros((1, 2, 1, 4), np.float32), 0).numpy()


def test_the_write_is_not_differentiable() -> None:
    cache = fl.tensor(np.zeros((2, 3), np.float32))
    rows = fl.tensor(np.ones((1, 3), np.float32))
    with pytest.raises(fl.NotDifferentiable):
        fl.grad(fl.cache_write(cache, rows, 0, axis=0).sum(), [rows])
