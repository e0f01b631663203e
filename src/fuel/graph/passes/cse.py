"""Common-subexpression elimination: one node per (op, arg, inputs); leaves and destructive nodes stay."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fuel.graph.node import Node, topo_order
from fuel.graph.passes import arg_key


def cse(roots: Sequence[Node], destructive: Callable[[Node], int | None]) -> list[Node]:
    memo: dict[Node, Node] = {}
    table: dict[object, Node] = {}
    for node in topo_order(list(roots)):
        if node.value is not None:
            memo[node] = node
            continue
        inputs = tuple(memo[i] for i in node.inputs)
        if destructive(node) is not None:
            memo[node] = node.with_inputs(inputs)
            continue
        key = (node.op, arg_key(node.arg), tuple(id(i) for i in inputs))
        try:
            memo[node] = table.setdefault(key, node.with_inputs(inputs))
        except TypeError:  # an unhashable argument: keep the node as it is
            memo[node] = node.with_inputs(inputs)
    return [memo[r] for r in roots]
