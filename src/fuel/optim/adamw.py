"""AdamW: Adam with decoupled weight decay, as torch.optim.AdamW's single-tensor CPU path (amsgrad=False,
maximize=False), operation for operation:

    p = p * (1 - lr * weight_decay)               (skipped when weight_decay is 0)
    m = m + (1 - beta1) * (g - m)                 (torch's lerp_; g - (g - m) * beta1 when 1 - beta1 >= 0.5)
    v = v * beta2 + (1 - beta2) * g * g           (mul_ then addcmul_)
    p = p + (-lr / (1 - beta1**t)) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)   (addcdiv_)

The step-dependent factors are computed in Python floats and rounded once to the compute dtype, as torch
rounds its Python-float scalars to the tensor's dtype."""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real

import numpy as np

from fuel.errors import ParamError
from fuel.graph.tensor import Tensor
from fuel.optim.optimizer import Optimizer
from fuel.optim.schedule import Schedule


def _number(op: str, name: str, value: object, low: float, high: float, low_open: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, Real) and math.isfinite(float(value))
    if ok:
        v = float(value)  # type: ignore[arg-type]
        ok = (v > low if low_open else v >= low) and v < high
    if not ok:
        bound = f"({low}, {high})" if low_open else f"[{low}, {high})"
        raise ParamError(f"{op}: {name} must be in {bound}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


class AdamW(Optimizer):
    """`AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)`, torch's semantics.
    State per parameter: `exp_avg` and `exp_avg_sq` (f32 for half parameters with master weights)."""

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: Sequence[Tensor], lr: float | Schedule = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, max_grad_norm: float | None = None,
                 master_weights: bool | None = None) -> None:
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ParamError(f"AdamW: betas must be a pair (beta1, beta2), got {betas!r}")
        self.beta1 = _number("AdamW", "betas[0]", betas[0], 0.0, 1.0)
        self.beta2 = _number("AdamW", "betas[1]", betas[1], 0.0, 1.0)
        self.eps = _number("AdamW", "eps", eps, 0.0, math.inf, low_open=True)
        self.weight_decay = _number("AdamW", "weight_decay", weight_decay, 0.0, math.inf)
        super().__init__(params, lr, max_grad_norm=max_grad_norm, master_weights=master_weights)

    def scalars(self, step: int, lr: float) -> dict[str, float]:
        bias_correction1 = 1 - self.beta1**step
        bias_correction2 = 1 - self.beta2**step
        return {"decay": 1 - lr * self.weight_decay,
                "neg_step_size": -(lr / bias_correction1),
                "bias_correction2_sqrt": bias_correction2**0.5}

    def _param_update(self, i: int, p: Tensor, g: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        dt = p.dtype
        if self.weight_decay != 0:
            p = p * self.scalar("decay", dt)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m_new = _lerp(m, g, 1 - self.beta1)
        v_new = v * self.beta2 + (1 - self.beta2) * g * g
        denom = v_new.sqrt() / self.scalar("bias_correction2_sqrt", dt) + self.eps
        p_new = p + self.scalar("neg_step_size", dt) * m_new / denom
        return p_new, {"exp_avg": m_new, "exp_avg_sq": v_new}


def _lerp(start: Tensor, end: Tensor, weight: float) -> Tensor:
    """torch's lerp: `start + w * (end - start)` for a weight below 0.5, else `end + (w - 1) * (end - start)`
    (more exact near 1), with w rounded to the tensors' dtype first (w - 1 is then exact)."""
    w = float(np.asarray(weight, start.dtype.np))
    if abs(w) < 0.5:
        return start + weight * (end - start)
    return end + (w - 1.0) * (end - start)
