"""The outputs (slots) of multi-output nodes, as (shape, dtype) pairs: a table for the multi-output
primitives, the registry's `output_views` for fused ops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fuel.dtype import DType
from fuel.errors import ShapeError
from fuel.graph.node import Node, Op, Shape

Slots = list[tuple[Shape, DType]]


def _input_grads(op: Op, n_wrt: int) -> Callable[[tuple[Node, ...], Any], Slots]:
    """Slots of a gradient kernel whose inputs are the forward's `n_wrt` inputs then its cotangents:
    one gradient per forward input, with that input's shape and dtype."""
    def slots(inputs: tuple[Node, ...], arg: Any) -> Slots:
        if len(inputs) < n_wrt:
            raise ShapeError(f"{op.name.lower()}: takes the forward's {n_wrt} inputs and its cotangents, got "
                             f"{len(inputs)} inputs")
        return [(i.shape, i.dtype) for i in inputs[:n_wrt]]
    return slots


# Multi-output primitives: the node's own shape and dtype are slot 0's; VIEW nodes project the slots.
PRIM_SLOTS: dict[Op, Callable[[tuple[Node, ...], Any], Slots]] = {
    Op.SELECTIVE_SCAN_GRAD: _input_grads(Op.SELECTIVE_SCAN_GRAD, 5),
    Op.SSD_CHUNK_SCAN_GRAD: _input_grads(Op.SSD_CHUNK_SCAN_GRAD, 5),
}


def slots_of(node: Node) -> Slots | None:
    """The (shape, dtype) of each output of a multi-output node, or None for a single-output one."""
    if node.op is Op.FUSED:
        from fuel.graph.registry import default_registry

        entry = default_registry().get(node.arg[0])
        if entry is None or entry.output_views is None:
            return None
        return entry.output_views(tuple(i.shape for i in node.inputs), tuple(i.dtype for i in node.inputs),
                                  node.arg[1])
    rule = PRIM_SLOTS.get(node.op)
    return None if rule is None else rule(node.inputs, node.arg)
