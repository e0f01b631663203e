"""Float64 NumPy references of every entry, and the inputs `fuel verify` and the tests draw.

Each module in REFERENCE_MODULES calls `register(name, ref, cases)` for its entries. A reference takes
float64 copies of the kernel's (already dtype-rounded) inputs and returns float64 output(s).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuel.dtype import DType


@dataclass(frozen=True)
class Case:
    """One set of inputs (in the impl's dtypes) and params for an entry."""

    label: str
    inputs: tuple[np.ndarray, ...]
    params: Any


RefFn = Callable[[list[np.ndarray], Any], np.ndarray]
CaseFn = Callable[[tuple[DType, ...], np.random.Generator], list[Case]]

REFERENCE_MODULES: tuple[str, ...] = (
    "softmax",
    "norms",
    "linear",
    "rope",
)

_REFS: dict[str, RefFn] = {}
_CASES: dict[str, CaseFn] = {}


def register(name: str, ref: RefFn, cases: CaseFn) -> None:
    _REFS[name] = ref
    _CASES[name] = cases


def _load() -> None:
    # Importing a module registers its entries; importing one directly must not hide the others.
    for m in REFERENCE_MODULES:
        importlib.import_module(f"{__name__}.{m}")


def has_reference(name: str) -> bool:
    _load()
    return name in _REFS


def reference(name: str, inputs: Sequence[np.ndarray], params: Any) -> np.ndarray:
    """The float64 reference output of entry `name` on `inputs` (float inputs are widened exactly)."""
    _load()
    wide = [a.astype(np.float64) if a.dtype.kind in "fV" or a.dtype.name == "bfloat16" else a for a in inputs]
    return _REFS[name](wide, params)


def cases(name: str, dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    """Inputs for entry `name` in the impl's dtype tuple (inputs..., output)."""
    _load()
    return _CASES[name](dtypes, rng)


def randn(rng: np.random.Generator, shape: Sequence[int], dtype: DType, scale: float = 1.0) -> np.ndarray:
    """Normal samples rounded once to `dtype`."""
    return (rng.standard_normal(tuple(shape)) * scale).astype(dtype.np)


ROW_SHAPES: tuple[tuple[int, ...], ...] = ((7, 33), (2, 3, 64), (1, 1), (5, 1), (3, 1000), (0, 8), (4,))
