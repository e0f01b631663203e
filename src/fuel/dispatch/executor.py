"""realize(): plan a graph once per structure, then run it over the leaves' current values."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from fuel.dispatch.buffers import POOL
from fuel.dispatch.cpu.prims import PRIM_KERNELS, PrimKernel
from fuel.dispatch.fused import BackendImpl, FusedKernelRegistry, default_kernel_registry
from fuel.errors import KernelError, ShapeError
from fuel.graph.node import DynScalar, Node, Op, topo_order
from fuel.graph.passes import arg_key
from fuel.graph.passes.cse import cse
from fuel.graph.passes.fuse import fuse
from fuel.graph.passes.lower import lower
from fuel.graph.passes.order import schedule
from fuel.graph.registry import FusedOpRegistry, default_registry

if TYPE_CHECKING:
    from fuel.graph.tensor import Tensor

BACKEND = "cpu"
PLAN_CACHE_SIZE = 512


@dataclass(frozen=True)
class Step:
    node: Node
    prim: PrimKernel | None
    impl: BackendImpl | None
    destructive: int | None
    inputs: tuple[int, ...]
    output: int
    free_after: tuple[int, ...]


@dataclass
class Plan:
    n_slots: int
    leaf_slots: tuple[int, ...]
    baked: dict[int, np.ndarray]
    steps: list[Step]
    outputs: tuple[int, ...]


@dataclass
class TraceRecord:
    node: str
    impl: str
    seconds: float
    copies: int


@dataclass
class Trace:
    """Per node run: what ran it, how long it took and how many input copies it needed."""

    records: list[TraceRecord] = field(default_factory=list)
    plans_built: int = 0
    plans_reused: int = 0

    def __str__(self) -> str:
        lines = [f"{'node':44} {'impl':44} {'ms':>9} copies"]
        for r in self.records:
            lines.append(f"{r.node[:44]:44} {r.impl[:44]:44} {r.seconds * 1e3:9.3f} {r.copies:6}")
        lines.append(f"plans built {self.plans_built}, reused {self.plans_reused}")
        return "\n".join(lines)


_PLANS: OrderedDict[object, Plan] = OrderedDict()
_TRACE: list[Trace] = []


@contextmanager
def trace() -> Iterator[Trace]:
    """Record every node the executor runs inside the block."""
    t = Trace()
    _TRACE.append(t)
    try:
        yield t
    finally:
        _TRACE.remove(t)


def clear_plan_cache() -> None:
    _PLANS.clear()


def plan_cache_size() -> int:
    return len(_PLANS)


def realize(*tensors: Tensor, env: dict[str, int] | None = None, fuse: bool = True) -> tuple[Tensor, ...]:
    """Compute the tensors (one plan for all of them) and return them, now realised."""
    from fuel.graph.tensor import Tensor

    for t in tensors:
        if not isinstance(t, Tensor):
            raise ShapeError(f"realize: expects Tensors, got {type(t).__name__}")
    roots = [t.node for t in tensors if t.node.value is None]
    if not roots:
        return tensors
    order = topo_order(roots)
    leaves = [n for n in order if n.value is not None]
    key = _structure_key(order, roots, fuse)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _build_plan(roots, leaves, fuse, default_registry(), default_kernel_registry())
        _PLANS[key] = plan
        if len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
        for tr in _TRACE:
            tr.plans_built += 1
    else:
        _PLANS.move_to_end(key)
        for tr in _TRACE:
            tr.plans_reused += 1
    # Kernels follow IEEE (log 0 = -inf, 0/0 = NaN, as torch does); NumPy's warnings would only be noise.
    with np.errstate(all="ignore"):
        values = _run(plan, [n.value for n in leaves], env)  # type: ignore[misc]
    for node, value in zip(roots, values, strict=True):
        node.value = value
    return tensors


def _structure_key(order: list[Node], roots: list[Node], fuse_on: bool) -> object:
    index = {n: i for i, n in enumerate(order)}
    parts: list[object] = [fuse_on]
    for n in order:
        if n.value is not None:
            parts.append(("leaf", n.shape, n.dtype))
        else:
            parts.append((n.op, arg_key(n.arg), tuple(index[i] for i in n.inputs), n.shape, n.dtype))
    parts.append(tuple(index[r] for r in roots))
    return tuple(parts)


def _destructive(registry: FusedOpRegistry) -> Any:
    def destructive(n: Node) -> int | None:
        if n.op is not Op.FUSED:
            return None
        entry = registry.get(n.arg[0])
        return None if entry is None else entry.destructive_input
    return destructive


def _impl_for(n: Node, kernels: FusedKernelRegistry) -> BackendImpl | None:
    return kernels.lookup(n.arg[0], BACKEND, (*(i.dtype for i in n.inputs), n.dtype))


def _build_plan(roots: list[Node], leaves: list[Node], fuse_on: bool,
                registry: FusedOpRegistry, kernels: FusedKernelRegistry) -> Plan:
    destructive = _destructive(registry)
    graph = cse(roots, destructive)
    if fuse_on:
        graph = cse(fuse(graph, registry), destructive)
    graph = lower(graph, registry, lambda n: _impl_for(n, kernels) is not None)
    order = schedule(graph, destructive)
    slot = {n: i for i, n in enumerate(order)}
    leaf_slots = tuple(slot.get(leaf, -1) for leaf in leaves)
    known = set(leaves)
    baked = {slot[n]: n.value for n in order if n.value is not None and n not in known}
    last_use: dict[int, int] = {}
    for step_index, n in enumerate(order):
        if n.value is None:
            for i in n.inputs:
                last_use[slot[i]] = step_index
    keep = {slot[r] for r in graph}
    frees: dict[int, list[int]] = {}
    for s, step_index in last_use.items():
        if s not in keep:
            frees.setdefault(step_index, []).append(s)
    steps = []
    for step_index, n in enumerate(order):
        if n.value is not None:
            continue
        impl = _impl_for(n, kernels) if n.op is Op.FUSED else None
        prim = None if n.op is Op.FUSED else PRIM_KERNELS[n.op]
        steps.append(Step(n, prim, impl, destructive(n), tuple(slot[i] for i in n.inputs), slot[n],
                          tuple(frees.get(step_index, ()))))
    return Plan(len(order), leaf_slots, baked, steps, tuple(slot[r] for r in graph))


def _resolve(params: Any, env: dict[str, int] | None) -> Any:
    """Replace DynScalar fields of a params dataclass by their bound values."""
    if not is_dataclass(params) or isinstance(params, type):
        return params
    changes = {f.name: getattr(params, f.name).resolve(env) for f in fields(params)
               if isinstance(getattr(params, f.name), DynScalar)}
    return replace(params, **changes) if changes else params


def _run(plan: Plan, leaf_values: Sequence[np.ndarray], env: dict[str, int] | None) -> list[np.ndarray]:
    slots: list[Any] = [None] * plan.n_slots
    for s, v in zip(plan.leaf_slots, leaf_values, strict=True):
        if s >= 0:
            slots[s] = v
    for s, v in plan.baked.items():
        slots[s] = v
    tracing = bool(_TRACE)
    for step in plan.steps:
        start = time.perf_counter() if tracing else 0.0
        args = [slots[i] for i in step.inputs]
        node = step.node
        copies = 0
        if step.prim is not None:
            out = step.prim(args, node)
            if type(out) is not np.ndarray:  # NumPy full reductions return scalars
                out = np.asarray(out)
            impl_name = f"prim:{node.op.name.lower()}"
        else:
            out, copies = _run_fused(step, args, env)
            impl_name = step.impl.name if step.impl else "?"
        if out.shape != node.shape or out.dtype != node.dtype.np:
            raise KernelError(f"{impl_name}: produced {list(out.shape)} {out.dtype}, rules say "
                              f"{list(node.shape)} {node.dtype.value}")
        slots[step.output] = out
        for s in step.free_after:
            slots[s] = None
        if tracing:
            record = TraceRecord(repr(node), impl_name, time.perf_counter() - start, copies)
            for t in _TRACE:
                t.records.append(record)
    return [slots[s] for s in plan.outputs]


def _run_fused(step: Step, args: list[np.ndarray], env: dict[str, int] | None) -> tuple[np.ndarray, int]:
    impl, node = step.impl, step.node
    assert impl is not None
    copies = 0
    if not impl.caps.strided_input:
        for k, a in enumerate(args):
            if not a.flags.c_contiguous:
                args[k] = np.ascontiguousarray(a)
                copies += 1
    params = _resolve(node.arg[1], env)
    if step.destructive is not None:
        out = args[step.destructive]
        if not out.flags.writeable:
            raise KernelError(f"{impl.name}: input {step.destructive} is destroyed in place but is read-only")
    else:
        out = POOL.empty(node.shape, node.dtype.np)
    impl.kernel(args, out, params)
    return out, copies
