"""Measure the errors behind an impl's PrecisionGuarantee: `python -m fuel.testing.measure [Entry ...]`.

For each impl, over many seeds of the reference cases, it reports the worst relative error of elements
whose own magnitude dominates their local scale, and the absolute coefficient (times the local scale S)
still needed on top of that relative error; a bound is set to about twice each.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from fuel.dispatch.impls import BackendImpl, default_kernel_registry
from fuel.graph.registry import FusedOpEntry, default_registry
from fuel.testing.check import as64, floor_of
from fuel.testing.contract import output_for
from fuel.testing.reference import cases, reference, scale


@dataclass(frozen=True)
class Measured:
    impl: str
    worst_relative: float
    """max (|err| - floor)/|ref| over elements with |ref| >= S/2 (the element dominates its scale), and
    at least the output format's unit roundoff."""
    absolute_needed: float
    """max (|err| - worst_relative·|ref| - floor)/S: what the relative part leaves uncovered."""

    def suggested(self) -> tuple[float, float]:
        """(max_relative, max_absolute): twice the measured worst, to two significant digits, rounded up."""
        return _up(2 * self.worst_relative), _up(2 * self.absolute_needed)


def _up(x: float) -> float:
    if x <= 0:
        return 0.0
    e = math.floor(math.log10(x)) - 1
    return math.ceil(x / 10.0**e) * 10.0**e


def unit_roundoff(dtype: np.dtype) -> float:
    """Half the distance from 1 to the next number of the format: the worst relative rounding error."""
    finfo = ml_dtypes.finfo(dtype) if dtype == np.dtype(ml_dtypes.bfloat16) else np.finfo(dtype)
    return float(finfo.eps) / 2


def measure_impl(entry: FusedOpEntry, impl: BackendImpl, seeds: Sequence[int]) -> Measured:
    errs, refs, scales = [], [], []
    floor = floor_of(impl.dtypes[-1].np)
    for seed in seeds:
        for case in cases(entry.name, impl.dtypes, np.random.default_rng(seed)):
            out = output_for(entry, impl, case.inputs, case.params)
            ref = reference(entry.name, case.inputs, case.params)
            s = scale(entry.name, case.inputs, case.params, ref)
            if isinstance(ref, tuple):  # a multi-output entry: its slots, one after another
                out, ref, s = (np.concatenate([np.ravel(as64(x)) for x in v]) for v in (out, ref, s))
            else:
                out = as64(out)
            keep = np.isfinite(ref)
            errs.append(np.abs(out[keep] - ref[keep]) - floor)
            refs.append(np.abs(ref[keep]))
            scales.append(s[keep])
    err, r, s = np.concatenate(errs), np.concatenate(refs), np.concatenate(scales)
    dominant = (r >= 0.5 * s) & (r > 0)
    worst_rel = float(np.max(err[dominant] / r[dominant])) if dominant.any() else 0.0
    # Rounding the result once to the output format may cost any element half an ulp (unit roundoff).
    worst_rel = max(worst_rel, unit_roundoff(impl.dtypes[-1].np))
    pos = s > 0
    need_abs = float(np.max((err[pos] - worst_rel * r[pos]) / s[pos])) if pos.any() else 0.0
    return Measured(impl.name, max(worst_rel, 0.0), max(need_abs, 0.0))


def measure(names: Sequence[str] = (), seeds: Sequence[int] = range(60)) -> list[Measured]:
    """Each impl of each (named) entry over `seeds` of its reference cases."""
    out: list[Measured] = []
    for entry in default_registry():
        if names and entry.name not in names:
            continue
        out.extend(measure_impl(entry, impl, seeds) for impl in default_kernel_registry().impls(entry.id))
    return out


def main(argv: Sequence[str]) -> int:
    print(f"{'impl':52} {'worst rel':>10} {'abs needed':>10}  suggested (max_relative, max_absolute)")
    for m in measure(argv):
        print(f"{m.impl:52} {m.worst_relative:10.3e} {m.absolute_needed:10.3e}  {m.suggested()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
