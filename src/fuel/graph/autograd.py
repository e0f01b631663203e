"""grad(): lazy reverse-mode gradients. Primitive VJPs live here; fused entries bring their own."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from numpy.typing import ArrayLike

from fuel.errors import DTypeError, NotDifferentiable, ShapeError
from fuel.graph.functions import where
from fuel.graph.node import Node, Op, topo_order
from fuel.graph.prims import COMPARE, make, views
from fuel.graph.registry import default_registry, snake_name
from fuel.graph.tensor import Tensor, full, tensor, zeros

Grads = list[Tensor | None]
PrimVjp = Callable[[list[Tensor], Node, Tensor, Tensor], Grads]


def _t(op: Op, inputs: Sequence[Tensor], arg: object = None) -> Tensor:
    return Tensor(make(op, tuple(i.node for i in inputs), arg))


def _max_share(x: Tensor, g: Tensor) -> Tensor:
    """Gradient of a max over the axes where g (the max's keepdim shape) has 1 or lacks on the left:
    tied maxima share the upstream gradient equally (like torch.amax), through ReduceMaxToBackward."""
    from fuel.graph.registry.reduce_max_to_backward import reduce_max_to_backward

    return reduce_max_to_backward(x, g)


def _slice_vjp(xs: list[Tensor], n: Node, y: Tensor, g: Tensor) -> Grads:
    out = g
    for axis, ((start, _stop, step), size) in enumerate(zip(n.arg, xs[0].shape, strict=True)):
        m = out.shape[axis]
        if step > 1 and m:
            widths = [(0, 0)] * (out.ndim + 1)
            widths[axis + 1] = (0, step - 1)
            spread = _t(Op.PAD, [out.unsqueeze(axis + 1)], (tuple(widths), 0.0))
            shape = list(out.shape)
            shape[axis] = m * step
            out = spread.reshape(shape)
            if m * step > size - start:
                keep = [(0, d, 1) for d in out.shape]
                keep[axis] = (0, size - start, 1)
                out = _t(Op.SLICE, [out], tuple(keep))
        widths = [(0, 0)] * out.ndim
        widths[axis] = (start, size - start - out.shape[axis])
        if widths[axis] != (0, 0):
            out = _t(Op.PAD, [out], (tuple(widths), 0.0))
    return [out]


def _concat_vjp(xs: list[Tensor], n: Node, y: Tensor, g: Tensor) -> Grads:
    grads: Grads = []
    at = 0
    for x in xs:
        ranges = [(0, d, 1) for d in g.shape]
        ranges[n.arg] = (at, at + x.shape[n.arg], 1)
        grads.append(_t(Op.SLICE, [g], tuple(ranges)))
        at += x.shape[n.arg]
    return grads


def _pad_vjp(xs: list[Tensor], n: Node, y: Tensor, g: Tensor) -> Grads:
    widths, _ = n.arg
    return [_t(Op.SLICE, [g], tuple((b, b + s, 1) for (b, _a), s in zip(widths, xs[0].shape, strict=True)))]


def _powi_vjp(xs: list[Tensor], n: Node, y: Tensor, g: Tensor) -> Grads:
    """k·x^(k−1)·g through PowIBackward (0 everywhere for k = 0)."""
    from fuel.graph.registry.powi_backward import powi_backward

    return [powi_backward(xs[0], g, int(n.arg))]


def _pow_scalar_vjp(xs: list[Tensor], n: Node, y: Tensor, g: Tensor) -> Grads:
    # p·x^(p−1) as its own power, never exp((p−1)·log x): at x = 0 that gives 0 for p > 1 (as torch does)
    # instead of NaN; p is not an integer here (those are POWI), so p − 1 is not 0.
    p = float(n.arg)
    return [g * (_t(Op.POW_SCALAR, xs, p - 1.0) * p)]


def _pow_vjp(xs: list[Tensor], n: Node, y: Tensor, g: Tensor) -> Grads:
    # torch's conventions: a zero exponent gets no base gradient (even at x = 0), and a zero base with a
    # non-negative exponent gets no exponent gradient (x^b·log x → 0 there, not NaN).
    x, b = xs
    zero = zeros(g.shape, g.dtype)
    d_base = where(b == 0.0, zero, g * (b * _t(Op.POW, [x, b - 1.0])))
    d_exp = where((x == 0.0) * (b >= 0.0), zero, g * (y * x.log()))
    return [d_base, d_exp]


def _maxmin_vjp(op: Op) -> PrimVjp:
    def vjp(xs: list[Tensor], n: Node, y: Tensor, g: Tensor) -> Grads:
        a, b = xs
        zero = zeros(g.shape, g.dtype)
        wins_a = (a > b) if op is Op.MAXIMUM else (a < b)
        wins_b = (b > a) if op is Op.MAXIMUM else (b < a)
        half = where(a == b, g * 0.5, zero)
        return [where(wins_a, g, half), where(wins_b, g, half)]
    return vjp


def _inverse(perm: Sequence[int]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def _none(arity: int) -> PrimVjp:
    return lambda xs, n, y, g: [None] * arity


PRIM_VJP: dict[Op, PrimVjp] = {
    Op.NEG: lambda xs, n, y, g: [-g],
    Op.ABS: lambda xs, n, y, g: [g * xs[0].sign()],
    Op.SQR: lambda xs, n, y, g: [g * (xs[0] + xs[0])],
    Op.SQRT: lambda xs, n, y, g: [g / (y + y)],
    Op.RSQRT: lambda xs, n, y, g: [g * (y * y * y * -0.5)],
    Op.RECIP: lambda xs, n, y, g: [-(g * y * y)],
    Op.EXP: lambda xs, n, y, g: [g * y],
    Op.LOG: lambda xs, n, y, g: [g / xs[0]],
    Op.TANH: lambda xs, n, y, g: [g * (1.0 - y * y)],
    Op.SIN: lambda xs, n, y, g: [g * xs[0].cos()],
    Op.COS: lambda xs, n, y, g: [-(g * xs[0].sin())],
    Op.SIGMOID: lambda xs, n, y, g: [g * (y * (1.0 - y))],
    Op.RELU: lambda xs, n, y, g: [g * _t(Op.STEP, xs)],
    Op.SILU: lambda xs, n, y, g: [g * (xs[0].sigmoid() + y * (1.0 - xs[0].sigmoid()))],
    Op.SIGN: _none(1),
    Op.STEP: _none(1),
    Op.FLOOR: _none(1),
    Op.ERF: lambda xs, n, y, g: [g * (xs[0].square() * -1.0).exp() * (2.0 / math.sqrt(math.pi))],
    Op.ADD: lambda xs, n, y, g: [g, g],
    Op.SUB: lambda xs, n, y, g: [g, -g],
    Op.MUL: lambda xs, n, y, g: [g * xs[1], g * xs[0]],
    Op.DIV: lambda xs, n, y, g: [g / xs[1], -(g * y) / xs[1]],
    Op.MAXIMUM: _maxmin_vjp(Op.MAXIMUM),
    Op.MINIMUM: _maxmin_vjp(Op.MINIMUM),
    **{op: _none(2) for op in COMPARE},
    Op.WHERE: lambda xs, n, y, g: [None, where(xs[0], g, 0.0), where(xs[0], 0.0, g)],
    Op.ADD_SCALAR: lambda xs, n, y, g: [g],
    Op.MUL_SCALAR: lambda xs, n, y, g: [g * float(n.arg)],
    Op.POWI: _powi_vjp,
    Op.POW_SCALAR: _pow_scalar_vjp,
    Op.POW: _pow_vjp,
    Op.CAST: lambda xs, n, y, g: [g.cast(xs[0].dtype) if xs[0].dtype.is_float else None],
    # bit operations move integer data: no gradient (a float input read through BITCAST gets none)
    Op.SHR: _none(2),
    Op.BITAND: _none(2),
    Op.BITCAST: _none(1),
    Op.REDUCE_SUM_TO: lambda xs, n, y, g: [g.broadcast_to(xs[0].shape)],
    Op.REDUCE_MAX_TO: lambda xs, n, y, g: [_max_share(xs[0], g)],
    Op.SUM_DIM: lambda xs, n, y, g: [g.unsqueeze(n.arg).broadcast_to(xs[0].shape)],
    Op.MEAN_DIM: lambda xs, n, y, g: [(g * (1.0 / xs[0].shape[n.arg])).unsqueeze(n.arg).broadcast_to(xs[0].shape)],
    Op.MAX_DIM: lambda xs, n, y, g: [_max_share(xs[0], g.unsqueeze(n.arg))],
    Op.BROADCAST_TO: lambda xs, n, y, g: [_t(Op.REDUCE_SUM_TO, [g], xs[0].shape)],
    Op.RESHAPE: lambda xs, n, y, g: [g.reshape(xs[0].shape)],
    Op.PERMUTE: lambda xs, n, y, g: [g.permute(*_inverse(n.arg))],
    Op.SLICE: _slice_vjp,
    Op.UNSQUEEZE: lambda xs, n, y, g: [g.squeeze(n.arg)],
    Op.SQUEEZE: lambda xs, n, y, g: [g.unsqueeze(n.arg)],
    Op.CONCAT: _concat_vjp,
    Op.PAD: _pad_vjp,
    Op.CONTIGUIZE: lambda xs, n, y, g: [g],
    Op.MATMUL: lambda xs, n, y, g: [_t(Op.MATMUL, [g, xs[1].transpose()]), _t(Op.MATMUL, [xs[0].transpose(), g])],
    Op.GATHER: lambda xs, n, y, g: [_t(Op.SCATTER_ADD, [zeros(xs[0].shape, g.dtype), xs[1], g], n.arg), None],
    Op.INDEX_SELECT: lambda xs, n, y, g: [_t(Op.INDEX_ADD, [zeros(xs[0].shape, g.dtype), xs[1], g], n.arg), None],
    Op.SCATTER_ADD: lambda xs, n, y, g: [g, None, _t(Op.GATHER, [g, xs[1]], n.arg)],
    Op.INDEX_ADD: lambda xs, n, y, g: [g, None, _t(Op.INDEX_SELECT, [g, xs[1]], n.arg)],
}


def _vjp(node: Node, g: Tensor) -> Grads:
    xs = [Tensor(i) for i in node.inputs]
    y = Tensor(node)
    if node.op is Op.FUSED:
        op_id, params = node.arg
        entry = default_registry().entry(op_id)
        if entry.vjp is None:
            raise NotDifferentiable(f"grad: {entry.name} is not differentiable ({entry.backward})")
        return entry.vjp(xs, params, y, g)
    rule = PRIM_VJP.get(node.op)
    if rule is None:
        raise NotDifferentiable(f"grad: primitive {node.op.name.lower()} has no gradient rule")
    return rule(xs, node, y, g)


def _multi_vjp(node: Node, per_slot: dict[int, Tensor]) -> Grads:
    """A multi-output node's VJP: its VIEWs as the outputs, one cotangent per slot (zeros where no
    gradient reached the slot)."""
    if node.op is not Op.FUSED:
        raise NotDifferentiable(f"grad: primitive {node.op.name.lower()} has no gradient rule")
    entry = default_registry().entry(node.arg[0])
    if entry.vjp is None:
        raise NotDifferentiable(f"grad: {entry.name} is not differentiable ({entry.backward})")
    outs = tuple(Tensor(v) for v in views(node))
    cotangents = tuple(per_slot.get(k, zeros(o.shape, o.dtype)) for k, o in enumerate(outs))
    return entry.vjp([Tensor(i) for i in node.inputs], node.arg[1], outs, cotangents)


def _wrt_list(wrt: Tensor | Iterable[Tensor]) -> list[Tensor]:
    """`wrt` as a list of graph tensors; arrays are refused, since no gradient could reach a new leaf."""
    items = [wrt] if isinstance(wrt, Tensor) else list(wrt)
    for k, w in enumerate(items):
        if not isinstance(w, Tensor):
            raise DTypeError(f"grad: wrt[{k}] is a {type(w).__name__}, not a Tensor of the graph; pass the "
                             f"fl.tensor(...) the output was built from")
        if not w.dtype.is_float:
            raise DTypeError(f"grad: cannot differentiate with respect to a {w.dtype.value} tensor (wrt[{k}])")
    return items


def _grad_out(out: Tensor, grad_out: Tensor | ArrayLike | None) -> Tensor:
    """The output's cotangent: ones for a one-element output, else given (arrays take out's dtype)."""
    if grad_out is None:
        if out.size != 1:
            raise ShapeError(f"grad: output has shape {list(out.shape)}; pass grad_out for non-scalar outputs")
        return full(out.shape, 1.0, out.dtype)
    g = grad_out if isinstance(grad_out, Tensor) else tensor(np.asarray(grad_out), dtype=out.dtype)
    if g.shape != out.shape:
        raise ShapeError(f"grad: grad_out has shape {list(g.shape)}, output has shape {list(out.shape)}")
    if g.dtype != out.dtype:
        raise DTypeError(f"grad: grad_out is {g.dtype.value}, output is {out.dtype.value}; cast one first")
    return g


def _op_name(node: Node) -> str:
    if node.op is Op.FUSED:
        return snake_name(default_registry().entry(node.arg[0]).name)
    return node.op.name.lower()


def grad(out: Tensor, wrt: Tensor | Iterable[Tensor], grad_out: Tensor | ArrayLike | None = None,
         fuse: bool = True) -> list[Tensor]:
    """Gradients of `out` (weighted by `grad_out`, default ones for a one-element out) w.r.t. `wrt`.

    `wrt` is a sequence of tensors of the graph (a bare Tensor is taken as a list of one; the result is
    always a list). `grad_out` may be a Tensor or any array-like, which is converted to out's dtype.
    The forward graph is pattern-fused first (unless `fuse=False`), so a softmax or norm the user wrote
    with primitives is differentiated through its fused backward entry. `wrt` nodes are kept as roots
    and never absorbed into a fused node (views included), so every gradient asked for can flow.
    """
    if not isinstance(out, Tensor):
        raise DTypeError(f"grad: output must be a Tensor, got {type(out).__name__}")
    if not out.dtype.is_float:
        raise DTypeError(f"grad: output must be a float tensor, got {out.dtype.value}")
    wrt_list = _wrt_list(wrt)
    cotangent = _grad_out(out, grad_out)
    out_node, wrt_nodes = out.node, [w.node for w in wrt_list]
    if fuse:
        from fuel.graph.passes.fuse import fuse as fuse_pass

        fused = fuse_pass([out_node, *wrt_nodes], default_registry(), keep=wrt_nodes)
        out_node, wrt_nodes = fused[0], fused[1:]
    order = topo_order([out_node], stop_at_leaves=False)
    targets = set(wrt_nodes)
    needed: set[Node] = set()
    for n in order:
        if n in targets or any(i in needed for i in n.inputs):
            needed.add(n)
    grads: dict[Node, Tensor] = {out_node: cotangent}
    slot_grads: dict[Node, dict[int, Tensor]] = {}  # per multi-output node, the cotangents of its VIEWs
    for node in reversed(order):
        g = grads.get(node)
        if node.op is Op.VIEW:
            if g is not None and node in needed:
                per = slot_grads.setdefault(node.inputs[0], {})
                slot = node.arg[0]
                per[slot] = g if slot not in per else per[slot] + g
            continue
        if node in slot_grads:
            rule_grads = _multi_vjp(node, slot_grads.pop(node))
        elif g is None or node not in needed or node.op is Op.CONST or not node.inputs:
            continue
        else:
            rule_grads = _vjp(node, g)
        for k, (inp, gi) in enumerate(zip(node.inputs, rule_grads, strict=True)):
            if inp not in needed:
                continue
            if gi is None:
                # A gradient asked for flows through an input the rule does not serve: a float one, or the
                # integers a float's bits were read from (a zero gradient there would be silently wrong).
                if inp.dtype.is_float or node.op is Op.BITCAST:
                    raise NotDifferentiable(f"grad: {_op_name(node)} gives no gradient for its input {k} "
                                            f"({list(inp.shape)} {inp.dtype.value}), which a tensor in wrt "
                                            f"depends on")
                continue
            if gi.shape != inp.shape or gi.dtype != inp.dtype:
                raise ShapeError(f"grad: rule for {node!r} gave {list(gi.shape)} {gi.dtype.value} "
                                 f"for input {list(inp.shape)} {inp.dtype.value}")
            prev = grads.get(inp)
            grads[inp] = gi if prev is None else prev + gi
    return [grads.get(n, zeros(w.shape, w.dtype)) for n, w in zip(wrt_nodes, wrt_list, strict=True)]

