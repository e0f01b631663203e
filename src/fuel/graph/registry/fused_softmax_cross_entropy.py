"""FusedSoftmaxCrossEntropy (id 17): softmax cross-entropy over class-index targets.

logits `[..., V]` (rank >= 1; f32, f64, bf16 or f16), targets i64 `[...]` = logits.shape[:-1]. Per row,
computed in f64:

    loss = logsumexp(logits[row]) − logits[row, target[row]]

Rows whose target equals `ignore_index` (default −100; it may be a real class id) contribute 0. The
output is always f32: `"none"` gives one loss per row (0 at ignored rows), `"sum"` their sum, `"mean"`
their sum over the number of non-ignored rows; with no non-ignored row (every target ignored, or no
rows at all) mean and sum are 0.0 (PyTorch >= 1.11 gives NaN for that mean). A target outside [0, V)
that is not `ignore_index` raises IndexOutOfRange when the graph runs, naming the value, its position
and V (so V = 0 is an error unless every target is ignored).

The lowering honours ignore_index (upstream's does not): a max-shifted log-softmax in f64, the target
column gathered with ignored targets replaced by the safe index 0, their loss masked to 0, the
reduction divided by the in-graph count of non-ignored rows, then a cast to f32.

Gradient w.r.t. logits, one fused primitive (CROSS_ENTROPY_GRAD): `(softmax(row) − onehot(target))·s`
with s = g/n_valid (mean), g (sum) or g[row] (none), zero rows at ignored targets; targets get none.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fuel.dtype import DType
from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.functions import where
from fuel.graph.node import Op, Shape
from fuel.graph.prims import make
from fuel.graph.registry import DECOMPOSE, FusedOpEntry, FusedOpFamily, FusedOps, fused_node
from fuel.graph.tensor import Tensor, TensorLike, as_tensor, zeros

NAME = "fused_softmax_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")
_I64 = np.iinfo(np.int64)


@dataclass(frozen=True)
class FusedSoftmaxCrossEntropyParams:
    reduction: str
    ignore_index: int

    def __post_init__(self) -> None:
        if not isinstance(self.reduction, str) or self.reduction not in REDUCTIONS:
            raise ParamError(f"{NAME}: reduction must be one of {', '.join(map(repr, REDUCTIONS))}, "
                             f"got {self.reduction!r}")
        ii = self.ignore_index
        if isinstance(ii, (bool, np.bool_)) or not isinstance(ii, (int, np.integer)):
            raise ParamError(f"{NAME}: ignore_index must be an int, got {ii!r}")
        if not _I64.min <= int(ii) <= _I64.max:
            raise ParamError(f"{NAME}: ignore_index must fit in i64, got {ii}")
        object.__setattr__(self, "ignore_index", int(ii))


def shape_rule(shapes: tuple[Shape, ...], params: FusedSoftmaxCrossEntropyParams) -> Shape:
    logits, targets = shapes
    if not logits:
        raise ShapeError(f"{NAME}: logits must have rank >= 1 ([..., V]), got a rank-0 tensor")
    if tuple(targets) != tuple(logits[:-1]):
        raise ShapeError(f"{NAME}: targets must have logits' shape without its last axis, "
                         f"{list(logits[:-1])}, got {list(targets)}")
    return tuple(targets) if params.reduction == "none" else ()


def dtype_rule(dtypes: tuple[DType, ...], params: FusedSoftmaxCrossEntropyParams) -> DType:
    logits, targets = dtypes
    if not logits.is_float:
        raise DTypeError(f"{NAME}: logits must be a float tensor (f32, f64, bf16 or f16), got {logits.value}")
    if targets is not DType.I64:
        raise DTypeError(f"{NAME}: targets must be i64, got {targets.value}")
    return DType.F32


def _total(t: Tensor) -> Tensor:
    """The sum of every element (a rank-0 tensor is its own sum)."""
    return t if t.ndim == 0 else t.sum()


def decompose(inputs: list[Tensor], params: FusedSoftmaxCrossEntropyParams) -> Tensor:
    logits, targets = inputs
    valid = targets != params.ignore_index  # u8, 1 at the rows that count
    if logits.shape[-1] == 0:
        # No column to gather: every non-ignored target is out of range. Gather from one zero column at
        # index t + 1 (t < 0 kept negative), so each of them fails the gather's range check.
        shifted_t = where(targets < 0, targets, targets + 1)
        idx = where(valid, shifted_t, 0).unsqueeze(-1)
        nll = zeros((*targets.shape, 1), DType.F64).gather(-1, idx).squeeze(-1)
    else:
        x = logits.cast(DType.F64)
        shifted = x - x.max(-1, keepdim=True)
        log_probs = shifted - shifted.exp().sum(-1, keepdim=True).log()
        idx = where(valid, targets, 0).unsqueeze(-1)  # ignored rows read column 0, then are masked out
        picked = log_probs.gather(-1, idx).squeeze(-1)
        nll = where(valid, -picked, 0.0)
    if params.reduction == "none":
        return nll.cast(DType.F32)
    total = _total(nll)
    if params.reduction == "mean":
        total = total / _total(valid.cast(DType.F64)).maximum(1.0)  # 0 / 1 when nothing counts
    return total.cast(DType.F32)


def vjp(inputs: list[Tensor], params: FusedSoftmaxCrossEntropyParams, out: Tensor,
        grad_out: Tensor) -> list[Tensor | None]:
    logits, targets = inputs
    g = grad_out.cast(DType.F32)
    return [Tensor(make(Op.CROSS_ENTROPY_GRAD, (logits.node, targets.node, g.node), params)), None]


def fused_softmax_cross_entropy(logits: TensorLike, targets: TensorLike, reduction: str = "mean",
                                ignore_index: int = -100) -> Tensor:
    """Softmax cross-entropy of `logits [..., V]` against class ids `targets [...]` (i64), as f32."""
    params = FusedSoftmaxCrossEntropyParams(reduction, ignore_index)
    nodes = [as_tensor(logits).node, as_tensor(targets).node]
    return Tensor(fused_node(FusedOps.FUSED_SOFTMAX_CROSS_ENTROPY, nodes, params))


ENTRY = FusedOpEntry(
    id=FusedOps.FUSED_SOFTMAX_CROSS_ENTROPY,
    name="FusedSoftmaxCrossEntropy",
    family=FusedOpFamily.FORWARD,
    params=FusedSoftmaxCrossEntropyParams,
    arity=(2,),
    shape_rule=shape_rule,
    dtype_rule=dtype_rule,
    decompose=decompose,
    # The inventory's metadata; `vjp` above is the fused gradient.
    backward=DECOMPOSE,
    vjp=vjp,
    pattern=None,
    output_views=None,
    destructive_input=None,
)
