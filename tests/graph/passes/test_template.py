"""The recipe-traced pattern framework: what a template matches, what it binds, and what it refuses.

The numbers of every fused op a template finds are checked against torch in the entries' own tests;
here the oracle is the graph itself: the bound nodes must be exactly the ones the expression was
built from, and each refusal is one the fused op would get wrong (a value computed twice, a different
axis, a different constant).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.dtype import DType
from fuel.graph.functions import concat, where
from fuel.graph.node import Node, Op, consumer_counts, topo_order
from fuel.graph.passes.template import Scalar, TemplateError, Wild, template_pattern
from fuel.graph.prims import make
from fuel.graph.registry import Match
from fuel.graph.tensor import Tensor


def _counts(roots: Sequence[Tensor]) -> Mapping[Node, int]:
    nodes = [r.node for r in roots]
    order = topo_order(nodes)
    by_id = consumer_counts(order, nodes)
    return {n: by_id.get(id(n), 0) for n in order}


def _match(pattern, y: Tensor, *others: Tensor) -> Match | None:  # type: ignore[no-untyped-def]
    return pattern(y.node, _counts([y, *others]))


def _rms(x: Wild, eps: Scalar) -> Tensor:
    return x / (x * x).mean(-1, keepdim=True).add(eps).sqrt()


RMS = template_pattern(_rms, build=lambda m: Match((m["x"],), m["eps"]))


def _leaf(shape: tuple[int, ...], dtype: str = "float32") -> Tensor:
    return fl.tensor(np.random.default_rng(0).standard_normal(shape).astype(dtype))


@settings(max_examples=20)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.floats(1e-8, 1.0), st.sampled_from([0, 1, 2]))
def test_any_rank_and_each_square_spelling_binds_x_and_eps(shape: list[int], eps: float, sq: int) -> None:
    x = _leaf(tuple(shape))
    square = [x * x, x.square(), x ** 2][sq]
    m = _match(RMS, x / square.mean(-1, keepdim=True).add(eps).sqrt())
    assert m is not None and m.inputs == (x.node,) and m.params == eps


def test_keepdim_spelled_as_reshape_or_reduce_to_matches() -> None:
    x = _leaf((3, 4))
    ms = make(Op.RESHAPE, ((x * x).mean(-1).node,), (3, 1))
    y = x / Tensor(ms).add(1e-5).sqrt()
    assert _match(RMS, y) is not None
    sm = template_pattern(lambda x: x / x.sum(-1, keepdim=True), build=lambda m: Match((m["x"],), None))
    z = Tensor(make(Op.DIV, (x.node, make(Op.BROADCAST_TO, (make(Op.REDUCE_SUM_TO, (x.node,), (3, 1)),), (3, 4)))))
    assert sm(z.node, _counts([z])) is not None
    whole = Tensor(make(Op.DIV, (x.node, make(Op.BROADCAST_TO, (make(Op.REDUCE_SUM_TO, (x.node,), (1, 1)),),
                                                                  (3, 4)))))
    assert sm(whole.node, _counts([whole])) is None  # a sum over every axis is not the last axis's


def test_wrong_axis_is_refused() -> None:
    x = _leaf((3, 4, 5))
    for axis in (0, 1, -2):
        assert _match(RMS, x / (x * x).mean(axis, keepdim=True).add(1e-5).sqrt()) is None


def test_second_consumer_of_an_interior_node_is_refused() -> None:
    x = _leaf((3, 4))
    ms = (x * x).mean(-1, keepdim=True)
    y = x / ms.add(1e-5).sqrt()
    assert _match(RMS, y) is not None
    assert _match(RMS, y, ms) is None  # the mean is read elsewhere: fusing would compute it twice
    assert _match(RMS, y, x * x) is not None  # another x * x node is not the matched one


def test_the_same_wild_must_be_the_same_node() -> None:
    x, z = _leaf((3, 4)), _leaf((3, 4))
    assert _match(RMS, x / (z * z).mean(-1, keepdim=True).add(1e-5).sqrt()) is None
    assert _match(RMS, x / (x * z).mean(-1, keepdim=True).add(1e-5).sqrt()) is None


def _softcap(s: Wild, c: Scalar) -> Tensor:
    return (s / c).tanh() * c


def _softcap_by_product(s: Wild, c: Scalar) -> Tensor:
    return (s * (1.0 / c)).tanh() * c


SOFTCAP = template_pattern(_softcap, variants=[_softcap_by_product], build=lambda m: Match((m["s"],), m["c"]))


def test_a_scalar_is_seen_through_the_reciprocal_and_every_occurrence_must_agree() -> None:
    s = _leaf((2, 6))
    for c in (30.0, 0.1, 7.3):
        m = _match(SOFTCAP, (s / c).tanh() * c)
        assert m is not None and m.params == pytest.approx(c, rel=1e-6)
        m = _match(SOFTCAP, (s * (1.0 / c)).tanh() * c)  # MUL_SCALAR(1/c) rather than a division
        assert m is not None and m.params == pytest.approx(c, rel=1e-12)
    assert _match(SOFTCAP, (s / 30.0).tanh() * 31.0) is None  # a mismatched scale
    assert _match(SOFTCAP, (s / 30.0).tanh() * 30.001) is None


def test_a_subtracted_scalar_binds_its_value() -> None:
    def shifted(x: Wild, b: Scalar) -> Tensor:
        return (x + b).exp()

    pat = template_pattern(shifted, build=lambda m: Match((m["x"],), m["b"]))
    x = _leaf((4,))
    m = _match(pat, (x - 2.5).exp())
    assert m is not None and m.params == -2.5


def test_literal_numbers_must_be_equal() -> None:
    def half(x: Wild) -> Tensor:
        return (x * 0.5).exp()

    pat = template_pattern(half, build=lambda m: Match((m["x"],), None))
    x = _leaf((4,))
    assert _match(pat, (x * 0.5).exp()) is not None
    assert _match(pat, (x * 0.25).exp()) is None


def _rope(x: Wild, cos: Wild, sin: Wild) -> Tensor:
    h = x.shape[-1] // 2
    return x * cos + concat([-x[..., h:], x[..., :h]], axis=-1) * sin


ROPE = template_pattern(_rope, build=lambda m: Match((m["x"], m["cos"], m["sin"]), None),
                        shapes={"x": (2, 3, 4, 8), "cos": (4, 8), "sin": (4, 8)})


def test_commutative_orders_optional_broadcasts_and_proportional_slices() -> None:
    for shape in ((6, 4), (2, 5, 16), (1, 2, 3, 10)):
        x, c, s = _leaf(shape), _leaf(shape[-2:]), _leaf(shape[-2:])
        h = shape[-1] // 2
        rot = concat([-x[..., h:], x[..., :h]], axis=-1)
        for y in (x * c + rot * s, s * rot + c * x):
            m = _match(ROPE, y)
            assert m is not None and m.inputs == (x.node, c.node, s.node)
        swapped = concat([x[..., :h], -x[..., h:]], axis=-1)
        assert _match(ROPE, x * c + swapped * s) is None
        third = concat([-x[..., 1:], x[..., :1]], axis=-1)
        assert shape[-1] == 2 or _match(ROPE, x * c + third * s) is None


def test_free_views_may_have_other_readers_but_computed_nodes_may_not() -> None:
    x, c, s = _leaf((2, 3, 4, 8)), _leaf((4, 8)), _leaf((4, 8))
    hi = x[..., 4:]
    neg = -hi
    rot = concat([neg, x[..., :4]], axis=-1)
    bc = c.broadcast_to(2, 3, 4, 8)
    y = x * bc + rot * s
    assert _match(ROPE, y, bc * 2.0) is not None  # a broadcast of an input is free
    assert _match(ROPE, y, hi * 3.0) is not None  # so is a slice of one
    assert _match(ROPE, y, rot * 2.0) is None  # the rotation is computed: a second reader blocks
    assert _match(ROPE, y, neg * 2.0) is None


def test_guards_restrict_wilds() -> None:
    pat = template_pattern(_rms, build=lambda m: Match((m["x"],), m["eps"]),
                           guards={"x": lambda n: n.dtype.is_float and n.shape[-1] > 3})
    assert _match(pat, (lambda x: x / (x * x).mean(-1, keepdim=True).add(1e-5).sqrt())(_leaf((2, 4)))) is not None
    assert _match(pat, (lambda x: x / (x * x).mean(-1, keepdim=True).add(1e-5).sqrt())(_leaf((2, 3)))) is None


def test_build_refusing_moves_on_and_variants_are_tried() -> None:
    def rsqrt_form(x: Wild, eps: Scalar) -> Tensor:
        return x * (x * x).mean(-1, keepdim=True).add(eps).rsqrt()

    pat = template_pattern(_rms, variants=[rsqrt_form],
                           build=lambda m: Match((m["x"],), m["eps"]) if m["eps"] > 0 else None)
    x = _leaf((3, 4))
    assert _match(pat, (x * x).mean(-1, keepdim=True).add(1e-5).rsqrt() * x) is not None
    assert _match(pat, x / (x * x).mean(-1, keepdim=True).add(-1e-5).sqrt()) is None


def test_where_with_a_literal_infinity() -> None:
    def masked(s: Wild, keep: Wild) -> Tensor:
        return where(keep, s, float("-inf")).exp()

    pat = template_pattern(masked, build=lambda m: Match((m["s"], m["keep"]), None),
                           dtypes={"keep": DType.U8})
    s = _leaf((3, 3))
    keep = fl.tensor(np.tri(3, dtype=np.uint8))
    m = _match(pat, where(keep, s, float("-inf")).exp())
    assert m is not None and m.inputs == (s.node, keep.node)
    assert _match(pat, where(keep, s, -1e9).exp()) is None


def test_a_recipe_with_an_array_constant_is_a_template_error() -> None:
    def bad(x: Wild) -> Tensor:
        return x + fl.tensor(np.ones((2, 3, 5, 8)))

    pat = template_pattern(bad, build=lambda m: None)
    with pytest.raises(TemplateError, match="bad builds a constant of shape"):
        _match(pat, _leaf((2, 3)))
