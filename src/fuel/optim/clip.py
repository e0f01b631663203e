"""Global-norm gradient clipping, as torch.nn.utils.clip_grad_norm_ (norm_type 2, lazily)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real

from fuel.errors import DTypeError, ParamError
from fuel.graph.tensor import Tensor

# torch's clip_grad_norm_ adds this to the total norm before dividing, so an all-zero gradient gives a finite
# coefficient (clamped to 1).
_NORM_EPS = 1e-6


def clip_grad_norm(grads: Sequence[Tensor | None], max_norm: float) -> tuple[list[Tensor | None], Tensor]:
    """(the clipped gradients, the total norm), both lazy. The total norm is the 2-norm of the per-tensor
    2-norms (each in its gradient's dtype, f32 for a half type, combined in the widest of them); each
    gradient is multiplied by `min(max_norm / (total + 1e-6), 1)` cast to its dtype, as torch's
    `clip_grad_norm_` does in place.
    `None` entries (parameters without a gradient) stay None and count for nothing."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, Real) or not math.isfinite(float(max_norm)) \
            or max_norm <= 0:
        raise ParamError(f"clip_grad_norm: max_norm must be a finite number > 0, got {max_norm!r}")
    present = [g for g in grads if g is not None]
    if not present:
        raise ParamError("clip_grad_norm: grads has no gradient (every entry is None)")
    for i, g in enumerate(grads):
        if g is not None and (not isinstance(g, Tensor) or not g.dtype.is_float):
            what = g.dtype.value if isinstance(g, Tensor) else type(g).__name__
            raise DTypeError(f"clip_grad_norm: grads[{i}] must be a float Tensor, got {what}")
    wide = max((g.dtype.acc if g.dtype.is_half else g.dtype for g in present), key=lambda d: d.np.itemsize)
    norms = [_norm(g).cast(wide) for g in present]
    squares = norms[0] * norms[0]
    for n in norms[1:]:
        squares = squares + n * n
    total = squares.sqrt()
    coef = (float(max_norm) / (total + _NORM_EPS)).minimum(1.0)
    return [None if g is None else g * coef.cast(g.dtype) for g in grads], total


def _norm(g: Tensor) -> Tensor:
    """The 2-norm of one gradient; a half type's is summed in f32 (torch's accumulation type too)."""
    x = g.cast(g.dtype.acc) if g.dtype.is_half else g
    return (x * x).sum().sqrt()
