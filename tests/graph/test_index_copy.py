"""index_copy, the destructive row scatter of a paged KV cache: against torch's `Tensor.index_copy_` in every
dtype, build and realize errors (nothing written on a bad index), ordering, gradients, a captured step
replayed natively with new slots each call followed by PagedAttn over the cache, and thread counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.cpu.prims import index_copy as kernel
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.runtime import pool
from fuel.testing.contract import fuel_threads
from fuel.testing.oracle import assert_close_rowwise
from fuel.testing.reference.attention_math import abs_attention64

DTYPES = [*FLOAT_DTYPES, DType.I64, DType.U8]
INDEX_DTYPES = [np.int64, np.uint32]


def torch_index_copy(target: np.ndarray, index: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """torch's `index_copy_(0, ...)` on a copy of target. bf16 goes through torch.bfloat16 on the same bits."""
    if target.dtype == DType.BF16.np:
        t = torch.from_numpy(target.view(np.int16).copy()).view(torch.bfloat16)
        r = torch.from_numpy(rows.view(np.int16).copy()).view(torch.bfloat16)
        return t.index_copy_(0, torch.from_numpy(index.astype(np.int64)), r).view(torch.int16).numpy().view(
            target.dtype)
    t, r = torch.from_numpy(target.copy()), torch.from_numpy(rows.copy())
    return t.index_copy_(0, torch.from_numpy(index.astype(np.int64)), r).numpy()


def _values(rng: np.random.Generator, shape: tuple[int, ...], dt: DType) -> np.ndarray:
    if dt.is_float:
        return rng.standard_normal(shape).astype(dt.np)
    return rng.integers(0, 200, shape).astype(dt.np)


@st.composite
def cases(draw: st.DrawFn) -> tuple[int, tuple[int, ...], np.ndarray, int]:
    """(target rows N, the rest of its shape, M distinct indices in any order, a seed)."""
    n = draw(st.integers(1, 40))
    rest = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=3)))
    m = draw(st.integers(0, n))
    order = draw(st.permutations(list(range(n))))
    return n, rest, np.array(order[:m]), draw(st.integers(0, 2**31))


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.value)
@settings(max_examples=40)
@given(case=cases(), index_dtype=st.sampled_from(INDEX_DTYPES))
def test_matches_torch_index_copy(dt: DType, case: tuple[int, tuple[int, ...], np.ndarray, int],
                                  index_dtype: type) -> None:
    n, rest, order, seed = case
    rng = np.random.default_rng(seed)
    target = _values(rng, (n, *rest), dt)
    rows = _values(rng, (order.size, *rest), dt)
    index: np.ndarray = order.astype(index_dtype)
    want = torch_index_copy(target, index, rows)
    saved_rows, saved_index = rows.copy(), index.copy()
    out = fl.index_copy(fl.tensor(target), index, rows).numpy()
    assert out.dtype == dt.np and out.tobytes() == want.tobytes()
    assert target.tobytes() == want.tobytes() and np.shares_memory(out, target)  # in place
    assert rows.tobytes() == saved_rows.tobytes() and np.array_equal(index, saved_index)


def test_a_strided_target_and_strided_rows_match_torch(rng: np.random.Generator) -> None:
    """A target viewed through a slice is written in place through NumPy, after the same checks."""
    base = rng.standard_normal((12, 3, 8)).astype(np.float32)
    target = base[::2, :, ::2]  # [6, 3, 4], strided
    rows = rng.standard_normal((3, 3, 8)).astype(np.float32)[:, :, 1::2]
    index = np.array([5, 0, 3])
    want = torch.from_numpy(target.copy()).index_copy_(0, torch.from_numpy(index), torch.from_numpy(rows.copy()))
    out = fl.index_copy(fl.tensor(target), index, rows).numpy()
    assert np.array_equal(out, want.numpy()) and np.array_equal(base[::2, :, ::2], want.numpy())
    with pytest.raises(fl.IndexOutOfRange, match=r"index\[1\] = 5 repeats index\[0\]"):
        fl.index_copy(fl.tensor(target), np.array([5, 5, 1]), rows).numpy()
    assert np.array_equal(target, want.numpy())


