"""CausalConv1d's job: one task over (batch, channel) rows whose bytes are the same at any part count, and
which matches torch's float64 depthwise conv1d (+ SiLU) per element; native replay posts the same job."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from fuel.cpu.conv import causal_conv1d as cc
from fuel.dtype import DType
from fuel.graph.registry.causal_conv1d import CausalConv1dParams
from fuel.runtime import jobs, pool

DTYPES = [np.dtype(np.float32), np.dtype(np.float64), DType.BF16.np]
# (the output's rounding, the compute type's unit roundoff): bf16 is computed in f32
UNITS = {np.dtype(np.float32): (2.0**-24, 2.0**-24), np.dtype(np.float64): (2.0**-53, 2.0**-53),
         DType.BF16.np: (2.0**-8, 2.0**-24)}


def _oracle(x: np.ndarray, w: np.ndarray, b: np.ndarray, silu: bool) -> tuple[np.ndarray, np.ndarray]:
    """torch float64: the output and the per-element scale |b| + Σ_k |w_k|·|x_{t+k}|."""
    t = [torch.from_numpy(v.astype(np.float64)) for v in (x, w, b)]
    c = w.shape[0]
    y = F.conv1d(t[0], t[1], t[2], groups=c)
    scale = F.conv1d(t[0].abs(), t[1].abs(), t[2].abs(), groups=c)
    return (F.silu(y) if silu else y).numpy(), scale.numpy()


@given(st.integers(1, 3), st.integers(1, 70), st.integers(1, 40), st.integers(1, 5), st.booleans(),
       st.sampled_from(DTYPES), st.integers(0, 2**31))
def test_job_matches_torch_and_its_bytes_do_not_depend_on_the_part_count(
        b: int, c: int, length: int, k: int, silu: bool, dtype: np.dtype, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, c, length + k - 1)).astype(dtype)
    w = rng.standard_normal((c, 1, k)).astype(dtype)
    bias = rng.standard_normal(c).astype(dtype)
    out = np.empty((b, c, length), dtype)
    job = cc.causal_conv1d_job([x, w, bias], out, CausalConv1dParams(silu))
    assert isinstance(job, jobs.Job)
    got = set()
    for parts in (1, 2, 3, 7):
        out[...] = 0
        pool.run_address(job.task, job.args, min(parts, job.most))
        got.add(out.tobytes())
    assert len(got) == 1
    want, scale = _oracle(x, w, bias, silu)
    # one rounding of the output, a few of SiLU's, and k + 1 roundings of the taps' sum (SiLU's slope <= 1.1)
    rounding, unit = UNITS[dtype]
    err = np.abs(out.astype(np.float64) - want)
    assert (err <= (rounding + 8 * unit) * np.abs(want) + 1.1 * (k + 1) * unit * scale).all()


def test_job_refuses_what_the_task_cannot_read_and_replay_posts_it() -> None:
    x = np.zeros((1, 4, 6), np.float32)
    w, bias = np.zeros((4, 1, 3), np.float32), np.zeros(4, np.float32)
    params = CausalConv1dParams(True)
    assert cc.causal_conv1d_job([x[:, ::2], w[::2], bias[::2]], np.zeros((1, 2, 4), np.float32), params) is None
    assert cc.causal_conv1d_job([x, w, bias], np.zeros((1, 4, 0), np.float32), params) == ()
    assert jobs.builder_of(cc.causal_conv1d_kernel) is cc.causal_conv1d_job
