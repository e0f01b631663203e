"""SGD with momentum, dampening, Nesterov and weight decay, as torch.optim.SGD's single-tensor CPU path
(maximize=False), operation for operation:

    g = g + weight_decay * p                      (skipped when weight_decay is 0)
    b = g at the first update, else b * momentum + (1 - dampening) * g      (with momentum)
    g = g + momentum * b if nesterov else b
    p = p + (-lr) * g

The first update's `b = g` is `b * 0 + g * 1` over the zero-initialised buffer (exact), so one captured
step serves every update: the two factors are per-step scalars."""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real

from fuel.errors import ParamError
from fuel.graph.tensor import Tensor
from fuel.optim.optimizer import Optimizer
from fuel.optim.schedule import Schedule


def _non_negative(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)) or value < 0:
        raise ParamError(f"SGD: {name} must be a finite number >= 0, got {value!r}")
    return float(value)


class SGD(Optimizer):
    """`SGD(params, lr, momentum=0, dampening=0, nesterov=False, weight_decay=0)`, torch's semantics.
    State per parameter: `momentum_buffer` (with momentum)."""

    def __init__(self, params: Sequence[Tensor], lr: float | Schedule, momentum: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0, *, max_grad_norm: float | None = None,
                 master_weights: bool | None = None) -> None:
        self.momentum = _non_negative("momentum", momentum)
        self.dampening = _non_negative("dampening", dampening)
        self.weight_decay = _non_negative("weight_decay", weight_decay)
        if not isinstance(nesterov, bool):
            raise ParamError(f"SGD: nesterov must be a bool, got {nesterov!r}")
        if nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ParamError(f"SGD: nesterov needs momentum > 0 and dampening 0, got momentum={momentum!r}, "
                             f"dampening={dampening!r}")
        self.nesterov = nesterov
        self.state_names = ("momentum_buffer",) if self.momentum != 0 else ()
        super().__init__(params, lr, max_grad_norm=max_grad_norm, master_weights=master_weights)

    def scalars(self, step: int, lr: float) -> dict[str, float]:
        first = step == 1
        return {"neg_lr": -lr, "keep": 0.0 if first else self.momentum, "take": 1.0 if first else 1 - self.dampening}

    def _param_update(self, i: int, p: Tensor, g: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        dt = p.dtype
        if self.weight_decay != 0:
            g = g + self.weight_decay * p
        new_state: dict[str, Tensor] = {}
        if self.momentum != 0:
            b = state["momentum_buffer"]
            b_new = b * self.scalar("keep", dt) + self.scalar("take", dt) * g
            new_state["momentum_buffer"] = b_new
            g = g + self.momentum * b_new if self.nesterov else b_new
        return p + self.scalar("neg_lr", dt) * g, new_state