def test_shape_and_dtype_errors_name_both_values() -> None:
    target = fl.tensor(np.zeros((6, 3, 32), np.float32))
    with pytest.raises(fl.ShapeError, match=r"index_copy: rows are \[4, 3, 64\], target rows are \[3, 32\]"):
        fl.index_copy(target, np.arange(4), np.zeros((4, 3, 64), np.float32))
    with pytest.raises(fl.ShapeError, match=r"rows are \[3, 3, 32\], target rows are \[3, 32\] \(4 indices\)"):
        fl.index_copy(target, np.arange(4), np.zeros((3, 3, 32), np.float32))
    with pytest.raises(fl.DTypeError, match="index_copy: rows are f64, the target is f32"):
        fl.index_copy(target, np.arange(2), np.zeros((2, 3, 32)))
    with pytest.raises(fl.DTypeError, match="index_copy: indices must be u32 or i64, got f32"):
        fl.index_copy(target, np.arange(2, dtype=np.float32), np.zeros((2, 3, 32), np.float32))
    with pytest.raises(fl.ShapeError, match=r"index_copy: needs 1-D indices .* got indices \[2, 1\]"):
        fl.index_copy(target, np.zeros((2, 1), np.int64), np.zeros((2, 3, 32), np.float32))
    with pytest.raises(fl.ShapeError, match=r"a target \[\]"):
        fl.index_copy(fl.tensor(np.float32(0)), np.arange(1), np.zeros(1, np.float32))


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=lambda d: np.dtype(d).name)
def test_bad_indices_raise_at_realize_before_anything_is_written(index_dtype: type) -> None:
    target = np.arange(24, dtype=np.float32).reshape(6, 4)
    before = target.copy()
    rows = -np.ones((3, 4), np.float32)
    for index, message in (([0, 6, 1], r"index_copy: index\[1\] = 6 is outside the target's 6 rows \[0, 6\)"),
                           ([2, 4, 2], r"index_copy: index\[2\] = 2 repeats index\[0\]; a scatter with dupl")):
        with pytest.raises(fl.IndexOutOfRange, match=message):
            fl.index_copy(fl.tensor(target), np.array(index, index_dtype), rows).numpy()
        assert np.array_equal(target, before)
    with pytest.raises(fl.IndexOutOfRange, match=r"index\[0\] = -1 is outside"):
        fl.index_copy(fl.tensor(target), np.array([-1, 0, 1]), rows).numpy()
    assert np.array_equal(target, before)
    frozen = target.copy()
    frozen.flags.writeable = False
    with pytest.raises(fl.KernelError, match="index_copy: the target is read-only"):
        fl.index_copy(fl.tensor(frozen), np.arange(3), rows).numpy()


def test_earlier_readers_run_before_the_write() -> None:
    cache = np.zeros((4, 2), np.float32)
    tc = fl.tensor(cache)
    before = tc.sum()
    written = fl.index_copy(tc, np.array([2]), np.ones((1, 2), np.float32))
    after = written.sum()
    b, a = fl.realize(before, after)
    assert b.item() == 0.0 and a.item() == 2.0
    np.testing.assert_array_equal(cache[2], [1, 1])


def test_a_reader_built_before_and_realised_after_the_write_is_stale() -> None:
    cache = fl.tensor(np.zeros((4, 2), np.float32))
    peek = cache.sum()
    fl.realize(fl.index_copy(cache, np.array([1, 3]), np.ones((2, 2), np.float32)))
    with pytest.raises(fl.StaleInput, match="index_copy"):
        peek.item()
    assert cache.sum().item() == 4.0
    with pytest.raises(fl.StaleInput, match="both overwrite"):
        fl.realize(fl.index_copy(cache, np.array([0]), np.ones((1, 2), np.float32)),
                   fl.index_copy(cache, np.array([2]), np.ones((1, 2), np.float32)))


def test_the_write_is_not_differentiable() -> None:
    target = fl.tensor(np.zeros((3, 2), np.float32))
    rows = fl.tensor(np.ones((1, 2), np.float32))
    with pytest.raises(fl.NotDifferentiable, match="index_copy"):
        fl.grad(fl.index_copy(target, np.array([1]), rows).sum(), [rows])


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)
def test_bytes_do_not_depend_on_the_thread_count(dt: DType, rng: np.random.Generator) -> None:
    """512 rows of 128 values: enough work that two threads cut the write into several parts."""
    n, m, rest = 1024, 512, (2, 64)
    index = rng.permutation(n)[:m]
    rows = _values(rng, (m, *rest), dt)
    start = _values(rng, (n, *rest), dt)
    with fuel_threads(2):
        assert pool.parts_for(m * 128 * dt.itemsize * kernel.SECONDS_PER_BYTE, m) > 1
    got = []
    for threads in (1, 2):
        target = start.copy()
        with fuel_threads(threads):
            got.append(fl.index_copy(fl.tensor(target), index, rows).numpy().tobytes())
    assert got[0] == got[1] == torch_index_copy(start, index, rows).tobytes()


BS, BLOCKS, HKV, HQ, D = 4, 8, 2, 4, 16


