"""PagedAttn (id 13): causal attention of new queries over a block-paged KV cache.

q `[B,Hq,Sq,D]`; k_cache, v_cache `[num_blocks, block_size, Hkv, D]` (q's dtype); block_table
`[B, max_blocks]` U32; context_lens `[B]` U32; optional ALiBi slopes `[Hq]` in the accumulation type
(F64 for F64 attention, else F32). Token t of sequence b lives at
`cache[block_table[b, t // block_size], t % block_size]`; `context_lens[b] = L` counts the Sq new
tokens, so query i sits at `aq = i + L − Sq` and key t is admissible iff `t < L` and `t <= aq`
(causal, bottom-right), and with a left window w (`window_size`, FlashAttn's `window_size_left`) also
`t >= aq − w`. Query head h reads kv head `h // (Hq/Hkv)`. Scores `s = scale·q·k`, softcap
`c·tanh(s/c)`, ALiBi `-slope_h·|aq − t|`, the mask, softmax; a row with no admissible key gives 0.

Block ids are checked when the kernel runs (`IndexOutOfRange`): only the blocks a sequence reads, up to
its live length and from its window's first key; entries outside that span are neither read nor checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fuel.dtype import DType
from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.functions import where
from fuel.graph.node import Shape
from fuel.graph.registry import NOT_DIFFERENTIABLE, FusedOpEntry, FusedOpFamily, FusedOps, fused_node
from fuel.graph.registry.flash_attn import alibi_dtype, check_dtypes, repeat_heads
from fuel.graph.tensor import Tensor, TensorLike, as_tensor, matmul, tensor, zeros

OP = "paged_attn"


@dataclass(frozen=True)
class PagedAttnParams:
    softmax_scale: float
    block_size: int
    softcap: float | None
    window_size: int | None = None  # the left window: key t is visible from aq iff aq − window <= t <= aq


def check_params(p: PagedAttnParams) -> None:
    if not math.isfinite(p.softmax_scale):
        raise ParamError(f"{OP}: softmax_scale must be finite, got {p.softmax_scale}")
    if p.softcap is not None and not (math.isfinite(p.softcap) and p.softcap > 0):
        raise ParamError(f"{OP}: softcap must be a positive finite number or None, got {p.softcap}")
    if isinstance(p.block_size, bool) or not isinstance(p.block_size, int) or p.block_size < 1:
        raise ParamError(f"{OP}: block_size must be an int >= 1, got {p.block_size!r}")
    w = p.window_size
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
        raise ParamError(f"{OP}: window_size must be a non-negative int or None, got {w!r}")


def shape_rule(shapes: tuple[Shape, ...], params: PagedAttnParams) -> Shape:
    q, kc, vc, bt, cl = shapes[:5]
    ranks = (("q", q, "[batch, heads, seq, head_dim]"),
             ("k_cache", kc, "[num_blocks, block_size, kv_heads, head_dim]"),
             ("v_cache", vc, "[num_blocks, block_size, kv_heads, head_dim]"),
             ("block_table", bt, "[batch, max_blocks]"), ("context_lens", cl, "[batch]"))
    for name, s, want in ranks:
        if len(s) != len(want.split(",")):
            raise ShapeError(f"{OP}: {name} must be {want}, got {list(s)}")
    if kc != vc:
        raise ShapeError(f"{OP}: k_cache is {list(kc)} but v_cache is {list(vc)}; they must have one shape")
    if kc[1] < 1:
        raise ShapeError(f"{OP}: the caches' block_size (axis 1) must be >= 1, got {list(kc)}")
    check_params(params)
    if kc[1] != params.block_size:
        raise ParamError(f"{OP}: params say block_size {params.block_size}, the caches have {kc[1]}")
    if q[3] != kc[3]:
        raise ShapeError(f"{OP}: head dims differ: q {q[3]}, k_cache {kc[3]}")
    if kc[2] == 0 or q[1] % kc[2]:
        raise ShapeError(f"{OP}: k_cache has {kc[2]} heads, which does not divide q's {q[1]} heads")
    if not q[0] == bt[0] == cl[0]:
        raise ShapeError(f"{OP}: batch sizes differ: q {q[0]}, block_table {bt[0]}, context_lens {cl[0]}")
    if len(shapes) == 6 and shapes[5] != (q[1],):
        raise ShapeError(f"{OP}: alibi must be [{q[1]}] (one slope per query head), got {list(shapes[5])}")
    return q


def dtype_rule(dtypes: tuple[DType, ...], params: PagedAttnParams) -> DType:
    q = check_dtypes(OP, dtypes[:3], ("k_cache", "v_cache"))
    for name, d in (("block_table", dtypes[3]), ("context_lens", dtypes[4])):
        if d is not DType.U32:
            raise DTypeError(f"{OP}: {name} must be u32, got {d.value}")
    if len(dtypes) == 6 and dtypes[5] is not alibi_dtype(q):
        raise DTypeError(f"{OP}: alibi must be {alibi_dtype(q).value} for {q.value} attention, got "
                         f"{dtypes[5].value}")
    return q


def _u32(a: np.ndarray) -> Tensor:
    return tensor(np.asarray(a, np.uint32))


def decompose(inputs: list[Tensor], params: PagedAttnParams) -> Tensor:
    """The executor's fallback where no kernel serves a dtype (every float dtype has one), exact in
    primitives so tests/test_contract.py can hold it to the reference like every other entry's.

    Gather every table entry's block (dead entries, and with a window w those wholly left of every
    query's window, redirected to block 0), then dense attention under the runtime mask `t + Sq − i <= L_b`
    (which is `t <= aq` and implies `t < L_b`), and with a window `L_b <= t + Sq − i + w` (which is
    `t >= aq − w`). Values at dead positions (past L_b, or left of the first query's window) are zeroed, so a
    never-written cache slot cannot leak NaN through a zero probability."""
    q, kc, vc, bt, cl = inputs[:5]
    alibi = inputs[5] if len(inputs) == 6 else None
    b, hq, sq, d = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    m = bt.shape[1]
    lmax = m * bs
    if q.size == 0 or lmax == 0:
        return zeros(q.shape, q.dtype)
    lens = cl.reshape(b, 1)
    w = params.window_size
    ids = where(_u32(np.arange(m) * bs) < lens, bt, 0)
    if w is not None:  # the block's last token t = (j+1)·bs − 1 reaches the first query's window
        ids = where(_u32((np.arange(m) + 1) * bs + sq + w) > lens, ids, 0)
    ids = ids.reshape(b * m)

    def dense(cache: Tensor) -> Tensor:
        pages = cache.index_select(0, ids).reshape(b, lmax, hkv, d).permute(0, 2, 1, 3)
        return repeat_heads(pages, hq)

    lb = cl.reshape(b, 1, 1, 1)
    v = where(_u32(np.arange(lmax).reshape(lmax, 1)) < lb, dense(vc), 0.0)
    if w is not None:
        v = where(_u32(np.arange(lmax).reshape(lmax, 1) + sq + w) >= lb, v, 0.0)
    s = matmul(q, dense(kc).transpose(-2, -1)) * params.softmax_scale
    if params.softcap is not None:
        s = (s * (1.0 / params.softcap)).tanh() * params.softcap
    reach = np.arange(lmax)[None, :] + sq - np.arange(sq)[:, None]  # t + Sq − i, at least 1
    if alibi is not None:
        dist = (lb.cast(alibi.dtype) - tensor(reach.astype(alibi.dtype.np))).abs()  # |aq − t|
        s = s + (alibi.reshape(1, hq, 1, 1) * -dist).cast(q.dtype)
    s = where(_u32(reach) <= lb, s, -np.inf)
    if w is not None:
        s = where(_u32(reach + w) >= lb, s, -np.inf)
    has_key = _u32(sq - np.arange(sq).reshape(sq, 1)) <= lb  # key 0 admissible
    return matmul(where(has_key, s.softmax(-1), 0.0), v)


def _number(name: str, x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise ParamError(f"{OP}: {name} must be a number, got {x!r}")
    return float(x)


def _index_input(name: str, x: TensorLike) -> Tensor:
    """An index input as a tensor; an array of another integer type is refused here, by this op's name
    (NumPy int32 tables, as flash-attn and vLLM use, are no Fuel type at all)."""
    if isinstance(x, Tensor):
        return x
    a = np.asarray(x)
    if a.dtype != np.uint32:
        raise DTypeError(f"{OP}: {name} must be u32, got {a.dtype}")
    return tensor(a)


def paged_attn(q: TensorLike, k_cache: TensorLike, v_cache: TensorLike, block_table: TensorLike,
               context_lens: TensorLike, softmax_scale: float | None = None, softcap: float | None = None,
               alibi: TensorLike | None = None, window_size: int | None = None) -> Tensor:
    """Causal attention of q `[B,Hq,Sq,D]` over a paged cache, each query seeing its last `window_size`
    keys and itself when a window is given; see the module doc for the layout."""
    tensors = [as_tensor(q), as_tensor(k_cache), as_tensor(v_cache), _index_input("block_table", block_table),
               _index_input("context_lens", context_lens)]
    tq, tk = tensors[0], tensors[1]
    for name, t, want in (("q", tq, "[batch, heads, seq, head_dim]"),
                          ("k_cache", tk, "[num_blocks, block_size, kv_heads, head_dim]")):
        if t.ndim != 4:
            raise ShapeError(f"{OP}: {name} must be {want}, got {list(t.shape)}")
    if alibi is not None:
        ta = as_tensor(alibi)
        if not ta.dtype.is_float:
            raise DTypeError(f"{OP}: alibi must be float slopes, got {ta.dtype.value}")
        want_dt = alibi_dtype(tq.dtype) if tq.dtype.is_float else ta.dtype
        tensors.append(ta.cast(want_dt))
    d = tq.shape[3]
    scale = _number("softmax_scale", softmax_scale) if softmax_scale is not None else (
        1.0 / math.sqrt(d) if d else 1.0)
    params = PagedAttnParams(scale, int(tk.shape[1]), None if softcap is None else _number("softcap", softcap),
                             window_size)
    return Tensor(fused_node(FusedOps.PAGED_ATTN, [t.node for t in tensors], params))


ENTRY = FusedOpEntry(
    id=FusedOps.PAGED_ATTN,
    name="PagedAttn",
    family=FusedOpFamily.ATTENTION,
    params=PagedAttnParams,
    arity=(5, 6),
    shape_rule=shape_rule,
    dtype_rule=dtype_rule,
    decompose=decompose,
    backward=NOT_DIFFERENTIABLE,
    vjp=None,
    pattern=None,
    no_pattern="a block table has no primitive spelling a user writes: serving code calls the op",
    output_views=None,
    destructive_input=None,
)
