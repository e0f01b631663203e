"""SelectiveScan's forward job: one task over (batch row, channel block) items whose bytes are the same at
any part count, against the float64 recurrence written out in NumPy; native replay posts the same job."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fuel.cpu.scans import selective_scan as ss
from fuel.dtype import DType
from fuel.graph.registry.selective_scan import SelectiveScanParams
from fuel.runtime import jobs, pool

PAIRS = [(np.dtype(np.float32),) * 2, (np.dtype(np.float64),) * 2, (np.dtype(np.uint16),) * 2,
         (np.dtype(np.float32), np.dtype(np.float64))]  # (inputs, outputs): bf16 bits, and f16's form
ROUNDING = {np.dtype(np.float32): 2.0**-24, np.dtype(np.float64): 2.0**-53, np.dtype(np.uint16): 2.0**-8}


def _as(v: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return v.astype(DType.BF16.np).view(np.uint16) if dtype == np.uint16 else v.astype(dtype)


def _wide(v: np.ndarray) -> np.ndarray:
    return v.view(DType.BF16.np).astype(np.float64) if v.dtype == np.uint16 else v.astype(np.float64)


def _recurrence(u: Any, delta: Any, a: Any, b: Any, c: Any, softplus: bool) -> tuple[np.ndarray, ...]:
    """float64: y, the last state, and their per-element scales (the recurrence on the terms' magnitudes)."""
    d = np.where(delta > 20, delta, np.log1p(np.exp(np.minimum(delta, 20)))) if softplus else delta
    h = np.zeros((u.shape[0], u.shape[2], a.shape[1]))
    habs = np.zeros_like(h)
    y, scale = np.zeros(u.shape), np.zeros(u.shape)
    for t in range(u.shape[1]):
        e = np.exp(d[:, t, :, None] * a)
        h = e * h + (d[:, t] * u[:, t])[..., None] * b[:, t, None, :]
        habs = e * habs + np.abs(d[:, t] * u[:, t])[..., None] * np.abs(b[:, t, None, :])
        y[:, t] = np.einsum("bdn,bn->bd", h, c[:, t])
        scale[:, t] = np.einsum("bdn,bn->bd", habs, np.abs(c[:, t]))
    return y, h, scale, habs


@settings(max_examples=30)
@given(st.integers(1, 2), st.integers(1, 9), st.integers(1, 150), st.integers(1, 5), st.booleans(),
       st.sampled_from(PAIRS), st.integers(0, 2**31))
def test_forward_job_matches_the_recurrence_at_every_part_count(nb: int, seq: int, dim: int, ns: int, sp: bool,
                                                                pair: Any, seed: int) -> None:
    din, dout = pair
    rng = np.random.default_rng(seed)
    raw = [rng.standard_normal((nb, seq, dim)), rng.standard_normal((nb, seq, dim)),
           -rng.uniform(0.1, 2.0, (dim, ns)), rng.standard_normal((nb, seq, ns)), rng.standard_normal((nb, seq, ns))]
    inputs = [_as(v, din) for v in raw]
    y, last = np.empty((nb, seq, dim), dout), np.empty((nb, dim, ns), dout)
    job = ss._forward_job(inputs, y, last, sp)
    assert job is not None
    got = set()
    for parts in (1, 2, 3, 7):
        y[...], last[...] = 0, 0
        pool.run_address(job.task, job.args, min(parts, job.most))
        got.add(y.tobytes() + last.tobytes())
    assert len(got) == 1
    want_y, want_last, scale, last_scale = _recurrence(*(_wide(v) for v in inputs), sp)
    unit = ROUNDING[dout]
    assert (np.abs(_wide(y) - want_y) <= unit * np.abs(want_y) + 1e-14 * scale).all()
    assert (np.abs(_wide(last) - want_last) <= unit * np.abs(want_last) + 1e-14 * last_scale).all()


def test_the_job_serves_f32_f64_and_bf16_and_replay_posts_it() -> None:
    shapes = [(1, 3, 5), (1, 3, 5), (5, 2), (1, 3, 2), (1, 3, 2)]
    params = SelectiveScanParams(True)
    for dt in (DType.F32, DType.F64, DType.BF16):
        inputs = [np.zeros(s, dt.np) for s in shapes]
        assert isinstance(ss.selective_scan_job(inputs, (np.zeros((1, 3, 5), dt.np), np.zeros((1, 5, 2), dt.np)),
                                                params), jobs.Job)
    halves = [np.zeros(s, np.float16) for s in shapes]
    assert ss.selective_scan_job(halves, (np.zeros((1, 3, 5), np.float16), np.zeros((1, 5, 2), np.float16)),
                                 params) is None
    y = np.zeros((2, 3, 5), np.float32)  # one array, not the pair (its first axis has two entries)
    assert ss.selective_scan_job([np.zeros(s, np.float32) for s in shapes], y, params) is None
    assert jobs.builder_of(ss.selective_scan) is ss.selective_scan_job
