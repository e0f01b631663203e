"""`fuel verify --decomposed`: every entry's lowering against its fused kernel.

For each impl of each entry with a decomposition, on the reference's cases (`fuel.testing.reference`):
the kernel's output (as `fuel verify` computes it) is the reference, and the decomposition, built over
copies of the inputs and realised without the fusion pass (so no pattern turns it back into the entry),
must be within the impl's declared precision of it, per element, measured against the reference's local
scale. Half-type cases run the decomposition in f32 and round its outputs once (`lowered_output`). A
decomposition that raises, or gives another shape or dtype, fails with its message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from fuel.dispatch.impls import BackendImpl, default_kernel_registry
from fuel.errors import NoDecomposition
from fuel.graph.registry import FusedOpEntry, default_registry
from fuel.testing.check import as64
from fuel.testing.contract import VerifyResult, output_for, precision_excess
from fuel.testing.reference import cases, has_reference, reference, scale


def _is_half(a: np.ndarray) -> bool:
    return a.dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def lowered_output(entry: FusedOpEntry, inputs: Sequence[np.ndarray], params: Any) -> Any:
    """The entry's decomposition realised over copies of `inputs` (none of them is written): an array,
    or a tuple of them for a multi-output entry.

    Half-type (bf16, f16) inputs are widened to f32 (exactly) and each output is rounded once to its
    input's half type, as the kernels compute them: the recipe is checked, not the rounding of every
    primitive to 8 or 11 bits, which no single-rounding kernel's bound allows for."""
    from fuel.dispatch.executor import realize
    from fuel.graph.tensor import tensor

    if entry.decompose is None:
        raise NoDecomposition(f"{entry.name} has no decomposition")
    half = next((a.dtype for a in inputs if _is_half(a)), None)
    leaves = [tensor(a.astype(np.float32) if _is_half(a) else np.array(a, copy=True)) for a in inputs]
    out = entry.decompose(leaves, params)
    outs = out if isinstance(out, tuple) else (out,)
    values = tuple(t.numpy() for t in realize(*outs, fuse=False))
    if half is not None:
        values = tuple(v.astype(half) if v.dtype == np.float32 else v for v in values)
    return values if isinstance(out, tuple) else values[0]


def _widened(x: Any) -> Any:
    return tuple(as64(o) for o in x) if isinstance(x, tuple) else as64(x)


def verify_decomposed_impl(entry: FusedOpEntry, impl: BackendImpl, seed: int = 0) -> VerifyResult:
    """The lowering against this impl on every reference case of its dtypes; `worst` is the largest
    |lowered − kernel| over its allowed bound (<= 1 passes)."""
    rng = np.random.default_rng(seed)
    worst, n = 0.0, 0
    label = ""
    try:
        for case in cases(entry.name, impl.dtypes, rng):
            label = case.label
            fused = output_for(entry, impl, case.inputs, case.params)
            lowered = lowered_output(entry, case.inputs, case.params)
            s = scale(entry.name, case.inputs, case.params, reference(entry.name, case.inputs, case.params))
            worst = max(worst, precision_excess(lowered, _widened(fused), impl.precision, s))
            n += 1
    except Exception as e:  # a crash is a failed check, reported with the case and its message
        return VerifyResult(entry.name, impl.name, n, worst, True, f"{label}: {type(e).__name__}: {e}")
    return VerifyResult(entry.name, impl.name, n, worst, True, "")


def verify_decomposed(names: Sequence[str] = (), seed: int = 0) -> list[VerifyResult]:
    """The lowering of every (named) entry against each of its kernels."""
    kernels = default_kernel_registry()
    results = []
    for entry in default_registry():
        if names and entry.name not in names:
            continue
        impls = kernels.impls(entry.id)
        if entry.decompose is None or not impls or not has_reference(entry.name):
            why = "no decomposition" if entry.decompose is None else "no impl" if not impls else "no reference"
            results.append(VerifyResult(entry.name, "-", 0, 0.0, True, why))
            continue
        results.extend(verify_decomposed_impl(entry, impl, seed) for impl in impls)
    return results
