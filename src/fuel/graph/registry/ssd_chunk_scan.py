"""SsdChunkScan (id 20): the Mamba-2 SSD scan, a scalar decay per head, with its last state (2 slots).

x `[B, L, H, P]`, dt `[B, L, H]`, a `[H]`, b and c `[B, L, H, N]`, all of x's float dtype; params
`chunk_size` (> 0, dividing L; L = 0 is allowed). Per (batch, head), with a state h `[P, N]` from 0:

    e_t = exp(dt_t · a_h),    h ← e_t · h + dt_t · (x_t ⊗ b_t),    y_t = h · c_t   (a sum over N)

(no softplus: dt is used as given). Slot 0 is y `[B, L, H, P]`, slot 1 last_state `[B, H, P, N]`
(h after the last step), both in x's dtype. The state accumulates in float64 and each output is
rounded once; the result is the sequential recurrence whatever `chunk_size` (the chunk size only
names the SSD's block length, which the kernels are free to use or not; it must still divide L).

Gradients w.r.t. all five inputs are one reverse-scan primitive (`Op.SSD_CHUNK_SCAN_GRAD`) fed with
both cotangents. The lowering unrolls the recurrence over L in float64 with the Tensor API (for tests
and dtypes without a kernel; it is O(L) nodes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fuel.dtype import DType
from fuel.errors import ParamError, ShapeError
from fuel.graph.functions import concat
from fuel.graph.node import Op, Shape
from fuel.graph.prims import make, views
from fuel.graph.registry import DECOMPOSE, FusedOpEntry, FusedOpFamily, FusedOps, fused_views
from fuel.graph.registry.common import float_like_first, operand_nodes
from fuel.graph.tensor import Tensor, TensorLike, zeros

NAME = "ssd_chunk_scan"


@dataclass(frozen=True)
class SsdChunkScanParams:
    chunk_size: int

    def __post_init__(self) -> None:
        c = self.chunk_size
        if isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, np.integer)):
            raise ParamError(f"ssd_chunk_scan: chunk_size must be an int, got {c!r}")
        if c <= 0:
            raise ParamError(f"ssd_chunk_scan: chunk_size must be positive, got {c}")
        object.__setattr__(self, "chunk_size", int(c))


def shape_rule(shapes: tuple[Shape, ...], params: SsdChunkScanParams) -> Shape:
    x, dt, a, b, c = shapes
    if len(x) != 4:
        raise ShapeError(f"ssd_chunk_scan: x must be [B, L, H, P], got {list(x)}")
    nb, length, nh, _ = x
    if dt != (nb, length, nh):
        raise ShapeError(f"ssd_chunk_scan: dt must be [B, L, H] = {[nb, length, nh]}, got {list(dt)}")
    if a != (nh,):
        raise ShapeError(f"ssd_chunk_scan: a must be [H] = [{nh}], got {list(a)}")
    if len(b) != 4 or b[:3] != (nb, length, nh):
        raise ShapeError(f"ssd_chunk_scan: b must be [B, L, H, N] = {[nb, length, nh]} + [N], got {list(b)}")
    if c != b:
        raise ShapeError(f"ssd_chunk_scan: c must have b's shape {list(b)}, got {list(c)}")
    if length % params.chunk_size:
        raise ParamError(f"ssd_chunk_scan: chunk_size {params.chunk_size} does not divide the sequence "
                         f"length {length}")
    return x


def dtype_rule(dtypes: tuple[DType, ...], params: SsdChunkScanParams) -> DType:
    return float_like_first(NAME, ("x", "dt", "a", "b", "c"), dtypes)


def output_views(shapes: tuple[Shape, ...], dtypes: tuple[DType, ...],
                 params: SsdChunkScanParams) -> list[tuple[Shape, DType]]:
    """Slot 0 y `[B, L, H, P]`, slot 1 last_state `[B, H, P, N]`, both in x's dtype."""
    x = shape_rule(shapes, params)
    dt = dtype_rule(dtypes, params)
    return [(x, dt), ((x[0], x[2], x[3], shapes[3][3]), dt)]


def decompose(inputs: list[Tensor], params: SsdChunkScanParams) -> tuple[Tensor, Tensor]:
    """The recurrence unrolled over L in float64 (the scans' accumulation type), cast back once."""
    dt_out = inputs[0].dtype
    x, dt, a, b, c = (t.cast(DType.F64) for t in inputs)
    nb, length, nh, p = x.shape
    n = b.shape[3]
    h = zeros((nb, nh, p, n), DType.F64)
    ys = []
    for t in range(length):
        d = dt[:, t:t + 1, :].reshape(nb, nh)
        e = (d * a.reshape(1, nh)).exp().reshape(nb, nh, 1, 1)
        u = (d.reshape(nb, nh, 1) * x[:, t:t + 1].reshape(nb, nh, p)).reshape(nb, nh, p, 1)
        h = e * h + u * b[:, t:t + 1].reshape(nb, nh, 1, n)
        ys.append((h * c[:, t:t + 1].reshape(nb, nh, 1, n)).sum(3).reshape(nb, 1, nh, p))
    y = concat(ys, axis=1) if ys else zeros((nb, 0, nh, p), DType.F64)
    return y.cast(dt_out), h.cast(dt_out)


def vjp(inputs: list[Tensor], params: SsdChunkScanParams, outs: tuple[Tensor, ...],
        grad_outs: tuple[Tensor, ...]) -> list[Tensor | None]:
    """All five gradients from one reverse scan over both cotangents (dy, dlast_state)."""
    dt = inputs[0].dtype
    cot = [g if g.dtype == dt else g.cast(dt) for g in grad_outs]
    node = make(Op.SSD_CHUNK_SCAN_GRAD, tuple(t.node for t in inputs) + tuple(g.node for g in cot), params)
    return [Tensor(v) for v in views(node)]


def ssd_chunk_scan(x: TensorLike, dt: TensorLike, a: TensorLike, b: TensorLike, c: TensorLike,
                   chunk_size: int) -> tuple[Tensor, Tensor]:
    """Mamba-2 SSD scan: x `[B, L, H, P]`, dt `[B, L, H]`, a `[H]`, b, c `[B, L, H, N]` ->
    `(y [B, L, H, P], last_state [B, H, P, N])`."""
    nodes = operand_nodes(x, dt, a, b, c)
    y, last = fused_views(FusedOps.SSD_CHUNK_SCAN, nodes, SsdChunkScanParams(chunk_size))
    return y, last


ENTRY = FusedOpEntry(
    id=FusedOps.SSD_CHUNK_SCAN,
    name="SsdChunkScan",
    family=FusedOpFamily.FORWARD,
    params=SsdChunkScanParams,
    arity=(5,),
    shape_rule=shape_rule,
    dtype_rule=dtype_rule,
    decompose=decompose,
    backward=DECOMPOSE,  # the inventory's metadata; `vjp` below is the exact reverse scan
    vjp=vjp,
    pattern=None,
    no_pattern=(
        "its lowering unrolls the chunk-to-chunk state passing, so its graph grows with the sequence and no "
        "fixed spelling exists to match: Mamba-2 code calls the op"),
    output_views=output_views,
    destructive_input=None,
)
