"""A fused op's gradient primitive writes into the output buffer it is given, as every primitive does: the
first call of an fl.jit capture runs each step into its arena buffer and later steps read that buffer through
views folded at capture (a reshape of the gradient), so a result left elsewhere was read as garbage."""

from __future__ import annotations

import numpy as np
import torch

import fuel as fl


def test_first_jit_call_reads_the_cross_entropy_gradient_through_a_reshape() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((8, 20)).astype(np.float32)
    targets = rng.integers(0, 20, (2, 4)).astype(np.int64)
    leaf = fl.tensor(logits)

    def step(t: fl.Tensor) -> tuple[fl.Tensor, fl.Tensor]:
        # the product's buffer is viewed as [2, 4, 20]; the gradient's [2, 4, 20] buffer is viewed as [8, 20]
        loss = fl.ops.fused_softmax_cross_entropy((leaf * 1.0).reshape(2, 4, 20), t)
        (g,) = fl.grad(loss, [leaf])
        return loss, g

    tl = torch.tensor(logits.astype(np.float64), requires_grad=True)
    torch.nn.functional.cross_entropy(tl, torch.from_numpy(targets.reshape(-1))).backward()
    assert tl.grad is not None
    want = tl.grad.numpy()
    f = fl.jit(step)
    for _ in range(2):  # the capture's first call, then a replay
        _, g = f(targets)
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-5, atol=1e-7)
