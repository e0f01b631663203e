"""The row kernels' jobs (softmax, RmsNorm, LayerNorm and their backwards, all built by `row_tasks.rows_job`):
each computes a row alone, so any cut of the rows into parts gives the very same bytes, and they agree
with torch in float64 (autograd for the norms' backwards, the written-out softmax Jacobian product for
softmax's). The same job is what native replay posts (`jobs.builder_of`), and the builder refuses what its
tasks do not read (f16, mixed dtypes, strided arrays) and gives no job for an empty output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuel.cpu.norms import layer_norm_last_dim, rms_norm_last_dim, softmax_last_dim
from fuel.dtype import DType
from fuel.graph.registry.layer_norm_last_dim import LayerNormLastDimParams
from fuel.graph.registry.rms_norm_last_dim import RmsNormLastDimParams
from fuel.runtime import jobs, pool
from fuel.testing.oracle import assert_close_rowwise
from tests.torch_rows import EPS, T, grad_of, ln, rms, softmax_backward

# (job builder, params, inputs, torch float64 oracle, is a backward)
CASES: dict[str, tuple[Any, Any, int, Callable[..., T], bool]] = {
    "softmax": (softmax_last_dim.softmax_job, None, 1, lambda x: torch.softmax(x, -1), False),
    "softmax_backward": (softmax_last_dim.softmax_backward_job, None, 2, softmax_backward, True),
    "rms_norm": (rms_norm_last_dim.rms_norm_job, RmsNormLastDimParams(EPS), 1, rms, False),
    "rms_norm_backward": (rms_norm_last_dim.rms_norm_backward_job, RmsNormLastDimParams(EPS), 2, grad_of(rms),
                          True),
    "layer_norm": (layer_norm_last_dim.layer_norm_job, LayerNormLastDimParams(EPS), 1, ln, False),
    "layer_norm_backward": (layer_norm_last_dim.layer_norm_backward_job, LayerNormLastDimParams(EPS), 2,
                            grad_of(ln), True),
}
DTYPES = [DType.F32, DType.F64, DType.BF16]


def _inputs(name: str, arity: int, shape: tuple[int, ...], dt: DType, rng: np.random.Generator) -> list[np.ndarray]:
    xs = [rng.standard_normal(shape) * 3 + 0.5 for _ in range(arity)]
    if name == "softmax_backward":  # y is a softmax output
        xs[0] = torch.softmax(torch.from_numpy(xs[0]), -1).numpy()
    return [x.astype(dt.np) for x in xs]


def _run(job: jobs.Job, parts: int) -> None:
    pool.run_address(job.task, job.args, parts)


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(sorted(CASES)), dt=st.sampled_from(DTYPES), rows=st.integers(1, 12),
       cols=st.integers(1, 70), seed=st.integers(0, 2**32 - 1))
def test_any_cut_of_the_rows_gives_the_same_bytes_and_matches_torch(name: str, dt: DType, rows: int, cols: int,
                                                                    seed: int) -> None:
    build, params, arity, oracle, backward = CASES[name]
    xs = _inputs(name, arity, (rows, cols), dt, np.random.default_rng(seed))
    outs = []
    for parts in (1, 2, 3, rows + 2):  # more parts than rows: some parts have none
        out = np.full((rows, cols), np.nan, dt.np)
        job = build(xs, out, params)
        assert isinstance(job, jobs.Job)
        _run(job, parts)
        outs.append(out)
    for out in outs[1:]:
        np.testing.assert_array_equal(out.view(np.uint8), outs[0].view(np.uint8))
    want = oracle(*[torch.from_numpy(x.astype(np.float64)) for x in xs]).detach().numpy()
    if name == "softmax_backward":  # the Jacobian product's terms can cancel: scale per element
        y, g = (x.astype(np.float64) for x in xs)
        scale = np.abs(y) * (np.abs(g) + np.abs(g * y).sum(-1, keepdims=True))
        assert_close_rowwise(outs[0], want, dt, backward=True, scale=scale)
    else:
        assert_close_rowwise(outs[0], want, dt, backward=backward)


@pytest.mark.parametrize("name", sorted(CASES))
def test_native_replay_posts_the_eager_kernels_job(name: str) -> None:
    build = CASES[name][0]
    kernel = {softmax_last_dim.softmax_job: softmax_last_dim.softmax_kernel,
              softmax_last_dim.softmax_backward_job: softmax_last_dim.softmax_backward_kernel,
              rms_norm_last_dim.rms_norm_job: rms_norm_last_dim.rms_norm_kernel,
              rms_norm_last_dim.rms_norm_backward_job: rms_norm_last_dim.rms_norm_backward_kernel,
              layer_norm_last_dim.layer_norm_job: layer_norm_last_dim.layer_norm_kernel,
              layer_norm_last_dim.layer_norm_backward_job: layer_norm_last_dim.layer_norm_backward_kernel}[build]
    assert jobs.builder_of(kernel) is build


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_builder_refuses_what_its_tasks_do_not_read(name: str) -> None:
    build, params, arity, _, _ = CASES[name]
    rng = np.random.default_rng(0)
    x = _inputs(name, arity, (4, 6), DType.F32, rng)
    assert build(x, np.empty((0, 6), np.float32), params) == ()
    assert build([a.astype(np.float16) for a in x], np.empty((4, 6), np.float16), params) is None
    assert build([a.astype(np.float64) for a in x], np.empty((4, 6), np.float32), params) is None
    strided = [np.asfortranarray(a) for a in x]
    assert build(strided, np.empty((4, 6), np.float32), params) is None
    assert build(x, np.empty((6, 4), np.float32).T, params) is None
    assert build(x, np.empty((4, 6), ml_dtypes.bfloat16), params) is None
