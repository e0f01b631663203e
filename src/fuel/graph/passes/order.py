"""Scheduling: topological order where a destructive node runs after every other reader of what it destroys."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from fuel.errors import KernelError
from fuel.graph.node import Node, Op, topo_order
from fuel.graph.prims import VIEW_OPS

_ALIASING = VIEW_OPS | {Op.RESHAPE, Op.CONTIGUIZE}


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
        aliases = {d.inputs[k]}
        for n in order[position[d.inputs[k]]:]:
            if n.value is None and n is not d and n.op in _ALIASING and n.inputs[0] in aliases:
                aliases.add(n)
        for a in aliases:
            for reader in users[a]:
                if reader is not d and reader not in aliases:
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
