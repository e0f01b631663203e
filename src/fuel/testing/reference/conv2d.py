"""Reference for Conv2D (6): float64 NumPy, tap by tap.

The convolution is a sum over its kernel taps of strided slices of the (padded) input times one weight
column, written from the definition (not from the kernel's im2col). The local scale of an output element
is the same operation on |inputs| (the sum of the |terms| it adds up).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.graph.registry.conv2d import Conv2DParams
from fuel.testing.reference import Case, randn, register


def conv2d64(xs: list[np.ndarray], p: Any) -> np.ndarray:
    x, w = xs[0], xs[1]
    n, _, h, wd = x.shape
    cout, cg, kh, kw = w.shape
    g = p.groups
    (pt, pb), (pl, pr) = p.padding
    (sh, sw), (dh, dw) = p.stride, p.dilation
    ho = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
    wo = (wd + pl + pr - dw * (kw - 1) - 1) // sw + 1
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    m = cout // g
    out = np.zeros((n, g, m, ho, wo))
    for a in range(kh):
        for b in range(kw):
            patch = xp[:, :, a * dh:a * dh + (ho - 1) * sh + 1:sh, b * dw:b * dw + (wo - 1) * sw + 1:sw]
            out += np.einsum("ngchw,gmc->ngmhw", patch.reshape(n, g, cg, ho, wo), w[:, :, a, b].reshape(g, m, cg))
    out = out.reshape(n, cout, ho, wo)
    if len(xs) == 3:
        out = out + xs[2].reshape(1, cout, 1, 1)
    return out


def conv2d_scale(xs: list[np.ndarray], p: Any, ref: np.ndarray) -> np.ndarray:
    return conv2d64([np.abs(a) for a in xs], p)


def _p2(stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1) -> Conv2DParams:
    return Conv2DParams(stride, padding, dilation, groups)


# (x, w, params), each with and without a bias (the impl's dtype tuple says which). Every form of the
# kernel: the padded-plane gather (unit stride), runs along output rows (strides), the transposed gather
# (kernels wider than the output), each with several column blocks across images and several K blocks,
# and the direct loop (depthwise, two channels per group, few taps); 1x1, a kernel as large as the
# padded input, asymmetric padding, strides and dilations, an empty batch and no output channels.
CONV2D_CASES: tuple[tuple[tuple[int, ...], tuple[int, ...], Conv2DParams], ...] = (
    ((2, 4, 7, 9), (6, 4, 3, 3), _p2(padding=1)),
    ((1, 6, 8, 7), (4, 3, 2, 3), _p2((2, 3), ((1, 0), (2, 1)), (2, 1), 2)),
    ((2, 5, 6, 6), (5, 1, 3, 3), _p2(2, 1, 1, 5)),
    ((2, 16, 4, 5), (12, 16, 1, 1), _p2()),
    ((3, 2, 4, 5), (6, 2, 1, 1), _p2(2)),
    ((1, 3, 4, 4), (8, 3, 6, 6), _p2(padding=1)),
    ((2, 64, 12, 12), (16, 64, 3, 3), _p2(padding=1)),
    ((1, 64, 7, 7), (8, 64, 6, 6), _p2()),
    ((1, 256, 10, 10), (8, 256, 3, 3), _p2()),
    ((1, 256, 16, 16), (8, 256, 3, 3), _p2(padding=1)),
    ((2, 4, 10, 12), (6, 4, 8, 10), _p2()),
    ((2, 6, 9, 20), (8, 6, 3, 3), _p2(1, ((1, 2), (0, 1)), (2, 1))),
    ((1, 6, 13, 14), (10, 3, 4, 6), _p2(2, ((1, 0), (0, 1)), (1, 2), 2)),
    ((2, 8, 9, 9), (10, 4, 3, 3), _p2(3, ((2, 1), (0, 3)), 2, 2)),
    ((0, 4, 5, 5), (6, 4, 3, 3), _p2(padding=1)),
    ((1, 4, 5, 5), (0, 4, 3, 3), _p2()),
)


def _conv2d_cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    dt = dtypes[0]
    with_bias = len(dtypes) == 4
    out = []
    for sx, sw_, p in CONV2D_CASES:
        inputs = [randn(rng, sx, dt), randn(rng, sw_, dt)]
        if with_bias:
            inputs.append(randn(rng, (sw_[0],), dt))
        out.append(Case(f"x{list(sx)} w{list(sw_)} {p}", tuple(inputs), p))
    big = [randn(rng, (2, 8, 6, 6), dt, 30.0), randn(rng, (9, 8, 3, 3), dt, 0.01)]
    if with_bias:
        big.append(randn(rng, (9,), dt, 5.0))
    out.append(Case("scaled", tuple(big), _p2(padding=1)))
    return out


register("Conv2D", conv2d64, _conv2d_cases, conv2d_scale)
