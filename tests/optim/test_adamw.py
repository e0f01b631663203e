"""AdamW against torch.optim.AdamW for 20 updates on random problems, fed identical gradients (oracle.py):
every parameter and state element within 1e-6 of torch in f32 (1e-13 in f64), each measured against the
float64 magnitudes it is formed from (oracle.AbsScale)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import fuel as fl
from fuel.optim import AdamW, cosine
from tests.optim.oracle import AbsScale, fuel_run, max_rel, torch_run

STEPS = 20
SHAPES = [(6, 5), (7,), (2, 3, 4)]
TOL: dict[Any, float] = {np.float32: 1e-6, np.float64: 1e-13}


def problem(seed: int, dtype: Any, steps: int = STEPS, shapes: list[tuple[int, ...]] = SHAPES) \
        -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    rng = np.random.default_rng(seed)
    p0 = [rng.standard_normal(s).astype(dtype) for s in shapes]
    # gradients of mixed magnitudes, so exp_avg_sq spans orders and eps matters for some elements
    grads = [[(rng.standard_normal(s) * 10.0 ** rng.integers(-4, 2, s)).astype(dtype) for s in shapes]
             for _ in range(steps)]
    return p0, grads


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("betas", "wd"), [((0.9, 0.999), 0.01), ((0.3, 0.95), 0.0), ((0.0, 0.5), 0.1)])
def test_adamw_matches_torch(dtype: Any, betas: tuple[float, float], wd: float) -> None:
    """Every update's parameters and the final exp_avg/exp_avg_sq; beta1 0.3 takes torch's other lerp form."""
    lr, eps = 3e-2, 1e-8
    p0, grads = problem(1, dtype)
    got, opt, _ = fuel_run(lambda ps: AdamW(ps, lr=lr, betas=betas, eps=eps, weight_decay=wd), p0, grads)
    want, (topt, _) = torch_run(lambda ps: torch.optim.AdamW(ps, lr=lr, betas=betas, eps=eps, weight_decay=wd,
                                                             foreach=False), p0, grads)
    scale = AbsScale(p0)
    for k in range(STEPS):
        scale.adamw(grads[k], lr, betas, eps, wd)
        for i in range(len(p0)):
            assert max_rel(got[k][i], want[k][i], scale.p[i]) <= TOL[dtype], (k, i)
    assert opt.step_count == STEPS
    for i, p in enumerate(topt.param_groups[0]["params"]):
        st = topt.state[p]
        assert max_rel(opt.state[i]["exp_avg"], st["exp_avg"].numpy(), scale.buf[i]) <= TOL[dtype]
        assert max_rel(opt.state[i]["exp_avg_sq"], st["exp_avg_sq"].numpy(), scale.sq[i]) <= TOL[dtype]


def test_adamw_with_a_schedule_and_clipping_matches_torch() -> None:
    """cosine with warmup against torch's SequentialLR(LinearLR, CosineAnnealingLR), and max_grad_norm against
    clip_grad_norm_ before each step (the total norm reported by `last_grad_norm` too)."""
    lr, total, warm, clip = 5e-2, STEPS, 4, 2.0
    p0, grads = problem(2, np.float32)
    norms = []

    def make(ps: list[fl.Tensor]) -> AdamW:
        return AdamW(ps, lr=cosine(lr, total, warmup_steps=warm, min_lr=1e-3), max_grad_norm=clip)

    params = [fl.tensor(a.copy()) for a in p0]
    opt = make(params)
    from tests.optim.oracle import dot_loss
    step = opt.compile(dot_loss(params))
    got = []
    for gs in grads:
        step(*gs)
        assert step.last_grad_norm is not None
        norms.append(step.last_grad_norm)
        got.append([p.numpy().copy() for p in params])

    def sched(o: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.SequentialLR(o, [
            torch.optim.lr_scheduler.LinearLR(o, start_factor=1 / warm, total_iters=warm - 1),
            torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=total - warm, eta_min=1e-3)], milestones=[warm])

    want, (_, tnorms) = torch_run(lambda ps: torch.optim.AdamW(ps, lr=lr, foreach=False), p0, grads,
                                  sched=sched, clip=clip)
    np.testing.assert_allclose(norms, tnorms, rtol=1e-6)
    assert max(tnorms) > 4 * clip  # the clipping is active
    scale = AbsScale(p0)
    for k in range(STEPS):
        coef = min(1.0, clip / (tnorms[k] + 1e-6))
        scale.adamw([g * coef for g in grads[k]], cosine(lr, total, warm, 1e-3)(k + 1), (0.9, 0.999), 1e-8, 1e-2)
        for i in range(len(p0)):
            assert max_rel(got[k][i], want[k][i], scale.p[i]) <= 1e-6, (k, i)


@pytest.mark.parametrize("half", [fl.bf16, fl.f16])
def test_master_weights_match_torch_in_f32(half: fl.DType) -> None:
    """Half parameters with f32 master weights and state: the masters against torch's AdamW on f32
    parameters fed the same (half) gradients, and each half parameter equal to the master's rounding."""
    lr, wd = 1e-2, 0.05
    p0, grads = problem(3, np.float32)
    p0 = [a.astype(half.np) for a in p0]
    grads = [[g.astype(half.np) for g in gs] for gs in grads]
    got, opt, _ = fuel_run(lambda ps: AdamW(ps, lr=lr, weight_decay=wd), p0, grads)
    assert all(m is not None and m.dtype == np.float32 for m in opt.masters)
    assert all(s["exp_avg"].dtype == np.float32 for s in opt.state)
    want, _ = torch_run(lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=wd, foreach=False),
                        [a.astype(np.float32) for a in p0], [[g.astype(np.float32) for g in gs] for gs in grads],
                        dtype=torch.float32)
    scale = AbsScale([a.astype(np.float32) for a in p0])
    for k in range(STEPS):
        scale.adamw([g.astype(np.float32) for g in grads[k]], lr, (0.9, 0.999), 1e-8, wd)
        for i in range(len(p0)):
            assert got[k][i].dtype == half.np
            # the half parameter is torch's f32 parameter rounded, unless the two f32 values straddle a
            # rounding boundary: then one half ulp apart at most
            rounded = want[k][i].astype(half.np).astype(np.float64)
            ulp = np.abs(np.spacing(want[k][i].astype(half.np))).astype(np.float64)
            assert (np.abs(got[k][i].astype(np.float64) - rounded) <= ulp).all(), (k, i)
    for i, m in enumerate(opt.masters):
        assert m is not None and max_rel(m, want[-1][i], scale.p[i]) <= 1e-6


