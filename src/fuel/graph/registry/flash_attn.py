"""FlashAttn (id 12): multi-head attention in bounded memory, every FlashAttention-2 option.

q `[B,Hq,Sq,D]`, k and v `[B,Hkv,Sk,D]` (Hkv divides Hq; query head h reads kv head h // (Hq/Hkv),
never materialised repeated), optional ALiBi slopes `[Hq]` in the accumulation type (F64 for F64
attention, else F32). Scores `s = scale·q·k`, softcap `c·tanh(s/c)`, ALiBi `-slope_h·|aq − j|`, the
mask, softmax. Alignment is bottom-right against the live length: `aq = i + k_len − Sq`; key j is
admissible iff `j < k_len` and `aq − left ≤ j ≤ aq + right` (None: unbounded; causal: right = 0).
A row with no admissible key gives 0. `k_len` (None: all Sk keys; an int; or a DynScalar bound at
realize) makes k/v a capacity cache whose first k_len rows are live.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fuel.dtype import DType
from fuel.errors import DTypeError, NoDecomposition, ParamError, ShapeError
from fuel.graph.functions import where
from fuel.graph.node import DynScalar, Node, Shape
from fuel.graph.registry import NOT_DIFFERENTIABLE, FusedOpEntry, FusedOpFamily, FusedOps, Match, fused_node
from fuel.graph.tensor import Tensor, TensorLike, as_tensor, matmul, tensor


@dataclass(frozen=True)
class FlashAttnParams:
    """Shared by FlashAttn and its three backward entries (the backward uses the forward's exact mask)."""

    softmax_scale: float
    causal: bool
    window_size_left: int | None
    window_size_right: int | None
    softcap: float | None
    k_len: DynScalar | int | None


def check_params(op: str, p: FlashAttnParams, sk: int) -> None:
    if not math.isfinite(p.softmax_scale):
        raise ParamError(f"{op}: softmax_scale must be finite, got {p.softmax_scale}")
    if p.softcap is not None and not (math.isfinite(p.softcap) and p.softcap > 0):
        raise ParamError(f"{op}: softcap must be a positive finite number or None, got {p.softcap}")
    for side, w in (("left", p.window_size_left), ("right", p.window_size_right)):
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise ParamError(f"{op}: window_size {side} must be a non-negative int or None, got {w!r}")
    kl = p.k_len
    if isinstance(kl, bool) or not (kl is None or isinstance(kl, (int, DynScalar))):
        raise ParamError(f"{op}: k_len must be None, an int or a DynScalar, got {kl!r}")
    if isinstance(kl, int) and not 0 <= kl <= sk:
        raise ParamError(f"{op}: k_len {kl} is outside the cache capacity [0, {sk}] of k and v")


def check_shapes(op: str, shapes: tuple[Shape, ...], p: FlashAttnParams) -> None:
    """q, k, v (and alibi) agree: ranks, batch, heads, lengths, head dims, ALiBi length."""
    q, k, v = shapes[:3]
    for name, s in (("q", q), ("k", k), ("v", v)):
        if len(s) != 4:
            raise ShapeError(f"{op}: {name} must be [batch, heads, seq, head_dim], got {list(s)}")
    if not q[0] == k[0] == v[0]:
        raise ShapeError(f"{op}: batch sizes differ: q {q[0]}, k {k[0]}, v {v[0]}")
    if k[1] != v[1]:
        raise ShapeError(f"{op}: k has {k[1]} heads, v has {v[1]}")
    if k[2] != v[2]:
        raise ShapeError(f"{op}: k has {k[2]} positions, v has {v[2]}")
    if not q[3] == k[3] == v[3]:
        raise ShapeError(f"{op}: head dims differ: q {q[3]}, k {k[3]}, v {v[3]}")
    if k[1] == 0 or q[1] % k[1]:
        raise ShapeError(f"{op}: k has {k[1]} heads, which does not divide q's {q[1]} heads")
    if len(shapes) == 4 and shapes[3] != (q[1],):
        raise ShapeError(f"{op}: alibi must be [{q[1]}] (one slope per query head), got {list(shapes[3])}")
    check_params(op, p, k[2])


def shape_rule(shapes: tuple[Shape, ...], params: FlashAttnParams) -> Shape:
    check_shapes("flash_attn", shapes, params)
    return shapes[0]


def alibi_dtype(q: DType) -> DType:
    """ALiBi slopes come in the accumulation type: F64 for F64 attention, F32 otherwise."""
    return DType.F64 if q is DType.F64 else DType.F32


def check_dtypes(op: str, dtypes: tuple[DType, ...], names: tuple[str, ...] = ("k", "v")) -> DType:
    """q is float; `names` (the inputs after q) have q's dtype; a trailing ALiBi input has alibi_dtype(q)."""
    q = dtypes[0]
    if not q.is_float:
        raise DTypeError(f"{op}: q must be a float tensor, got {q.value}")
    for name, d in zip(names, dtypes[1:], strict=False):
        if d != q:
            raise DTypeError(f"{op}: {name} must have q's dtype {q.value}, got {d.value}")
    if len(dtypes) > len(names) + 1 and dtypes[-1] != alibi_dtype(q):
        raise DTypeError(f"{op}: alibi must be {alibi_dtype(q).value} for {q.value} attention, got "
                         f"{dtypes[-1].value}")
    return q


def dtype_rule(dtypes: tuple[DType, ...], params: FlashAttnParams) -> DType:
    return check_dtypes("flash_attn", dtypes)


def live_length(p: FlashAttnParams, sk: int) -> int:
    """The static number of live keys, or NoDecomposition when k_len is only known at realize."""
    if isinstance(p.k_len, DynScalar):
        raise NoDecomposition(f"a DynScalar k_len ({p.k_len.name!r}) has no primitive form: the mask depends "
                              f"on its value at realize")
    return sk if p.k_len is None else p.k_len


def admissible_mask(sq: int, kl: int, p: FlashAttnParams) -> np.ndarray:
    """Bool `[Sq, kl]`: key j admissible for query i (bottom-right alignment)."""
    aq = np.arange(sq)[:, None] + (kl - sq)
    j = np.arange(kl)[None, :]
    ok = np.ones((sq, kl), bool)
    right = p.window_size_right
    if p.causal:
        right = 0 if right is None else min(right, 0)
    if p.window_size_left is not None:
        ok &= j >= aq - p.window_size_left
    if right is not None:
        ok &= j <= aq + right
    return ok


def repeat_heads(x: Tensor, hq: int) -> Tensor:
    """[B,Hkv,S,D] -> [B,Hq,S,D], kv head h // G for query head h (the decomposition only)."""
    b, hkv, s, d = x.shape
    g = hq // hkv
    if g == 1:
        return x
    return x.reshape(b, hkv, 1, s, d).broadcast_to(b, hkv, g, s, d).reshape(b, hq, s, d)


@dataclass
class Materialised:
    """The decomposition's pieces: probabilities [B,Hq,Sq,kl], tanh(s/c) under a softcap, repeated K and V."""

    probs: Tensor
    capped: Tensor | None
    k: Tensor
    v: Tensor


def materialise(q: Tensor, k: Tensor, v: Tensor, alibi: Tensor | None, p: FlashAttnParams) -> Materialised:
    """The score matrix and its softmax in primitives (what the fused kernels never build)."""
    _, hq, sq, _ = q.shape
    kl = live_length(p, k.shape[2])
    kr = repeat_heads(k[:, :, :kl], hq)
    s = matmul(q, kr.transpose(-2, -1)) * p.softmax_scale
    capped = None
    if p.softcap is not None:
        capped = (s * (1.0 / p.softcap)).tanh()
        s = capped * p.softcap
    if alibi is not None:
        aq = np.arange(sq)[:, None] + (kl - sq)
        dist = np.abs(aq - np.arange(kl)[None, :]).astype(alibi.dtype.np)
        s = s + (alibi.reshape(hq, 1, 1) * tensor(-dist)).cast(q.dtype)
    ok = admissible_mask(sq, kl, p)
    # A constant mask, and no zeroing where every row has a key: the spelling FlashAttn's pattern reads.
    s = s + tensor(np.where(ok, 0.0, -np.inf).astype(q.dtype.np), const=True)
    probs = s.softmax(-1) if kl else s
    if kl and ok.any(-1).all():
        return Materialised(probs, capped, kr, repeat_heads(v[:, :, :kl], hq))
    any_key = tensor(ok.any(-1, keepdims=True).astype(np.uint8))
    return Materialised(where(any_key, probs, 0.0), capped, kr, repeat_heads(v[:, :, :kl], hq))


def decompose(inputs: list[Tensor], params: FlashAttnParams) -> Tensor:
    q, k, v = inputs[:3]
    m = materialise(q, k, v, inputs[3] if len(inputs) == 4 else None, params)
    return matmul(m.probs, m.v)


def vjp(inputs: list[Tensor], params: FlashAttnParams, out: Tensor, grad_out: Tensor) -> list[Tensor | None]:
    from fuel.graph.registry.flash_attn_backward import flash_attn_backward_grads

    return flash_attn_backward_grads(inputs, params, grad_out)


def make_params(q: Tensor, softmax_scale: float | None, causal: bool, window_size: tuple[int | None, int | None],
                softcap: float | None, k_len: DynScalar | int | None, op: str) -> FlashAttnParams:
    if len(q.shape) != 4:
        raise ShapeError(f"{op}: q must be [batch, heads, seq, head_dim], got {list(q.shape)}")
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ParamError(f"{op}: window_size must be a pair (left, right), got {window_size!r}") from None
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None and q.shape[3] else softmax_scale
    return FlashAttnParams(float(1.0 if scale is None else scale), bool(causal), left, right,
                           None if softcap is None else float(softcap), k_len)


def attention_inputs(q: TensorLike, k: TensorLike, v: TensorLike, alibi: TensorLike | None) -> list[Tensor]:
    """The fused node's inputs; ALiBi slopes are converted once to the accumulation type."""
    tq, tk, tv = as_tensor(q), as_tensor(k), as_tensor(v)
    nodes = [tq, tk, tv]
    if alibi is not None:
        ta = as_tensor(alibi)
        want = alibi_dtype(tq.dtype)
        if not ta.dtype.is_float:
            raise DTypeError(f"flash_attn: alibi must be float slopes, got {ta.dtype.value}")
        nodes.append(ta if ta.dtype is want else ta.cast(want))
    return nodes


def flash_attn(q: TensorLike, k: TensorLike, v: TensorLike, softmax_scale: float | None = None,
               causal: bool = False, window_size: tuple[int | None, int | None] = (None, None),
               softcap: float | None = None, alibi: TensorLike | None = None,
               k_len: DynScalar | int | None = None) -> Tensor:
    """Attention of q `[B,Hq,Sq,D]` over k, v `[B,Hkv,Sk,D]`; see the module doc for every option."""
    inputs = attention_inputs(q, k, v, alibi)
    params = make_params(inputs[0], softmax_scale, causal, window_size, softcap, k_len, "flash_attn")
    return Tensor(fused_node(FusedOps.FLASH_ATTN, [t.node for t in inputs], params))


def pattern(node: Node, counts: Mapping[Node, int]) -> Match | None:
    """The naive attention spellings (fuel.graph.registry.flash_attn_pattern, which imports this module)."""
    from fuel.graph.registry.flash_attn_pattern import pattern as live

    return live(node, counts)


ENTRY = FusedOpEntry(
    id=FusedOps.FLASH_ATTN,
    name="FlashAttn",
    family=FusedOpFamily.ATTENTION,
    params=FlashAttnParams,
    arity=(3, 4),
    shape_rule=shape_rule,
    dtype_rule=dtype_rule,
    decompose=decompose,
    backward=NOT_DIFFERENTIABLE,
    vjp=vjp,
    pattern=pattern,
    output_views=None,
    destructive_input=None,
)
