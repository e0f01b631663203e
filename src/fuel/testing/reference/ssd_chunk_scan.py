"""Reference for SsdChunkScan (20): the float64 sequential recurrence, one step at a time.

`h ← exp(dt·a_h)·h + dt·(x ⊗ b)`, `y_t = h·c_t`, h from 0: written from the definition (not from the
kernel's rescaled state). The local scale of an element is the same recurrence on |x|·|dt|, |b| and
|c| with the real decays (which are positive): the sum of the magnitudes of the terms it adds up.
Inputs follow Mamba-2's initialisation: a = −U(1, 16), dt log-uniform in [1e-3, 1e-1].
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.graph.registry.ssd_chunk_scan import SsdChunkScanParams
from fuel.testing.reference import Case, randn, register


def ssd_scan64(x: np.ndarray, dt: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray,
               absolute: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(y [B, L, H, P], last_state [B, H, P, N]); `absolute` runs it on the terms' magnitudes."""
    nb, length, nh, p = x.shape
    n = b.shape[3]
    h = np.zeros((nb, nh, p, n))
    y = np.zeros((nb, length, nh, p))
    for t in range(length):
        d = dt[:, t]
        e = np.exp(d * a)[:, :, None, None]
        u = d[:, :, None] * x[:, t]
        bt, ct = b[:, t], c[:, t]
        if absolute:
            u, bt, ct = np.abs(u), np.abs(bt), np.abs(ct)
        h = e * h + u[:, :, :, None] * bt[:, :, None, :]
        y[:, t] = np.einsum("bhpn,bhn->bhp", h, ct)
    return y, h


def ssd_chunk_scan64(xs: list[np.ndarray], p: Any) -> tuple[np.ndarray, np.ndarray]:
    x, dt, a, b, c = xs
    return ssd_scan64(x, dt, a, b, c)


def ssd_chunk_scan_scale(xs: list[np.ndarray], p: Any, ref: Any) -> tuple[np.ndarray, np.ndarray]:
    x, dt, a, b, c = xs
    return ssd_scan64(x, dt, a, b, c, absolute=True)


def mamba2_inputs(rng: np.random.Generator, shape: tuple[int, int, int, int, int], dt: DType,
                  xscale: float = 1.0) -> tuple[np.ndarray, ...]:
    """(x, dt, a, b, c) for (B, L, H, P, N) in `dt`, drawn as Mamba-2 initialises its layers."""
    nb, length, nh, p, n = shape
    step = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), (nb, length, nh))).astype(dt.np)
    a = (-rng.uniform(1.0, 16.0, nh)).astype(dt.np)
    return (randn(rng, (nb, length, nh, p), dt, xscale), step, a, randn(rng, (nb, length, nh, n), dt),
            randn(rng, (nb, length, nh, n), dt))


# (B, L, H, P, N, chunk): small Mamba-like heads, size-1 dims, L = 0, L = chunk, several chunks
SHAPES: tuple[tuple[int, int, int, int, int, int], ...] = (
    (2, 8, 3, 4, 5, 4), (1, 16, 2, 8, 16, 8), (1, 1, 1, 1, 1, 1), (2, 0, 2, 3, 4, 4), (1, 6, 1, 3, 1, 6),
    (3, 4, 2, 1, 7, 2), (1, 12, 1, 5, 3, 3),
)


def _cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    dt = dtypes[0]
    out = [Case(f"[{nb},{length},{nh},{p}] N={n} chunk={k}", mamba2_inputs(rng, (nb, length, nh, p, n), dt),
                SsdChunkScanParams(k)) for nb, length, nh, p, n, k in SHAPES]
    # large steps (decays down to e^-16 per step) and a wide range of x
    big = list(mamba2_inputs(rng, (1, 10, 2, 4, 6), dt, 8.0))
    big[1] = rng.uniform(0.0, 1.0, (1, 10, 2)).astype(dt.np)
    out.append(Case("long steps, wide x", tuple(big), SsdChunkScanParams(5)))
    return out


register("SsdChunkScan", ssd_chunk_scan64, _cases, ssd_chunk_scan_scale)
