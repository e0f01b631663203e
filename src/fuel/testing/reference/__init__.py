"""Float64 NumPy references of every entry, and the inputs `fuel verify` and the tests draw.

Every module in this package is found by discovery and calls `register(name, ref, cases, scale)` for
its entries. A reference takes float64 copies of the kernel's (already dtype-rounded) inputs and returns
float64 output(s). `scale` gives the local magnitude the absolute part of a precision bound is measured
against, per output element (default: max|ref| over the element's last-axis row).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.testing.check import row_max_scale


@dataclass(frozen=True)
class Case:
    """One set of inputs (in the impl's dtypes) and params for an entry. Consecutive cases of one `group`
    call the same kernels (`fuel compile` compiles them in one process); an impl's cases are one group
    unless their builder says otherwise."""

    label: str
    inputs: tuple[np.ndarray, ...]
    params: Any
    group: str = ""


RefFn = Callable[[list[np.ndarray], Any], Any]  # an array, or one per slot of a multi-output entry
CaseFn = Callable[[tuple[DType, ...], np.random.Generator], list[Case]]
ScaleFn = Callable[[list[np.ndarray], Any, Any], Any]
"""(float64 inputs, params, float64 reference output) -> per-element scale, broadcastable to the output."""


def row_max(inputs: list[np.ndarray], params: Any, ref: Any) -> Any:
    """The default scale: max|ref| over each element's last-axis row (per slot for a multi-output entry)."""
    if isinstance(ref, tuple):
        return tuple(row_max_scale(r, -1) for r in ref)
    return row_max_scale(ref, -1)


_REFS: dict[str, RefFn] = {}
_CASES: dict[str, CaseFn] = {}
_SCALES: dict[str, ScaleFn] = {}


def register(name: str, ref: RefFn, cases: CaseFn, scale: ScaleFn = row_max) -> None:
    _REFS[name] = ref
    _CASES[name] = cases
    _SCALES[name] = scale


def _load() -> None:
    # Importing a module registers its entries; importing one directly must not hide the others.
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def _widen(inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [a.astype(np.float64) if a.dtype.kind in "fV" or a.dtype.name == "bfloat16" else a for a in inputs]


def has_reference(name: str) -> bool:
    _load()
    return name in _REFS


def reference(name: str, inputs: Sequence[np.ndarray], params: Any) -> Any:
    """The float64 reference output of entry `name` on `inputs` (float inputs are widened exactly): an
    array, or a tuple of them (one per slot) for a multi-output entry."""
    _load()
    return _REFS[name](_widen(inputs), params)


def scale(name: str, inputs: Sequence[np.ndarray], params: Any, ref: Any) -> Any:
    """The local scale of each element of `ref` (entry `name`'s reference output on `inputs`); for a
    multi-output entry, `ref` and the result are tuples with one array per slot."""
    _load()
    s = _SCALES[name](_widen(inputs), params, ref)
    if isinstance(ref, tuple):
        return tuple(np.broadcast_to(np.asarray(si, np.float64), r.shape) for si, r in zip(s, ref, strict=True))
    return np.broadcast_to(np.asarray(s, np.float64), ref.shape)


def cases(name: str, dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    """Inputs for entry `name` in the impl's dtype tuple (inputs..., output)."""
    _load()
    return _CASES[name](dtypes, rng)


def randn(rng: np.random.Generator, shape: Sequence[int], dtype: DType, scale: float = 1.0) -> np.ndarray:
    """Normal samples rounded once to `dtype`."""
    return (rng.standard_normal(tuple(shape)) * scale).astype(dtype.np)


ROW_SHAPES: tuple[tuple[int, ...], ...] = ((7, 33), (2, 3, 64), (1, 1), (5, 1), (3, 1000), (0, 8), (4,))
