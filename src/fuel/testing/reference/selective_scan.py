"""Reference for SelectiveScan (19): the Mamba-1 recurrence in float64 NumPy, one step at a time.

    d = softplus(delta) (log1p(exp(x)), x > 20 gives x) if delta_softplus else delta
    h_t = exp(d_t·a)·h_{t−1} + d_t·u_t·b_t,  h_{−1} = 0,   y_t = Σ_n h_t·c_t,   last_state = h_{L−1}

The local scale of an element is the same recurrence over |d·u|, |b| and |c| (the decays exp(d·a) are
positive): the sum of the |terms| each state and each output add up.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.graph.registry.selective_scan import SelectiveScanParams
from fuel.testing.reference import Case, randn, register


def softplus64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _scan(u: np.ndarray, d: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray,
          absolute: bool = False) -> tuple[np.ndarray, np.ndarray]:
    nb, seq, dim = u.shape
    h = np.zeros((nb, dim, a.shape[1]))
    y = np.zeros((nb, seq, dim))
    with np.errstate(over="ignore", invalid="ignore"):
        for t in range(seq):
            dt = d[:, t, :, None]
            du = dt * u[:, t, :, None]
            if absolute:
                du = np.abs(du)
            h = np.exp(dt * a[None]) * h + du * b[:, t, None, :]
            y[:, t] = (h * c[:, t, None, :]).sum(-1)
    return y, h


def selective_scan64(xs: list[np.ndarray], p: Any) -> tuple[np.ndarray, np.ndarray]:
    u, delta, a, b, c = xs
    d = softplus64(delta) if p.delta_softplus else delta
    return _scan(u, d, a, b, c)


def selective_scan_scale(xs: list[np.ndarray], p: Any, ref: Any) -> tuple[np.ndarray, np.ndarray]:
    u, delta, a, b, c = xs
    d = softplus64(delta) if p.delta_softplus else delta
    return _scan(u, d, a, np.abs(b), np.abs(c), absolute=True)


def mamba_inputs(rng: np.random.Generator, shape: tuple[int, int, int, int], dt: DType,
                 softplus: bool) -> tuple[np.ndarray, ...]:
    """Mamba-1's initialisation: a = −(1..N) per channel, dt log-uniform in [1e-3, 1e-1] (given as its
    inverse softplus when the op applies softplus), u, b, c standard normal."""
    nb, seq, dim, ns = shape
    step = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), (nb, seq, dim)))
    delta = step + np.log(-np.expm1(-step)) if softplus else step
    a = -np.broadcast_to(np.arange(1, ns + 1, dtype=np.float64), (dim, ns))
    return (randn(rng, (nb, seq, dim), dt), delta.astype(dt.np), a.astype(dt.np),
            randn(rng, (nb, seq, ns), dt), randn(rng, (nb, seq, ns), dt))


# (B, L, dim, N): Mamba-like rows, decode (L = 1), a size-1 dim, more channels than one kernel block
# (64) with a tail, and empty sequence, batch, channels and state.
SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (2, 12, 5, 4), (1, 1, 3, 2), (2, 8, 1, 1), (1, 16, 70, 3), (1, 0, 3, 2), (0, 4, 3, 2), (2, 5, 0, 3),
    (1, 3, 2, 0),
)


def _cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    dt = dtypes[0]
    out = []
    for softplus in (False, True):
        p = SelectiveScanParams(softplus)
        for shape in SHAPES:
            out.append(Case(f"{list(shape)} softplus={softplus}", mamba_inputs(rng, shape, dt, softplus), p))
        # Without softplus: any a and delta of either sign (growing states too); with it: delta on both
        # sides of the threshold 20 and a negative (a positive one would overflow f32 within the case).
        nb, seq, dim, ns = 2, 10, 6, 5
        a = randn(rng, (dim, ns), dt)
        wide = (randn(rng, (nb, seq, dim), dt, 3.0), randn(rng, (nb, seq, dim), dt, 12.0 if softplus else 0.3),
                -np.abs(a) if softplus else a, randn(rng, (nb, seq, ns), dt), randn(rng, (nb, seq, ns), dt))
        out.append(Case(f"wide range softplus={softplus}", wide, p))
    return out


register("SelectiveScan", selective_scan64, _cases, selective_scan_scale)
