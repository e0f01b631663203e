"""PowIBackward's job: one task over the elements, so any cut of them gives the same bytes; the values
agree with torch's autograd of x**exp in float64, and native replay posts the eager kernel's job."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuel.cpu import powi_backward
from fuel.dtype import DType
from fuel.graph.registry.powi_backward import PowIBackwardParams
from fuel.runtime import jobs, pool
from fuel.testing.oracle import assert_close_rowwise


def torch_powi_grad(x: np.ndarray, g: np.ndarray, exp: int) -> np.ndarray:
    x64 = torch.tensor(x.astype(np.float64), requires_grad=True)
    (dx,) = torch.autograd.grad(x64**exp, [x64], torch.tensor(g.astype(np.float64)))
    return dx.numpy()


@settings(max_examples=40, deadline=None)
@given(dt=st.sampled_from([DType.F32, DType.F64]), n=st.integers(1, 300), exp=st.integers(-6, 7),
       seed=st.integers(0, 2**32 - 1))
def test_any_cut_gives_the_same_bytes_and_matches_torch(dt: DType, n: int, exp: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.uniform(0.5, 2.0, n) * rng.choice([-1, 1], n)).astype(dt.np)
    g = rng.standard_normal(n).astype(dt.np)
    outs = []
    for parts in (1, 2, 7, n + 3):
        out = np.full(n, np.nan, dt.np)
        job = powi_backward.powi_backward_job([x, g], out, PowIBackwardParams(exp))
        assert isinstance(job, jobs.Job)
        pool.run_address(job.task, job.args, parts)
        outs.append(out)
    for out in outs[1:]:
        np.testing.assert_array_equal(out.view(np.uint8), outs[0].view(np.uint8))
    want = torch_powi_grad(x, g, exp)
    assert_close_rowwise(outs[0], want, dt, scale=np.abs(want))


def test_exp_zero_writes_zeros_in_the_job() -> None:
    x = np.array([0.0, np.inf, np.nan, 2.0], np.float32)
    out = np.full(4, np.nan, np.float32)
    powi_backward.powi_backward_kernel([x, np.ones(4, np.float32)], out, PowIBackwardParams(0))
    np.testing.assert_array_equal(out, torch_powi_grad(np.array([1.0, 1, 1, 2]), np.ones(4), 0).astype(np.float32))


def test_native_replay_posts_the_eager_job_and_the_builder_refuses_other_arrays() -> None:
    assert jobs.builder_of(powi_backward.powi_backward_kernel) is powi_backward.powi_backward_job
    p = PowIBackwardParams(3)
    x = np.ones((4, 6), np.float32)
    assert powi_backward.powi_backward_job([x, x], np.empty((0, 6), np.float32), p) == ()
    assert powi_backward.powi_backward_job([x, np.asfortranarray(x)], np.empty((4, 6), np.float32), p) is None
    assert powi_backward.powi_backward_job([x, x], np.empty((4, 6), np.float64), p) is None
    half = x.astype(np.float16)
    assert powi_backward.powi_backward_job([half, half], np.empty((4, 6), np.float16), p) is None


def test_a_zero_base_with_a_negative_power_divides_as_ieee_does() -> None:
    """1/0 inside the task is ±inf, as torch gives: never an exception the task could only swallow."""
    x = np.array([0.0, -0.0, 2.0], np.float32)
    g = np.array([1.0, 1.0, 1.0], np.float32)
    out = np.full(3, np.nan, np.float32)
    powi_backward.powi_backward_kernel([x, g], out, PowIBackwardParams(-2))
    np.testing.assert_array_equal(out, torch_powi_grad(x, g, -2).astype(np.float32))
