"""The convolutions' shared geometry (fuel.graph.registry.conv_geometry): tap positions against a loop over
every tap, and the checks both convolutions' rules share."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fuel as fl
from fuel.graph.registry.conv2d import Conv2DParams
from fuel.graph.registry.conv_geometry import check_extents, check_ranks, tap_positions
from fuel.graph.registry.conv_transpose2d import ConvTranspose2DParams

small = st.integers(1, 4)


@given(small, small, small, small, small, small, small, small)
def test_tap_positions_match_a_loop_over_every_tap(kh: int, kw: int, gh: int, gw: int, sh: int, sw: int,
                                                   dh: int, dw: int) -> None:
    width = (gw - 1) * sw + (kw - 1) * dw + 1
    want = [(a * dh + i * sh) * width + b * dw + j * sw
            for a in range(kh) for b in range(kw) for i in range(gh) for j in range(gw)]
    got = tap_positions((kh, kw), (gh, gw), width, (sh, sw), (dh, dw))
    assert got.dtype == np.int64 and got.tolist() == want


def test_rank_and_extent_checks_name_the_op_and_the_shape() -> None:
    with pytest.raises(fl.ShapeError, match=r"^op: x must be \[N, Cin, H, W\], got \[1, 2, 3\]$"):
        check_ranks("op", (1, 2, 3), (1, 1, 1, 1), "[Cout, Cin/groups, Kh, Kw]")
    with pytest.raises(fl.ShapeError, match=r"^op: w must be \[Cout, Cin/groups, Kh, Kw\], got \[1\]$"):
        check_ranks("op", (1, 1, 1, 1), (1,), "[Cout, Cin/groups, Kh, Kw]")
    with pytest.raises(fl.ShapeError, match=r"^op: the kernel must be at least 1x1, w is \[1, 1, 0, 2\]$"):
        check_extents("op", (1, 1, 3, 3), (1, 1, 0, 2))
    with pytest.raises(fl.ShapeError, match=r"^op: x's spatial size must be at least 1x1, x is \[1, 1, 3, 0\]$"):
        check_extents("op", (1, 1, 3, 0), (1, 1, 1, 1))


def test_both_params_hold_the_canonical_geometry_and_name_their_op() -> None:
    p = Conv2DParams(2, (1, 0), 3, 1)
    assert (p.stride, p.padding, p.dilation, p.groups) == ((2, 2), ((1, 1), (0, 0)), (3, 3), 1)
    t = ConvTranspose2DParams((1, 2), 1, (0, 1), 1, 2)
    assert (t.stride, t.padding, t.output_padding, t.dilation, t.groups) == ((1, 2), ((1, 1), (1, 1)), (0, 1),
                                                                            (1, 1), 2)
    with pytest.raises(fl.ParamError, match=r"^conv2d: stride must be at least 1"):
        Conv2DParams(0, 0, 1, 1)
    with pytest.raises(fl.ParamError, match=r"^conv_transpose2d: output_padding must be at least 0"):
        ConvTranspose2DParams(1, 0, -1, 1, 1)
    with pytest.raises(fl.ParamError, match=r"^conv_transpose2d: groups must be at least 1"):
        ConvTranspose2DParams(1, 0, 0, 1, 0)
