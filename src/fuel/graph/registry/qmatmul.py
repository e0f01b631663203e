"""QMatMul (id 14): `C = A @ dequant(W)ᵀ` with W a GGUF/ggml block-quantized `[n, k]` weight.

Inputs: a F32 `[..., M, k]` and w_q U32 1-D, the raw little-endian bytes of W carried as u32 words:
n rows of k/block_elements blocks of the quant type's layout (`fuel.quant.QuantType`). The byte count
n·(k/blk)·bytes_per_block need not be a multiple of 4: the stream is then padded to whole words (at
most 3 bytes, ignored), as a loader must pad it. Output F32 `[..., M, n]`. Dequantisation is bit-exact
with the `gguf` package; products and sums are f32. The weight is shared by every batch entry.

`transpose=True` is the internal form the gradient uses: a is then `[..., M, n]` and the result
`a @ dequant(W)`, `[..., M, k]`. Only activations are differentiable (the weight is frozen integer
data): the VJP of either form is the other form, and w_q gets none (`fl.grad` refuses a U32 tensor).

Decomposition: the weight dequantised with bit primitives (`fuel.quant.lowering`, bit for bit the
kernel's and gguf's values), then one MATMUL of either form. It materialises the `[n, k]` f32 weight the
kernel never builds; it is the reference form `fuel verify --decomposed` checks the kernel against.

Pattern: that lowering itself. A MATMUL whose weight operand is a u32 stream decoded by
`fuel.quant.lowering` (as `decompose` builds it, either form) becomes one QMatMul, provided nothing
outside reads the decoded weight or any step of its decoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from fuel.dtype import DType
from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.node import Node, Op, Shape
from fuel.graph.registry import NOT_DIFFERENTIABLE, FusedOpEntry, FusedOpFamily, FusedOps, Match, fused_node
from fuel.graph.tensor import Tensor, TensorLike, as_tensor
from fuel.quant import QuantType

OP = "qmatmul"


@dataclass(frozen=True)
class QMatMulParams:
    """The weight's quant type and logical shape `[n, k]`; `transpose` selects `a @ dequant(W)`."""

    quant_type: QuantType
    k: int
    n: int
    transpose: bool = False


