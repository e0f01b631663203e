"""An `fl.jit` trace in progress, and what its function may realise.

`fl.jit` runs its function once per signature over placeholder leaves holding the arguments. A value the
function realised then (`.numpy()`, `.item()`, `float(t)`, `bool(t)`, `np.asarray(t)`, `fl.realize`)
would be computed once and baked into the capture, whatever later calls pass. So while a thread traces,
realising a tensor is a `RealizeInTrace` error when it depends on an argument, or on a captured array
that can change between calls (a writable one). A tensor computed only from constants (`frozen` arrays:
read-only ones, `fl.tensor(arr, const=True)`, Python numbers) may be realised: its value is the same at
every call, and it is what the capture would fold anyway.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence

from fuel.errors import RealizeInTrace
from fuel.graph.node import Node, is_constant, topo_order

# Every placeholder of every trace, for as long as its node lives: it holds one call's argument, so no
# pass may decide by its values (`fuel.graph.passes.fuse.value_readable`), even a read-only one's.
_PLACEHOLDERS: weakref.WeakSet[Node] = weakref.WeakSet()

_STATE = threading.local()  # .args: {id(placeholder node): argument index}, .effects: the destructive
# nodes built, while this thread traces


@contextlib.contextmanager
def tracing(placeholders: Sequence[Node]) -> Iterator[None]:
    """This thread traces a function over `placeholders` (one per positional argument)."""
    outer, outer_effects = getattr(_STATE, "args", None), getattr(_STATE, "effects", None)
    _STATE.args = {id(p): i for i, p in enumerate(placeholders)}
    _STATE.effects = []
    _PLACEHOLDERS.update(placeholders)
    try:
        yield
    finally:
        _STATE.args, _STATE.effects = outer, outer_effects


def is_placeholder(node: Node) -> bool:
    """Whether `node` stands for an `fl.jit` argument (its value is only the first call's)."""
    return node in _PLACEHOLDERS


def note_effect(node: Node) -> None:
    """Record a destructive node built while this thread traces: `fl.jit` runs it at every call even when
    no output reads it (an optimizer's parameter update), as an eager program would have run the write."""
    effects: list[Node] | None = getattr(_STATE, "effects", None)
    if effects is not None:
        effects.append(node)


def effects() -> list[Node]:
    """The destructive nodes built so far in this thread's trace (empty outside a trace)."""
    return list(getattr(_STATE, "effects", None) or ())


def check_realize(nodes: Sequence[Node], how: str) -> None:
    """Refuse, inside a trace, to realise (by `how`, e.g. ".item()") a node that is not a constant."""
    args: dict[int, int] | None = getattr(_STATE, "args", None)
    if args is None:
        return
    for node in nodes:
        leaves = [n for n in topo_order([node]) if n.value is not None]
        what = f"{how} of a {list(node.shape)} {node.dtype.value} tensor ({node.op.name})"
        for leaf in leaves:
            if id(leaf) in args:
                raise RealizeInTrace(
                    f"jit: fn must not realise inside fl.jit, but it called {what}, which depends on argument "
                    f"{args[id(leaf)]} ({list(leaf.shape)} {leaf.dtype.value}): fn runs once per signature, "
                    f"so the value would be baked into the capture; keep it lazy, or return it as an output")
        for leaf in leaves:
            if not is_constant(leaf):
                raise RealizeInTrace(
                    f"jit: fn must not realise inside fl.jit, but it called {what}, which reads a writable "
                    f"captured array ({list(leaf.shape)} {leaf.dtype.value}) that may change between calls: "
                    f"its value would be baked into the capture; realise it before fl.jit, or capture the "
                    f"array as a constant with fl.tensor(arr, const=True)")
