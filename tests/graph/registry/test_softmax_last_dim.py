"""SoftmaxLastDim (1) and SoftmaxLastDimBackward (7) against torch, every dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.node import Node, Op
from fuel.graph.passes.fuse import fuse
from fuel.graph.prims import make
from fuel.graph.registry import FusedOps, default_registry
from fuel.testing.check import floor_of
from fuel.testing.oracle import assert_close_rowwise

SHAPES = [(7, 33), (2, 3, 64), (1, 1), (5, 1), (3, 1000), (0, 8), (4,)]


def assert_close_softmax(got: np.ndarray, want: np.ndarray, dt: DType, x: np.ndarray) -> None:
    """Softmax's errors are relative to each element (one exp, one scaling), so each is its own scale:
    a row's scale would let its many small elements be wrong. The absolute part also grows with
    |x - max(x)|: that difference is rounded once in the working format (error u·|x - max|), and exp
    turns it into the same relative error, for any implementation. Below the accumulation format's
    normal range exp may flush to 0, and nothing finer than the output's smallest subnormal is stored."""
    x64 = x.astype(np.float64)
    spread = np.abs(x64 - x64.max(-1, keepdims=True)) if x.size else x64
    floor = max(float(np.finfo(dt.acc.np).tiny), floor_of(dt.np))
    assert_close_rowwise(got, want, dt, scale=np.abs(want) * (1 + spread), floor=floor)


def _fused_ids(t: fl.trace) -> list[str]:  # type: ignore[valid-type]
    return [r.impl for r in t.records if not r.impl.startswith("prim:")]  # type: ignore[attr-defined]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_matches_torch(float_dtype: DType, shape: tuple[int, ...], rng: np.random.Generator) -> None:
    x = (rng.standard_normal(shape) * 3).astype(float_dtype.np)
    got = fl.ops.softmax_last_dim(x).numpy()
    assert got.dtype == float_dtype.np and got.shape == shape
    want = torch.softmax(torch.from_numpy(x.astype(np.float64)), -1).numpy()
    assert_close_softmax(got, want, float_dtype, x)


def test_backward_matches_torch_autograd(float_dtype: DType, rng: np.random.Generator) -> None:
    x = (rng.standard_normal((6, 40)) * 2).astype(float_dtype.np)
    g = rng.standard_normal((6, 40)).astype(float_dtype.np)
    tx = fl.tensor(x)
    y = fl.ops.softmax_last_dim(tx)
    (gx,) = fl.grad(y, [tx], grad_out=fl.tensor(g))
    with fl.trace() as t:
        got = gx.numpy()
    assert "SoftmaxLastDimBackward[cpu:" + ",".join([float_dtype.value] * 3) + "]" in _fused_ids(t)
    x64 = torch.tensor(x.astype(np.float64), requires_grad=True)
    (want,) = torch.autograd.grad(torch.softmax(x64, -1), [x64], torch.from_numpy(g.astype(np.float64)))
    assert_close_rowwise(got, want.numpy(), float_dtype, backward=True)


def test_backward_kernel_matches_torch_backward_data(float_dtype: DType, rng: np.random.Generator) -> None:
    y = torch.softmax(torch.randn(5, 17, dtype=torch.float64), -1).numpy().astype(float_dtype.np)
    g = rng.standard_normal((5, 17)).astype(float_dtype.np)
    got = fl.ops.softmax_last_dim_backward(y, g).numpy()
    y64, g64 = (torch.from_numpy(a.astype(np.float64)) for a in (y, g))
    want = torch._softmax_backward_data(g64, y64, -1, torch.float64).numpy()
    assert_close_rowwise(got, want, float_dtype, backward=True)


def test_all_minus_inf_row_gives_nan_like_torch() -> None:
    x = np.array([[-np.inf, -np.inf], [0.0, -np.inf]], np.float32)
    got = fl.ops.softmax_last_dim(x).numpy()
    assert np.isnan(got[0]).all()
    np.testing.assert_array_equal(got[1], [1.0, 0.0])


def test_nan_propagates_to_its_row() -> None:
    got = fl.ops.softmax_last_dim(np.array([[1.0, np.nan, 2.0], [1.0, 2.0, 3.0]], np.float32)).numpy()
    assert np.isnan(got[0]).all() and np.isfinite(got[1]).all()


