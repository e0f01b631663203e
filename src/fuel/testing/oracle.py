"""Tolerances for comparing a kernel against an independent float64 oracle in the tests.

Row-wise ops: `|out - ref| <= rtol*|ref| + atol*S` with S = max|ref| over the element's own row (the
op's reduction axis) unless the caller passes a per-element scale; backward ops get twice the bound.
Attention forward: the same form with S = Σ p·|v| per element and oracles.md's f32 attention tolerances.
Contractions: `|out - ref| <= c_acc*S + c_out*|ref|` with S = |A| @ |B| (+ |bias|), per element.
Both add the output format's smallest subnormal and compare NaN and ±inf exactly (see `check`).
"""

from __future__ import annotations

import numpy as np

from fuel.dtype import DType
from fuel.testing.check import as64, excess, floor_of, nonfinite_mismatch, overflow_to_inf, row_max_scale

ROWWISE: dict[DType, tuple[float, float]] = {
    DType.F64: (1e-12, 1e-12),
    DType.F32: (1e-5, 1e-6),
    DType.F16: (2e-3, 1e-3),
    DType.BF16: (1.6e-2, 1e-2),
}
# Attention forward (FlashAttn, PagedAttn): oracles.md's f32 rule (rtol 1e-5, atol 1e-5), the absolute
# part scaled per element by S = Σ_j p_j·|v_j|. Rounding in f32 scores moves every p_j by about
# scale·ε·Σ|q·k|, which the averaged output carries over: with large logits (q 2x the unit scale) that is
# 1-1.5e-6·S where OpenBLAS's Haswell sgemm forms the scores (Zen 3), over the row-wise 1e-6.
ATTENTION: dict[DType, tuple[float, float]] = {**ROWWISE, DType.F32: (1e-5, 1e-5)}
CONTRACTION: dict[DType, tuple[float, float]] = {
    DType.F64: (1e-14, 1e-15),
    DType.F32: (1e-6, 2e-7),
    DType.F16: (1e-6, 1e-3),
    DType.BF16: (1e-6, 8e-3),
}


def _report(ratio: np.ndarray, size: int, dtype: DType) -> None:
    bad = ratio > 1.0
    assert not bad.any(), (f"{int(bad.sum())} of {size} elements off; worst |err|/allowed "
                           f"{float(np.max(ratio)):.3e} ({dtype.value})")


def assert_close_rowwise(out: np.ndarray, ref: np.ndarray, dtype: DType, backward: bool = False,
                         axis: int = -1, scale: np.ndarray | None = None, floor: float | None = None,
                         tolerances: dict[DType, tuple[float, float]] = ROWWISE) -> None:
    """Row-wise op (softmax, norms, rope, CE, …) against a float64 oracle.

    `axis` is the op's reduction axis (the row); `scale` replaces the row's max|ref| when the op's
    natural scale is per element; `floor` (default: the output format's smallest subnormal) is the
    absolute error always allowed, e.g. the smallest normal of a format the kernel flushes in.
    """
    o, r = as64(out), overflow_to_inf(as64(ref), dtype.np)
    assert o.shape == r.shape, f"shape {o.shape} != reference {r.shape}"
    why = nonfinite_mismatch(o, r)
    assert why is None, why
    rtol, atol = tolerances[dtype]
    k = 2.0 if backward else 1.0
    s = row_max_scale(r, axis) if scale is None else scale
    _report(excess(o, r, s, k * rtol, k * atol, floor_of(dtype.np) if floor is None else floor), r.size, dtype)


def assert_close_attention(out: np.ndarray, ref: np.ndarray, dtype: DType, scale: np.ndarray,
                           backward: bool = False) -> None:
    """Attention forward against a float64 oracle: `ATTENTION`'s bound, its absolute part times the
    per-element scale S = Σ p·|v| (twice the bound for a backward)."""
    assert_close_rowwise(out, ref, dtype, backward, scale=scale, tolerances=ATTENTION)


def assert_close_contraction(out: np.ndarray, ref: np.ndarray, scale: np.ndarray, dtype: DType,
                             acc: DType | None = None) -> None:
    """Contraction (matmul, conv, …): bound scaled per element by S = |A| @ |B| and by |ref|."""
    o, r = as64(out), as64(ref)
    assert o.shape == r.shape, f"shape {o.shape} != reference {r.shape}"
    why = nonfinite_mismatch(o, r)
    assert why is None, why
    c_acc = CONTRACTION[acc or dtype.acc][0]
    c_out = CONTRACTION[dtype][1]
    _report(excess(o, r, scale, c_out, c_acc, floor_of(dtype.np)), r.size, dtype)
