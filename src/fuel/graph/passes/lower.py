"""Lowering: a fused node no kernel serves is replaced by its entry's primitive decomposition."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fuel.errors import KernelError, NoDecomposition
from fuel.graph.node import Node, Op, topo_order
from fuel.graph.registry import FusedOpRegistry


def lower(roots: Sequence[Node], registry: FusedOpRegistry, served: Callable[[Node], bool]) -> list[Node]:
    """Decompose every FUSED node for which `served(node)` is false, until none is left."""
    from fuel.graph.tensor import Tensor

    current = list(roots)
    for _ in range(16):
        order = topo_order(current)
        memo: dict[Node, Node] = {}
        changed = False
        for n in order:
            if n.value is not None:
                memo[n] = n
                continue
            new = n.with_inputs(tuple(memo[i] for i in n.inputs))
            if new.op is Op.FUSED and not served(new):
                entry = registry.entry(new.arg[0])
                if entry.decompose is None:
                    raise KernelError(f"{entry.name}: no kernel for dtypes "
                                      f"({', '.join(i.dtype.value for i in new.inputs)}) and no decomposition")
                try:
                    out = entry.decompose([Tensor(i) for i in new.inputs], new.arg[1]).node
                except NoDecomposition as e:
                    raise KernelError(f"{entry.name}: no kernel for these dtypes and {e}") from e
                if out.shape != new.shape or out.dtype != new.dtype:
                    raise KernelError(f"{entry.name}: decomposition gives {list(out.shape)} {out.dtype.value}, "
                                      f"rules say {list(new.shape)} {new.dtype.value}")
                new = out
                changed = True
            memo[n] = new
        current = [memo[r] for r in current]
        if not changed:
            return current
    raise KernelError("lower: decompositions did not settle after 16 rounds")