def test_user_expression_is_fused_and_numbers_agree(rng: np.random.Generator) -> None:
    xa = rng.standard_normal((8, 50)).astype(np.float32)
    x = fl.tensor(xa)
    e = (x - x.max(-1, keepdim=True)).exp()
    y = e / e.sum(-1, keepdim=True)
    with fl.trace() as t:
        fused = y.numpy()
    assert _fused_ids(t) == ["SoftmaxLastDim[cpu:f32,f32]"]
    e2 = (x - x.max(-1, keepdim=True)).exp()
    unfused = fl.realize(e2 / e2.sum(-1, keepdim=True), fuse=False)[0].numpy()
    np.testing.assert_allclose(fused, unfused, rtol=2e-6, atol=1e-8)


def test_legacy_seven_node_spelling_is_fused() -> None:
    x = Node(Op.CONST, (), (3, 5), DType.F32, None, np.zeros((3, 5), np.float32))
    m = make(Op.BROADCAST_TO, (make(Op.REDUCE_MAX_TO, (x,), (3, 1)),), (3, 5))
    e = make(Op.EXP, (make(Op.SUB, (x, m)),))
    s = make(Op.BROADCAST_TO, (make(Op.REDUCE_SUM_TO, (e,), (3, 1)),), (3, 5))
    (root,) = fuse([make(Op.DIV, (e, s))], default_registry())
    assert root.op is Op.FUSED and root.arg[0] == FusedOps.SOFTMAX_LAST_DIM and root.inputs == (x,)


def test_sum_over_all_axes_is_not_mistaken_for_softmax() -> None:
    x = Node(Op.CONST, (), (3, 5), DType.F32, None, np.zeros((3, 5), np.float32))
    m = make(Op.BROADCAST_TO, (make(Op.REDUCE_MAX_TO, (x,), (3, 1)),), (3, 5))
    e = make(Op.EXP, (make(Op.SUB, (x, m)),))
    s = make(Op.BROADCAST_TO, (make(Op.REDUCE_SUM_TO, (e,), (1, 1)),), (3, 5))
    (root,) = fuse([make(Op.DIV, (e, s))], default_registry())
    assert root.op is Op.DIV


def test_interior_node_with_another_consumer_blocks_fusion() -> None:
    x = fl.tensor(np.zeros((2, 4), np.float32))
    e = (x - x.max(-1, keepdim=True)).exp()
    y = e / e.sum(-1, keepdim=True)
    roots = fuse([y.node, e.node], default_registry())
    assert roots[0].op is Op.DIV


def test_decompose_then_fuse_round_trips(rng: np.random.Generator) -> None:
    for op_id in (FusedOps.SOFTMAX_LAST_DIM, FusedOps.SOFTMAX_LAST_DIM_BACKWARD):
        entry = default_registry().entry(op_id)
        ins = [fl.tensor(rng.standard_normal((3, 6)).astype(np.float32)) for _ in entry.arity * entry.arity[0]]
        params = entry.params()
        lowered = entry.decompose([*ins][: entry.arity[0]], params)  # type: ignore[misc]
        assert lowered.node.op is not Op.FUSED
        (back,) = fuse([lowered.node], default_registry())
        assert back.op is Op.FUSED and back.arg == (op_id, params)
        assert back.inputs == tuple(t.node for t in ins[: entry.arity[0]])


@pytest.mark.parametrize(("build", "error", "message"), [
    (lambda: fl.ops.softmax_last_dim(np.float32(1.0)), fl.ShapeError, "softmax_last_dim: x must have rank >= 1"),
    (lambda: fl.ops.softmax_last_dim(np.zeros(3, np.int64)), fl.DTypeError, "softmax_last_dim: x must be a float"),
    (lambda: fl.ops.softmax_last_dim_backward(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32)),
     fl.ShapeError, r"upstream gradient \[3, 2\] must have y's shape \[2, 3\]"),
    (lambda: fl.ops.softmax_last_dim_backward(np.zeros(3, np.float32), np.zeros(3)),
     fl.DTypeError, "upstream gradient is f64, y is f32"),
    (lambda: fl.tensor(np.zeros((2, 2, 2), np.float32)).softmax(3), fl.ShapeError, "softmax: axis 3"),
])
def test_bad_inputs_raise_at_build_time(build, error, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=message):
        build()


