"""realize(): plan a graph once per structure, then run it over the leaves' current values.

A plan holds kernels, op specs and slots, never Nodes or arrays of the graph it was built from: a
cached plan pins nothing of the user's. Plans are keyed by graph structure and by the generation
of both registries, so a kernel registered later is picked up instead of a stale plan reused.
"""

from __future__ import annotations

import operator
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fuel.dispatch.impls import FusedKernelRegistry, default_kernel_registry
from fuel.dispatch.plan import Plan, Step, build, dyn_names
from fuel.dispatch.plan import destructive_of as _destructive
from fuel.dtype import DType
from fuel.errors import KernelError, ShapeError, StaleInput
from fuel.graph.node import Node, Op, OpSpec, topo_order
from fuel.graph.passes import arg_key
from fuel.graph.passes.fuse import value_key
from fuel.graph.passes.order import alias_root
from fuel.graph.registry import FusedOpRegistry, default_registry
from fuel.graph.traced import check_realize
from fuel.runtime.buffers import POOL

if TYPE_CHECKING:
    from fuel.graph.tensor import Tensor

PLAN_CACHE_SIZE = 512


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

    @property
    def copies(self) -> int:
        """How many inputs the executor made contiguous (copied) for kernels that read only contiguous ones."""
        return sum(r.copies for r in self.records)

    @property
    def copied(self) -> list[TraceRecord]:
        """The runs that copied an input, in order."""
        return [r for r in self.records if r.copies]

    def __str__(self) -> str:
        lines = [f"{'node':44} {'impl':44} {'ms':>9} copies"]
        for r in self.records:
            lines.append(f"{r.node[:44]:44} {r.impl[:44]:44} {r.seconds * 1e3:9.3f} {r.copies:6}")
        lines.append(f"plans built {self.plans_built}, reused {self.plans_reused}, input copies {self.copies}")
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
    check_realize([t.node for t in tensors], "fl.realize()")  # refused inside an fl.jit trace
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
                                     f"(inplace_affine, cache_write, index_copy) has overwritten since; build it "
                                     f"again from the op's result")


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
            parts.append(("leaf", n.shape, n.dtype, value_key(n)))  # patterns may read small constants
        else:
            parts.append((n.op, arg_key(n.arg), tuple(index[i] for i in n.inputs), n.shape, n.dtype))
    parts.append(tuple(index[r] for r in roots))
    return tuple(parts)


def build_plan(roots: list[Node], leaves: list[Node], fuse_on: bool,
               registry: FusedOpRegistry, kernels: FusedKernelRegistry) -> Plan:
    """`fuel.dispatch.plan.build`, counted in every open trace."""
    for tr in _TRACE:
        tr.plans_built += 1
    return build(roots, leaves, fuse_on, registry, kernels)


def _copy_with(obj: Any, changes: dict[str, Any]) -> Any:
    """A copy of a frozen dataclass instance with `changes`, without `dataclasses.replace`'s __init__ (its
    fields were validated when the graph was built; a bound DynScalar is checked where it is used). A decode
    step binds one per cache write and attention (docs/performance/runtime.md, "executor")."""
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


_DTYPE_OF = operator.attrgetter("dtype")


def _names(items: Sequence[Any]) -> str:
    """Dtypes (or arrays' dtypes) by Fuel's names where Fuel stores them, NumPy's otherwise."""
    known = {d.np: d.value for d in DType}
    dts = [getattr(x, "dtype", x) for x in items]
    return "(" + ", ".join(known.get(d, str(d)) for d in dts) + ")"


def run_fused(step: Step, args: list[np.ndarray], out: np.ndarray | None, env: dict[str, int] | None,
              check: Sequence[int] | None = None, slots: list[Any] | None = None) -> tuple[Any, int]:
    """Run a fused step's kernel into `out` (allocated here when None).

    Inputs at positions `check` (all when None) are made contiguous for an impl that needs it: every
    non-contiguous one for an impl without `strided_input`, those its `caps.reads` refuses otherwise. A joint
    step also writes its siblings' outputs into `slots`. Returns the output and the number of input
    copies made. The inputs' and the output's dtypes must be the impl's registered tuple, else it is a
    KernelError and the kernel does not run: kernels read their arrays as the types they were written for.
    """
    impl, spec = step.impl, step.spec
    assert impl is not None
    ins, out_dtype = impl.np_dtypes
    if tuple(map(_DTYPE_OF, args)) != ins:
        raise KernelError(f"{impl.name}: is registered for inputs {_names(ins)}, got {_names(args)}")
    copies = 0
    caps = impl.caps
    if not caps.strided_input or caps.reads is not None:
        reads = caps.reads
        for k in range(len(args)) if check is None else check:
            a = args[k]
            if not a.flags.c_contiguous and (reads is None or not reads(k, a)):
                args[k] = np.ascontiguousarray(a)
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
    if type(result) is not tuple and result.dtype is not out_dtype and result.dtype != out_dtype:
        raise KernelError(f"{impl.name}: is registered for a {_names([out_dtype])} output, got {_names([result])}")
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
