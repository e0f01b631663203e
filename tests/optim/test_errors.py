"""Bad optimizer input raises a FuelError naming the optimizer, the argument, what it expected and what came."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import fuel as fl
from fuel.optim import SGD, AdamW


def params() -> list[fl.Tensor]:
    return [fl.tensor(np.zeros((2, 3), np.float32)), fl.tensor(np.zeros(4, np.float32))]


@pytest.mark.parametrize(("build", "error", "message"), [
    (lambda: AdamW(params(), lr=-1e-3), fl.ParamError, "AdamW: lr must be a finite number >= 0 or a schedule"),
    (lambda: SGD(params(), lr=-0.1), fl.ParamError, r"SGD: lr must be a finite number >= 0 or a schedule .*got -0.1"),
    (lambda: AdamW(params(), lr=float("inf")), fl.ParamError, "AdamW: lr must be a finite number"),
    (lambda: AdamW(params(), betas=(1.0, 0.999)), fl.ParamError, r"AdamW: betas\[0\] must be in \[0.0, 1.0\), got 1.0"),
    (lambda: AdamW(params(), betas=(0.9, -0.1)), fl.ParamError, r"AdamW: betas\[1\] must be in \[0.0, 1.0\), got -0.1"),
    (lambda: AdamW(params(), betas=(0.9,)), fl.ParamError, r"AdamW: betas must be a pair \(beta1, beta2\)"),
    (lambda: AdamW(params(), eps=0.0), fl.ParamError, r"AdamW: eps must be in \(0.0, inf\), got 0.0"),
    (lambda: AdamW(params(), eps=-1e-8), fl.ParamError, r"AdamW: eps must be in \(0.0, inf\), got -1e-08"),
    (lambda: AdamW(params(), weight_decay=-0.1), fl.ParamError, r"AdamW: weight_decay must be in \[0.0, inf\)"),
    (lambda: SGD(params(), 0.1, momentum=-0.9), fl.ParamError, "SGD: momentum must be a finite number >= 0, got -0.9"),
    (lambda: SGD(params(), 0.1, weight_decay=-1), fl.ParamError, "SGD: weight_decay must be a finite number >= 0"),
    (lambda: SGD(params(), 0.1, nesterov=True), fl.ParamError,
     "SGD: nesterov needs momentum > 0 and dampening 0, got momentum=0.0, dampening=0.0"),
    (lambda: AdamW(params(), max_grad_norm=0.0), fl.ParamError,
     "AdamW: max_grad_norm must be a finite number > 0 or None, got 0.0"),
    (lambda: AdamW([]), fl.ParamError, "AdamW: params is empty"),
    (lambda: AdamW(params()[0]), fl.ParamError, "AdamW: params must be a sequence of Tensors, got Tensor"),
    (lambda: AdamW([params()[0] + 1.0]), fl.ParamError, r"AdamW: params\[0\] must be a realised leaf"),
    (lambda: AdamW([fl.tensor(np.zeros(3, np.int64))]), fl.DTypeError,
     r"AdamW: params\[0\] must be a float tensor, got i64"),
    (lambda: AdamW([fl.tensor(np.zeros(3, np.float32), const=True)]), fl.ParamError,
     r"AdamW: params\[0\] must be over a writable C-contiguous array"),
    (lambda: AdamW([p := params()[0], p]), fl.ParamError, r"AdamW: params\[1\] is params\[0\] again"),
    (lambda: AdamW(params(), master_weights=True), fl.DTypeError,
     r"AdamW: master_weights=True needs bf16 or f16 parameters, got \['f32'\]"),
])
def test_bad_construction(build: Callable[[], Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        build()


@pytest.mark.parametrize(("grads", "error", "message"), [
    ([np.zeros((2, 3), np.float32)], fl.ParamError,
     r"AdamW.update: grads has 1 entries, expected one per parameter \(2\)"),
    ([np.zeros((3, 2), np.float32), np.zeros(4, np.float32)], fl.ShapeError,
     r"AdamW.update: grads\[0\] is \[3, 2\], its parameter is \[2, 3\]"),
    ([np.zeros((2, 3), np.float32), np.zeros(4, np.int64)], fl.DTypeError,
     r"AdamW.update: grads\[1\] must be a float tensor, got i64"),
])
def test_bad_grads(grads: list[np.ndarray], error: type, message: str) -> None:
    opt = AdamW(params())
    with pytest.raises(error, match=message):
        opt.update([fl.tensor(g) for g in grads])
    with pytest.raises(fl.ParamError, match=r"AdamW.update: grads\[0\] must be a Tensor or None, got ndarray"):
        opt.update([np.zeros((2, 3), np.float32), None])


def test_bad_compile_and_schedule_values() -> None:
    ps = params()
    with pytest.raises(fl.ParamError, match="compile: accumulate must be an integer >= 1, got 0"):
        AdamW(ps).compile(lambda: ps[0].sum(), accumulate=0)
    step = AdamW(ps).compile(lambda x: ps[0] * x)
    with pytest.raises(fl.ShapeError, match=r"compile: loss_fn must return a scalar float Tensor, got a \[2, 3\] f32"):
        step(np.ones((2, 3), np.float32))
    assert step.opt.step_count == 0  # the failed step is not counted
    opt = SGD(ps, lambda k: 0.1 if k < 2 else -0.1)
    opt.advance()
    with pytest.raises(fl.ParamError, match=r"SGD: the schedule gave lr=-0\.1 at step 2; expected a finite"):
        opt.advance()
    assert opt.step_count == 1


def test_a_failed_micro_batch_is_not_counted() -> None:
    """With accumulate=2, a micro-batch whose step fails (a batch of the wrong shape) adds nothing: the next
    two good calls make the update."""
    ps = params()
    opt = SGD(ps, 0.5)
    step = opt.compile(lambda x: (ps[0] * x).sum(), accumulate=2)
    with pytest.raises(fl.ShapeError):
        step(np.ones((3, 3), np.float32))
    assert step.micro == 0
    step(np.ones((2, 3), np.float32))
    assert opt.step_count == 0
    step(np.ones((2, 3), np.float32))
    assert opt.step_count == 1
    np.testing.assert_array_equal(ps[0].numpy(), np.full((2, 3), -0.5, np.float32))
