"""FlashAttn's NumPy-step path (f64, the half types, f32 without a task sgemm) and the backward: their row
passes are jobs, and the part count the runtime picks never changes a byte."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import fuel as fl
from fuel.dtype import DType
from fuel.runtime import pool, threads
from tests.graph.registry.attention_oracle import bottom_right, torch_attention

DTYPES: dict[str, Any] = {"f32-steps": np.float32, "f64": np.float64, "bf16": DType.BF16.np}


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = fl.get_num_threads()
    fl.set_num_threads(2)
    try:
        yield
    finally:
        fl.set_num_threads(before)


def _inputs(dtype: np.dtype, b: int, hq: int, hkv: int, sq: int, sk: int, d: int) -> list[np.ndarray]:
    rng = np.random.default_rng(8)
    shapes = ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d))
    return [rng.standard_normal(s).astype(np.float32).astype(dtype) for s in shapes]


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize(("b", "hq", "hkv", "sq", "sk", "d"), [(2, 6, 2, 40, 600, 16), (1, 4, 1, 70, 70, 32)],
                         ids=["groups", "one-group"])
def test_forward_bytes_do_not_depend_on_the_part_count(two_threads: None, monkeypatch: pytest.MonkeyPatch,
                                                       name: str, b: int, hq: int, hkv: int, sq: int, sk: int,
                                                       d: int) -> None:
    """Parts 1, 2, 3 and 8 of every row pass and store give the same bytes, within f32's (f64's) rounding
    of torch float64 (bf16: one rounding on store), per element."""
    dtype = np.dtype(DTYPES[name])
    if name == "f32-steps":
        monkeypatch.setattr(threads, "blas_sgemm_address", lambda: 0)
    q, k, v = _inputs(dtype, b, hq, hkv, sq, sk, d)

    def once(parts: int) -> bytes:
        monkeypatch.setattr(pool, "parts_for", lambda seconds, most: min(parts, most))
        out = fl.ops.flash_attn(fl.tensor(q), fl.tensor(k), fl.tensor(v), causal=True, softcap=20.0)
        return np.asarray(fl.realize(out)[0]).tobytes()

    results = {once(parts) for parts in (1, 2, 3, 8)}
    assert len(results) == 1
    got = np.frombuffer(results.pop(), dtype).reshape(q.shape).astype(np.float64)
    mask, aq = bottom_right(sq, sk, causal=True)
    want, size = torch_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), d ** -0.5, mask,
                                 aq, softcap=20.0)
    eps = 2.0 ** -52 if dtype == np.float64 else 2.0 ** -23
    rounding = 2.0 ** -8 if name == "bf16" else 0.0
    assert (np.abs(got - want) <= 64 * eps * size + rounding * np.abs(want) + 1e-300).all()


@pytest.mark.parametrize("name", ["f64", "f32"])
def test_backward_bytes_do_not_depend_on_the_part_count(two_threads: None, monkeypatch: pytest.MonkeyPatch,
                                                        name: str) -> None:
    """dQ, dK and dV at parts 1, 2, 3 and 8 of the delta and gradient row passes: the same bytes, within
    rounding of torch float64 autograd, per row of each gradient."""
    dtype = np.dtype(np.float64 if name == "f64" else np.float32)
    q, k, v = _inputs(dtype, 2, 4, 2, 150, 150, 16)
    do = np.random.default_rng(9).standard_normal(q.shape).astype(dtype)

    def once(parts: int) -> bytes:
        monkeypatch.setattr(pool, "parts_for", lambda seconds, most: min(parts, most))
        tq, tk, tv = fl.tensor(q), fl.tensor(k), fl.tensor(v)
        out = fl.ops.flash_attn(tq, tk, tv, causal=True)
        grads = fl.grad(out, [tq, tk, tv], grad_out=fl.tensor(do))
        fl.realize(*grads)
        return b"".join(np.asarray(g).tobytes() for g in grads)

    results = {once(parts) for parts in (1, 2, 3, 8)}
    assert len(results) == 1
    flat = np.frombuffer(results.pop(), dtype)
    got = np.split(flat, np.cumsum([q.size, k.size]))
    tq, tk, tv = (torch.from_numpy(x.astype(np.float64)).requires_grad_() for x in (q, k, v))
    kr, vr = tk.repeat_interleave(2, 1), tv.repeat_interleave(2, 1)
    out = torch.nn.functional.scaled_dot_product_attention(tq, kr, vr, is_causal=True)
    out.backward(torch.from_numpy(do.astype(np.float64)))
    eps = 2.0 ** -52 if dtype == np.float64 else 2.0 ** -23
    for g, t, x in zip(got, (tq, tk, tv), (q, k, v), strict=True):
        assert t.grad is not None
        want = t.grad.numpy()
        # per row: the gradient's own size, and the input row it scales (do, q, k, v are all of unit size)
        size = np.abs(want).max(-1, keepdims=True) + np.abs(x).max(-1, keepdims=True)
        assert (np.abs(g.reshape(x.shape) - want) <= 4096 * eps * size).all()
