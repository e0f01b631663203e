"""Scheduling: topological order where a destructive node runs after every other reader of what it destroys."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from fuel.errors import KernelError, StaleInput
from fuel.graph.node import Node, Op, topo_order
from fuel.graph.prims import VIEW_OPS

_ALIASING = VIEW_OPS | {Op.RESHAPE, Op.CONTIGUIZE}


def alias_root(n: Node) -> Node:
    """The node whose buffer `n` views (itself when it is no view)."""
    while n.value is None and n.op in _ALIASING:
        n = n.inputs[0]
    return n


def _users_of(d: Node, users: dict[Node, list[Node]]) -> set[Node]:
    """Every node that depends on `d` (transitively)."""
    seen: set[Node] = set()
    stack = list(users[d])
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(users[n])
    return seen


def schedule(roots: Sequence[Node], destructive: Callable[[Node], int | None]) -> list[Node]:
    order = topo_order(list(roots))
    position = {n: i for i, n in enumerate(order)}
    users: dict[Node, list[Node]] = {n: [] for n in order}
    for n in order:
        if n.value is None:
            for i in n.inputs:
                users[i].append(n)
    after: dict[Node, set[Node]] = {n: set() for n in order}  # extra edges: key runs after each value
    for d in order:
        k = destructive(d) if d.value is None else None
        if k is None:
            continue
        root = alias_root(d.inputs[k])
        aliases = {root}
        for n in order[position[root]:]:
            if n.value is None and n is not d and n.op in _ALIASING and n.inputs[0] in aliases:
                aliases.add(n)
        downstream = _users_of(d, users)
        for a in aliases:
            for reader in users[a]:
                if reader is d or reader in aliases:
                    continue
                kr = destructive(reader) if reader.value is None else None
                if kr is not None and alias_root(reader.inputs[kr]) is root:
                    raise StaleInput(f"schedule: {d!r} and {reader!r} both overwrite {root!r} in place, each "
                                     f"from its old value; chain them (build the second on the first's result)")
                if reader in downstream:
                    raise StaleInput(f"schedule: {reader!r} reads {a!r}, which {d!r} overwrites in place, and "
                                     f"also depends on that op's result, so it would need the value after it "
                                     f"is destroyed; copy the input first (e.g. x * 1.0) or use only the result")
                after[d].add(reader)
    indegree = {n: 0 for n in order}
    succ: dict[Node, list[Node]] = {n: [] for n in order}
    for n in order:
        preds = set(n.inputs) if n.value is None else set()
        preds |= after[n]
        for p in preds:
            succ[p].append(n)
            indegree[n] += 1
    ready = [(position[n], n.serial, n) for n in order if indegree[n] == 0]
    heapq.heapify(ready)
    out: list[Node] = []
    while ready:
        _, _, n = heapq.heappop(ready)
        out.append(n)
        for s in succ[n]:
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(ready, (position[s], s.serial, s))
    if len(out) != len(order):
        raise KernelError("schedule: a destructive node's input is read by one of its own inputs (a cycle)")
    return out