def _torch_paged_step(kc: torch.Tensor, vc: torch.Tensor, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                      slots: np.ndarray, tables: list[list[int]], lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """torch in float64: index_copy_ the step's K/V rows into flat caches, then causal SDPA of each sequence's
    new queries over its pages (the last len(q rows) positions). Returns (output, Σ p·|v|)."""
    idx = torch.from_numpy(slots.astype(np.int64))
    kc.index_copy_(0, idx, torch.from_numpy(k.astype(np.float64)))
    vc.index_copy_(0, idx, torch.from_numpy(v.astype(np.float64)))
    sq = q.shape[2]
    outs, scales = [], []
    for b, (table, length) in enumerate(zip(tables, lens, strict=True)):
        pos = [table[t // BS] * BS + t % BS for t in range(length)]
        kk = kc[pos].permute(1, 0, 2)[None]  # [1, Hkv, L, D]
        vv = vc[pos].permute(1, 0, 2)[None]
        qb = torch.from_numpy(q[b:b + 1].astype(np.float64))
        mask = torch.arange(length)[None, :] <= torch.arange(sq)[:, None] + length - sq
        outs.append(torch.nn.functional.scaled_dot_product_attention(qb, kk, vv, attn_mask=mask, scale=D ** -0.5,
                                                                     enable_gqa=True).numpy())
        scales.append(abs_attention64(qb.numpy(), kk.numpy(), vv.numpy(), D ** -0.5, causal=True))
    return np.concatenate(outs), np.concatenate(scales)


def test_a_captured_step_writes_new_slots_each_call_then_paged_attn_reads_them(rng: np.random.Generator) -> None:
    """Two sequences decode one token per call into a shared paged cache: one capture, replayed natively,
    writes each call's slots (a tensor argument) before PagedAttn reads the reshaped cache in the same graph."""
    k_cache = np.zeros((BLOCKS * BS, HKV, D), np.float32)
    v_cache = np.zeros((BLOCKS * BS, HKV, D), np.float32)
    tables = [[5, 2, 7], [0, 6, 3]]  # each sequence's blocks, shared pool
    bt = np.array(tables, np.uint32)

    def step(q: fl.Tensor, k: fl.Tensor, v: fl.Tensor, slots: fl.Tensor, lens: fl.Tensor) -> fl.Tensor:
        kc = fl.index_copy(fl.tensor(k_cache), slots, k).reshape(BLOCKS, BS, HKV, D)
        vc = fl.index_copy(fl.tensor(v_cache), slots, v).reshape(BLOCKS, BS, HKV, D)
        return fl.ops.paged_attn(q, kc, vc, bt, lens, softmax_scale=D ** -0.5)

    f = fl.jit(step)
    tk, tv = torch.zeros((BLOCKS * BS, HKV, D), dtype=torch.float64), torch.zeros((BLOCKS * BS, HKV, D),
                                                                                  dtype=torch.float64)
    for t in range(10):
        lens = [t + 1, t + 1]
        slots = np.array([tables[b][t // BS] * BS + t % BS for b in range(2)], np.int64)
        q = rng.standard_normal((2, HQ, 1, D)).astype(np.float32)
        k, v = (rng.standard_normal((2, HKV, D)).astype(np.float32) for _ in range(2))
        got = f(q, k, v, slots, np.array(lens, np.uint32)).numpy()
        want, scale = _torch_paged_step(tk, tv, q, k, v, slots, tables, lens)
        assert_close_rowwise(got, want, DType.F32, scale=scale)
        np.testing.assert_array_equal(k_cache, tk.numpy().astype(np.float32))
        np.testing.assert_array_equal(v_cache, tv.numpy().astype(np.float32))
    assert f.captures == 1
    cap = f.capture_for(q, k, v, slots, np.array(lens, np.uint32))
    assert cap is not None and cap.native is not None
    writes = [j for j in cap.native.program.jobs if j.task == kernel._write.address]
    assert len(writes) == 2  # both caches' writes are native jobs

    # A bad slot in a replayed call raises before its cache is written; the capture goes on afterwards.
    before_k, before_v = k_cache.copy(), v_cache.copy()
    for bad, message in (([3, BLOCKS * BS], r"index\[1\] = 32 is outside"), ([9, 9], r"index\[1\] = 9 repeats")):
        with pytest.raises(fl.IndexOutOfRange, match=message):
            f(q, k, v, np.array(bad, np.int64), np.array(lens, np.uint32))
        assert np.array_equal(k_cache, before_k) and np.array_equal(v_cache, before_v)
    slots = np.array([1, 4], np.int64)
    f(q, k, v, slots, np.array(lens, np.uint32))
    assert np.array_equal(k_cache[slots], k) and np.array_equal(v_cache[slots], v)
    assert f.captures == 1
