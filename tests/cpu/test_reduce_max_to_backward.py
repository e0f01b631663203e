"""ReduceMaxToBackward's jobs: a row task (groups along the last axes) and a column task (groups along a
middle run of axes, items of COLUMN_BLOCK columns), so any cut of the groups gives the same bytes; each
value is torch.amax's autograd in float64 (g shared by the ties), correctly rounded once. Native replay
posts the job where the groups are a run of axes; elsewhere (a transposing copy) it has none."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuel.cpu import reduce_max_to_backward as rmb
from fuel.dtype import DType
from fuel.graph.registry.reduce_max_to_backward import ReduceMaxToBackwardParams
from fuel.graph.shapes import reduce_to_axes
from fuel.runtime import jobs, pool


def torch_amax_grad(x: np.ndarray, g: np.ndarray) -> np.ndarray:
    axes = reduce_to_axes("amax", x.shape, g.shape)
    keep = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    if not axes:  # torch.amax(dim=()) would reduce every axis: nothing reduced is the identity
        return np.broadcast_to(g.astype(np.float64).reshape(keep), x.shape).copy()
    x64 = torch.tensor(x.astype(np.float64), requires_grad=True)
    (dx,) = torch.autograd.grad(torch.amax(x64, dim=axes, keepdim=True), [x64],
                                torch.tensor(g.astype(np.float64).reshape(keep)))
    return dx.numpy()


@settings(max_examples=40, deadline=None)
@given(dt=st.sampled_from([DType.F32, DType.F64]), a=st.integers(1, 5), r=st.integers(1, 9),
       c=st.sampled_from([1, 3, 256, 300, 600]), seed=st.integers(0, 2**32 - 1))
def test_any_cut_gives_the_same_bytes_and_matches_torch(dt: DType, a: int, r: int, c: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, (a, r, c)).astype(dt.np)  # small integers: many ties
    g = rng.standard_normal((a, 1, c)).astype(dt.np)
    params = ReduceMaxToBackwardParams()
    outs = []
    for parts in (1, 2, 5, a * 3 + 2):
        out = np.full(x.shape, np.nan, dt.np)
        job = rmb.reduce_max_to_backward_job([x, g], out, params)
        assert isinstance(job, jobs.Job)
        pool.run_address(job.task, job.args, parts)
        outs.append(out)
    for out in outs[1:]:
        np.testing.assert_array_equal(out.view(np.uint8), outs[0].view(np.uint8))
    np.testing.assert_array_equal(outs[0], torch_amax_grad(x, g).astype(dt.np))


def test_native_replay_posts_the_job_where_the_groups_are_a_run() -> None:
    assert jobs.builder_of(rmb.reduce_max_to_backward_native) is rmb.reduce_max_to_backward_job
    x = np.arange(60, dtype=np.float32).reshape(4, 5, 3)
    apart = np.ones((1, 5, 1), np.float32)  # axes 0 and 2 reduced, apart from each other
    assert rmb.reduce_max_to_backward_job([x, apart], np.empty_like(x),
                                          ReduceMaxToBackwardParams()) is None
    out = np.empty_like(x)
    rmb.reduce_max_to_backward_native([x, apart], out, ReduceMaxToBackwardParams())
    np.testing.assert_array_equal(out, torch_amax_grad(x, apart).astype(np.float32))


@pytest.mark.parametrize("dtype", [np.float16, np.int32])
def test_the_builder_refuses_other_dtypes(dtype: type) -> None:
    x: np.ndarray = np.ones((4, 6), dtype)
    g: np.ndarray = np.ones((4, 1), dtype)
    assert rmb.reduce_max_to_backward_job([x, g], np.empty_like(x), ReduceMaxToBackwardParams()) is None
