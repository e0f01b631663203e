"""Learning-rate schedules: callables `step -> lr`, where step counts optimizer updates from 1 (the first
update is step 1). Each equals a torch.optim.lr_scheduler construction stepped after every update, as
torch users write `opt.step(); sched.step()`: torch's lr at the k-th update is its scheduler's value at
`last_epoch = k - 1`. Which construction each equals is stated in its docstring and tested against torch.

Schedules are plain Python (float64) arithmetic; the optimizer writes their value into its per-step scalar
arrays (`Optimizer.advance`), so one captured step serves every learning rate."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral, Real

from fuel.errors import ParamError

Schedule = Callable[[int], float]


def _rate(op: str, name: str, value: object) -> float:
    """A finite, non-negative learning rate."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)) or value < 0:
        raise ParamError(f"{op}: {name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _count(op: str, name: str, value: object, least: int) -> int:
    """A step count of at least `least`."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < least:
        raise ParamError(f"{op}: {name} must be an integer >= {least}, got {value!r}")
    return int(value)


def _step(op: str, step: object) -> int:
    return _count(op, "step", step, 1)


@dataclass(frozen=True)
class constant:
    """`lr` at every step: torch's optimizer without a scheduler (or ConstantLR(factor=1.0))."""

    lr: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _rate("constant", "lr", self.lr))

    def __call__(self, step: int) -> float:
        _step("constant", step)
        return self.lr


@dataclass(frozen=True)
class linear_warmup:
    """`lr * min(step, warmup_steps) / warmup_steps`: rises linearly to `lr` at step `warmup_steps`, then
    stays. Equals torch's `LambdaLR(opt, lambda e: min(1.0, (e + 1) / warmup_steps))` and
    `LinearLR(opt, start_factor=1 / warmup_steps, end_factor=1.0, total_iters=warmup_steps - 1)`."""

    lr: float
    warmup_steps: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _rate("linear_warmup", "lr", self.lr))
        object.__setattr__(self, "warmup_steps", _count("linear_warmup", "warmup_steps", self.warmup_steps, 1))

    def __call__(self, step: int) -> float:
        k = _step("linear_warmup", step)
        return self.lr * min(1.0, k / self.warmup_steps)


@dataclass(frozen=True)
class cosine:
    """A linear warmup over `warmup_steps` (as `linear_warmup`), then half a cosine from `lr` down to
    `min_lr`: at step k > warmup_steps, `min_lr + (lr - min_lr) * (1 + cos(pi * e / T)) / 2` with
    `e = k - 1 - warmup_steps` and `T = total_steps - warmup_steps`. It reaches `min_lr` after the last
    step, and holds `min_lr` past `total_steps` (torch's cosine would rise again).

    With warmup_steps = 0 this is torch's `CosineAnnealingLR(opt, T_max=total_steps, eta_min=min_lr)`;
    otherwise `SequentialLR(opt, [LinearLR(opt, start_factor=1 / warmup_steps, total_iters=warmup_steps - 1),
    CosineAnnealingLR(opt, T_max=total_steps - warmup_steps, eta_min=min_lr)], milestones=[warmup_steps])`."""

    lr: float
    total_steps: int
    warmup_steps: int = 0
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _rate("cosine", "lr", self.lr))
        object.__setattr__(self, "min_lr", _rate("cosine", "min_lr", self.min_lr))
        total = _count("cosine", "total_steps", self.total_steps, 1)
        object.__setattr__(self, "total_steps", total)
        warm = _count("cosine", "warmup_steps", self.warmup_steps, 0)
        if warm >= total:
            raise ParamError(f"cosine: warmup_steps must be below total_steps ({total}), got {warm}")
        object.__setattr__(self, "warmup_steps", warm)
        if self.min_lr > self.lr:
            raise ParamError(f"cosine: min_lr must be <= lr ({self.lr}), got {self.min_lr}")

    def __call__(self, step: int) -> float:
        k = _step("cosine", step)
        if k <= self.warmup_steps:
            return self.lr * k / self.warmup_steps
        e, t = k - 1 - self.warmup_steps, self.total_steps - self.warmup_steps
        if e >= t:
            return self.min_lr
        return self.min_lr + (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * e / t)) / 2.0


def as_schedule(op: str, lr: object) -> Schedule:
    """`lr` as a schedule: a number is `constant(lr)`, a callable is taken as it is (its values are checked
    at every step, by `Optimizer.advance`)."""
    if callable(lr):
        return lr
    if isinstance(lr, bool) or not isinstance(lr, Real) or not math.isfinite(float(lr)) or lr < 0:
        raise ParamError(f"{op}: lr must be a finite number >= 0 or a schedule (step -> lr), got {lr!r}")
    return constant(float(lr))
