"""Kernels of the bit primitives (rules in `fuel.graph.bits`): SHR, BITAND and BITCAST.

SHR and BITAND are NumPy's `>>` and `&` on two operands of one integer dtype, written straight into
`out` when it has that dtype (no temporary). BITCAST reads the input's bytes as the target dtype: a
C-contiguous input is reinterpreted in place (`.view`), any other layout is made contiguous first, and the
bytes are copied into `out` when one is given. Each element's bits depend on its own inputs only, so no
split of the work changes a byte.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fuel.graph.node import Op, OpSpec

PrimKernel = Callable[[list[np.ndarray], OpSpec, np.ndarray | None], np.ndarray]


def _bitwise(f: np.ufunc) -> PrimKernel:
    def kernel(xs: list[np.ndarray], n: OpSpec, out: np.ndarray | None) -> np.ndarray:
        a, b = xs
        if out is not None and out.dtype == a.dtype == b.dtype:
            return f(a, b, out=out)
        y = f(a, b).astype(n.dtype.np, copy=False)
        if out is None:
            return np.asarray(y)
        np.copyto(out, y)
        return out
    return kernel


def _bitcast(xs: list[np.ndarray], n: OpSpec, out: np.ndarray | None) -> np.ndarray:
    x = np.ascontiguousarray(xs[0])
    y = (x.reshape(1) if x.ndim == 0 else x).view(n.dtype.np).reshape(n.shape)
    if out is None:
        return y if x is not xs[0] else y.copy()  # the input's memory is not handed out as a new value
    np.copyto(out, y)
    return out


BIT_KERNELS: dict[Op, PrimKernel] = {Op.SHR: _bitwise(np.right_shift), Op.BITAND: _bitwise(np.bitwise_and),
                                     Op.BITCAST: _bitcast}
