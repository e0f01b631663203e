"""Checks every impl must pass: precision against the float64 reference, and bit-stability."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuel.dispatch.impls import BackendImpl, PrecisionGuarantee, default_kernel_registry
from fuel.errors import ParamError
from fuel.graph.registry import FusedOpEntry, default_registry
from fuel.runtime import threads
from fuel.runtime.threads import serial
from fuel.testing.check import excess, floor_of, nonfinite_mismatch, row_max_scale
from fuel.testing.reference import cases, has_reference, reference, scale


def output_for(entry: FusedOpEntry, impl: BackendImpl, inputs: Sequence[np.ndarray], params: Any) -> Any:
    """Allocate the output the executor would (from the entry's rules) and run the kernel on it: an
    array, or a tuple of them (one per slot) for a multi-output entry."""
    shape = entry.shape_rule(tuple(a.shape for a in inputs), params)
    if entry.output_views is not None:
        slots = entry.output_views(tuple(a.shape for a in inputs), tuple(impl.dtypes[:-1]), params)
        outs = tuple(np.full(s, np.nan, d.np) for s, d in slots)
        impl.kernel([np.ascontiguousarray(a) for a in inputs], outs, params)
        return outs
    if entry.destructive_input is not None:
        out = np.array(inputs[entry.destructive_input], copy=True)
        args = [out if i == entry.destructive_input else np.ascontiguousarray(a) for i, a in enumerate(inputs)]
    else:
        out = np.full(shape, np.nan, impl.dtypes[-1].np) if impl.dtypes[-1].is_float else np.zeros(
            shape, impl.dtypes[-1].np)
        args = [np.ascontiguousarray(a) for a in inputs]
    impl.kernel(args, out, params)
    return out


def precision_excess(out: Any, ref: Any, p: PrecisionGuarantee, local_scale: Any = None) -> float:
    """max over elements of |out - ref| / allowed; <= 1 passes, inf when NaN/±inf disagree.

    allowed = max_relative·|ref| + max_absolute·S + (the output format's smallest subnormal), with S
    the element's local scale (default: max|ref| over its last-axis row); see PrecisionGuarantee.
    Tuples (a multi-output entry's slots) are checked slot by slot.
    """
    if isinstance(ref, tuple):
        if not isinstance(out, tuple) or len(out) != len(ref):
            return float("inf")
        scales = local_scale if local_scale is not None else (None,) * len(ref)
        return max((precision_excess(o, r, p, s) for o, r, s in zip(out, ref, scales, strict=True)), default=0.0)
    o = np.asarray(out)
    if o.shape != ref.shape or nonfinite_mismatch(o, ref) is not None:
        return float("inf")
    s = row_max_scale(ref) if local_scale is None else local_scale
    ratio = excess(o, ref, s, p.max_relative or 0.0, p.max_absolute or 0.0, floor_of(o.dtype))
    return float(np.max(ratio)) if ratio.size else 0.0


def output_bytes(out: Any) -> bytes:
    return b"".join(o.tobytes() for o in out) if isinstance(out, tuple) else bytes(out.tobytes())


@contextmanager
def fuel_threads(n: int) -> Iterator[None]:
    """Run the block at fuel's thread count `n` (the pool's and the BLAS's), restoring the previous count
    afterwards: the part count every job is cut into follows it."""
    before = threads.get_num_threads()
    threads.set_num_threads(n)
    try:
        yield
    finally:
        threads.set_num_threads(before)


def thread_counts() -> tuple[int, ...]:
    """The thread counts a bit-stable impl must agree across: 1 (every job in one part) and 2."""
    return (1, 2)


@dataclass
class VerifyResult:
    entry: str
    impl: str
    cases: int
    worst: float
    bit_stable: bool
    error: str
    unstable: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.worst <= 1.0 and self.bit_stable


def verify_impl(entry: FusedOpEntry, impl: BackendImpl, seed: int = 0, repeats: int = 16) -> VerifyResult:
    """Precision on every case, and the same bytes over `repeats` calls, at fuel thread counts 1 and 2 and
    on the serial path the executor takes for small work. `fuel verify` makes 16 calls; the test suite
    fewer (every case, dtype and thread count still checked, a call-to-call drift just less likely seen)."""
    if repeats < 1:
        raise ParamError(f"verify_impl: repeats must be at least 1 (the call measured), got {repeats}")
    rng = np.random.default_rng(seed)
    worst, n, unstable = 0.0, 0, ""
    try:
        for case in cases(entry.name, impl.dtypes, rng):
            out = output_for(entry, impl, case.inputs, case.params)
            ref = reference(entry.name, case.inputs, case.params)
            s = scale(entry.name, case.inputs, case.params, ref)
            worst = max(worst, precision_excess(out, ref, impl.precision, s))
            n += 1
            first = output_bytes(out)
            if not unstable and any(output_bytes(output_for(entry, impl, case.inputs, case.params)) != first
                                    for _ in range(repeats - 1)):
                unstable = f"{case.label}: differs between calls"
            for count in thread_counts():
                if unstable:
                    break
                with fuel_threads(count):
                    if output_bytes(output_for(entry, impl, case.inputs, case.params)) != first:
                        unstable = f"{case.label}: differs with {count} thread(s)"
            if not unstable:
                with serial():
                    if output_bytes(output_for(entry, impl, case.inputs, case.params)) != first:
                        unstable = f"{case.label}: the serial path differs from the parallel one"
    except Exception as e:  # a crash is a failed verification, reported with its message
        return VerifyResult(entry.name, impl.name, n, worst, not unstable, f"{type(e).__name__}: {e}", unstable)
    return VerifyResult(entry.name, impl.name, n, worst, not unstable, "", unstable)


def verify_each(check: Callable[[FusedOpEntry, BackendImpl, int], VerifyResult], names: Sequence[str] = (),
                seed: int = 0, needs_decompose: bool = False) -> list[VerifyResult]:
    """`check(entry, impl, seed)` for every impl of every (named) entry; an entry it cannot check gets one
    passing row saying why (no decomposition when `needs_decompose`, no impl, no reference)."""
    kernels = default_kernel_registry()
    results = []
    for entry in default_registry():
        if names and entry.name not in names:
            continue
        impls = kernels.impls(entry.id)
        why = ("no decomposition" if needs_decompose and entry.decompose is None else "no impl" if not impls
               else "no reference" if not has_reference(entry.name) else "")
        if why:
            results.append(VerifyResult(entry.name, "-", 0, 0.0, True, why))
            continue
        results.extend(check(entry, impl, seed) for impl in impls)
    return results


def verify(names: Sequence[str] = (), seed: int = 0) -> list[VerifyResult]:
    """Every impl of every (named) entry against its reference, with bit-stability over calls and threads."""
    return verify_each(verify_impl, names, seed)
