"""Nf4Matmul (id 21): a matrix product with a bitsandbytes NF4 weight, `act @ dequant(W)ᵀ`.

Inputs: act `[..., M, K]` (f32, bf16 or f16; f64 runs through the decomposition, for checking);
w_packed `[N, K/2]` u8 in bitsandbytes' byte order (the even k in the HIGH nibble, so weights from
`bitsandbytes.functional.quantize_4bit(w, quant_type="nf4")` load unchanged once reshaped);
absmax `[N, K/block_size]` f32 (f64 accepted with f64 act). `dequant(W)[n, k] =
NF4[code(n, k)] · absmax[n, k // block_size]`, rounded once to f32 (fuel.quant.nf4). K must be even
and a multiple of block_size (any positive even number; bitsandbytes uses 32 ... 4096), so blocks never
cross a row. Output `[..., M, N]` in act's dtype, accumulated in f32 and rounded once. act needs rank
>= 2: a single vector is passed as `[1, K]`.

`transpose=True` is the other product with the same weight, `act [..., M, N] @ dequant(W)` ->
`[..., M, K]`: the gradient of the forward with respect to its activations (QLoRA's backward), run
from the packed bytes like the forward instead of through a dequantised copy of W.

Gradients: act gets the other product (an Nf4Matmul with `transpose` flipped); absmax gets its exact
gradient `Σ_k∈block dW[n, k]·NF4[code(n, k)]` with `dW = gᵀ·act` (built lazily, so a QLoRA step that
asks only for activation and adapter gradients never computes it); the packed codes are integers and
have none (fl.grad refuses a u8 wrt).

Pattern: the lowering wherever it is written, a QLoRA weight dequantised with primitives (bytes split by
floor(b/16) into high then low nibble, looked up in the 16-entry NF4 table, scaled per block of absmax)
then multiplied by the activations, its transpose or not; anything else (another nibble order or table, a
dequantised weight read elsewhere) stays primitive.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fuel.dtype import DType
from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.functions import concat
from fuel.graph.node import Node, Op, Shape
from fuel.graph.registry import NOT_DIFFERENTIABLE, FusedOpEntry, FusedOpFamily, FusedOps, Match, fused_node
from fuel.graph.tensor import Tensor, TensorLike, as_tensor, tensor
from fuel.quant.nf4 import NF4

OP = "nf4_matmul"


@dataclass(frozen=True)
class Nf4MatmulParams:
    block_size: int
    transpose: bool = False  # False: act @ dequant(W)ᵀ; True: act @ dequant(W)


def check_params(p: Nf4MatmulParams) -> None:
    bs = p.block_size
    if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0 or bs % 2:
        raise ParamError(f"{OP}: block_size must be a positive even int, got {bs!r}")
    if not isinstance(p.transpose, bool):
        raise ParamError(f"{OP}: transpose must be a bool, got {p.transpose!r}")


def shape_rule(shapes: tuple[Shape, ...], params: Nf4MatmulParams) -> Shape:
    act, w, absmax = shapes
    check_params(params)
    bs = params.block_size
    if len(w) != 2:
        raise ShapeError(f"{OP}: w_packed must be [N, K/2], got {list(w)}")
    n, k = w[0], 2 * w[1]
    if k % bs:
        raise ShapeError(f"{OP}: K={k} (w_packed {list(w)}) is not a multiple of block_size {bs}")
    if absmax != (n, k // bs):
        raise ShapeError(f"{OP}: absmax must be [N, K/block_size] = [{n}, {k // bs}], got {list(absmax)}")
    if len(act) < 2:
        raise ShapeError(f"{OP}: act must be [..., M, {n if params.transpose else k}] (rank >= 2), got {list(act)}")
    want, name = (n, "N") if params.transpose else (k, "K")
    if act[-1] != want:
        odd = "; K must be even, two 4-bit codes a byte" if not params.transpose and act[-1] % 2 else ""
        raise ShapeError(f"{OP}: act has {name}={act[-1]} but w_packed {list(w)} holds {name}={want}{odd}")
    return act[:-1] + ((k if params.transpose else n),)


def dtype_rule(dtypes: tuple[DType, ...], params: Nf4MatmulParams) -> DType:
    act, w, absmax = dtypes
    if not act.is_float:
        raise DTypeError(f"{OP}: act must be f32, bf16 or f16, got {act.value}")
    if w is not DType.U8:
        raise DTypeError(f"{OP}: w_packed must be u8 (two NF4 codes a byte), got {w.value}")
    if absmax is not DType.F32 and not (absmax is DType.F64 and act is DType.F64):
        raise DTypeError(f"{OP}: absmax must be f32, got {absmax.value}")
    return act


def _work(act: DType) -> DType:
    return DType.F64 if act is DType.F64 else DType.F32


def nf4_table(w_packed: Tensor, dtype: DType) -> Tensor:
    """NF4[code] `[N, K]` in `dtype`: nibbles split by exact float arithmetic (`hi = floor(b/16)`,
    `lo = b − 16·hi`), interleaved in k order and looked up in the 16-entry table by index_select."""
    n, half = w_packed.shape
    b = w_packed.cast(DType.F32)
    hi = (b * 0.0625).floor()
    lo = b - hi * 16.0
    codes = concat([hi.unsqueeze(-1), lo.unsqueeze(-1)], -1).reshape(n * 2 * half).cast(DType.U32)
    return tensor(NF4.astype(dtype.np)).index_select(0, codes).reshape(n, 2 * half)


def dequantize(w_packed: Tensor, absmax: Tensor, block_size: int, dtype: DType) -> Tensor:
    """dequant(W) `[N, K]` in `dtype` (f32: bitsandbytes' values bit for bit)."""
    n, k = w_packed.shape[0], 2 * w_packed.shape[1]
    nb = k // block_size
    values = nf4_table(w_packed, dtype).reshape(n, nb, block_size)
    return (values * absmax.cast(dtype).reshape(n, nb, 1)).reshape(n, k)


def decompose(inputs: list[Tensor], params: Nf4MatmulParams) -> Tensor:
    """Dequantise W in f32 (f64 for f64 act), one matmul in that type, one rounding to act's dtype."""
    act, w, absmax = inputs
    work = _work(act.dtype)
    deq = dequantize(w, absmax, params.block_size, work)
    return (act.cast(work) @ (deq if params.transpose else deq.T)).cast(act.dtype)


def _below(n: Node, *ops: Op) -> Node:
    """`n` with any chain of the given single-input ops peeled off."""
    while n.op in ops:
        n = n.inputs[0]
    return n


def _codes(n: Node) -> tuple[Node, list[Node]] | None:
    """(w_packed, the nodes) when `n` is the k-ordered nibble stream of a u8 `[N, K/2]`:
    concat([floor(b/16), b − 16·floor(b/16)] along a new last axis) with b = w_packed as f32."""
    if n.op is not Op.CONCAT or len(n.inputs) != 2 or n.arg != len(n.shape) - 1 or n.shape[-1] != 2:
        return None
    hi_u, lo_u = n.inputs
    if hi_u.op is not Op.UNSQUEEZE or lo_u.op is not Op.UNSQUEEZE:
        return None
    hi, lo = hi_u.inputs[0], lo_u.inputs[0]
    if hi.op is not Op.FLOOR or hi.inputs[0].op is not Op.MUL_SCALAR or hi.inputs[0].arg != 0.0625:
        return None
    b = hi.inputs[0].inputs[0]
    if lo.op is not Op.SUB or lo.inputs[0] is not b or lo.inputs[1].op is not Op.MUL_SCALAR:
        return None
    if lo.inputs[1].arg != 16.0 or lo.inputs[1].inputs[0] is not hi:
        return None
    if b.op is not Op.CAST or b.dtype is not DType.F32 or b.inputs[0].dtype is not DType.U8:
        return None
    return b.inputs[0], [n, hi_u, lo_u, hi, lo, hi.inputs[0], lo.inputs[1], b]


def _dequantized(n: Node) -> tuple[Node, Node, int, list[Node]] | None:
    """(w_packed, absmax, block_size, the nodes) when `n` is `dequantize(w_packed, absmax, ...)`."""
    if n.op is not Op.RESHAPE or len(n.shape) != 2 or n.inputs[0].op is not Op.MUL:
        return None
    mul = n.inputs[0]
    for values, scale in (mul.inputs, mul.inputs[::-1]):
        if len(values.shape) != 3 or values.op is not Op.RESHAPE:
            continue
        rows, nb, bs = values.shape
        sc = _below(scale, Op.BROADCAST_TO)
        if sc.op is not Op.RESHAPE or sc.shape != (rows, nb, 1):
            continue
        absmax = _below(sc.inputs[0], Op.CAST)
        sel = _below(values, Op.RESHAPE)
        if sel.op is not Op.INDEX_SELECT or sel.arg != 0 or absmax.shape != (rows, nb):
            continue
        table, idx = sel.inputs
        if table.value is None or not np.array_equal(np.asarray(table.value, np.float64), NF4.astype(np.float64)):
            continue
        if idx.op is not Op.CAST or idx.dtype is not DType.U32:
            continue
        found = _codes(_below(idx.inputs[0], Op.RESHAPE))
        if found is None or found[0].shape != (rows, nb * bs // 2):
            continue
        chain = [*_chain(values, sel), *_chain(idx.inputs[0], found[1][0]), *_chain(scale, sc),
                 *_chain(sc.inputs[0], absmax)]
        return found[0], absmax, bs, [n, mul, sc, sel, idx, *chain, *found[1]]
    return None


def _chain(top: Node, bottom: Node) -> list[Node]:
    """The single-input nodes from `top` down to (and without) `bottom`."""
    out = []
    while top is not bottom:
        out.append(top)
        top = top.inputs[0]
    return out


def _closed(root: Node, interior: list[Node], counts: Mapping[Node, int]) -> bool:
    """No interior node but the root is read outside the match."""
    inside = {id(n): n for n in interior}
    uses: dict[int, int] = {}
    for n in inside.values():
        for i in n.inputs:
            uses[id(i)] = uses.get(id(i), 0) + 1
    return all(n is root or counts[n] == uses.get(k, 0) for k, n in inside.items())


def pattern(node: Node, counts: Mapping[Node, int]) -> Match | None:
    """The lowering: `act @ dequantize(w_packed, absmax)ᵀ` (or without the transpose), the nibbles split by
    floor(b/16), looked up in the NF4 table and scaled per block; act cast to f32 (and the product back)
    where it is a half type. A hand matcher: its reshapes carry N, K and the block size."""
    root, act = node, None
    if node.op is Op.CAST and node.inputs[0].op is Op.MATMUL:
        node = node.inputs[0]
        a = node.inputs[0]
        if not (a.op is Op.CAST and a.dtype is DType.F32 and a.inputs[0].dtype is root.dtype and root.dtype.is_half):
            return None
        act = a.inputs[0]
    if node.op is not Op.MATMUL or len(node.shape) < 2:
        return None
    a, b = node.inputs
    act = a if act is None else act
    bt = _below(b, Op.BROADCAST_TO)
    transpose = bt.op is not Op.PERMUTE
    deq = bt if transpose else bt.inputs[0]
    if not transpose and tuple(bt.arg) != (1, 0):
        return None
    found = _dequantized(deq)
    if found is None:
        return None
    w, absmax, bs, nodes = found
    interior = [root, node, *_chain(b, deq), *_chain(a, act), *nodes]
    if not _closed(root, interior, counts):
        return None
    return Match((act, w, absmax), Nf4MatmulParams(bs, transpose))


def _rows(t: Tensor) -> Tensor:
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def vjp(inputs: list[Tensor], params: Nf4MatmulParams, out: Tensor, grad_out: Tensor) -> list[Tensor | None]:
    act, w, absmax = inputs
    g = grad_out
    grad_act = nf4_matmul(g, w, absmax, params.block_size, transpose=not params.transpose)
    work = _work(act.dtype)
    x2, g2 = _rows(act.cast(work)), _rows(g.cast(work))
    d_w = x2.T @ g2 if params.transpose else g2.T @ x2  # d loss / d dequant(W), [N, K]
    n, k = d_w.shape
    bs = params.block_size
    per_value = d_w * nf4_table(w, work)
    grad_absmax = per_value.reshape(n, k // bs, bs).sum(-1).cast(absmax.dtype)
    return [grad_act, None, grad_absmax]


def nf4_matmul(act: TensorLike, w_packed: TensorLike, absmax: TensorLike, block_size: int = 64, *,
               transpose: bool = False) -> Tensor:
    """`act @ dequant(W)ᵀ` (or `act @ dequant(W)` with transpose): act `[..., M, K]`, w_packed
    `[N, K/2]` u8 (bitsandbytes order), absmax `[N, K/block_size]` f32; see the module doc."""
    if isinstance(block_size, np.integer):
        block_size = int(block_size)
    params = Nf4MatmulParams(block_size, transpose)
    nodes = [as_tensor(act).node, as_tensor(w_packed).node, as_tensor(absmax).node]
    return Tensor(fused_node(FusedOps.NF4_MATMUL, nodes, params))


ENTRY = FusedOpEntry(
    id=FusedOps.NF4_MATMUL,
    name="Nf4Matmul",
    family=FusedOpFamily.QUANTIZED,
    params=Nf4MatmulParams,
    arity=(3,),
    shape_rule=shape_rule,
    dtype_rule=dtype_rule,
    decompose=decompose,
    # The inventory's metadata (upstream: frozen weights); `vjp` below is exact.
    backward=NOT_DIFFERENTIABLE,
    vjp=vjp,
    pattern=pattern,
    output_views=None,
    destructive_input=None,
)
