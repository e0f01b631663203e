"""Pattern fusion: every live pattern of the registry, matched top-down with consumer counts."""

from __future__ import annotations

from collections.abc import Sequence

from fuel.graph.node import Node, Op, consumer_counts, topo_order
from fuel.graph.registry import FusedOpId, FusedOpRegistry, Match, fused_node


class _Counts(dict[Node, int]):
    def __missing__(self, key: Node) -> int:
        return 0


def fuse(roots: Sequence[Node], registry: FusedOpRegistry) -> list[Node]:
    """Replace each subgraph a pattern recognises by its fused node; repeat until nothing changes."""
    patterns = [(e.id, e.pattern) for e in registry if e.pattern is not None]
    current = list(roots)
    for _ in range(8):
        order = topo_order(current)
        by_id = consumer_counts(order, current)
        counts = _Counts({n: by_id.get(id(n), 0) for n in order})
        replaced: dict[Node, tuple[FusedOpId, tuple[Node, ...], object]] = {}
        for node in reversed(order):
            if node.value is not None:
                continue
            best: tuple[int, FusedOpId, Match] | None = None
            for op_id, pattern in patterns:
                if node.op is Op.FUSED and node.arg[0] == op_id:
                    continue
                m = pattern(node, counts)
                # Several patterns can match one root (a layer norm is an RMS norm of the centred
                # x): the one absorbing the most nodes wins, ties to the lower id.
                if m is not None and (best is None or _region(node, m.inputs) > best[0]):
                    best = (_region(node, m.inputs), op_id, m)
            if best is not None:
                replaced[node] = (best[1], best[2].inputs, best[2].params)
        if not replaced:
            return current
        # Inputs of a match lie below its root, so one pass in topological order rebuilds all.
        memo: dict[Node, Node] = {}
        for n in order:
            if n.value is not None:
                memo[n] = n
            elif n in replaced:
                fused_id, inputs, params = replaced[n]
                memo[n] = fused_node(fused_id, [memo[i] for i in inputs], params)
            else:
                memo[n] = n.with_inputs(tuple(memo[i] for i in n.inputs))
        current = [memo[r] for r in current]
    return current


def _region(root: Node, inputs: tuple[Node, ...]) -> int:
    """How many nodes a match replaces: those reachable from its root without passing its inputs."""
    stop = set(inputs)
    seen: set[Node] = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if n in seen or n in stop:
            continue
        seen.add(n)
        stack.extend(n.inputs)
    return len(seen)
