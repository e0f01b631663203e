"""Patterns derived from recipes: a function in the primitive Tensor API, traced once into a template.

    def _recipe(x: Wild, eps: Scalar) -> Tensor:
        return x / (x * x).mean(-1, keepdim=True).add(eps).sqrt()
    pattern = template_pattern(_recipe, build=lambda m: Match((m["x"],), Params(m["eps"])))

`template_pattern` calls the recipe once on placeholder leaves (one per `Wild` parameter, at small
example shapes) and sentinel numbers (one per `Scalar` parameter), and turns the traced graph into a
template. The callable it returns is the `pattern(node, counts) -> Match | None` fuse.py runs.

How a template matches a graph node (the contract every recipe relies on):
- Structure, not shapes: op by op, with axes in negative form (a reduction of the last axis matches at
  any rank), slices as fractions of their axis, permutations by their trailing non-identity part. A
  RESHAPE only matches the same target shape; PAD matches any widths on the same axes (build checks them).
- Equivalent spellings read alike: `v * v`, `v.square()` and `v ** 2`; a keepdim reduction spelled
  UNSQUEEZE(X_DIM), RESHAPE(X_DIM) or REDUCE_X_TO; the commutative binary ops in either operand order.
- A BROADCAST_TO in the template is optional in the graph (at other shapes it may be a no-op).
- A `Wild` binds any node (the same node wherever the name recurs), subject to the recipe's guards.
- A `Scalar` binds the argument of ADD_SCALAR / MUL_SCALAR / POW_SCALAR or a one-element constant leaf,
  seen through the negation or reciprocal the recipe applied to it (`x - eps` is ADD_SCALAR(-eps),
  `s / c` divides by a constant c while `s * (1 / c)` multiplies by 1/c). Every occurrence must agree
  (to the rounding of the constant's dtype). Other one-element constants match by value.
- Single consumer: every matched node except the root has no reader outside the match, or fusing
  would compute it twice. Free views are exempt: a view op reading only bound inputs (or other free
  views) copies nothing, so another reader keeping it alive duplicates no work.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np

from fuel.dtype import DType
from fuel.errors import ParamError
from fuel.graph.node import Node, Op, Shape
from fuel.graph.passes.readings import COMMUTATIVE, SCALAR_ARG, VIEWS, readings
from fuel.graph.registry import Match
from fuel.graph.tensor import Tensor

Wild: TypeAlias = Tensor
Scalar: TypeAlias = float

# How the recipe transformed a Scalar before the graph saw it, and the inverse that recovers it.
_TRANSFORMS: dict[str, Callable[[float], float]] = {
    "id": lambda v: v, "neg": lambda v: -v,
    "recip": lambda v: 1.0 / v if v else math.inf, "negrecip": lambda v: -1.0 / v if v else math.inf,
}
DEFAULT_SHAPE: Shape = (2, 3, 5, 8)


class TemplateError(ParamError):
    """A recipe the template tracer cannot turn into a template (a bug in the pattern's module)."""


@dataclass(eq=False)
class TNode:
    """A template node. kind: 'op', 'bcast' (optional broadcast), 'wild', 'scalar' or 'literal'."""

    kind: str
    key: Hashable
    inputs: tuple[TNode, ...] = ()
    bind: tuple[str, str] | None = None  # (Scalar name, transform) of a SCALAR_ARG op or scalar leaf
    literal: Any = None  # the fixed scalar of a SCALAR_ARG op, or a literal leaf's value


@dataclass
class _State:
    tmap: dict[int, Node] = field(default_factory=dict)
    wild: dict[str, Node] = field(default_factory=dict)
    scal: dict[str, tuple[float, float]] = field(default_factory=dict)
    real: list[Node] = field(default_factory=list)  # matched interior nodes (root first)

    def copy(self) -> _State:
        return _State(dict(self.tmap), dict(self.wild), dict(self.scal), list(self.real))


def _tol(dtype: DType) -> float:
    return float(np.finfo(dtype.np).eps) if dtype.is_float else 0.0


def _bind_scalar(st: _State, bind: tuple[str, str], raw: float, tol: float) -> _State | None:
    name, how = bind
    v = _TRANSFORMS[how](float(raw))
    if not math.isfinite(v) and not math.isinf(v):
        return None
    old = st.scal.get(name)
    if old is not None:
        w, wt = old
        if v != w and not (math.isfinite(v) and abs(v - w) <= 2 * max(tol, wt, 1e-12) * max(abs(v), abs(w))):
            return None
        return st
    st2 = st.copy()
    st2.scal[name] = (v, tol)
    return st2


def _leaf_scalar(n: Node) -> float | None:
    if n.value is None or n.value.size != 1 or n.op is not Op.CONST:
        return None
    return float(np.asarray(n.value).reshape(()))


class Bound:
    """A successful match: `m["x"]` is the node a Wild bound, `m["eps"]` the number a Scalar bound."""

    def __init__(self, root: Node, st: _State) -> None:
        self.root = root
        self._st = st

    def __getitem__(self, name: str) -> Any:
        if name in self._st.wild:
            return self._st.wild[name]
        return self._st.scal[name][0]

    def get(self, name: str) -> Any:
        """What `name` bound, or None when this variant of the recipe does not use it."""
        return self[name] if name in self._st.wild or name in self._st.scal else None

    def node(self, name: str) -> Node:
        return self._st.wild[name]

    def scalar(self, name: str) -> float:
        return self._st.scal[name][0]

    @property
    def nodes(self) -> tuple[Node, ...]:
        """The matched interior nodes, root first."""
        return tuple(self._st.real)


class Template:
    """One traced recipe: match it at a graph node."""

    def __init__(self, root: TNode, guards: Mapping[str, Callable[[Node], bool]]) -> None:
        self.root = root
        self.guards = dict(guards)

    def match(self, node: Node, counts: Mapping[Node, int]) -> Iterator[Bound]:
        for st in self._match(self.root, node, _State()):
            if self._consumers_ok(node, st, counts):
                yield Bound(node, st)

    def _consumers_ok(self, root: Node, st: _State, counts: Mapping[Node, int]) -> bool:
        bound = {id(n) for n in st.wild.values()}
        interior = {id(n): n for n in st.real if id(n) not in bound}
        free: dict[int, bool] = {}

        def is_free(n: Node) -> bool:
            if id(n) not in interior:  # a bound input or a leaf: outside the match
                return True
            if n.op not in VIEWS:
                return False
            if id(n) not in free:
                free[id(n)] = all(is_free(i) for i in n.inputs)
            return free[id(n)]

        uses: dict[int, int] = {}
        for n in interior.values():
            for i in n.inputs:
                uses[id(i)] = uses.get(id(i), 0) + 1
        return all(n is root or is_free(n) or counts[n] == uses.get(k, 0) for k, n in interior.items())

    def _match(self, t: TNode, n: Node, st: _State) -> Iterator[_State]:
        prev = st.tmap.get(id(t))
        if prev is not None:
            if prev is n:
                yield st
            return
        if t.kind == "wild":
            name = str(t.key)
            if (name in st.wild and st.wild[name] is not n) or not self.guards.get(name, _yes)(n):
                return
            st = st.copy()
            st.wild[name], st.tmap[id(t)] = n, n
            yield st
        elif t.kind in ("scalar", "literal"):
            v = _leaf_scalar(n)
            if v is None:
                return
            if t.kind == "literal":
                if not (v == t.literal or (math.isnan(v) and math.isnan(t.literal))):
                    return
                yield st
            else:
                assert t.bind is not None
                got = _bind_scalar(st, t.bind, v, _tol(n.dtype))
                if got is not None:
                    yield got
        elif t.kind == "bcast":
            if n.op is Op.BROADCAST_TO:
                st2 = st.copy()
                st2.tmap[id(t)] = n
                st2.real.append(n)
                yield from self._match(t.inputs[0], n.inputs[0], st2)
            st3 = st.copy()
            st3.tmap[id(t)] = n
            yield from self._match(t.inputs[0], n, st3)
        else:
            yield from self._match_op(t, n, st)

    def _match_op(self, t: TNode, n: Node, st: _State) -> Iterator[_State]:
        if n.value is not None and n.op is Op.CONST:
            return
        for r in readings(n):
            if r.key != t.key or len(r.inputs) != len(t.inputs):
                continue
            st2: _State | None = st
            if t.bind is not None:
                st2 = _bind_scalar(st, t.bind, r.arg, 0.0)
            elif t.literal is not None and r.arg != t.literal:
                continue
            if st2 is None:
                continue
            st2 = st2.copy()
            st2.tmap[id(t)] = n
            st2.real.extend((n, *r.covered))
            orders = [r.inputs]
            if n.op in COMMUTATIVE and len(r.inputs) == 2 and r.inputs[0] is not r.inputs[1]:
                orders.append(r.inputs[::-1])
            for ins in orders:
                yield from self._match_all(t.inputs, ins, st2)

    def _match_all(self, ts: Sequence[TNode], ns: Sequence[Node], st: _State) -> Iterator[_State]:
        if not ts:
            yield st
            return
        for s1 in self._match(ts[0], ns[0], st):
            yield from self._match_all(ts[1:], ns[1:], s1)


def _yes(n: Node) -> bool:
    return True


# ---- tracing a recipe ----------------------------------------------------------------------


def _sentinel(i: int) -> float:
    """A number no recipe writes by hand: the i-th Scalar's placeholder value."""
    return 0.7310585786300049 + 0.1234567891 * (i + 1)


def _find_transform(v: float, sentinels: Mapping[str, float]) -> tuple[str, str] | None:
    for name, s in sentinels.items():
        for how, f in _TRANSFORMS.items():
            if v != 0 and math.isfinite(v) and abs(f(v) - s) <= 1e-9 * abs(s):
                return name, how
    return None


def trace_template(recipe: Callable[..., Tensor], shapes: Mapping[str, Shape] | None = None,
                   dtypes: Mapping[str, DType] | None = None,
                   guards: Mapping[str, Callable[[Node], bool]] | None = None) -> Template:
    """Trace `recipe` once: Wild parameters become placeholder leaves, Scalar ones sentinel numbers."""
    params = inspect.signature(recipe).parameters
    scalars = {n for n, p in params.items() if p.annotation in (Scalar, "Scalar", "float")}
    sentinels = {n: _sentinel(i) for i, n in enumerate(sorted(scalars))}
    holders: dict[int, str] = {}
    args: dict[str, Any] = {}
    for name in params:
        if name in scalars:
            args[name] = sentinels[name]
            continue
        shape = (shapes or {}).get(name, DEFAULT_SHAPE)
        dt = (dtypes or {}).get(name, DType.F64)
        leaf = Node(Op.CONST, (), tuple(shape), dt, None, np.zeros(shape, dt.np))
        holders[id(leaf)] = name
        args[name] = Tensor(leaf)
    out = recipe(**args)
    memo: dict[int, TNode] = {}

    def convert(n: Node) -> TNode:
        if id(n) in memo:
            return memo[id(n)]
        if id(n) in holders:
            t = TNode("wild", holders[id(n)])
        elif n.op is Op.CONST:
            v = _leaf_scalar(n)
            if v is None:
                raise TemplateError(f"template: {recipe.__name__} builds a constant of shape {list(n.shape)}; "
                                    f"only one-element constants can stand in a template")
            found = _find_transform(v, sentinels)
            t = TNode("scalar", None, bind=found) if found else TNode("literal", None, literal=v)
        elif n.op is Op.BROADCAST_TO:
            t = TNode("bcast", None, (convert(n.inputs[0]),))
        else:
            r = readings(n)[0]
            bind = _find_transform(float(r.arg), sentinels) if n.op in SCALAR_ARG else None
            literal = r.arg if n.op in SCALAR_ARG and bind is None else None
            t = TNode("op", r.key, tuple(convert(i) for i in r.inputs), bind, literal)
        memo[id(n)] = t
        return t

    root = convert(out.node)
    if root.kind != "op":
        raise TemplateError(f"template: {recipe.__name__} must compute something, its root is a {root.kind}")
    return Template(root, guards or {})


Build = Callable[[Bound], Match | None]
Pattern = Callable[[Node, Mapping[Node, int]], Match | None]


def template_pattern(recipe: Callable[..., Tensor], build: Build, variants: Sequence[Callable[..., Tensor]] = (),
                     shapes: Mapping[str, Shape] | None = None, dtypes: Mapping[str, DType] | None = None,
                     guards: Mapping[str, Callable[[Node], bool]] | None = None) -> Pattern:
    """The fuse pass's `pattern` for `recipe` and its `variants` (other spellings, the same parameters).

    `build` turns each match into the fused node's Match, or None to refuse it (the next candidate match
    is then tried). Traced lazily on first use, so importing a registry module stays cheap.
    """
    templates: list[Template] = []

    def pattern(node: Node, counts: Mapping[Node, int]) -> Match | None:
        if not templates:
            templates.extend(trace_template(r, shapes, dtypes, guards) for r in (recipe, *variants))
        if node.op in (Op.CONST, Op.BROADCAST_TO):
            return None
        keys = {r.key for r in readings(node)}
        for tpl in templates:
            if tpl.root.key not in keys:
                continue
            for m in tpl.match(node, counts):
                res = build(m)
                if res is not None:
                    return res
        return None

    return pattern
