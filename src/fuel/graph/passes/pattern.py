"""Helpers patterns share: recognising keepdim reductions and broadcasts, and consumer guards."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from fuel.graph.node import Node, Op


def only_used_once(counts: Mapping[Node, int], nodes: Iterable[Node]) -> bool:
    return all(counts[n] == 1 for n in nodes)


def keepdim_last(n: Node, dim_op: Op, to_op: Op | None) -> tuple[Node, list[Node]] | None:
    """If `n` reduces the last axis of some x keeping it as 1, return (x, the nodes doing it).

    Three spellings: UNSQUEEZE(last)(DIM_OP(last)(x)), RESHAPE(keep)(DIM_OP(last)(x)) and
    TO_OP(x.shape[:-1] + (1,))(x).
    """
    if n.op in (Op.UNSQUEEZE, Op.RESHAPE) and n.inputs[0].op is dim_op:
        r = n.inputs[0]
        x = r.inputs[0]
        if x.shape and r.arg == len(x.shape) - 1 and n.shape == x.shape[:-1] + (1,):
            return x, [n, r]
    if to_op is not None and n.op is to_op:
        x = n.inputs[0]
        if x.shape and n.shape == x.shape[:-1] + (1,):
            return x, [n]
    return None


def unbroadcast(n: Node, shape: tuple[int, ...]) -> tuple[Node, list[Node]]:
    """See through a BROADCAST_TO to `shape`; a node already of that shape stands as it is."""
    if n.op is Op.BROADCAST_TO and n.shape == shape:
        return n.inputs[0], [n]
    return n, []


def broadcast_keepdim_last(n: Node, dim_op: Op, to_op: Op | None, shape: tuple[int, ...]
                           ) -> tuple[Node, list[Node]] | None:
    """`n` = broadcast to `shape` of a keepdim last-axis reduction of some x (of that shape)."""
    inner, bnodes = unbroadcast(n, shape)
    found = keepdim_last(inner, dim_op, to_op)
    if found is None or found[0].shape != shape:
        return None
    return found[0], bnodes + found[1]
