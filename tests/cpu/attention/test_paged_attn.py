"""PagedAttn's job: its tasks are fixed by the call's shape, and the part count the runtime picks never
changes a byte."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import fuel as fl
from fuel.cpu.attention import paged_attn
from fuel.dtype import DType
from fuel.runtime import pool
from fuel.testing.reference.paged_attn import paged_inputs
from tests.graph.registry.attention_oracle import torch_attention


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = fl.get_num_threads()
    fl.set_num_threads(2)
    try:
        yield
    finally:
        fl.set_num_threads(before)


@pytest.mark.parametrize(("hkv", "rows", "longest", "tasks"), [(8, 4, 100, 1), (3, 1, 64, 2), (16, 8, 40, 3),
                                                               (4, 2, 5000, 1), (1, 1, 10, 1)])
def test_the_head_split_is_fixed_by_the_shape(hkv: int, rows: int, longest: int, tasks: int) -> None:
    """KV heads per task: the same at any thread count (a job is built once and may run at another)."""
    before = fl.get_num_threads()
    try:
        got = set()
        for n in (1, 2):
            fl.set_num_threads(n)
            got.add(paged_attn.head_chunk(hkv, rows, longest, tasks))
    finally:
        fl.set_num_threads(before)
    assert len(got) == 1
    hc = got.pop()
    assert 1 <= hc <= hkv and hc * rows * longest <= max(paged_attn.SCORE_BUFFER, rows * longest)


def _gathered(kc: np.ndarray, bt: np.ndarray, n: int, b: int, bs: int) -> np.ndarray:
    """Sequence b's first n cached rows `[Hkv, n, D]`, read through the table with NumPy."""
    rows = [kc[bt[b, t // bs], t % bs] for t in range(n)]
    return np.stack(rows, 1) if rows else np.zeros((kc.shape[2], 0, kc.shape[3]), kc.dtype)


@pytest.mark.parametrize("dt", [DType.F32, DType.F64, DType.BF16], ids=lambda d: d.name)
def test_bytes_do_not_depend_on_the_part_count(two_threads: None, monkeypatch: pytest.MonkeyPatch,
                                               dt: DType) -> None:
    """Parts 1, 2, 3 and 8 give the same bytes, which agree with torch float64 over each sequence's live keys."""
    inputs, params = paged_inputs(np.random.default_rng(4), dt, 2, 8, 2, 3, 32, 4, (13, 6), alibi=True)
    q, kc, vc, bt, cl, slopes = inputs

    def once(parts: int) -> bytes:
        monkeypatch.setattr(pool, "parts_for", lambda seconds, most: min(parts, most))
        out = np.zeros(q.shape, q.dtype)
        paged_attn.paged_attention(list(inputs), out, params)
        return out.tobytes()

    results = {once(parts) for parts in (1, 2, 3, 8)}
    assert len(results) == 1
    got = np.frombuffer(results.pop(), q.dtype).reshape(q.shape).astype(np.float64)
    eps = {DType.F32: 2.0 ** -23, DType.F64: 2.0 ** -52, DType.BF16: 2.0 ** -8}[dt]
    for b in range(q.shape[0]):
        n = int(cl[b])
        k, v = (_gathered(c, bt, n, b, params.block_size)[None] for c in (kc, vc))
        aq = np.arange(q.shape[2]) + n - q.shape[2]
        mask = np.arange(n)[None, :] <= aq[:, None]
        want, size = torch_attention(q[b:b + 1].astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                     params.softmax_scale, torch.from_numpy(mask), torch.from_numpy(aq),
                                     alibi=np.asarray(slopes, np.float64))
        assert (np.abs(got[b:b + 1] - want) <= 64 * eps * size + 1e-300).all()
