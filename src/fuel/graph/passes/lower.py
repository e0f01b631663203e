"""Lowering: a fused node no kernel serves is replaced by its entry's primitive decomposition."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fuel.errors import KernelError, NoDecomposition
from fuel.graph.node import Node, Op, topo_order
from fuel.graph.registry import FusedOpRegistry
from fuel.graph.slots import slots_of


def lower(roots: Sequence[Node], registry: FusedOpRegistry, served: Callable[[Node], bool]) -> list[Node]:
    """Decompose every FUSED node for which `served(node)` is false, until none is left."""
    from fuel.graph.tensor import Tensor

    current = list(roots)
    for _ in range(16):
        order = topo_order(current)
        memo: dict[Node, Node] = {}
        changed = False
        lowered_slots: dict[Node, tuple[Node, ...]] = {}  # a lowered multi-output node's slots
        for n in order:
            if n.value is not None:
                memo[n] = n
                continue
            new = n.with_inputs(tuple(memo[i] for i in n.inputs))
            if new.op is Op.VIEW and new.inputs[0] in lowered_slots:
                new = lowered_slots[new.inputs[0]][new.arg[0]]
            elif new.op is Op.FUSED and not served(new):
                entry = registry.entry(new.arg[0])
                if entry.decompose is None:
                    raise KernelError(f"{entry.name}: no kernel for dtypes "
                                      f"({', '.join(i.dtype.value for i in new.inputs)}) and no decomposition")
                try:
                    result = entry.decompose([Tensor(i) for i in new.inputs], new.arg[1])
                except NoDecomposition as e:
                    raise KernelError(f"{entry.name}: no kernel for these dtypes and {e}") from e
                outs = result if isinstance(result, tuple) else (result,)
                want = slots_of(new) or [(new.shape, new.dtype)]
                got = [(t.shape, t.dtype) for t in outs]
                if got != want:
                    raise KernelError(f"{entry.name}: decomposition gives {_show(got)}, rules say {_show(want)}")
                if isinstance(result, tuple):
                    lowered_slots[new] = tuple(t.node for t in outs)
                else:
                    new = outs[0].node
                changed = True
            memo[n] = new
        current = [memo[r] for r in current]
        if not changed:
            return current
    raise KernelError("lower: decompositions did not settle after 16 rounds")


def _show(slots: list[tuple[tuple[int, ...], Any]]) -> str:
    return ", ".join(f"{list(shape)} {dtype.value}" for shape, dtype in slots)
