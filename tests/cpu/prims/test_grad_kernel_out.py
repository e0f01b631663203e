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


def test_index_add_writes_into_its_output_buffer_with_the_fresh_arrays_bytes() -> None:
    """INDEX_ADD (an embedding's gradient) given its arena buffer adds straight into it: the same additions in
    the same order as into a fresh copy of the base (repeated indices included), checked against torch's
    index_add in float64; a half type still goes through the f32 copy."""
    from fuel.cpu.prims.prims import PRIM_KERNELS
    from fuel.dtype import DType
    from fuel.graph.node import Op, OpSpec

    rng = np.random.default_rng(1)
    base = rng.standard_normal((50, 6)).astype(np.float32)
    idx = rng.integers(0, 50, 40).astype(np.int64)
    src = rng.standard_normal((40, 6)).astype(np.float32)
    kernel = PRIM_KERNELS[Op.INDEX_ADD]
    spec = OpSpec(Op.INDEX_ADD, 0, (50, 6), DType.F32, ((50, 6), (40,), (40, 6)), (DType.F32, DType.I64, DType.F32),
                  "index_add")
    fresh = kernel([base, idx, src], spec, None)
    out = np.full((50, 6), np.nan, np.float32)
    assert kernel([base, idx, src], spec, out) is out and out.tobytes() == fresh.tobytes()
    want = torch.from_numpy(base.astype(np.float64)).index_add(0, torch.from_numpy(idx),
                                                               torch.from_numpy(src.astype(np.float64)))
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-6, atol=1e-6)
