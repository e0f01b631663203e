"""SsdChunkScan's pool jobs: the forward task over (batch, head, P-block) units and the gradient's task over
(batch, head) units write the same bytes at any part count, and match a float64 oracle (the sequential
recurrence written out in NumPy; torch autograd through it for the gradient)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuel.cpu.scans import ssd_chunk_scan as ssd
from fuel.dtype import DType
from fuel.graph.registry.ssd_chunk_scan import SsdChunkScanParams
from fuel.runtime import jobs, pool

PAIRS = [(np.dtype(np.float32),) * 2, (np.dtype(np.float64),) * 2, (DType.BF16.np,) * 2,
         (np.dtype(np.float32), np.dtype(np.float64))]  # (inputs, outputs); the last is f16's form
ROUNDING = {np.dtype(np.float32): 2.0**-24, np.dtype(np.float64): 2.0**-53, DType.BF16.np: 2.0**-8}
SHAPES = st.tuples(st.integers(1, 2), st.integers(1, 9), st.integers(1, 3), st.integers(1, 140), st.integers(1, 6))


def _inputs(rng: np.random.Generator, nb: int, length: int, nh: int, p: int, n: int) -> list[np.ndarray]:
    return [rng.standard_normal((nb, length, nh, p)), rng.uniform(0.01, 1.0, (nb, length, nh)),
            -rng.uniform(0.1, 2.0, nh), rng.standard_normal((nb, length, nh, n)),
            rng.standard_normal((nb, length, nh, n))]


def _recurrence(x: Any, dt: Any, a: Any, b: Any, c: Any) -> tuple[np.ndarray, ...]:
    """float64: y, the last state, and their per-element scales (the recurrence on the terms' magnitudes)."""
    nb, length, nh, p = x.shape
    h = np.zeros((nb, nh, p, b.shape[3]))
    habs = np.zeros_like(h)
    y, scale = np.zeros(x.shape), np.zeros(x.shape)
    for t in range(length):
        e = np.exp(dt[:, t] * a)[..., None, None]
        u = dt[:, t, :, None] * x[:, t]
        h = e * h + u[..., None] * b[:, t, :, None, :]
        habs = e * habs + np.abs(u)[..., None] * np.abs(b[:, t, :, None, :])
        y[:, t] = np.einsum("bhpn,bhn->bhp", h, c[:, t])
        scale[:, t] = np.einsum("bhpn,bhn->bhp", habs, np.abs(c[:, t]))
    return y, h, scale, habs


@settings(max_examples=30)
@given(SHAPES, st.sampled_from(PAIRS), st.integers(0, 2**31))
def test_forward_job_matches_the_recurrence_at_every_part_count(shape: tuple[int, ...], pair: Any, seed: int) -> None:
    din, dout = pair
    inputs = [v.astype(din) for v in _inputs(np.random.default_rng(seed), *shape)]
    y = np.empty(inputs[0].shape, dout)
    last = np.empty((shape[0], shape[2], shape[3], shape[4]), dout)
    job = ssd._forward_job(inputs, y, last)
    assert job is not None
    got = set()
    for parts in (1, 2, 3, 7):
        y[...], last[...] = 0, 0
        pool.run_address(job.task, job.args, min(parts, job.most))
        got.add(y.tobytes() + last.tobytes())
    assert len(got) == 1
    want_y, want_last, scale, last_scale = _recurrence(*(v.astype(np.float64) for v in inputs))
    unit = ROUNDING[dout]
    assert (np.abs(y.astype(np.float64) - want_y) <= unit * np.abs(want_y) + 1e-13 * scale).all()
    assert (np.abs(last.astype(np.float64) - want_last) <= unit * np.abs(want_last) + 1e-13 * last_scale).all()


def test_forward_job_refuses_what_its_tasks_cannot_read() -> None:
    inputs = _inputs(np.random.default_rng(0), 1, 3, 2, 4, 2)
    y, last = np.empty((1, 3, 2, 4)), np.empty((1, 2, 4, 2))
    assert ssd._forward_job([inputs[0][:, :, ::2], *inputs[1:]], y[:, :, ::2], last) is None
    assert ssd._forward_job([v.astype(np.float16) for v in inputs], y, last) is None
    assert ssd.ssd_chunk_scan_job(inputs, (y, np.empty((1, 2, 4, 0))), SsdChunkScanParams(1)) is None
    assert ssd.ssd_chunk_scan_job(inputs, y, SsdChunkScanParams(1)) is None  # one array, not the pair
    assert jobs.builder_of(ssd.ssd_chunk_scan_f32) is ssd.ssd_chunk_scan_job


@pytest.mark.parametrize("shape", [(2, 70, 3, 5, 4), (1, 130, 1, 3, 2)])
def test_gradient_matches_torch_autograd_at_every_part_count(monkeypatch: pytest.MonkeyPatch,
                                                             shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    inputs = _inputs(rng, *shape)
    dy = rng.standard_normal(inputs[0].shape)
    dlast = rng.standard_normal((shape[0], shape[2], shape[3], shape[4]))
    got = set()
    for parts in (1, 2, 3, 7):
        monkeypatch.setattr(pool, "parts_for", lambda seconds, most, p=parts: min(p, most))
        grads = ssd.ssd_chunk_scan_grad([*inputs, dy, dlast], SsdChunkScanParams(8))
        got.add(b"".join(g.tobytes() for g in grads))
    assert len(got) == 1
    ts = [torch.tensor(v, requires_grad=True) for v in inputs]
    x, dt, a, b, c = ts
    h = torch.zeros(shape[0], shape[2], shape[3], shape[4], dtype=torch.float64)
    ys = []
    for t in range(shape[1]):
        h = torch.exp(dt[:, t] * a)[..., None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, c[:, t]))
    loss = (torch.stack(ys, 1) * torch.from_numpy(dy)).sum() + (h * torch.from_numpy(dlast)).sum()
    want = torch.autograd.grad(loss, ts)
    for g, w in zip(grads, want, strict=True):
        w64 = w.numpy()
        tol = 1e-10 * np.maximum(1.0, np.abs(w64).max(axis=-1, keepdims=True) if w64.ndim else 1.0)
        assert (np.abs(g - w64) <= tol).all()
