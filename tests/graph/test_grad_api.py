"""fl.grad's contract: what it accepts, and that fusion never hides a tensor a gradient is asked for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fuel as fl
from fuel.graph.node import Op, topo_order


def _f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _torch_grad(fn, arrays: list[np.ndarray], wrt: int, weights: np.ndarray) -> np.ndarray:  # type: ignore[no-untyped-def]
    ts = [torch.tensor(a.astype(np.float64), requires_grad=True) for a in arrays]
    views = fn(*ts)
    views[wrt].retain_grad()
    (views[-1] * torch.tensor(weights.astype(np.float64))).sum().backward()
    g = views[wrt].grad
    assert g is not None
    return g.numpy()


def test_gradient_wrt_a_broadcast_bias_fused_into_linear(rng: np.random.Generator) -> None:
    x, w, b = _f32(rng, 3, 4), _f32(rng, 4, 5), _f32(rng, 5)
    bb = fl.tensor(b).broadcast_to(3, 5)
    y = fl.tensor(x) @ fl.tensor(w) + bb
    (g,) = fl.grad(y.sum(), [bb])
    np.testing.assert_array_equal(g.numpy(), np.ones((3, 5), np.float32))
    (g_unfused,) = fl.grad(y.sum(), [bb], fuse=False)
    np.testing.assert_array_equal(g.numpy(), g_unfused.numpy())


def test_gradient_wrt_broadcast_rope_table_and_half_slice(rng: np.random.Generator) -> None:
    x, cos, sin = _f32(rng, 2, 3, 8), _f32(rng, 3, 8), _f32(rng, 3, 8)
    weights = rng.standard_normal((2, 3, 8))
    tx, tcos, tsin = fl.tensor(x), fl.tensor(cos), fl.tensor(sin)
    cos_b = tcos.broadcast_to(2, 3, 8)
    lo = tx[..., :4]
    y = tx * cos_b + fl.concat([-tx[..., 4:], lo], axis=-1) * tsin.broadcast_to(2, 3, 8)
    # Without the views in wrt, this graph fuses into one Rope node.
    (gx,) = fl.grad((y * fl.tensor(weights.astype(np.float32))).sum(), [tx])
    assert any(n.op is Op.FUSED and n.arg[0] == fl.default_registry().by_name("Rope").id
               for n in topo_order([gx.node]))
    g_cos, g_lo = fl.grad(y, [cos_b, lo], grad_out=weights.astype(np.float32))

    def torch_fn(x_, c_, s_):  # type: ignore[no-untyped-def]
        c_b = c_.expand(2, 3, 8)
        lo_ = x_[..., :4]
        rot = torch.cat([-x_[..., 4:], lo_], dim=-1)
        return [c_b, lo_, x_ * c_b + rot * s_]

    np.testing.assert_allclose(g_cos.numpy(), _torch_grad(torch_fn, [x, cos, sin], 0, weights), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_lo.numpy(), _torch_grad(torch_fn, [x, cos, sin], 1, weights), rtol=1e-5, atol=1e-6)


def test_grad_out_and_wrt_accept_array_likes_and_a_bare_tensor(rng: np.random.Generator) -> None:
    x = fl.tensor(_f32(rng, 2, 3))
    y = x * 3.0
    for grad_out in (np.ones((2, 3), np.float32), np.ones((2, 3)), [[1.0, 1.0, 1.0]] * 2):
        (g,) = fl.grad(y, [x], grad_out=grad_out)
        np.testing.assert_array_equal(g.numpy(), np.full((2, 3), 3.0, np.float32))
    (g,) = fl.grad(y.sum(), x)
    np.testing.assert_array_equal(g.numpy(), np.full((2, 3), 3.0, np.float32))
    (g,) = fl.grad(y.sum(), (t for t in [x]))
    assert g.shape == (2, 3)


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda x, y: fl.grad(y.sum(), [np.zeros((2, 3), np.float32)]), fl.DTypeError,
     r"grad: wrt\[0\] is a ndarray, not a Tensor of the graph"),
    (lambda x, y: fl.grad(y, [x], grad_out=np.ones((3, 2))), fl.ShapeError,
     r"grad: grad_out has shape \[3, 2\], output has shape \[2, 3\]"),
    (lambda x, y: fl.grad(y, [x], grad_out=fl.tensor(np.ones((2, 3)))), fl.DTypeError,
     "grad: grad_out is f64, output is f32"),
    (lambda x, y: fl.grad(y, [x]), fl.ShapeError, "pass grad_out for non-scalar outputs"),
    (lambda x, y: fl.grad(np.ones(1), [x]), fl.DTypeError, "grad: output must be a Tensor, got ndarray"),
])
def test_grad_rejects_what_it_cannot_differentiate(call, error, message) -> None:  # type: ignore[no-untyped-def]
    x = fl.tensor(np.ones((2, 3), np.float32))
    with pytest.raises(error, match=message):
        call(x, x * 2.0)


def test_a_gradient_an_op_does_not_serve_is_an_error_not_zeros() -> None:
    """FlashAttn serves no gradient for its ALiBi slopes: asking for one raises instead of giving zeros."""
    rng = np.random.default_rng(0)
    q, k, v = (fl.tensor(rng.standard_normal((1, 2, 3, 4)).astype(np.float32)) for _ in range(3))
    slopes = fl.tensor(np.array([0.5, 0.25], np.float32))
    out = fl.ops.flash_attn(q, k, v, alibi=slopes)
    with pytest.raises(fl.NotDifferentiable, match="flash_attn gives no gradient for its input 3"):
        fl.grad(out.sum(), [q, slopes])
    (gq,) = fl.grad(out.sum(), [q])  # the inputs it serves are unaffected
    assert np.isfinite(gq.numpy()).all()
