"""Reference for ConvTranspose2D (11): float64 NumPy, tap by tap.

A sum over the kernel taps of the input scattered at stride into the output, written from the
definition (not from the kernel's col2im). The local scale of an output element is the same operation
on |inputs|.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.graph.registry.conv_transpose2d import ConvTranspose2DParams
from fuel.testing.reference import Case, randn, register


def conv_transpose2d64(xs: list[np.ndarray], p: Any) -> np.ndarray:
    x, w = xs
    n, cin, h, wd = x.shape
    _, m, kh, kw = w.shape
    g = p.groups
    cg = cin // g
    (pt, pb), (pl, pr) = p.padding
    (sh, sw), (dh, dw) = p.stride, p.dilation
    (oph, opw) = p.output_padding
    ho = (h - 1) * sh - pt - pb + dh * (kh - 1) + oph + 1
    wo = (wd - 1) * sw - pl - pr + dw * (kw - 1) + opw + 1
    hb = max((h - 1) * sh + dh * (kh - 1) + 1, pt + ho)
    wb = max((wd - 1) * sw + dw * (kw - 1) + 1, pl + wo)
    buf = np.zeros((n, g * m, hb, wb))
    xg = x.reshape(n, g, cg, h, wd)
    for a in range(kh):
        for b in range(kw):
            part = np.einsum("ngchw,gcm->ngmhw", xg, w[:, :, a, b].reshape(g, cg, m)).reshape(n, g * m, h, wd)
            buf[:, :, a * dh:a * dh + (h - 1) * sh + 1:sh, b * dw:b * dw + (wd - 1) * sw + 1:sw] += part
    return buf[:, :, pt:pt + ho, pl:pl + wo]


def conv_transpose2d_scale(xs: list[np.ndarray], p: Any, ref: np.ndarray) -> np.ndarray:
    return conv_transpose2d64([np.abs(a) for a in xs], p)


def _pt(stride: Any = 1, padding: Any = 0, output_padding: Any = 0, dilation: Any = 1,
        groups: int = 1) -> ConvTranspose2DParams:
    return ConvTranspose2DParams(stride, padding, output_padding, dilation, groups)


# (x, w, params): strides, output_padding (also past the stride when the dilation allows), dilation,
# groups up to depthwise, asymmetric padding, 1x1, several input blocks and output-channel chunks.
CONV_TRANSPOSE2D_CASES: tuple[tuple[tuple[int, ...], tuple[int, ...], ConvTranspose2DParams], ...] = (
    ((2, 4, 5, 6), (4, 3, 3, 3), _pt(padding=1)),
    ((1, 6, 4, 5), (6, 2, 2, 3), _pt((2, 3), ((1, 0), (0, 2)), (1, 2), 1, 3)),
    ((2, 4, 5, 5), (4, 4, 3, 3), _pt(1, 0, 1, 2)),
    ((2, 6, 4, 4), (6, 1, 3, 3), _pt(2, 1, 1, 1, 6)),
    ((1, 8, 40, 40), (8, 16, 3, 3), _pt(1, 1)),
    ((1, 8, 10, 10), (8, 64, 3, 3), _pt(2, 1, 1)),
    ((2, 3, 4, 4), (3, 5, 1, 1), _pt(2)),
    ((1, 2, 3, 3), (2, 4, 4, 4), _pt(3, 2, 2, 2)),
    ((1, 3, 6, 6), (3, 4, 3, 3), _pt(1, 3)),
    ((0, 4, 5, 5), (4, 3, 3, 3), _pt(padding=1)),
)


def _conv_transpose2d_cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    dt = dtypes[0]
    out = [Case(f"x{list(sx)} w{list(sw_)} {p}", (randn(rng, sx, dt), randn(rng, sw_, dt)), p)
           for sx, sw_, p in CONV_TRANSPOSE2D_CASES]
    out.append(Case("scaled", (randn(rng, (2, 6, 5, 5), dt, 30.0), randn(rng, (6, 4, 3, 3), dt, 0.01)), _pt(2, 1)))
    return out



register("ConvTranspose2D", conv_transpose2d64, _conv_transpose2d_cases, conv_transpose2d_scale)
