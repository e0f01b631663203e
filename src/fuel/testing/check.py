"""The element-wise comparison shared by the test oracle and `fuel verify`.

An element passes when `|out - ref| <= max_relative·|ref| + max_absolute·S + floor`, where S is a
*local* scale of the element's computation: by default the largest |ref| in its own row (the op's
reduction axis), or a per-element scale such as `|A| @ |B|` for a contraction. A whole-tensor scale
would let one large row hide a wrong small one (a bf16 softmax with most elements zeroed passed).
`floor` is the output format's smallest subnormal: no format resolves differences finer than that.

Non-finite values are compared exactly: NaN only where the reference has NaN, ±inf only where the
reference has the same infinity.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np


def as64(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def nonfinite_mismatch(out: np.ndarray, ref: np.ndarray) -> str | None:
    """Why `out`'s NaN and infinities disagree with `ref`'s, or None when they agree."""
    o, r = as64(out), as64(ref)
    nan_o, nan_r = np.isnan(o), np.isnan(r)
    if not np.array_equal(nan_o, nan_r):
        extra, missing = int((nan_o & ~nan_r).sum()), int((nan_r & ~nan_o).sum())
        return f"NaN where the reference is not at {extra} elements, a number where it is NaN at {missing}"
    inf_o, inf_r = np.isinf(o), np.isinf(r)
    if not np.array_equal(inf_o, inf_r) or not np.array_equal(o[inf_r], r[inf_r]):
        diff = int(((inf_o | inf_r) & (o != r)).sum())
        return f"infinities differ from the reference (position or sign) at {diff} elements"
    return None


def overflow_to_inf(ref: np.ndarray, dt: Any) -> np.ndarray:
    """ref (float64) with each finite value past the largest that format `dt` rounds to a finite number
    replaced by the ±inf that `dt` stores for it: the correctly rounded answer there is infinite."""
    if np.dtype(dt).itemsize >= 8 or np.dtype(dt).kind not in "fV":  # float64 and integers: as they are
        return ref
    with np.errstate(over="ignore"):
        stored = as64(ref.astype(dt))
    over = np.isinf(stored) & np.isfinite(ref)
    return np.where(over, np.copysign(np.inf, ref), ref) if over.any() else ref


def row_max_scale(ref: np.ndarray, axis: int = -1) -> np.ndarray:
    """The default local scale: max |ref| over the element's row (finite values only), per element."""
    r = np.abs(as64(ref))
    r = np.where(np.isfinite(r), r, 0.0)
    if r.ndim == 0 or r.size == 0:
        return r
    return np.broadcast_to(np.max(r, axis=axis, keepdims=True), r.shape)


def floor_of(dtype: Any) -> float:
    """The smallest subnormal of a float format (NumPy or ml_dtypes); 0 for anything else."""
    dt = np.dtype(dtype)
    if dt == np.dtype(ml_dtypes.bfloat16):
        return float(ml_dtypes.finfo(ml_dtypes.bfloat16).smallest_subnormal)
    if dt.kind == "f":
        return float(np.finfo(dt).smallest_subnormal)
    return 0.0


def excess(out: np.ndarray, ref: np.ndarray, scale: np.ndarray, max_relative: float, max_absolute: float,
           floor: float = 0.0) -> np.ndarray:
    """|out - ref| / allowed at each element where ref is finite (<= 1 passes); 0 where both agree exactly.

    Call `nonfinite_mismatch` first: this only measures the finite elements.
    """
    o, r = as64(out), as64(ref)
    if o.shape != r.shape:
        raise ValueError(f"shape {o.shape} != reference {r.shape}")
    s = np.broadcast_to(as64(scale), r.shape)
    keep = np.isfinite(r)
    o, r, s = o[keep], r[keep], s[keep]
    allowed = max_relative * np.abs(r) + max_absolute * s + floor
    err = np.abs(o - r)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(err == 0, 0.0, err / allowed)


def ulp_error(got: Any, ref: np.ndarray, dt: Any) -> float:
    """Worst |got - ref| in units of the spacing of `dt` (a fuel DType) at ref, ref in float64; NaN must sit
    exactly where ref has NaN (AssertionError otherwise). Where the spacing is 0 the smallest f64 stands in."""
    g = np.asarray(got, np.float64)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(g), nan), "NaN where the reference is not (or the reverse)"
    r, g = ref[~nan], g[~nan]
    at = np.abs(r) if dt.np == np.float64 else np.abs(r).astype(dt.np)
    with np.errstate(invalid="ignore"):  # an infinity's spacing, and inf - inf: handled by the where()s
        spacing = np.spacing(at).astype(np.float64)
        spacing = np.where(spacing > 0, spacing, np.finfo(np.float64).tiny)
        err = np.where(g == r, 0.0, np.abs(g - r) / spacing)
    return float(err.max()) if r.size else 0.0

