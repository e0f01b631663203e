"""realize(): plan a graph once per structure, then run it over the leaves' current values.

A plan holds kernels, op specs and slots, never Nodes or arrays of the graph it was built from: a
cached plan pins nothing of the user's. Plans are keyed by graph structure and by the generation
of both registries, so a kernel registered later is picked up instead of a stale plan reused.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from fuel.dispatch import threads
from fuel.dispatch.buffers import POOL
from fuel.dispatch.cpu.prims import PRIM_KERNELS, PrimKernel
from fuel.dispatch.fused import BackendImpl, FusedKernelRegistry, JointKernel, default_kernel_registry
from fuel.errors import KernelError, ShapeError, StaleInput
from fuel.graph.node import DynScalar, Node, Op, OpSpec, topo_order
from fuel.graph.passes import arg_key
from fuel.graph.passes.cse import cse
from fuel.graph.passes.fuse import fuse
from fuel.graph.passes.lower import lower
from fuel.graph.passes.order import alias_root, schedule
from fuel.graph.prims import DESTRUCTIVE_PRIMS, slots_of
from fuel.graph.registry import FusedOpRegistry, default_registry

if TYPE_CHECKING:
    from fuel.graph.tensor import Tensor

BACKEND = "cpu"
PLAN_CACHE_SIZE = 512


@dataclass(frozen=True)
class Step:
    spec: OpSpec
    prim: PrimKernel | None
    impl: BackendImpl | None
    params: Any  # a fused node's params, or a primitive's arg, as built (DynScalars unresolved)
    dyn_fields: tuple[str, ...]  # the params fields that are DynScalars, resolved per run
    destructive: int | None
    serial: bool  # below the Numba pool's threshold: the kernel runs on one Numba thread
    inline: bool  # below the workers' threshold too: split_work runs its parts in the calling thread
    inputs: tuple[int, ...]
    output: int
    free_after: tuple[int, ...]
    name: str  # the impl (or primitive) that runs it, as a trace shows it
    slots: tuple[tuple[tuple[int, ...], np.dtype[Any]], ...] | None = None  # a multi-output step's outputs
    joint: JointKernel | None = None  # runs this step's siblings too (same inputs and params)
    siblings: tuple[tuple[int, int, OpSpec], ...] = ()  # (entry id, slot, spec) of each sibling's output


@dataclass
class Plan:
    n_slots: int
    leaf_slots: tuple[int, ...]  # per leaf of the realised graph, in topological order (-1: unused)
    baked: dict[int, np.ndarray]  # constants the passes made (never the user's arrays)
    steps: list[Step]
    outputs: tuple[int, ...]
    destroys: bool = False  # some step writes an input in place


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
_PLANS_LOCK = threading.Lock()
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


def tracing() -> list[Trace]:
    return _TRACE


def clear_plan_cache() -> None:
    with _PLANS_LOCK:
        _PLANS.clear()


def plan_cache_size() -> int:
    return len(_PLANS)


def realize(*tensors: Tensor, env: dict[str, int] | None = None, fuse: bool = True) -> tuple[Tensor, ...]:
    """Compute the tensors (one plan for all of them) and return them, now realised."""
    from fuel.graph.tensor import Tensor

    for t in tensors:
        if not isinstance(t, Tensor):
            raise ShapeError(f"realize: expects Tensors, got {type(t).__name__}")
    if env:
        _drop_stale([t.node for t in tensors], env)
    roots = [t.node for t in tensors if t.node.value is None]
    if not roots:
        return tensors
    order = topo_order(roots)
    leaves = [n for n in order if n.value is not None]
    _check_not_stale(order, leaves)
    registry, kernels = default_registry(), default_kernel_registry()
    plan = cached_plan(order, roots, leaves, fuse, registry, kernels)
    threads.apply()
    values = run(plan, [n.value for n in leaves], env)  # type: ignore[misc]
    if plan.destroys:
        _mark_overwritten(order, _destructive(registry))
    bound = _bindings(order, env)
    for node, value in zip(roots, values, strict=True):
        node.value = value
        node.bound = bound.get(node)
    return tensors


def _check_not_stale(order: list[Node], leaves: list[Node]) -> None:
    """Refuse a graph built on a buffer that a destructive op rewrote after the graph was built: it
    would compute from the new contents, not from what its builder saw."""
    if all(leaf.written < 0 for leaf in leaves):
        return
    for n in order:
        if n.value is None:
            for i in n.inputs:
                if i.written > n.serial:
                    raise StaleInput(f"realize: {n!r} was built on {i!r}, whose buffer a destructive op "
                                     f"(inplace_affine, cache_write) has overwritten since; build it again "
                                     f"from the op's result")


def _mark_overwritten(order: list[Node], destructive: Any) -> None:
    """Stamp each realised buffer a destructive node of this graph wrote in place."""
    for n in order:
        k = destructive(n) if n.value is None else None
        if k is not None:
            root = alias_root(n.inputs[k])
            if root.value is not None:
                root.overwritten()


def cached_plan(order: list[Node], roots: list[Node], leaves: list[Node], fuse_on: bool,
                registry: FusedOpRegistry, kernels: FusedKernelRegistry) -> Plan:
    """The plan for this graph structure, built once and kept in the cache."""
    key = (_structure_key(order, roots, fuse_on), id(registry), id(kernels), kernels.generation)
    with _PLANS_LOCK:
        plan = _PLANS.get(key)
        if plan is not None:
            _PLANS.move_to_end(key)
    if plan is None:
        plan = build_plan(roots, leaves, fuse_on, registry, kernels)
        with _PLANS_LOCK:
            _PLANS[key] = plan
            if len(_PLANS) > PLAN_CACHE_SIZE:
                _PLANS.popitem(last=False)
    else:
        for tr in _TRACE:
            tr.plans_reused += 1
    return plan


def _drop_stale(roots: list[Node], env: dict[str, int]) -> None:
    """Forget realised values computed under other bindings of a name `env` binds now."""
    stack, seen = list(roots), set()
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if n.value is not None:
            if n.bound is None or all(env.get(k, v) == v for k, v in n.bound.items()):
                continue
            n.value, n.bound = None, None
        stack.extend(n.inputs)


def dyn_names(params: Any) -> tuple[str, ...]:
    """The fields of a params dataclass that hold DynScalars."""
    if not is_dataclass(params) or isinstance(params, type):
        return ()
    return tuple(f.name for f in fields(params) if isinstance(getattr(params, f.name), DynScalar))


def _bindings(order: list[Node], env: dict[str, int] | None) -> dict[Node, dict[str, int]]:
    """Per node, the DynScalar bindings its value depends on (only nodes that depend on some)."""
    if not env:
        return {}
    out: dict[Node, dict[str, int]] = {}
    for n in order:
        if n.value is not None:
            if n.bound:
                out[n] = n.bound
            continue
        names: dict[str, int] = {}
        for i in n.inputs:
            names.update(out.get(i, {}))
        params = n.arg[1] if n.op is Op.FUSED else n.arg
        for f in dyn_names(params):
            name = getattr(params, f).name
            names[name] = int(env[name])
        if names:
            out[n] = names
    return out


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
            return DESTRUCTIVE_PRIMS.get(n.op)
        entry = registry.get(n.arg[0])
        return None if entry is None else entry.destructive_input
    return destructive


def _impl_for(n: Node, kernels: FusedKernelRegistry) -> BackendImpl | None:
    return kernels.lookup(n.arg[0], BACKEND, (*(i.dtype for i in n.inputs), n.dtype))


def _thread_use(n: Node, impl: BackendImpl | None) -> tuple[bool, bool]:
    """(serial, inline) of a step by its impl's cost: one Numba thread, and no worker threads either."""
    if impl is None:
        return False, False
    cost = impl.cost([*(i.shape for i in n.inputs), n.shape], [*(i.dtype for i in n.inputs), n.dtype], n.arg[1])
    return threads.thread_use(cost.flops, cost.bytes_moved)


