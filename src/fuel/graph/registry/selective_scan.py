"""SelectiveScan (id 19): Mamba-1's selective scan, with its final state.

u, delta `[B, L, dim]`, a `[dim, dstate]` (used as is: Mamba passes −exp(A_log)), b, c
`[B, L, dstate]` shared by every channel; `delta_softplus` applies softplus to delta first
(log1p(exp(x)), PyTorch's threshold: x > 20 gives x). With d the (softplus of) delta and h_{−1} = 0:

    h_t[b, d, :] = exp(d_t·a[d, :])·h_{t−1}[b, d, :] + d_t·u_t·b_t[b, :]
    y[b, t, d] = Σ_n h_t[b, d, n]·c_t[b, n]

Two outputs, both in u's dtype: slot 0 `y [B, L, dim]`, slot 1 `last_state = h_{L−1} [B, dim, dstate]`
(zeros for L = 0). No initial state, D skip or z gate: the inventory's signature (the caller adds
D·u and the gate). Kernels keep the state in f64 in every dtype and round each output once.

The lowering unrolls the recurrence over L with primitives in f64 (small L: tests and dtypes without a
kernel). The gradient is one SELECTIVE_SCAN_GRAD primitive (a reverse scan over recomputed states)
giving du, ddelta (through the softplus), da, db and dc from both cotangents.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fuel.dtype import DType
from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.functions import concat, where
from fuel.graph.node import Op, Shape
from fuel.graph.prims import make, views
from fuel.graph.registry import DECOMPOSE, FusedOpEntry, FusedOpFamily, FusedOps, fused_views
from fuel.graph.registry.common import operand_nodes
from fuel.graph.tensor import Tensor, TensorLike, zeros

NAME = "selective_scan"


@dataclass(frozen=True)
class SelectiveScanParams:
    delta_softplus: bool

    def __post_init__(self) -> None:
        if not isinstance(self.delta_softplus, (bool, np.bool_)):
            raise ParamError(f"selective_scan: delta_softplus must be a bool, got {self.delta_softplus!r}")
        object.__setattr__(self, "delta_softplus", bool(self.delta_softplus))


def _dims(shapes: tuple[Shape, ...]) -> tuple[int, int, int, int]:
    """(B, L, dim, dstate) after checking every shape."""
    u, delta, a, b, c = shapes
    if len(u) != 3:
        raise ShapeError(f"selective_scan: u must be [B, L, dim], got {list(u)}")
    nb, seq, dim = u
    if tuple(delta) != tuple(u):
        raise ShapeError(f"selective_scan: delta must be [B, L, dim] = {list(u)}, got {list(delta)}")
    if len(a) != 2 or a[0] != dim:
        raise ShapeError(f"selective_scan: a must be [dim, dstate] = [{dim}, dstate], got {list(a)}")
    ns = a[1]
    for name, s in (("b", b), ("c", c)):
        if tuple(s) != (nb, seq, ns):
            raise ShapeError(f"selective_scan: {name} must be [B, L, dstate] = {[nb, seq, ns]}, got {list(s)}")
    return nb, seq, dim, ns


def shape_rule(shapes: tuple[Shape, ...], params: SelectiveScanParams) -> Shape:
    nb, seq, dim, _ = _dims(shapes)
    return (nb, seq, dim)


def dtype_rule(dtypes: tuple[DType, ...], params: SelectiveScanParams) -> DType:
    u = dtypes[0]
    if not u.is_float:
        raise DTypeError(f"selective_scan: u must be a float tensor, got {u.value}")
    for name, dt in zip(("delta", "a", "b", "c"), dtypes[1:], strict=True):
        if dt != u:
            raise DTypeError(f"selective_scan: {name} must have u's dtype {u.value}, got {dt.value}")
    return u


def output_views(shapes: tuple[Shape, ...], dtypes: tuple[DType, ...],
                 params: SelectiveScanParams) -> list[tuple[Shape, DType]]:
    nb, seq, dim, ns = _dims(shapes)
    dt = dtype_rule(dtypes, params)
    return [((nb, seq, dim), dt), ((nb, dim, ns), dt)]


def softplus(x: Tensor) -> Tensor:
    """log1p(exp(x)) as relu(x) + log1p(exp(−|x|)), and x above PyTorch's threshold 20. log1p(e) is
    log(1 + e)·e/((1 + e) − 1) (exact to a few ulp, also where 1 + e rounds to 1)."""
    e = (-x.abs()).exp()
    w = e + 1.0
    lp = where(w == 1.0, e, w.log() * e / where(w == 1.0, 1.0, w - 1.0))
    return where(x > 20.0, x, x.relu() + lp)


def decompose(inputs: list[Tensor], params: SelectiveScanParams) -> tuple[Tensor, Tensor]:
    """The recurrence unrolled over L in f64 (the kernels' accumulator), each output cast back once."""
    dt = inputs[0].dtype
    u, delta, a, b, c = (t.cast(DType.F64) for t in inputs)
    nb, seq, dim = u.shape
    ns = a.shape[1]
    d = softplus(delta) if params.delta_softplus else delta
    h = zeros((nb, dim, ns), DType.F64)
    ys = []
    for t in range(seq):
        dt_t = d[:, t, :].reshape(nb, dim, 1)
        h = (dt_t * a.reshape(1, dim, ns)).exp() * h + (dt_t * u[:, t, :].reshape(nb, dim, 1)) * b[:, t, :].reshape(
            nb, 1, ns)
        ys.append((h * c[:, t, :].reshape(nb, 1, ns)).sum(2).reshape(nb, 1, dim))
    y = concat(ys, axis=1) if ys else zeros((nb, 0, dim), DType.F64)
    return y.cast(dt), h.cast(dt)


def vjp(inputs: list[Tensor], params: SelectiveScanParams, outs: tuple[Tensor, ...],
        grad_outs: tuple[Tensor, ...]) -> list[Tensor | None]:
    """One reverse-scan kernel for all five gradients, from dy and dlast_state together."""
    dy, dlast = (g.cast(inputs[0].dtype) for g in grad_outs)
    node = make(Op.SELECTIVE_SCAN_GRAD, (*(t.node for t in inputs), dy.node, dlast.node), params)
    return [Tensor(v) for v in views(node)]


def selective_scan(u: TensorLike, delta: TensorLike, a: TensorLike, b: TensorLike, c: TensorLike,
                   delta_softplus: bool = False) -> tuple[Tensor, Tensor]:
    """Mamba-1 selective scan: `(y [B, L, dim], last_state [B, dim, dstate])`."""
    nodes = operand_nodes(u, delta, a, b, c)
    y, last = fused_views(FusedOps.SELECTIVE_SCAN, nodes, SelectiveScanParams(delta_softplus))
    return y, last


ENTRY = FusedOpEntry(
    id=FusedOps.SELECTIVE_SCAN,
    name="SelectiveScan",
    family=FusedOpFamily.FORWARD,
    params=SelectiveScanParams,
    arity=(5,),
    shape_rule=shape_rule,
    dtype_rule=dtype_rule,
    decompose=decompose,
    # The inventory says Decompose (BPTT through the unrolled scan); `vjp` is the fused reverse scan.
    backward=DECOMPOSE,
    vjp=vjp,
    pattern=None,
    no_pattern=(
        "its lowering unrolls the recurrence one position at a time, so its graph grows with the sequence and"
        " no fixed spelling exists to match: Mamba code calls the op"),
    output_views=output_views,
    destructive_input=None,
)
