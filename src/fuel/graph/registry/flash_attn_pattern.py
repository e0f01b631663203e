"""FlashAttn's live pattern: `softmax(q @ k.transpose(-1, -2) * scale [softcapped] [masked]) @ v`.

Spellings recognised (every combination of one from each line):
- scores: `(q @ kᵀ) * scale` or `(q @ kᵀ) / d` (scale = 1/d);
- softcap: none, `(s / c).tanh() * c` or `(s * (1 / c)).tanh() * c`;
- mask: none, `s + bias` with bias a constant of 0 and -inf, `where(keep, s, -inf)` or
  `where(drop, -inf, s)` with keep/drop a constant u8 mask;
- softmax: the fused SoftmaxLastDim (`s.softmax(-1)`, or exp/sum spelled out, which its own pattern
  fuses first);
- GQA: k and v repeated per query-head group by reshape → broadcast → reshape (what repeat_interleave
  lowers to), an unsqueeze → broadcast → reshape, or a broadcast of one kv head; the fused node reads the
  unrepeated k and v.

A mask must be a constant (`fuel.graph.passes.fuse.value_readable`: its array cannot change, so a plan
keyed on its contents stays right; a writable array could be rewritten between realisations), the same
for every batch and head, whose admissible keys are exactly
FlashAttn's for some causal / window_size (bottom-right alignment), with at least one key per row (a
fully masked row is NaN in the user's softmax but 0 in FlashAttn). Anything else stays primitive.
Reading a mask's values is done once per mask array (cached by the leaf, until it is written).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping

import numpy as np

from fuel.dtype import DType
from fuel.graph.functions import where
from fuel.graph.node import Node, Op
from fuel.graph.passes.fuse import value_readable
from fuel.graph.passes.template import Bound, Scalar, Wild, template_pattern
from fuel.graph.registry import Match
from fuel.graph.registry.flash_attn import FlashAttnParams, admissible_mask
from fuel.graph.registry.softmax_last_dim import softmax_last_dim
from fuel.graph.tensor import Tensor

MaskParams = tuple[bool, int | None, int | None]  # causal, window left, window right
_mask_cache: weakref.WeakKeyDictionary[Node, tuple[int, tuple[int, ...], MaskParams | None]] = \
    weakref.WeakKeyDictionary()


def _scores_mul(q: Tensor, k: Tensor, scale: float) -> Tensor:
    return (q @ k.transpose(-1, -2)) * scale


def _scores_div(q: Tensor, k: Tensor, scale: float) -> Tensor:
    return (q @ k.transpose(-1, -2)) / (1.0 / scale)


def _cap_div(s: Tensor, cap: float) -> Tensor:
    return (s / cap).tanh() * cap


def _cap_mul(s: Tensor, cap: float) -> Tensor:
    return (s * (1.0 / cap)).tanh() * cap


_SCORES = (_scores_mul, _scores_div)
_CAPS = (None, _cap_div, _cap_mul)
_MASKS = ("none", "bias", "keep", "drop")


def _variant(scores: int, cap: int, mask: str):  # type: ignore[no-untyped-def]
    def recipe(q: Wild, k: Wild, v: Wild, bias: Wild, keep: Wild, drop: Wild, scale: Scalar, c: Scalar) -> Tensor:
        s = _SCORES[scores](q, k, scale)
        capper = _CAPS[cap]
        if capper is not None:
            s = capper(s, c)
        if mask == "bias":
            s = s + bias
        elif mask == "keep":
            s = where(keep, s, -math.inf)
        elif mask == "drop":
            s = where(drop, -math.inf, s)
        return softmax_last_dim(s) @ v

    recipe.__name__ = f"attention_{_SCORES[scores].__name__}_{cap}_{mask}"
    return recipe


def _unrepeat(n: Node) -> Node:
    """The [B, Hkv, S, D] tensor behind a per-group repetition of its heads, or n itself."""
    if len(n.shape) != 4:
        return n
    b, h, s, d = n.shape
    if n.op is Op.BROADCAST_TO and n.inputs[0].shape == (b, 1, s, d):
        return n.inputs[0]
    if n.op is not Op.RESHAPE or n.inputs[0].op is not Op.BROADCAST_TO:
        return n
    wide = n.inputs[0]
    spread = wide.inputs[0]
    if spread.op not in (Op.RESHAPE, Op.UNSQUEEZE) or len(spread.shape) != 5:
        return n
    base = spread.inputs[0]
    hkv = base.shape[1] if len(base.shape) == 4 else 0
    if hkv and base.shape == (b, hkv, s, d) and spread.shape == (b, hkv, 1, s, d) and \
            wide.shape == (b, hkv, h // hkv, s, d) and h % hkv == 0:
        return base
    return n


def mask_params(ok: np.ndarray) -> MaskParams | None:
    """The (causal, left, right) whose admissible set is exactly `ok` [Sq, Sk], or None."""
    sq, sk = ok.shape
    if sk == 0 or not ok.any(axis=-1).all():
        return None
    aq = np.arange(sq) + (sk - sq)
    lo = ok.argmax(axis=-1)
    hi = sk - 1 - ok[:, ::-1].argmax(axis=-1)
    rights = set((hi - aq)[hi < sk - 1].tolist())
    lefts = set((aq - lo)[lo > 0].tolist())
    if len(rights) > 1 or len(lefts) > 1:
        return None
    right = rights.pop() if rights else None
    left = lefts.pop() if lefts else None
    if (right is not None and right < 0) or (left is not None and left < 0):
        return None
    causal = right == 0
    found: MaskParams = (causal, left, None if causal else right)
    p = FlashAttnParams(1.0, causal, left, found[2], None, None)
    return found if np.array_equal(admissible_mask(sq, sk, p), ok) else None


def _admissible(leaf: Node, kind: str, shape: tuple[int, ...]) -> MaskParams | None:
    """Read a realised mask leaf once: one [Sq, Sk] admissible set for every batch and head."""
    if not value_readable(leaf) or len(leaf.shape) > 4:
        return None
    cached = _mask_cache.get(leaf)
    if cached is not None and cached[0] == leaf.written and cached[1] == shape:
        return cached[2]
    v = np.asarray(leaf.value)
    try:
        full = np.broadcast_to(v, shape)
    except ValueError:
        return None
    if kind == "bias":  # an additive mask of 0 (attend) and -inf (masked), nothing in between
        result = _uniform(full == 0) if np.all((v == 0) | (v == -np.inf)) else None
    else:
        result = _uniform(full != 0 if kind == "keep" else full == 0)
    _mask_cache[leaf] = (leaf.written, shape, result)
    return result


def _uniform(ok: np.ndarray) -> MaskParams | None:
    first = ok[:1, :1]
    if not np.array_equal(np.broadcast_to(first, ok.shape), ok):
        return None
    return mask_params(np.ascontiguousarray(first[0, 0]))


def _build(m: Bound) -> Match | None:
    q, k, v = m.node("q"), _unrepeat(m.node("k")), _unrepeat(m.node("v"))
    if len(q.shape) != 4 or len(k.shape) != 4:
        return None
    scale, cap = float(m["scale"]), m.get("c")
    if not math.isfinite(scale) or (cap is not None and not (math.isfinite(cap) and cap > 0)):
        return None
    causal, left, right = False, None, None
    for kind in ("bias", "keep", "drop"):
        leaf = m.get(kind)
        if leaf is not None:
            got = _admissible(leaf, kind, q.shape[:3] + (k.shape[2],))
            if got is None:
                return None
            causal, left, right = got
    params = FlashAttnParams(scale, causal, left, right, None if cap is None else float(cap), None)
    return Match((q, k, v), params)


_RECIPES = [_variant(s, c, mk) for mk in _MASKS for c in range(len(_CAPS)) for s in range(len(_SCORES))]
_SHAPES = {"q": (2, 4, 5, 8), "k": (2, 1, 6, 8), "v": (2, 1, 6, 8), "bias": (5, 6), "keep": (5, 6), "drop": (5, 6)}
match_attention = template_pattern(_RECIPES[0], build=_build, variants=_RECIPES[1:], shapes=_SHAPES,
                                   dtypes={"keep": DType.U8, "drop": DType.U8})


def pattern(node: Node, counts: Mapping[Node, int]) -> Match | None:
    return match_attention(node, counts)