def test_eager_update_matches_torch() -> None:
    """`advance()` then realising `update(grads)` outside fl.jit gives the same updates."""
    lr = 1e-2
    p0, grads = problem(4, np.float32, steps=5)
    params = [fl.tensor(a.copy()) for a in p0]
    opt = AdamW(params, lr=lr)
    want, _ = torch_run(lambda ps: torch.optim.AdamW(ps, lr=lr, foreach=False), p0, grads)
    scale = AbsScale(p0)
    for k, gs in enumerate(grads):
        opt.advance()
        fl.realize(*opt.update([fl.tensor(g) for g in gs]))
        scale.adamw(gs, lr, (0.9, 0.999), 1e-8, 1e-2)
        for i, p in enumerate(params):
            assert max_rel(p.numpy(), want[k][i], scale.p[i]) <= 1e-6


def test_least_squares_mlp_trains_like_torch() -> None:
    """End to end: fuel computes the gradients of a two-layer MLP's mean squared error; losses and parameters
    follow torch's for 20 AdamW updates (gradients now differ by rounding, so 1e-5)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = rng.standard_normal((16, 3)).astype(np.float32)
    w1, b1 = (rng.standard_normal((12, 8)) / 3).astype(np.float32), np.zeros(12, np.float32)
    w2 = (rng.standard_normal((3, 12)) / 3).astype(np.float32)
    params = [fl.tensor(a.copy()) for a in (w1, b1, w2)]

    def loss_fn(xs: fl.Tensor, ys: fl.Tensor) -> fl.Tensor:
        h = (fl.matmul(xs, params[0].transpose(0, 1)) + params[1]).tanh()
        err = fl.matmul(h, params[2].transpose(0, 1)) - ys
        return (err * err).mean()

    step = AdamW(params, lr=2e-2).compile(loss_fn)
    tp = [torch.tensor(a.copy(), requires_grad=True) for a in (w1, b1, w2)]
    topt = torch.optim.AdamW(tp, lr=2e-2, foreach=False)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    losses, tlosses = [], []
    for _ in range(STEPS):
        losses.append(step(x, y))
        tloss = (((tx @ tp[0].T + tp[1]).tanh() @ tp[2].T - ty) ** 2).mean()
        tloss.backward()
        topt.step()
        topt.zero_grad()
        tlosses.append(float(tloss.detach()))
    np.testing.assert_allclose(losses, tlosses, rtol=1e-5)
    assert losses[-1] < 0.6 * losses[0]
    # each AdamW update moves an element by about lr at most: |p0| + lr * steps bounds what formed it
    for p, t, a in zip(params, tp, (w1, b1, w2), strict=True):
        assert max_rel(p.numpy(), t.detach().numpy(), np.abs(a) + 2e-2 * STEPS) <= 1e-5
