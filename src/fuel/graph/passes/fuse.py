"""Pattern fusion: every live pattern of the registry, matched top-down with consumer counts."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence

import numpy as np

from fuel.errors import FuelError
from fuel.graph.node import Node, Op, consumer_counts, frozen, topo_order
from fuel.graph.registry import FusedOpEntry, FusedOpId, FusedOpRegistry, Match, fused_node
from fuel.graph.traced import is_placeholder

# The largest constant a pattern may read the values of (an attention mask [Sq, Sk], say).
READABLE_MAX_SIZE = 1 << 16


def value_readable(leaf: Node) -> bool:
    """Whether a pattern may decide by `leaf`'s values: a constant (its array cannot change, see
    `fuel.graph.node.frozen`) of rank >= 2 and at most READABLE_MAX_SIZE elements, and no `fl.jit` argument.
    Scalars are excluded so that a plan stays shared across scalar constants (a learning rate, say)."""
    v = leaf.value
    return (v is not None and leaf.op is Op.CONST and v.ndim >= 2 and v.size <= READABLE_MAX_SIZE and frozen(v)
            and not is_placeholder(leaf))


def value_key(leaf: Node) -> bytes | None:
    """A digest of a value-readable leaf's contents, else None. Plans are keyed on it: a plan fused by
    reading one constant (a causal mask) is never reused for another of the same shape (a window)."""
    if not value_readable(leaf):
        return None
    arr = np.ascontiguousarray(leaf.value)
    return hashlib.blake2b(arr.tobytes(), digest_size=16).digest()


class _Counts(dict[Node, int]):
    def __missing__(self, key: Node) -> int:
        return 0


def fuse(roots: Sequence[Node], registry: FusedOpRegistry, keep: Collection[Node] = ()) -> list[Node]:
    """Replace each subgraph a pattern recognises by its fused node; repeat until nothing changes.

    No node in `keep` is absorbed into a match (it may still be a match's root or input): a gradient
    asked for a view that a pattern sees through would otherwise have nowhere to flow.
    """
    kept = set(keep)
    patterns = [(e, e.pattern) for e in registry if e.pattern is not None]
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
            for entry, pattern in patterns:
                if node.op is Op.FUSED and node.arg[0] == entry.id:
                    continue
                m = pattern(node, counts)
                if m is None or not _fits(entry, m, node):
                    continue
                # Several patterns can match one root (a layer norm is an RMS norm of the centred
                # x): the one absorbing the most nodes wins, ties to the lower id.
                region = _region(node, m.inputs)
                if kept and any(n in kept for n in region if n is not node):
                    continue
                size = len(region)
                if best is None or size > best[0]:
                    best = (size, entry.id, m)
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
        kept = {memo.get(n, n) for n in kept}
    return current


def _region(root: Node, inputs: tuple[Node, ...]) -> set[Node]:
    """The nodes a match replaces: those reachable from its root without passing its inputs."""
    stop = set(inputs)
    seen: set[Node] = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if n in seen or n in stop:
            continue
        seen.add(n)
        stack.extend(n.inputs)
    return seen


def _fits(entry: FusedOpEntry, m: Match, root: Node) -> bool:
    """A match is used only if the entry's rules accept its inputs and give the root's shape and dtype."""
    try:
        shape = entry.shape_rule(tuple(i.shape for i in m.inputs), m.params)
        dtype = entry.dtype_rule(tuple(i.dtype for i in m.inputs), m.params)
    except FuelError:
        return False
    return tuple(shape) == root.shape and dtype == root.dtype and len(m.inputs) in entry.arity
