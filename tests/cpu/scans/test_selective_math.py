"""selective_math's f64 exp and softplus against torch's float64 exp, softplus and sigmoid."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit

from fuel.cpu.scans.selective_math import exp64, softplus, softplus_slope


@njit(error_model="numpy")
def _apply(x: Any, out: Any, which: int) -> None:
    for i in range(x.shape[0]):
        out[i] = exp64(x[i]) if which == 0 else softplus(x[i]) if which == 1 else softplus_slope(x[i])


def _run(x: np.ndarray, which: int) -> np.ndarray:
    out = np.empty_like(x)
    _apply(x, out, which)
    return out


def test_exp_softplus_and_slope_against_torch() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-800, 800, 20000), rng.uniform(-30, 30, 20000), [0.0, -0.0, 20.0, 20.5]])
    t = torch.from_numpy(x)
    want = torch.exp(t).numpy()
    got = _run(x, 0)
    # within a few ulp; 0 below -708 (an absolute error under 4e-308) and inf above 709.43 (the contract)
    inside = x <= 709.43
    assert (np.abs(got[inside] - want[inside]) <= 4 * np.spacing(want[inside]) + 4e-308).all()
    assert np.isposinf(got[~inside]).all()
    for which, ref in ((1, F.softplus(t)), (2, torch.where(t > 20, 1.0, torch.sigmoid(t)))):
        w = ref.numpy()
        assert (np.abs(_run(x, which) - w) <= 4 * np.spacing(np.abs(w)) + 1e-300).all()
    assert np.isnan(_run(np.array([np.nan]), 0)).all()