def _serial_now(step: Step, params: Any) -> tuple[bool, bool]:
    """Serial or parallel for a step with DynScalar parameters, sized with their values for this run: at
    plan time its cost had to assume the largest (a decode step's attention over a 2048-row cache reads
    only the live rows, which for a short conversation is work too small to wake the pool for)."""
    assert step.impl is not None
    spec = step.spec
    cost = step.impl.cost([*spec.in_shapes, spec.shape], [*spec.in_dtypes, spec.dtype], params)
    return threads.thread_use(cost.flops, cost.bytes_moved)


def build_plan(roots: list[Node], leaves: list[Node], fuse_on: bool,
               registry: FusedOpRegistry, kernels: FusedKernelRegistry) -> Plan:
    for tr in _TRACE:
        tr.plans_built += 1
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
        fused = n.op is Op.FUSED
        impl = _impl_for(n, kernels) if fused else None
        params = n.arg[1] if fused else n.arg
        slots = slots_of(n)
        serial, inline = _thread_use(n, impl)
        steps.append(Step(
            spec=n.spec(), prim=None if fused else PRIM_KERNELS[n.op], impl=impl, params=params,
            dyn_fields=dyn_names(params), destructive=destructive(n),
            serial=serial, inline=inline,
            inputs=tuple(slot[i] for i in n.inputs), output=slot[n], free_after=tuple(frees.get(step_index, ())),
            name=impl.name if impl is not None else f"prim:{n.op.name.lower()}",
            slots=None if slots is None else tuple((shape, dtype.np) for shape, dtype in slots)))
    return Plan(len(order), leaf_slots, baked, join_siblings(steps, kernels), tuple(slot[r] for r in graph),
                destroys=any(st.destructive is not None for st in steps))


