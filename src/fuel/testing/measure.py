"""Measure the errors behind an impl's PrecisionGuarantee: `python -m fuel.testing.measure [Entry ...]`.

For each impl, over many seeds of the reference cases, it reports the worst relative error of elements
whose own magnitude dominates their local scale, and the absolute coefficient (times the local scale S)
still needed on top of a given relative bound. A bound is then set to about twice what this reports.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fuel.dispatch.fused import BackendImpl, default_kernel_registry
from fuel.graph.registry import FusedOpEntry, default_registry
from fuel.testing.check import as64, floor_of
from fuel.testing.contract import output_for
from fuel.testing.reference import cases, reference, scale


@dataclass(frozen=True)
class Measured:
    impl: str
    worst_relative: float
    """max (|err| - floor)/|ref| over elements with |ref| >= S/2 (the element dominates its scale)."""
    absolute_needed: float
    """max (|err| - relative·|ref| - floor)/S: the absolute coefficient `relative` leaves uncovered."""
    relative: float


def measure_impl(entry: FusedOpEntry, impl: BackendImpl, seeds: Sequence[int], relative: float) -> Measured:
    worst_rel, need_abs = 0.0, 0.0
    for seed in seeds:
        for case in cases(entry.name, impl.dtypes, np.random.default_rng(seed)):
            out = as64(output_for(entry, impl, case.inputs, case.params))
            ref = reference(entry.name, case.inputs, case.params)
            s = scale(entry.name, case.inputs, case.params, ref)
            keep = np.isfinite(ref)
            o, r, s = out[keep], ref[keep], s[keep]
            err = np.abs(o - r) - floor_of(impl.dtypes[-1].np)
            dominant = (np.abs(r) >= 0.5 * s) & (r != 0)
            if dominant.any():
                worst_rel = max(worst_rel, float(np.max(err[dominant] / np.abs(r[dominant]))))
            pos = s > 0
            if pos.any():
                need_abs = max(need_abs, float(np.max((err[pos] - relative * np.abs(r[pos])) / s[pos])))
    return Measured(impl.name, worst_rel, max(need_abs, 0.0), relative)


def measure(names: Sequence[str] = (), seeds: Sequence[int] = range(60)) -> list[Measured]:
    """Each impl measured with half its present max_relative (the worst that bound was set from)."""
    out = []
    for entry in default_registry():
        if names and entry.name not in names:
            continue
        for impl in default_kernel_registry().impls(entry.id):
            out.append(measure_impl(entry, impl, seeds, (impl.precision.max_relative or 0.0) / 2))
    return out


def main(argv: Sequence[str]) -> int:
    print(f"{'impl':52} {'worst rel':>10} {'abs needed at rel':>18} {'rel':>9}")
    for m in measure(argv):
        print(f"{m.impl:52} {m.worst_relative:10.3e} {m.absolute_needed:18.3e} {m.relative:9.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
