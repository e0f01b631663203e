"""torch.optim as the oracle of the optimizer tests, and the per-element error scale they are measured by.

Both optimizers are fed identical gradients: the loss is `sum_i (p_i * g_i).sum()` over gradient arrays
passed as the step's batch, whose gradient w.r.t. p_i is g_i exactly (in fuel and in torch), so the tests
isolate the optimizer. torch runs on its single-tensor CPU path (`foreach=False`).

The error scale. An element of a parameter or a state can sit near 0 by cancellation (a momentum that
averages gradients of both signs, a parameter that crossed 0), where the relative error of its own value
is no measure of the arithmetic. Each element is measured instead against the float64 sum of the
magnitudes of every term that formed it: the optimizer's own recurrence run over |g| and |p| with every
subtraction made an addition (`AbsScale`). That is per element (never a tensor's max), and it is the
quantity floating-point error is proportional to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import fuel as fl
from fuel.optim import Optimizer, TrainStep

Arrays = list[np.ndarray]


def dot_loss(params: Sequence[fl.Tensor]) -> Callable[..., fl.Tensor]:
    """loss_fn(*grads) = sum_i (p_i * g_i).sum(): its gradient w.r.t. p_i is g_i exactly."""
    def loss(*gs: fl.Tensor) -> fl.Tensor:
        total = (params[0] * gs[0]).sum()
        for p, g in zip(params[1:], gs[1:], strict=True):
            total = total + (p * g).sum()
        return total.cast(fl.f32) if total.dtype.is_half else total
    return loss


def torch_dot_loss(params: Sequence[torch.Tensor], grads: Arrays) -> torch.Tensor:
    return sum((p * torch.from_numpy(g).to(p.dtype)).sum() for p, g in zip(params, grads, strict=True))  # type: ignore[return-value]


def fuel_run(make: Callable[[list[fl.Tensor]], Optimizer], p0: Arrays, grads: list[Arrays],
             accumulate: int = 1) -> tuple[list[Arrays], Optimizer, TrainStep]:
    """Each update's parameters (copies) from `opt.compile(dot_loss)`, fed `grads[k]` at call k."""
    params = [fl.tensor(a.copy()) for a in p0]
    opt = make(params)
    step = opt.compile(dot_loss(params), accumulate=accumulate)
    history = []
    for k, gs in enumerate(grads):
        step(*gs)
        if (k + 1) % accumulate == 0:
            history.append([p.numpy().copy() for p in params])
    return history, opt, step


def torch_run(make: Callable[[list[torch.Tensor]], Any], p0: Arrays, grads: list[Arrays],
              accumulate: int = 1, dtype: torch.dtype | None = None,
              sched: Callable[[Any], Any] | None = None, clip: float | None = None) -> tuple[list[Arrays], Any]:
    """torch's updates of the same problem: `(loss / accumulate).backward()` per micro-batch, then
    clipping (if set), `opt.step()`, `sched.step()`. Parameters are kept in `dtype` (default p0's)."""
    params = [torch.tensor(a.copy(), dtype=dtype, requires_grad=True) for a in p0]
    opt = make(params)
    scheduler = sched(opt) if sched is not None else None
    history, norms = [], []
    for k, gs in enumerate(grads):
        loss = torch_dot_loss(params, gs)
        (loss / accumulate if accumulate > 1 else loss).backward()
        if (k + 1) % accumulate:
            continue
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip, foreach=False)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        history.append([p.detach().numpy().copy() for p in params])
    return history, (opt, norms)


def max_rel(got: np.ndarray, want: np.ndarray, scale: np.ndarray) -> float:
    """The largest per-element error |got - want| / scale (every array compared in float64)."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert g.shape == w.shape
    return float((np.abs(g - w) / scale).max())


class AbsScale:
    """The per-element float64 magnitudes an optimizer's values are formed from (module docstring)."""

    def __init__(self, p0: Arrays) -> None:
        self.p = [np.abs(a.astype(np.float64)) for a in p0]
        self.buf: list[np.ndarray] = [np.zeros_like(a) for a in self.p]
        self.steps = 0

    def adamw(self, grads: Arrays, lr: float, betas: tuple[float, float], eps: float, wd: float) -> None:
        """One AdamW update over |g|; `self.buf` bounds exp_avg, exp_avg_sq is a sum of squares (its own scale)."""
        self.steps += 1
        b1, b2 = betas
        self.sq = getattr(self, "sq", [np.zeros_like(a) for a in self.p])
        for i, g in enumerate(grads):
            ag = np.abs(g.astype(np.float64))
            self.buf[i] = b1 * self.buf[i] + (1 - b1) * ag
            self.sq[i] = b2 * self.sq[i] + (1 - b2) * ag * ag
            bc1, bc2 = 1 - b1**self.steps, 1 - b2**self.steps
            self.p[i] = (1 + lr * wd) * self.p[i] + lr / bc1 * self.buf[i] / (np.sqrt(self.sq[i] / bc2) + eps)

    def sgd(self, grads: Arrays, lr: float, momentum: float, dampening: float, nesterov: bool, wd: float) -> None:
        self.steps += 1
        for i, g in enumerate(grads):
            d = np.abs(g.astype(np.float64)) + wd * self.p[i]
            if momentum:
                self.buf[i] = d if self.steps == 1 else momentum * self.buf[i] + (1 - dampening) * d
                d = d + momentum * self.buf[i] if nesterov else self.buf[i]
            self.p[i] = self.p[i] + lr * d
