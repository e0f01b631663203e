"""`opt.compile(loss_fn)`: gradient accumulation against torch's `(loss / n).backward()` per micro-batch,
a step that allocates nothing after its first call, and checkpoints (resuming gives the uninterrupted run's
parameters bit for bit)."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest
import torch

import fuel as fl
from fuel.optim import SGD, AdamW, Optimizer, cosine
from tests.optim.oracle import AbsScale, fuel_run, max_rel, torch_run
from tests.optim.test_adamw import problem


def test_accumulation_matches_torch() -> None:
    """3 micro-batches per update, 4 updates, with clipping: torch sums (loss / 3).backward() into .grad."""
    n, updates, lr, clip = 3, 4, 2e-2, 5.0
    p0, grads = problem(21, np.float32, steps=n * updates)
    got, opt, step = fuel_run(lambda ps: AdamW(ps, lr=lr, max_grad_norm=clip), p0, grads, accumulate=n)
    want, (_, norms) = torch_run(lambda ps: torch.optim.AdamW(ps, lr=lr, foreach=False), p0, grads,
                                 accumulate=n, clip=clip)
    assert opt.step_count == updates and len(got) == updates
    assert step.last_grad_norm == pytest.approx(norms[-1], rel=1e-6)
    scale = AbsScale(p0)
    for k in range(updates):
        # the accumulated gradient's magnitude: the sum of its micro-batches' |g| / n, clipped like the sum
        coef = min(1.0, clip / (norms[k] + 1e-6))
        mags = [sum(np.abs(grads[k * n + j][i].astype(np.float64)) for j in range(n)) / n * coef
                for i in range(len(p0))]
        scale.adamw(mags, lr, (0.9, 0.999), 1e-8, 1e-2)
        for i in range(len(p0)):
            assert max_rel(got[k][i], want[k][i], scale.p[i]) <= 1e-6, (k, i)
    assert all((b == 0).all() for b in step.buffers)  # zeroed by the update


@pytest.fixture(scope="module")
def mlp() -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    p0 = [(rng.standard_normal(s) / 8).astype(np.float32) for s in [(512, 16), (512,), (4, 512)]]
    return p0, rng.standard_normal((128, 16)).astype(np.float32), rng.standard_normal((128, 4)).astype(np.float32)


def mlp_loss(params: list[fl.Tensor]) -> Callable[[fl.Tensor, fl.Tensor], fl.Tensor]:
    def loss(xs: fl.Tensor, ys: fl.Tensor) -> fl.Tensor:
        h = (fl.matmul(xs, params[0].transpose(0, 1)) + params[1]).tanh()
        err = fl.matmul(h, params[2].transpose(0, 1)) - ys
        return (err * err).mean()
    return loss


def test_a_step_allocates_nothing_after_its_first_call(mlp: tuple[list[np.ndarray], np.ndarray, np.ndarray]) -> None:
    """The captures (one per accumulation phase) and their arenas stay as laid out at the first call, and a
    step neither keeps NumPy memory nor allocates an intermediate: its intermediates are [128, 512] f32
    (256 KiB) each, and a step's transient peak stays under half of that (what it does allocate is NumPy's
    fixed-size ufunc buffers and small Python objects), its retained growth under 64 KiB over 30 steps."""
    p0, x, y = mlp
    params = [fl.tensor(a.copy()) for a in p0]
    step = AdamW(params, lr=1e-2, max_grad_norm=1.0).compile(mlp_loss(params), accumulate=2)
    for _ in range(4):
        step(x, y)
    assert step.add is not None
    captures = (step.apply.captures, step.add.captures)
    arenas = (step.apply.capture_for(x, y).arena_bytes, step.add.capture_for(x, y).arena_bytes)
    assert min(arenas) > 4 * 256 * 1024  # the intermediates live in the arenas
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        peaks = []
        for _ in range(30):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            step(x, y)
            peaks.append(tracemalloc.get_traced_memory()[1] - before)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert max(peaks) < 128 * 1024, peaks
    assert grown < 64 * 1024
    assert (step.apply.captures, step.add.captures) == captures == (1, 1)
    assert (step.apply.capture_for(x, y).arena_bytes, step.add.capture_for(x, y).arena_bytes) == arenas


OPTIMIZERS: list[Callable[[list[fl.Tensor]], Optimizer]] = [
    lambda ps: AdamW(ps, lr=cosine(3e-2, 12, warmup_steps=3), max_grad_norm=1.0),
    lambda ps: SGD(ps, 1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
]


@pytest.mark.parametrize("make", OPTIMIZERS, ids=["adamw", "sgd"])
@pytest.mark.parametrize("dtype", [fl.f32, fl.bf16])
def test_resume_is_bit_identical(mlp: tuple[list[np.ndarray], np.ndarray, np.ndarray],
                                 make: Callable[[list[fl.Tensor]], Optimizer], dtype: fl.DType) -> None:
    """6 steps, a checkpoint (parameters and state_dict), 6 more; a fresh model and optimizer loaded from the
    checkpoint then make the same 6 steps to the same bits (bf16 parameters keep f32 master weights)."""
    p0, x, y = mlp
    params = [fl.tensor(a.astype(dtype.np)) for a in p0]
    opt = make(params)
    step = opt.compile(mlp_loss(params))
    for _ in range(6):
        step(x, y)
    saved_params = [p.numpy().copy() for p in params]
    saved = opt.state_dict()
    assert int(saved["step"]) == 6
    losses = [step(x, y) for _ in range(6)]

    resumed = [fl.tensor(a.copy()) for a in saved_params]
    opt2 = make(resumed)
    opt2.load_state_dict(saved)
    step2 = opt2.compile(mlp_loss(resumed))
    assert [step2(x, y) for _ in range(6)] == losses
    for a, b in zip(params, resumed, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for k, v in opt.state_dict().items():
        np.testing.assert_array_equal(v, opt2.state_dict()[k])


def test_state_dict_round_trip_and_its_errors() -> None:
    params = [fl.tensor(np.ones((2, 3), np.float32)), fl.tensor(np.ones(4, np.float32))]
    opt = AdamW(params)
    state = opt.state_dict()
    assert sorted(state) == ["state.0.exp_avg", "state.0.exp_avg_sq", "state.1.exp_avg", "state.1.exp_avg_sq",
                             "step"]
    state["state.1.exp_avg"] = np.full(4, 0.5, np.float32)
    state["step"] = np.array(3)
    opt.load_state_dict(state)
    assert opt.step_count == 3
    np.testing.assert_array_equal(opt.state[1]["exp_avg"], np.full(4, 0.5, np.float32))
    bad = [({**state, "state.2.exp_avg": np.zeros(1, np.float32)}, fl.ParamError,
            "AdamW.load_state_dict: unknown key 'state.2.exp_avg'"),
           ({k: v for k, v in state.items() if k != "state.0.exp_avg_sq"}, fl.ParamError,
            "AdamW.load_state_dict: missing key 'state.0.exp_avg_sq'"),
           ({**state, "state.0.exp_avg": np.zeros((3, 2), np.float32)}, fl.ShapeError,
            r"AdamW.load_state_dict: 'state.0.exp_avg' is \[3, 2\], expected \[2, 3\]"),
           ({**state, "state.0.exp_avg": np.zeros((2, 3), np.float64)}, fl.DTypeError,
            "AdamW.load_state_dict: 'state.0.exp_avg' is f64, expected f32"),
           ({**state, "step": np.array(-1)}, fl.ParamError, "AdamW.load_state_dict: 'step' must be >= 0, got -1")]
    for d, error, message in bad:
        with pytest.raises(error, match=message):
            opt.load_state_dict(d)
    assert opt.step_count == 3  # a refused checkpoint changes nothing
