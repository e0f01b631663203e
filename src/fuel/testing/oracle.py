"""Tolerances for comparing a kernel against an independent float64 oracle (see the oracle notes).

Row-wise ops: `|out - ref| <= rtol*|ref| + atol*max|ref|`; backward ops get twice the bound.
Contractions: `|out - ref| <= c_acc*S + c_out*|ref|` with S = |A| @ |B| (the scale of the sum).
"""

from __future__ import annotations

import numpy as np

from fuel.dtype import DType

ROWWISE: dict[DType, tuple[float, float]] = {
    DType.F64: (1e-12, 1e-12),
    DType.F32: (1e-5, 1e-6),
    DType.F16: (2e-3, 1e-3),
    DType.BF16: (1.6e-2, 1e-2),
}
CONTRACTION: dict[DType, tuple[float, float]] = {
    DType.F64: (1e-14, 1e-15),
    DType.F32: (1e-6, 2e-7),
    DType.F16: (1e-6, 1e-3),
    DType.BF16: (1e-6, 8e-3),
}


def _finite_match(out: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    o = np.asarray(out, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    assert o.shape == r.shape, f"shape {o.shape} != reference {r.shape}"
    assert np.array_equal(np.isnan(o), np.isnan(r)), "NaN positions differ from the reference"
    inf = np.isinf(r)
    assert np.array_equal(o[inf], r[inf]), "infinities differ from the reference"
    keep = np.isfinite(r)
    return o[keep], r[keep]


def assert_close_rowwise(out: np.ndarray, ref: np.ndarray, dtype: DType, backward: bool = False) -> None:
    """Row-wise op (softmax, norms, rope, CE, …) against a float64 oracle."""
    o, r = _finite_match(out, ref)
    if not r.size:
        return
    rtol, atol = ROWWISE[dtype]
    k = 2.0 if backward else 1.0
    allowed = k * (rtol * np.abs(r) + atol * np.max(np.abs(r)))
    err = np.abs(o - r)
    bad = err > allowed
    assert not bad.any(), (f"{int(bad.sum())} of {r.size} elements off; worst |err| {err.max():.3e}, "
                           f"allowed there {allowed[np.argmax(err - allowed)]:.3e} ({dtype.value})")


def assert_close_contraction(out: np.ndarray, ref: np.ndarray, scale: np.ndarray, dtype: DType,
                             acc: DType | None = None) -> None:
    """Contraction (matmul, conv, …): bound scaled by S = |A| @ |B| and by |ref|."""
    o = np.asarray(out, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    s = np.broadcast_to(np.asarray(scale, dtype=np.float64), r.shape)
    assert o.shape == r.shape, f"shape {o.shape} != reference {r.shape}"
    assert np.isfinite(o).all() == np.isfinite(r).all(), "non-finite values differ from the reference"
    c_acc = CONTRACTION[acc or dtype.acc][0]
    c_out = CONTRACTION[dtype][1]
    allowed = c_acc * s + c_out * np.abs(r) + 1e-300
    err = np.abs(o - r)
    bad = err > allowed
    assert not bad.any(), f"{int(bad.sum())} of {r.size} elements off; worst err/allowed {np.max(err / allowed):.3e}"
