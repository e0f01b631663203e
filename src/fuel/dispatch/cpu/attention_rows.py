"""FlashAttn's per-row pieces, shared by the forward, the decode path and the backward: the mask of a call
(`Window`), each query row's admissible keys, and the row passes over a row's scores (scale, softcap,
ALiBi, max, exp). They are inlined into their callers' kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from fuel.dispatch.cpu.vecmath import cast_like, exp_nonpositive, maxnum, neg_inf_like
from fuel.errors import IndexOutOfRange

# Reassociation lets row reductions vectorise (one fixed order per build); no nnan/ninf: -inf is
# the mask value and NaN must propagate.
FASTMATH = {"nsz", "reassoc", "contract", "arcp"}


@dataclass(frozen=True)
class Window:
    """The resolved mask of one call: live keys, query count and window sides (-1: unbounded)."""

    kl: int
    sq: int
    left: int
    right: int

    def keys(self, i0: int, i1: int) -> tuple[int, int]:
        """Keys [lo, hi) some query in [i0, i1) may attend to (hi <= lo: none)."""
        lo = 0 if self.left < 0 else max(0, i0 + self.kl - self.sq - self.left)
        hi = self.kl if self.right < 0 else min(self.kl, i1 - 1 + self.kl - self.sq + self.right + 1)
        return lo, hi


def window_of(params: Any, sq: int, sk: int) -> Window:
    """The mask a call's (resolved) FlashAttnParams describe; a k_len outside the cache is an error."""
    kl = sk if params.k_len is None else int(params.k_len)
    if not 0 <= kl <= sk:
        raise IndexOutOfRange(f"flash_attn: k_len {kl} is outside the cache capacity [0, {sk}]")
    right = params.window_size_right
    if params.causal:
        right = 0 if right is None else min(right, 0)
    left = params.window_size_left
    return Window(kl, sq, -1 if left is None else left, -1 if right is None else right)


@njit(inline="always", cache=True, fastmath=FASTMATH)
def row_window(i: int, j0: int, cols: int, kl: int, sq: int, left: int, right: int) -> tuple[int, int]:
    """Columns [lo, hi) of a key block starting at key j0 that query i may attend to."""
    aq = i + kl - sq
    lo = 0 if left < 0 else max(0, aq - left - j0)
    hi = min(cols, kl - j0) if right < 0 else min(cols, kl - j0, aq + right + 1 - j0)
    return lo, max(lo, hi)


@njit(inline="always", cache=True, fastmath=FASTMATH)
def transform_row(seg: Any, aq: int, j0: int, scale: Any, softcap: Any, slope: Any) -> Any:
    """Scores of one row's admissible segment in place (seg starts at key j0): scale, softcap, ALiBi;
    returns their max."""
    m = neg_inf_like(scale)
    if softcap > 0 or slope != 0:
        for c in range(seg.shape[0]):
            x = seg[c] * scale
            if softcap > 0:
                x = softcap * np.tanh(x / softcap)
            x -= slope * cast_like(abs(aq - (j0 + c)), scale)
            seg[c] = x
            m = maxnum(m, x)
        return m
    for c in range(seg.shape[0]):  # the common case, kept branch-free so it vectorises
        x = seg[c] * scale
        seg[c] = x
        m = maxnum(m, x)
    return m


@njit(inline="always", cache=True, fastmath=FASTMATH)
def row_max(seg: Any, like: Any) -> Any:
    """The max of a segment (-inf for an empty one or one of NaN), read only: vectorises."""
    m = neg_inf_like(like)
    for c in range(seg.shape[0]):
        m = maxnum(m, seg[c])
    return m


@njit(inline="always", cache=True, fastmath=FASTMATH)
def exp_scaled(seg: Any, scale: Any, shift: Any) -> Any:
    """seg <- exp(seg·scale - shift) (every value·scale <= shift, up to rounding); returns the sum. The
    scale is folded into the exponent's argument (one fused multiply-add) so the common row needs no
    separate pass to scale it; scale 1 gives exactly `exp_shifted`."""
    total = shift * 0
    for c in range(seg.shape[0]):
        e = exp_nonpositive(seg[c] * scale - shift)
        seg[c] = e
        total += e
    return total


@njit(inline="always", cache=True, fastmath=FASTMATH)
def exp_shifted(seg: Any, shift: Any) -> Any:
    """seg <- exp(seg - shift) (every value <= shift); returns the sum."""
    total = seg[0] * 0 if seg.shape[0] else shift * 0
    for c in range(seg.shape[0]):
        e = exp_nonpositive(seg[c] - shift)
        seg[c] = e
        total += e
    return total


@njit(inline="always", cache=True)
def zero_outside(row: Any, lo: int, hi: int) -> None:
    for c in range(lo):
        row[c] = 0
    for c in range(hi, row.shape[0]):
        row[c] = 0
