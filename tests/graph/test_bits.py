"""The bit primitives' rules (`fuel.graph.bits`): shapes and dtypes, the errors that name the op and both
values, and no gradient through them."""

from __future__ import annotations

import numpy as np
import pytest

import fuel as fl
from fuel.errors import DTypeError, NotDifferentiable, ParamError, ShapeError
from fuel.graph.node import Op
from fuel.graph.prims import make


def test_shapes_and_dtypes() -> None:
    w = fl.tensor(np.zeros((3, 5), np.uint32))
    assert (w.bitcast(fl.u8).shape, w.bitcast(fl.u8).dtype) == ((3, 20), fl.u8)
    assert fl.tensor(np.zeros((2, 4), np.uint8)).bitcast(fl.f16).shape == (2, 2)
    assert fl.tensor(np.zeros((), np.uint32)).bitcast(fl.f32).shape == ()
    b = fl.tensor(np.zeros((4, 1), np.uint8)) >> fl.tensor(np.array([[0, 4]], np.uint8))
    assert (b.shape, b.dtype) == ((4, 2), fl.u8)
    assert (fl.tensor(np.zeros(3, np.uint8)) & fl.tensor(np.zeros(3, np.uint32))).dtype == fl.u32


def test_refusals_name_the_op_and_both_values() -> None:
    with pytest.raises(ShapeError, match=r"bitcast: the last axis of \[3, 5\] u32 holds 20 bytes, not a multiple "
                                         r"of u64's 8"):
        fl.tensor(np.zeros((3, 5), np.uint32)).bitcast(fl.u64)
    with pytest.raises(ShapeError, match="bitcast: a rank-0 u8"):
        fl.tensor(np.zeros((), np.uint8)).bitcast(fl.f16)
    with pytest.raises(ParamError, match="bitcast: target must be a DType, got 'f16'"):
        make(Op.BITCAST, (fl.tensor(np.zeros(2, np.uint8)).node,), "f16")
    with pytest.raises(DTypeError, match="shr: needs integer operands, got f32"):
        fl.tensor(np.ones(3, np.float32)) >> 1
    with pytest.raises(DTypeError, match="bitand: needs integer operands, got f64"):
        fl.tensor(np.ones(3)) & fl.tensor(np.ones(3))
    a, b = fl.tensor(np.zeros(3, np.uint8)).node, fl.tensor(np.zeros(3, np.uint32)).node
    with pytest.raises(DTypeError, match="shr: operands must have one dtype, got u8 and u32"):
        make(Op.SHR, (a, b))
    with pytest.raises(ShapeError, match=r"bitand: operands must have one shape, got \[3\] and \[2\]"):
        make(Op.BITAND, (a, fl.tensor(np.zeros(2, np.uint8)).node))
    with pytest.raises(DTypeError, match="shr: the Python int 256 is out of range for u8"):
        fl.tensor(np.zeros(3, np.uint8)) >> 256


def test_no_gradient_flows_through_bits() -> None:
    """A float read through its bits gets no gradient: grad names the op instead of inventing one."""
    x = fl.tensor(np.ones(4, np.float32))
    y = (x.bitcast(fl.u32) & 0x7FFFFFFF).bitcast(fl.f32).sum()
    with pytest.raises(NotDifferentiable, match="bitcast gives no gradient for its input 0"):
        fl.grad(y, [x])
    with pytest.raises(DTypeError, match="cannot differentiate with respect to a u32 tensor"):
        w = fl.tensor(np.ones(4, np.uint32))
        fl.grad((w >> 1).bitcast(fl.f32).sum(), [w])