def join_siblings(steps: list[Step], kernels: FusedKernelRegistry) -> list[Step]:
    """Fused steps that one joint kernel serves, over the same input slots and params, run as one: the
    first computes every sibling's output and the others are dropped (their frees move to the step
    before them, which is then the last reader of what they read)."""
    groups: dict[object, tuple[JointKernel, list[int]]] = {}
    for k, st in enumerate(steps):
        joint = None if st.impl is None else kernels.joint_for(st.impl.op_id, BACKEND)
        if joint is not None and st.impl is not None:
            key = (id(joint), st.inputs, arg_key(st.params), st.impl.dtypes[:-1])
            groups.setdefault(key, (joint, []))[1].append(k)
    dropped: set[int] = set()
    for joint, members in groups.values():
        if len(members) < 2:
            continue
        first, rest = steps[members[0]], [steps[m] for m in members[1:]]
        siblings = tuple((s.impl.op_id, s.output, s.spec) for s in rest if s.impl is not None)
        steps[members[0]] = replace(first, joint=joint, siblings=siblings,
                                    name=" + ".join([first.name, *(s.name for s in rest)]))
        dropped.update(members[1:])
    if not dropped:
        return steps
    kept: list[Step] = []
    for k, st in enumerate(steps):
        if k not in dropped:
            kept.append(st)
        elif st.free_after:
            kept[-1] = replace(kept[-1], free_after=kept[-1].free_after + st.free_after)
    return kept


def _copy_with(obj: Any, changes: dict[str, Any]) -> Any:
    """A copy of a frozen dataclass instance with `changes`, without `dataclasses.replace`'s __init__ (its
    fields were validated when the graph was built; a bound DynScalar is checked where it is used). A decode
    step binds one per cache write and attention: 1.3 µs here against 3-4 µs."""
    new = object.__new__(type(obj))
    fields = dict(obj.__dict__)
    fields.update(changes)
    object.__setattr__(new, "__dict__", fields)
    return new


def resolve(params: Any, names: Sequence[str], env: dict[str, int] | None) -> Any:
    """params with its DynScalar fields `names` replaced by their bound values."""
    if not names:
        return params
    return _copy_with(params, {f: getattr(params, f).resolve(env) for f in names})


def prim_spec(step: Step, env: dict[str, int] | None) -> OpSpec:
    """A primitive step's spec with the DynScalars of its arg bound (e.g. a cache write's offset)."""
    spec: OpSpec = _copy_with(step.spec, {"arg": resolve(step.params, step.dyn_fields, env)})
    return spec


def _resolve(params: Any, env: dict[str, int] | None) -> Any:
    """Replace DynScalar fields of a params dataclass by their bound values."""
    return resolve(params, dyn_names(params), env)


