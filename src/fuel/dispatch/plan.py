"""A graph's plan: its nodes as steps over numbered slots, each with the kernel that runs it.

`build` runs the graph passes (CSE, fusion, lowering, scheduling) and turns the scheduled nodes into
`Step`s: a primitive's NumPy kernel or a fused node's impl, its input and output slots, the slots it
frees and its DynScalar fields. How a step's kernel uses threads is the runtime's choice, per job, when it
runs (`fuel.runtime.jobs`). The executor caches and runs plans; `fl.jit` keeps one per captured signature.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

import numpy as np

from fuel.cpu.prims.prims import PRIM_KERNELS, PrimKernel
from fuel.dispatch.impls import BackendImpl, FusedKernelRegistry, JointKernel
from fuel.graph.node import DynScalar, Node, Op, OpSpec
from fuel.graph.passes import arg_key
from fuel.graph.passes.cse import cse
from fuel.graph.passes.fuse import fuse
from fuel.graph.passes.lower import lower
from fuel.graph.passes.order import schedule
from fuel.graph.prims import DESTRUCTIVE_PRIMS
from fuel.graph.registry import FusedOpRegistry
from fuel.graph.slots import slots_of

BACKEND = "cpu"


@dataclass(frozen=True)
class Step:
    spec: OpSpec
    prim: PrimKernel | None
    impl: BackendImpl | None
    params: Any  # a fused node's params, or a primitive's arg, as built (DynScalars unresolved)
    dyn_fields: tuple[str, ...]  # the params fields that are DynScalars, resolved per run
    destructive: int | None
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


def dyn_names(params: Any) -> tuple[str, ...]:
    """The fields of a params dataclass that hold DynScalars."""
    if not is_dataclass(params) or isinstance(params, type):
        return ()
    return tuple(f.name for f in fields(params) if isinstance(getattr(params, f.name), DynScalar))



def destructive_of(registry: FusedOpRegistry) -> Any:
    def destructive(n: Node) -> int | None:
        if n.op is not Op.FUSED:
            return DESTRUCTIVE_PRIMS.get(n.op)
        entry = registry.get(n.arg[0])
        return None if entry is None else entry.destructive_input
    return destructive


def impl_for(n: Node, kernels: FusedKernelRegistry) -> BackendImpl | None:
    return kernels.lookup(n.arg[0], BACKEND, (*(i.dtype for i in n.inputs), n.dtype))


def build(roots: list[Node], leaves: list[Node], fuse_on: bool,
               registry: FusedOpRegistry, kernels: FusedKernelRegistry) -> Plan:
    destructive = destructive_of(registry)
    graph = cse(roots, destructive)
    if fuse_on:
        graph = cse(fuse(graph, registry), destructive)
    graph = lower(graph, registry, lambda n: impl_for(n, kernels) is not None)
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
        impl = impl_for(n, kernels) if fused else None
        params = n.arg[1] if fused else n.arg
        slots = slots_of(n)
        steps.append(Step(
            spec=n.spec(), prim=None if fused else PRIM_KERNELS[n.op], impl=impl, params=params,
            dyn_fields=dyn_names(params), destructive=destructive(n),
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
