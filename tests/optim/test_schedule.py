"""The LR schedules against the torch.optim.lr_scheduler constructions their docstrings name: the lr torch
uses at its k-th `opt.step()` (stepping the scheduler after each) equals `schedule(k)` for every k."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fuel.errors import ParamError
from fuel.optim import constant, cosine, linear_warmup

LR = 0.3


def torch_lrs(make: Callable[[torch.optim.Optimizer], Any] | None, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    sched = make(opt) if make is not None else None
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched is not None:
            sched.step()
    return lrs


def check(schedule: Callable[[int], float], want: list[float]) -> None:
    got = [schedule(k) for k in range(1, len(want) + 1)]
    # torch steps its schedulers by recurrences; these are closed forms: equal to float64 rounding, per step
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_constant() -> None:
    check(constant(LR), torch_lrs(None, 10))


@pytest.mark.parametrize("warmup", [1, 2, 5])
def test_linear_warmup(warmup: int) -> None:
    want = torch_lrs(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: min(1.0, (e + 1) / warmup)), 12)
    check(linear_warmup(LR, warmup), want)
    linear = torch_lrs(lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=1 / warmup, end_factor=1.0,
                                                                   total_iters=warmup - 1), 12)
    check(linear_warmup(LR, warmup), linear)


@pytest.mark.parametrize(("total", "warmup", "min_lr"), [(10, 0, 0.0), (12, 0, 0.01), (15, 4, 0.02), (9, 1, 0.0)])
def test_cosine(total: int, warmup: int, min_lr: float) -> None:
    def make(o: torch.optim.Optimizer) -> Any:
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=total - warmup, eta_min=min_lr)
        if warmup == 0:
            return cos
        lin = torch.optim.lr_scheduler.LinearLR(o, start_factor=1 / warmup, total_iters=warmup - 1)
        return torch.optim.lr_scheduler.SequentialLR(o, [lin, cos], milestones=[warmup])

    sched = cosine(LR, total, warmup_steps=warmup, min_lr=min_lr)
    want = torch_lrs(make, total + 1)  # through the step after the last, where torch reaches min_lr
    check(sched, want)
    assert want[-1] == pytest.approx(min_lr, abs=1e-15)
    assert sched(total + 5) == min_lr  # held past total_steps


@pytest.mark.parametrize(("build", "message"), [
    (lambda: linear_warmup(LR, -3), "linear_warmup: warmup_steps must be an integer >= 1, got -3"),
    (lambda: linear_warmup(LR, 0), "linear_warmup: warmup_steps must be an integer >= 1, got 0"),
    (lambda: cosine(LR, -10), "cosine: total_steps must be an integer >= 1, got -10"),
    (lambda: cosine(LR, 10, warmup_steps=-1), "cosine: warmup_steps must be an integer >= 0, got -1"),
    (lambda: cosine(LR, 10, warmup_steps=10), r"cosine: warmup_steps must be below total_steps \(10\), got 10"),
    (lambda: cosine(LR, 10, min_lr=1.0), r"cosine: min_lr must be <= lr \(0.3\), got 1.0"),
    (lambda: cosine(-1.0, 10), "cosine: lr must be a finite number >= 0, got -1.0"),
    (lambda: constant(float("nan")), "constant: lr must be a finite number >= 0, got nan"),
    (lambda: linear_warmup(LR, 2.5), "linear_warmup: warmup_steps must be an integer >= 1, got 2.5"),
    (lambda: constant(LR)(0), "constant: step must be an integer >= 1, got 0"),
    (lambda: cosine(LR, 10)(-2), "cosine: step must be an integer >= 1, got -2"),
])
def test_bad_schedules_name_the_argument(build: Callable[[], Any], message: str) -> None:
    with pytest.raises(ParamError, match=message):
        build()