def test_higher_order_gradient_through_the_backward_entry(rng: np.random.Generator) -> None:
    x = rng.standard_normal((3, 4))
    tx = fl.tensor(x)
    (g1,) = fl.grad((fl.ops.softmax_last_dim(tx) ** 2).sum(), [tx])
    (g2,) = fl.grad((g1 * g1).sum(), [tx])
    x64 = torch.tensor(x, requires_grad=True)
    (t1,) = torch.autograd.grad((torch.softmax(x64, -1) ** 2).sum(), [x64], create_graph=True)
    (t2,) = torch.autograd.grad((t1 * t1).sum(), [x64])
    np.testing.assert_allclose(g2.numpy(), t2.numpy(), rtol=1e-10, atol=1e-12)


# |sum - 1| allowed per dtype: each element is within a unit roundoff or so of its value, so the
# sum is within about that of 1 (NumPy sums the stored values in float64).
ROW_SUM_TOL = {DType.F64: 1e-14, DType.F32: 2e-6, DType.BF16: 8e-3, DType.F16: 1e-3}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.floats(0.1, 50.0), st.sampled_from(FLOAT_DTYPES))
def test_softmax_rows_sum_to_one_for_any_shape(shape: list[int], scale: float, dt: DType) -> None:
    x = (np.random.default_rng(sum(shape)).standard_normal(shape) * scale).astype(dt.np)
    got = fl.tensor(x).softmax(-1).numpy().astype(np.float64)
    assert got.shape == tuple(shape) and (got >= 0).all()
    sums = got.sum(-1)
    assert np.abs(sums - 1.0).max() <= ROW_SUM_TOL[dt], sums
    want = torch.softmax(torch.from_numpy(x.astype(np.float64)), -1).numpy()
    assert_close_softmax(got, want, dt, x)


def _fused_ids_of(*ys: fl.Tensor) -> set[int]:
    """The fused entries the fuse pass puts in the plan of `ys` (roots and everything below)."""
    from fuel.graph.node import topo_order

    return {n.arg[0] for n in topo_order(fuse([y.node for y in ys], default_registry())) if n.op is Op.FUSED}


def test_pattern_refuses_a_wrong_axis_or_another_input() -> None:
    x = fl.tensor(np.zeros((3, 4, 5), np.float32))
    z = fl.tensor(np.ones((3, 4, 5), np.float32))
    e = (x - x.max(1, keepdim=True)).exp()
    assert FusedOps.SOFTMAX_LAST_DIM not in _fused_ids_of(e / e.sum(1, keepdim=True))  # a softmax of axis 1
    e = (x - x.max(-1, keepdim=True)).exp()
    assert FusedOps.SOFTMAX_LAST_DIM not in _fused_ids_of(e / e.sum(0, keepdim=True))  # mixed axes
    e = (x - z.max(-1, keepdim=True)).exp()
    assert FusedOps.SOFTMAX_LAST_DIM not in _fused_ids_of(e / e.sum(-1, keepdim=True))  # max of another tensor


def test_backward_pattern_fuses_the_user_expression_and_guards(rng: np.random.Generator) -> None:
    y_np = torch.softmax(torch.randn(4, 11, dtype=torch.float64), -1).numpy().astype(np.float32)
    g_np = rng.standard_normal((4, 11)).astype(np.float32)
    y, g = fl.tensor(y_np), fl.tensor(g_np)
    expr = y * (g - (g * y).sum(-1, keepdim=True))
    (root,) = fuse([expr.node], default_registry())
    assert root.op is Op.FUSED and root.arg[0] == FusedOps.SOFTMAX_LAST_DIM_BACKWARD
    assert root.inputs == (y.node, g.node)
    want = torch._softmax_backward_data(torch.from_numpy(g_np.astype(np.float64)),
                                        torch.from_numpy(y_np.astype(np.float64)), -1, torch.float64).numpy()
    assert_close_rowwise(fl.realize(expr)[0].numpy(), want, DType.F32, backward=True)
    s = (g * y).sum(-1, keepdim=True)
    assert FusedOps.SOFTMAX_LAST_DIM_BACKWARD not in _fused_ids_of(y * (g - s), s)  # the sum read elsewhere
    y3, g3 = fl.tensor(np.ones((2, 3, 4), np.float32)), fl.tensor(np.ones((2, 3, 4), np.float32))
    wrong_axis = y3 * (g3 - (g3 * y3).sum(1, keepdim=True))
    assert FusedOps.SOFTMAX_LAST_DIM_BACKWARD not in _fused_ids_of(wrong_axis)
    other = fl.tensor(y_np[::-1].copy())
    assert FusedOps.SOFTMAX_LAST_DIM_BACKWARD not in _fused_ids_of(y * (g - (g * other).sum(-1, keepdim=True)))
