"""The registry's shared entry pieces (fuel.graph.registry.common): the dtype rules of ops whose inputs take
the first one's float dtype and of gradient ops, a builder's operand nodes and the autograd-only gradient
entries."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fuel as fl
from fuel.dtype import DType
from fuel.graph.registry import NOT_DIFFERENTIABLE, FusedOpFamily, FusedOps, default_registry
from fuel.graph.registry.common import float_like_first, gradient_dtype, operand_nodes, spoken

NAMES = ("x", "w", "bias", "c")


@given(st.lists(st.sampled_from(list(DType)), min_size=1, max_size=4))
def test_float_like_first_returns_the_shared_float_dtype_or_names_every_other_input(dts: list[DType]) -> None:
    names = NAMES[:len(dts)]
    first, rest = dts[0], dts[1:]
    if not first.is_float:
        with pytest.raises(fl.DTypeError) as info:
            float_like_first("op", names, dts)
        assert str(info.value) == f"op: x must be a float tensor, got {first.value}"
    elif any(d != first for d in rest):
        with pytest.raises(fl.DTypeError) as info:
            float_like_first("op", names, dts)
        others = " and ".join(", ".join(names[1:]).rsplit(", ", 1))
        got = " and ".join(", ".join(d.value for d in rest).rsplit(", ", 1))
        assert str(info.value) == f"op: {others} must have x's dtype {first.value}, got {got}"
    else:
        assert float_like_first("op", names, dts) is first


def test_spoken_lists_names_as_a_sentence() -> None:
    assert spoken(["a"]) == "a"
    assert spoken(["a", "b"]) == "a and b"
    assert spoken(["dt", "a", "b", "c"]) == "dt, a, b and c"


@given(st.sampled_from(list(DType)), st.lists(st.sampled_from(list(DType)), max_size=1))
def test_gradient_dtype_is_the_forward_operands_float_dtype_shared_by_the_gradient(first: DType,
                                                                                  rest: list[DType]) -> None:
    if not first.is_float:
        with pytest.raises(fl.DTypeError) as info:
            gradient_dtype("op", ("y", "upstream gradient"), [first, *rest])
        assert str(info.value) == f"op: y must be a float tensor, got {first.value}"
    elif rest and rest[0] != first:
        with pytest.raises(fl.DTypeError) as info:
            gradient_dtype("op", ("y", "upstream gradient"), [first, *rest])
        assert str(info.value) == f"op: upstream gradient is {rest[0].value}, y is {first.value}"
    else:
        assert gradient_dtype("op", ("y", "upstream gradient"), [first, *rest]) is first


def test_operand_nodes_give_a_bare_scalar_the_first_operands_dtype() -> None:
    x = fl.tensor(np.ones((2, 3), np.float16))
    nodes = operand_nodes(x, 2.0, np.zeros(3, np.float64))
    assert nodes[0] is x.node
    assert nodes[1].dtype is DType.F16 and nodes[1].shape == ()
    assert nodes[2].dtype is DType.F64  # an array keeps its dtype: the op's dtype rule judges it


@pytest.mark.parametrize("name", ["SoftmaxLastDimBackward", "LayerNormLastDimBackward", "RmsNormLastDimBackward",
                                  "ReduceMaxToBackward", "PowIBackward"])
def test_gradient_entries_are_binary_backward_ops_with_their_own_vjp(name: str) -> None:
    e = default_registry().by_name(name)
    assert e.family is FusedOpFamily.BACKWARD and e.arity == (2,)
    assert e.backward is NOT_DIFFERENTIABLE and e.vjp is not None and e.decompose is not None
    assert e.output_views is None and e.destructive_input is None
    assert (e.pattern is not None) == (e.id == FusedOps.SOFTMAX_LAST_DIM_BACKWARD)
