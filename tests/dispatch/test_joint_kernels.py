"""Joint kernels: sibling entries over the same inputs and params run once (FlashAttnBackward Q/K/V)."""

from __future__ import annotations

import numpy as np

import fuel as fl


def _grads(q: fl.Tensor, k: fl.Tensor, v: fl.Tensor, do: fl.Tensor) -> list[fl.Tensor]:
    out = fl.ops.flash_attn(q, k, v, causal=True, window_size=(9, None), k_len=45)
    return fl.grad(out, [q, k, v], grad_out=do)


def _inputs(rng: np.random.Generator) -> list[np.ndarray]:
    shapes = [(1, 4, 37, 16), (1, 2, 50, 16), (1, 2, 50, 16), (1, 4, 37, 16)]
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _attention_steps(t: fl.trace) -> list[str]:  # type: ignore[valid-type]
    return [r.impl for r in t.records if "Attn" in r.impl]  # type: ignore[attr-defined]


def test_three_gradients_run_as_one_step_with_the_same_bytes(rng: np.random.Generator) -> None:
    arrays = _inputs(rng)
    alone = [g.numpy() for g in _grads(*(fl.tensor(a) for a in arrays))]  # one plan per gradient
    together = _grads(*(fl.tensor(a) for a in arrays))
    with fl.trace() as t:
        fl.realize(*together)
    (step,) = _attention_steps(t)
    assert step.count("FlashAttnBackward") == 3
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_array_equal(a, b.numpy())


def test_joint_step_under_replay(rng: np.random.Generator) -> None:
    arrays = _inputs(rng)
    want = [g.numpy() for g in _grads(*(fl.tensor(a) for a in arrays))]
    step = fl.jit(_grads)
    for _ in range(3):
        with fl.trace() as t:
            got = step(*arrays)
        assert len(_attention_steps(t)) == 1
        for a, b in zip(want, got, strict=True):
            np.testing.assert_array_equal(a, b.numpy())


def test_a_lone_gradient_runs_its_own_kernel(rng: np.random.Generator) -> None:
    q, k, v, do = (fl.tensor(a) for a in _inputs(rng))
    dq = fl.ops.flash_attn_backward_q(q, k, v, do, causal=True)
    dv = fl.ops.flash_attn_backward_v(q, k, v, do, causal=False)  # other params: not a sibling
    with fl.trace() as t:
        fl.realize(dq, dv)
    assert sorted(_attention_steps(t)) == ["FlashAttnBackwardQ[cpu:f32,f32,f32,f32,f32]",
                                           "FlashAttnBackwardV[cpu:f32,f32,f32,f32,f32]"]
