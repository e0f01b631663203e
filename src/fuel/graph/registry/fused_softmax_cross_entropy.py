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

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import numpy as np

from fuel.dtype import DType
from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.functions import where
from fuel.graph.node import Node, Op, Shape
from fuel.graph.passes.template import Bound, Scalar, Wild, template_pattern
from fuel.graph.prims import make
from fuel.graph.registry import DECOMPOSE, FusedOpEntry, FusedOpFamily, FusedOps, Match, Pattern, fused_node
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
    """The sum of every element, one REDUCE_SUM_TO at any rank (0 included): the spelling the pattern
    reads as the reduction, so a rank-0 "sum" stays apart from "none"."""
    return t.sum()


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


# ---- the pattern: the spellings users write, traced once into templates -------------------------------
# log_softmax three ways (max-shifted, unshifted, log of the softmax op), the target column gathered,
# negated before the gather, after it or after the reduction, then kept per row, summed or averaged.
# ignore_index goes through a `where` on the targets, as the lowering spells it: `valid = t != ii`,
# the gather at `where(valid, t, 0)`, the loss `where(valid, -picked, 0.0)`, a mean divided by
# `max(Σ valid, 1)`. A mean without ignore_index needs rows (a mean of none is NaN, the op's is 0).
# A spelling without ignore_index fuses with the i64 minimum as ignore_index: no class id, and a gather
# refuses it, so no answer a spelling gives changes.
PLAIN = int(_I64.min)


def _lsm_shifted(x: Tensor) -> Tensor:
    s = x - x.max(-1, keepdim=True)
    return s - s.exp().sum(-1, keepdim=True).log()


def _lsm_plain(x: Tensor) -> Tensor:
    return x - x.exp().sum(-1, keepdim=True).log()


def _lsm_softmax(x: Tensor) -> Tensor:
    return x.softmax(-1).log()


def _picked(log_probs: Tensor, idx: Tensor) -> Tensor:
    return log_probs.gather(-1, idx.unsqueeze(-1)).squeeze(-1)


def _recipe(lsm: Callable[[Tensor], Tensor], neg: str, reduction: str, ignore: bool, rank1: bool,
            work: DType) -> Callable[..., Tensor]:
    def recipe(x: Wild, t: Wild, ii: Wild, inv_n: Scalar) -> Tensor:
        lp = -lsm(x) if neg == "lsm" else lsm(x)
        if ignore:
            valid = t != ii
            nll = where(valid, -_picked(lp, where(valid, t, 0)), 0.0)
        else:
            nll = -_picked(lp, t) if neg == "row" else _picked(lp, t)
        if reduction == "none":
            return nll.cast(DType.F32)
        if reduction == "sum":
            total = nll.sum()
        elif ignore:
            total = nll.sum() / valid.cast(work).sum().maximum(1.0)
        else:
            total = nll.mean() if rank1 else nll.sum() * inv_n
        return (-total if neg == "total" else total).cast(DType.F32)

    return recipe


def _build(reduction: str, ignore: bool, rank1: bool, m: Bound) -> Match | None:
    x, t = m.node("x"), m.node("t")
    if not x.dtype.is_float or t.dtype is not DType.I64 or t.shape != x.shape[:-1] or not x.shape[-1]:
        return None
    ignore_index = PLAIN
    if ignore:
        ii = m.node("ii")
        if ii.value is None or ii.value.size != 1 or ii.dtype is not DType.I64:
            return None
        ignore_index = int(np.asarray(ii.value).reshape(()))
    rows = math.prod(t.shape)
    if reduction == "mean" and not ignore and (not rows or (not rank1 and m.scalar("inv_n") != 1.0 / rows)):
        return None
    return Match((x, t), FusedSoftmaxCrossEntropyParams(reduction, ignore_index))


def _group(reduction: str, ignore: bool, rank1: bool, work: DType) -> Pattern:
    lsms = (_lsm_shifted, _lsm_plain, _lsm_softmax) if work is DType.F32 else (_lsm_shifted,)
    negs = ("row",) if ignore else ("lsm", "row") if reduction == "none" else ("lsm", "row", "total")
    recipes = [_recipe(lsm, neg, reduction, ignore, rank1, work) for lsm in lsms for neg in negs]
    rows = (4,) if rank1 else (2, 3)
    return template_pattern(recipes[0], partial(_build, reduction, ignore, rank1), recipes[1:],
                            shapes={"x": (*rows, 6), "t": rows, "ii": ()},
                            dtypes={"x": work, "t": DType.I64, "ii": DType.I64})


# f32 logits as users write them; f64 (or logits cast up) rounded to f32 at the end, as the lowering is.
_GROUPS = [_group(red, ignore, rank1, work)
           for work in (DType.F32, DType.F64)
           for red in REDUCTIONS
           for ignore in ((False, True) if work is DType.F32 else (True,))
           for rank1 in ((False,) if red == "none" else (False, True))]


def pattern(node: Node, counts: Mapping[Node, int]) -> Match | None:
    """Softmax cross-entropy spelled with primitives (see the spellings above)."""
    if node.op not in (Op.CAST, Op.NEG, Op.WHERE, Op.SQUEEZE, Op.REDUCE_SUM_TO, Op.SUM_DIM, Op.MEAN_DIM,
                       Op.MUL_SCALAR, Op.DIV) or node.dtype is not DType.F32:
        return None
    for group in _GROUPS:
        m = group(node, counts)
        if m is not None:
            return m
    return None


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
    pattern=pattern,
    output_views=None,
    destructive_input=None,
)
