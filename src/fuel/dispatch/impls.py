"""The kernel side of the registry: implementations per (fused op, backend, dtype tuple)."""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from fuel.dispatch import cache_stamps
from fuel.dtype import DType
from fuel.errors import FuelError
from fuel.graph.node import Shape
from fuel.graph.registry import FusedOpId, FusedOps

Kernel = Callable[[list[np.ndarray], Any, Any], None]


@dataclass(frozen=True)
class CostEstimate:
    """Work of one call: floating-point operations and bytes read plus written."""

    flops: int
    bytes_moved: int


CostFn = Callable[[Sequence[Shape], Sequence[DType], Any], CostEstimate]


@dataclass(frozen=True)
class PrecisionGuarantee:
    """Measured bound against the float64 reference on the same (dtype-rounded) inputs.

    An output element passes when `|out - ref| <= max_relative·|ref| + max_absolute·S + tiny`, where S
    is the element's *local* scale, which the entry's reference registration defines
    (`fuel.testing.reference.register(..., scale=...)`): by default max|ref| over the element's own
    last-axis row; per element where the work is a sum of products, e.g. `|a| @ |b| + |bias|` for a
    linear. `tiny` is the output format's smallest subnormal. NaN and ±inf must match the reference
    exactly. `max_ulp` is not used by the check (no impl states an ulp bound).
    """

    bit_stable_on_same_hardware: bool
    max_ulp: int | None
    max_relative: float | None
    max_absolute: float | None
    notes: str


@dataclass(frozen=True)
class KernelCaps:
    """What an impl accepts beyond contiguous, offset-0, row-major inputs.

    With `strided_input` the executor hands the kernel its inputs as they are (views: transposed, sliced,
    broadcast, offset), except an input at position k that `reads(k, array)` says the kernel cannot read
    in place, which it copies first (and counts in `fuel.trace()`); `reads` None means any layout."""

    strided_input: bool
    reads: Callable[[int, np.ndarray], bool] | None = None


CONTIGUOUS_ONLY = KernelCaps(strided_input=False)


@dataclass(frozen=True)
class BackendImpl:
    """One kernel for one dtype tuple. `dtypes` = input dtypes in order, then the output's."""

    op_id: FusedOpId
    backend: str
    kernel: Kernel
    dtypes: tuple[DType, ...]
    cost: CostFn
    precision: PrecisionGuarantee
    caps: KernelCaps
    revision: str

    @property
    def name(self) -> str:
        return f"{FusedOps.NAMES[self.op_id]}[{self.backend}:{','.join(d.value for d in self.dtypes)}]"

    @functools.cached_property
    def np_dtypes(self) -> tuple[tuple[np.dtype[Any], ...], np.dtype[Any]]:
        """`dtypes` as NumPy's (input dtypes, output dtype): the form the executor checks arrays in."""
        return tuple(d.np for d in self.dtypes[:-1]), self.dtypes[-1].np

    @property
    def source(self) -> str:
        """`file:line` of the kernel function."""
        fn = inspect.unwrap(self.kernel)
        try:
            file = inspect.getsourcefile(fn) or "?"
            line = inspect.getsourcelines(fn)[1]
        except (OSError, TypeError):
            return "?"
        marker = "/src/"
        return f"{file[file.rfind(marker) + len(marker):] if marker in file else file}:{line}"


KERNEL_PACKAGE = "fuel.cpu"


def kernel_imports(module: ModuleType) -> set[str]:
    """The `fuel.cpu` modules `module` imports, directly or through each other (`from fuel.cpu.simd import
    half` names module `fuel.cpu.simd.half`)."""
    seen: set[str] = set()
    todo = [module.__name__]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in ast.walk(ast.parse(inspect.getsource(importlib.import_module(name)))):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                    node.module.startswith(KERNEL_PACKAGE):
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names
                                          if cache_stamps.module_file(f"{node.module}.{a.name}") is not None)]
            todo.extend(t for t in targets if t.startswith(KERNEL_PACKAGE + ".") and t not in seen)
    return seen


def revision_of(*objects: Any) -> str:
    """A hash of the source of the modules holding `objects` and of the kernel modules they import
    (vecmath, half, row helpers): it changes when anything the kernel runs does."""
    h = hashlib.sha256()
    names: set[str] = set()
    for o in objects:
        mod = inspect.getmodule(inspect.unwrap(o))
        if mod is not None:
            names |= kernel_imports(mod)
    for name in sorted(names):
        h.update(name.encode())
        h.update(inspect.getsource(importlib.import_module(name)).encode())
    return h.hexdigest()[:16]


JointFn = Callable[[Sequence[np.ndarray], dict[int, np.ndarray], Any], None]


@dataclass(frozen=True)
class JointKernel:
    """One kernel that computes the outputs of several entries over the same inputs and params (the
    three FlashAttnBackward gradients share one softmax recomputation). `kernel(inputs, outs, params)`
    fills `outs`, keyed by entry id; the executor runs it once for the siblings a plan holds."""

    op_ids: frozenset[int]
    backend: str
    kernel: JointFn


class KernelRegistryError(FuelError):
    """Two impls claim the same key, or an impl names an unknown op."""


class FusedKernelRegistry:
    """Impls by (op id, backend, dtype tuple)."""

    def __init__(self) -> None:
        self._impls: dict[tuple[int, str, tuple[DType, ...]], BackendImpl] = {}
        self._joint: dict[tuple[int, str], JointKernel] = {}
        self.generation = 0  # counts registrations: plans built before one are not reused after it

    def register(self, impl: BackendImpl) -> None:
        if impl.op_id not in FusedOps.NAMES:
            raise KernelRegistryError(f"kernels: impl for unknown op id {impl.op_id}")
        key = (impl.op_id, impl.backend, impl.dtypes)
        if key in self._impls:
            raise KernelRegistryError(f"kernels: {impl.name} is registered twice")
        self._impls[key] = impl
        self.generation += 1

    def register_joint(self, joint: JointKernel) -> None:
        for op_id in joint.op_ids:
            if (op_id, joint.backend) in self._joint:
                raise KernelRegistryError(f"kernels: {FusedOps.NAMES[op_id]} has two joint kernels")
            self._joint[(op_id, joint.backend)] = joint
        self.generation += 1

    def joint_for(self, op_id: int, backend: str) -> JointKernel | None:
        return self._joint.get((op_id, backend))

    def lookup(self, op_id: int, backend: str, dtypes: tuple[DType, ...]) -> BackendImpl | None:
        return self._impls.get((op_id, backend, dtypes))

    def impls(self, op_id: int) -> list[BackendImpl]:
        return [i for (oid, _, _), i in self._impls.items() if oid == op_id]

    def __iter__(self) -> Iterator[BackendImpl]:
        return iter(sorted(self._impls.values(), key=lambda i: (i.op_id, i.backend, [d.value for d in i.dtypes])))

    def __len__(self) -> int:
        return len(self._impls)


@functools.cache
def default_kernel_registry() -> FusedKernelRegistry:
    """Every CPU impl, registered once."""
    from fuel.dispatch.discovery import register_default_fused_kernels

    reg = FusedKernelRegistry()
    register_default_fused_kernels(reg)
    return reg


def elementwise_cost(flops_per_element: int) -> CostFn:
    """Cost of a row-wise op: `k` flops per output element; every input and the output move once."""

    def cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: Any) -> CostEstimate:
        n = math.prod(shapes[-1])
        moved = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
        return CostEstimate(flops=flops_per_element * n, bytes_moved=moved)

    return cost