def weight_bytes(p: QMatMulParams) -> int:
    """Bytes of the block stream of a `[n, k]` weight (without the padding to whole words)."""
    return p.n * (p.k // p.quant_type.block_elements) * p.quant_type.block_bytes


def weight_words(p: QMatMulParams) -> int:
    """u32 words carrying the stream: its bytes rounded up to a multiple of 4."""
    return -(-weight_bytes(p) // 4)


def _check_params(p: QMatMulParams) -> None:
    if not isinstance(p.quant_type, QuantType):
        raise ParamError(f"{OP}: quant_type must be a QuantType, got {p.quant_type!r}")
    for name in ("k", "n"):
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ParamError(f"{OP}: {name} must be a non-negative int, got {v!r}")
    if not isinstance(p.transpose, bool):
        raise ParamError(f"{OP}: transpose must be a bool, got {p.transpose!r}")
    blk = p.quant_type.block_elements
    if p.k % blk:
        raise ShapeError(f"{OP}: k must be a multiple of {p.quant_type.ggml_name}'s {blk}-element block, "
                         f"got k={p.k}")


def shape_rule(shapes: tuple[Shape, ...], params: QMatMulParams) -> Shape:
    """[..., M, n] (or [..., M, k] with transpose)"""
    _check_params(params)
    a, w = shapes
    qt, k, n = params.quant_type, params.k, params.n
    if len(a) < 2:
        raise ShapeError(f"{OP}: a needs rank >= 2 ([..., M, K]), got {list(a)}")
    inner, outer = (n, k) if params.transpose else (k, n)
    if a[-1] != inner:
        what = "n (transpose: a is [..., M, n])" if params.transpose else "k"
        raise ShapeError(f"{OP}: a's last dim must be {what}={inner}, got a {list(a)}")
    words = weight_words(params)
    if len(w) != 1 or w[0] != words:
        nbytes = weight_bytes(params)
        pad = f", padded to {words * 4}" if nbytes % 4 else ""
        raise ShapeError(f"{OP}: a {qt.ggml_name} weight [n={n}, k={k}] is {n} rows of {k // qt.block_elements} "
                         f"blocks of {qt.block_bytes} bytes = {nbytes} bytes{pad}, so w_q must be 1-D u32 "
                         f"[{words}], got {list(w)}")
    return a[:-1] + (outer,)


def dtype_rule(dtypes: tuple[DType, ...], params: QMatMulParams) -> DType:
    """F32"""
    a, w = dtypes
    if a is not DType.F32:
        raise DTypeError(f"{OP}: a must be f32, got {a.value}")
    if w is not DType.U32:
        raise DTypeError(f"{OP}: w_q must be u32 (the block bytes as little-endian words), got {w.value}")
    return DType.F32


def vjp(inputs: list[Tensor], params: QMatMulParams, out: Tensor, grad_out: Tensor) -> list[Tensor | None]:
    """d a = g @ dequant(W) (or g @ dequant(W)ᵀ for the transposed form); the weight gets none."""
    flipped = replace(params, transpose=not params.transpose)
    return [Tensor(fused_node(FusedOps.QMATMUL, [grad_out.node, inputs[1].node], flipped)), None]


def decompose(inputs: list[Tensor], params: QMatMulParams) -> Tensor:
    """`a @ Wᵀ` (or `a @ W`) with W `[n, k]` f32 dequantised from the word stream by primitives."""
    from fuel.quant.lowering import dequantize

    a, w_q = inputs
    w = dequantize(w_q, params.quant_type, params.n, params.k)
    return a @ (w if params.transpose else w.T)


def _streams(b: Node, limit: int = 512) -> list[Node]:
    """The 1-D u32 word streams among `b`'s ancestors that a BITCAST reads as bytes: where a lowering of
    a weight operand starts (a bounded search that descends no leaf and no product, so a model's
    activations, which come out of products, are not walked)."""
    seen: set[int] = set()
    stack, found = [b], []
    while stack and len(seen) < limit:
        n = stack.pop()
        if id(n) in seen or n.value is not None:
            continue
        seen.add(id(n))
        src = n.inputs[0] if n.op is Op.BITCAST else None
        if src is not None and n.dtype is DType.U8 and src.dtype is DType.U32 and len(src.shape) == 1:
            found.append(src)
        elif n.op not in (Op.MATMUL, Op.FUSED):  # no lowering of a weight passes through a product
            stack.extend(n.inputs)
    return found


def _same(ref: Node, got: Node, pairs: dict[int, Node]) -> bool:
    """Whether `got` computes what `ref` does: the same ops, arguments, shapes and dtypes over the same
    bound inputs, and constants of equal bytes (the lowering's shift tables, its empty-weight zeros)."""
    if ref is got:
        return True
    if id(ref) in pairs:
        return pairs[id(ref)] is got
    if (ref.op is not got.op or ref.shape != got.shape or ref.dtype is not got.dtype
            or len(ref.inputs) != len(got.inputs) or (ref.value is None) != (got.value is None)):
        return False
    if ref.value is not None and got.value is not None:
        if ref.op is not Op.CONST or got.op is not Op.CONST or ref.value.tobytes() != got.value.tobytes():
            return False
    elif ref.arg != got.arg:
        return False
    pairs[id(ref)] = got
    return all(_same(r, g, pairs) for r, g in zip(ref.inputs, got.inputs, strict=True))


def _sole_reader(root: Node, interior: list[Node], counts: Mapping[Node, int]) -> bool:
    """Every matched node but the root is read only inside the match (else fusing computes it twice)."""
    uses: dict[int, int] = {}
    for n in interior:
        for i in n.inputs:
            uses[id(i)] = uses.get(id(i), 0) + 1
    return all(n is root or n.value is not None or counts[n] == uses.get(id(n), 0) for n in interior)


def pattern(node: Node, counts: Mapping[Node, int]) -> Match | None:
    """QMatMul's own lowering, `a @ dequant(W)ᵀ` or `a @ dequant(W)` built by `decompose`: for each u32
    stream under the weight operand and each geometry its shape and length allow, the lowering is rebuilt
    over the same inputs and compared node for node; every interior node must have no other reader."""
    if node.op is not Op.MATMUL or node.dtype is not DType.F32 or len(node.shape) < 2:
        return None
    a, b = node.inputs
    if b.value is not None:
        return None
    for w_q in _streams(b):
        for transpose in (False, True):
            n, k = (b.shape[-2], b.shape[-1]) if transpose else (b.shape[-1], b.shape[-2])
            for qt in QuantType:
                p = QMatMulParams(qt, k, n, transpose)
                if k % qt.block_elements or weight_words(p) != w_q.shape[0]:
                    continue
                pairs: dict[int, Node] = {}
                if _same(decompose([Tensor(a), Tensor(w_q)], p).node, node, pairs) and _sole_reader(
                        node, [g for g in pairs.values() if g is not a and g is not w_q], counts):
                    return Match((a, w_q), p)
    return None


def qmatmul(a: TensorLike, w_q: TensorLike, quant_type: QuantType | str, k: int, n: int,
            transpose: bool = False) -> Tensor:
    """`a @ dequant(W)ᵀ` for a GGUF block-quantized weight W `[n, k]` given as its raw bytes in u32 words.

    `quant_type` is a QuantType or its name ("Q4_0", "Q4_K", "Q4K"). `transpose=True` computes
    `a @ dequant(W)` instead (a `[..., M, n]`), the form the gradient uses.
    """
    params = QMatMulParams(QuantType.of(quant_type, OP), k, n, transpose)
    return Tensor(fused_node(FusedOps.QMATMUL, [as_tensor(a).node, as_tensor(w_q).node], params))


ENTRY = FusedOpEntry(
    id=FusedOps.QMATMUL,
    name="QMatMul",
    family=FusedOpFamily.QUANTIZED,
    params=QMatMulParams,
    arity=(2,),
    shape_rule=shape_rule,
    dtype_rule=dtype_rule,
    decompose=decompose,
    # The inventory's metadata (frozen weights); `vjp` gives the activations' gradient exactly.
    backward=NOT_DIFFERENTIABLE,
    vjp=vjp,
    pattern=pattern,
    output_views=None,
    destructive_input=None,
)
