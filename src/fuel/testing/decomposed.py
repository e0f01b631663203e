"""`fuel verify --decomposed`: every entry's lowering against its fused kernel.

For each impl of each entry with a decomposition, on the reference's cases (`fuel.testing.reference`):
the kernel's output (as `fuel verify` computes it) is the reference, and the decomposition, built over
copies of the inputs and realised without the fusion pass (so no pattern turns it back into the entry),
must be within the impl's declared precision of it, per element, measured against the reference's local
scale. The decomposition runs on inputs widened to f64 and its outputs are rounded once to the kernel's
types (`lowered_output`): the recipe is checked, not its primitives' range and rounding in narrow
types. A decomposition that raises, or gives another shape or dtype, fails with its message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from fuel.dispatch.impls import BackendImpl
from fuel.errors import NoDecomposition
from fuel.graph.registry import FusedOpEntry
from fuel.testing.check import as64
from fuel.testing.contract import VerifyResult, output_for, precision_excess, verify_each
from fuel.testing.reference import cases, reference, scale


def _is_float(a: np.ndarray) -> bool:
    return a.dtype.kind == "f" or a.dtype == np.dtype(ml_dtypes.bfloat16)


def lowered_output(entry: FusedOpEntry, inputs: Sequence[np.ndarray], params: Any, like: Any = None) -> Any:
    """The entry's decomposition realised over copies of `inputs` (none of them is written): an array,
    or a tuple of them for a multi-output entry.

    With `like` (the kernel's output, or one per slot), float inputs are widened to f64 (exactly) and each
    float output is rounded once to `like`'s dtype: the recipe is evaluated nearly exactly, as the kernels'
    declared bounds are stated against the exact value, so what is checked is the lowering's math, not the
    range or the rounding of each primitive in the kernel's type (`x·x` of a norm overflows f32 where
    the kernel rescales; eight bf16 roundings are not the kernel's one). Without `like`, the lowering
    runs in the inputs' own types."""
    from fuel.dispatch.executor import realize
    from fuel.graph.tensor import tensor

    if entry.decompose is None:
        raise NoDecomposition(f"{entry.name} has no decomposition")
    wide = like is not None
    leaves = [tensor(a.astype(np.float64) if wide and _is_float(a) else np.array(a, copy=True)) for a in inputs]
    out = entry.decompose(leaves, params)
    outs = out if isinstance(out, tuple) else (out,)
    values = tuple(t.numpy() for t in realize(*outs, fuse=False))
    if wide:
        targets = like if isinstance(like, tuple) else (like,)
        values = tuple(v.astype(t.dtype) if _is_float(v) and _is_float(t) else v
                       for v, t in zip(values, targets, strict=True))
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
            lowered = lowered_output(entry, case.inputs, case.params, like=fused)
            s = scale(entry.name, case.inputs, case.params, reference(entry.name, case.inputs, case.params))
            worst = max(worst, precision_excess(lowered, _widened(fused), impl.precision, s))
            n += 1
    except Exception as e:  # a crash is a failed check, reported with the case and its message
        return VerifyResult(entry.name, impl.name, n, worst, True, f"{label}: {type(e).__name__}: {e}")
    return VerifyResult(entry.name, impl.name, n, worst, True, "")


def verify_decomposed(names: Sequence[str] = (), seed: int = 0) -> list[VerifyResult]:
    """The lowering of every (named) entry against each of its kernels."""
    return verify_each(verify_decomposed_impl, names, seed, needs_decompose=True)