def run(plan: Plan, leaf_values: Sequence[np.ndarray], env: dict[str, int] | None) -> list[np.ndarray]:
    """Run a plan once, allocating its intermediates (large ones from the pool) and freeing each
    after its last reader."""
    slots: list[Any] = [None] * plan.n_slots
    for s, v in zip(plan.leaf_slots, leaf_values, strict=True):
        if s >= 0:
            slots[s] = v
    for s, v in plan.baked.items():
        slots[s] = v
    tracing = bool(_TRACE)
    try:
        # Kernels follow IEEE (log 0 = -inf, 0/0 = NaN, as torch does); NumPy's warnings would only be noise.
        with np.errstate(all="ignore"):
            for step in plan.steps:
                start = time.perf_counter() if tracing else 0.0
                args = [slots[i] for i in step.inputs]
                spec = step.spec
                copies = 0
                if step.prim is not None:
                    out = checked(step, step.prim(args, prim_spec(step, env) if step.dyn_fields else spec, None))
                else:
                    out, copies = run_fused(step, args, None, env, slots=slots)
                slots[step.output] = out
                for s in step.free_after:
                    slots[s] = None
                if tracing:
                    record(step, start, copies)
    finally:
        threads.use_serial(False)
    return [slots[s] for s in plan.outputs]


def checked(step: Step, out: Any) -> Any:
    """A primitive's result as an array (a tuple of them for a multi-output one), checked against the
    node's rules."""
    if step.slots is not None:
        if not isinstance(out, tuple) or [(o.shape, o.dtype) for o in out] != list(step.slots):
            raise KernelError(f"{step.name}: produced {_describe(out)}, rules say "
                              f"{[(list(s), str(d)) for s, d in step.slots]}")
        return out
    if type(out) is not np.ndarray:  # NumPy full reductions return scalars
        out = np.asarray(out)
    spec = step.spec
    if out.shape != spec.shape or out.dtype != spec.dtype.np:
        raise KernelError(f"{step.name}: produced {list(out.shape)} {out.dtype}, rules say "
                          f"{list(spec.shape)} {spec.dtype.value}")
    return out


def _describe(out: Any) -> str:
    if isinstance(out, tuple):
        return str([(list(o.shape), str(o.dtype)) for o in out])
    return type(out).__name__


def run_fused(step: Step, args: list[np.ndarray], out: np.ndarray | None, env: dict[str, int] | None,
              check: Sequence[int] | None = None, slots: list[Any] | None = None) -> tuple[Any, int]:
    """Run a fused step's kernel into `out` (allocated here when None), serially if the step is small.

    Inputs at positions `check` (all when None) are made contiguous for an impl that needs it. A joint
    step also writes its siblings' outputs into `slots`. Returns the output and the number of input
    copies made.
    """
    impl, spec = step.impl, step.spec
    assert impl is not None
    copies = 0
    if not impl.caps.strided_input:
        for k in range(len(args)) if check is None else check:
            if not args[k].flags.c_contiguous:
                args[k] = np.ascontiguousarray(args[k])
                copies += 1
    params = resolve(step.params, step.dyn_fields, env)
    result: Any
    if step.destructive is not None:
        result = args[step.destructive]
        if not result.flags.writeable:
            raise KernelError(f"{impl.name}: input {step.destructive} is destroyed in place but is read-only")
    elif step.slots is not None:
        result = tuple(POOL.empty(shape, dtype) for shape, dtype in step.slots)
    else:
        result = POOL.empty(spec.shape, spec.dtype.np) if out is None else out
    threads.use_serial(*(_serial_now(step, params) if step.dyn_fields else (step.serial, step.inline)))
    if step.joint is not None and slots is not None:
        outs: dict[int, np.ndarray] = {impl.op_id: result}
        for op_id, slot, sib in step.siblings:
            outs[op_id] = slots[slot] = POOL.empty(sib.shape, sib.dtype.np)
        step.joint.kernel(args, outs, params)
    else:
        impl.kernel(args, result, params)
    return result, copies


def record(step: Step, start: float, copies: int) -> None:
    """Add a step's run to every open trace."""
    rec = TraceRecord(step.spec.label, step.name, time.perf_counter() - start, copies)
    for t in _TRACE:
        t.records.append(rec)
