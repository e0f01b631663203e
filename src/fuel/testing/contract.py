"""Checks every impl must pass: precision against the float64 reference, and bit-stability."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuel.dispatch.fused import BackendImpl, PrecisionGuarantee, default_kernel_registry
from fuel.graph.registry import FusedOpEntry, default_registry
from fuel.testing.reference import cases, has_reference, reference


def output_for(entry: FusedOpEntry, impl: BackendImpl, inputs: Sequence[np.ndarray], params: Any) -> np.ndarray:
    """Allocate the output the executor would (from the entry's rules) and run the kernel on it."""
    shape = entry.shape_rule(tuple(a.shape for a in inputs), params)
    if entry.destructive_input is not None:
        out = np.array(inputs[entry.destructive_input], copy=True)
        args = [out if i == entry.destructive_input else np.ascontiguousarray(a) for i, a in enumerate(inputs)]
    else:
        out = np.full(shape, np.nan, impl.dtypes[-1].np) if impl.dtypes[-1].is_float else np.zeros(
            shape, impl.dtypes[-1].np)
        args = [np.ascontiguousarray(a) for a in inputs]
    impl.kernel(args, out, params)
    return out


def precision_excess(out: np.ndarray, ref: np.ndarray, p: PrecisionGuarantee) -> float:
    """max over elements of |out - ref| / allowed; <= 1 passes. NaN/inf must agree exactly."""
    o = np.asarray(out, dtype=np.float64)
    if o.shape != ref.shape:
        return float("inf")
    finite = np.isfinite(ref)
    if not np.array_equal(np.isnan(o), np.isnan(ref)) or not np.array_equal(o[~finite & ~np.isnan(ref)],
                                                                          ref[~finite & ~np.isnan(ref)]):
        return float("inf")
    if not finite.any():
        return 0.0
    o, r = o[finite], ref[finite]
    scale = float(np.max(np.abs(r)))
    allowed = (p.max_absolute or 0.0) * scale + (p.max_relative or 0.0) * np.abs(r)
    err = np.abs(o - r)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / allowed)
    return float(np.max(ratio)) if ratio.size else 0.0


@dataclass
class VerifyResult:
    entry: str
    impl: str
    cases: int
    worst: float
    bit_stable: bool
    error: str

    @property
    def ok(self) -> bool:
        return not self.error and self.worst <= 1.0 and self.bit_stable


def verify_impl(entry: FusedOpEntry, impl: BackendImpl, seed: int = 0, repeats: int = 16) -> VerifyResult:
    rng = np.random.default_rng(seed)
    worst, stable, n = 0.0, True, 0
    try:
        for case in cases(entry.name, impl.dtypes, rng):
            out = output_for(entry, impl, case.inputs, case.params)
            ref = reference(entry.name, case.inputs, case.params)
            worst = max(worst, precision_excess(out, ref, impl.precision))
            n += 1
            first = out.tobytes()
            for _ in range(repeats - 1):
                if output_for(entry, impl, case.inputs, case.params).tobytes() != first:
                    stable = False
                    break
    except Exception as e:  # a crash is a failed verification, reported with its message
        return VerifyResult(entry.name, impl.name, n, worst, stable, f"{type(e).__name__}: {e}")
    return VerifyResult(entry.name, impl.name, n, worst, stable, "")


def verify(names: Sequence[str] = (), seed: int = 0) -> list[VerifyResult]:
    """Every impl of every (named) entry against its reference, with 16-call bit-stability."""
    kernels = default_kernel_registry()
    results = []
    for entry in default_registry():
        if names and entry.name not in names:
            continue
        impls = kernels.impls(entry.id)
        if not impls or not has_reference(entry.name):
            results.append(VerifyResult(entry.name, "-", 0, 0.0, True,
                                        "no impl" if not impls else "no reference"))
            continue
        results.extend(verify_impl(entry, impl, seed) for impl in impls)
    return results
