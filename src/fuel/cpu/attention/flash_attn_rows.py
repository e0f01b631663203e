"""FlashAttn's per-row pieces, shared by the forward, the decode path and the backward: the mask of a call
(`Window`), each query row's admissible keys, and the row passes over a row's scores (scale, softcap,
ALiBi, max, exp). They are inlined into their callers' kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from fuel.cpu.simd.vecmath import cast_like, exp_nonpositive, maxnum, neg_inf_like, store_as
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
        return window_keys(i0, i1, self.kl, self.sq, self.left, self.right)


@njit(inline="always", cache=True)
def window_keys(i0: int, i1: int, kl: int, sq: int, left: int, right: int) -> tuple[int, int]:
    """Keys [lo, hi) some query in [i0, i1) may attend to, for kl live keys, sq queries and window sides
    (-1: unbounded): `Window.keys`, callable from jitted code too."""
    lo = 0 if left < 0 else max(0, i0 + kl - sq - left)
    hi = kl if right < 0 else min(kl, i1 - 1 + kl - sq + right + 1)
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


@njit(inline="always", cache=True)
def plain_row(scale: Any, softcap: Any, slope: Any) -> bool:
    """Whether a row's scores are q·k times a positive scale only: its softmax max is kept in raw q·k
    units and the scale folded into exp (`online_row`); the backward recomputes P the same way."""
    return softcap <= 0 and scale > 0 and slope == 0


@njit(inline="always", cache=True, fastmath=FASTMATH)
def row_max(seg: Any, like: Any) -> Any:
    """The max of a segment (-inf for an empty one or one of NaN), read only: vectorises."""
    m = neg_inf_like(like)
    for c in range(seg.shape[0]):
        m = maxnum(m, seg[c])
    return m


@njit(inline="always", cache=True, fastmath=FASTMATH)
def exp_scaled(seg: Any, scale: Any, shift: Any) -> Any:
    """seg <- exp((seg - shift)·scale) for every value <= shift and scale > 0; returns the sum. The
    exponent is <= 0 whatever the rounding (a rounded difference of x <= shift is <= 0, and so is its
    product with a positive scale), which the fast exp needs: `seg·scale - shift` with shift the rounded
    max·scale is not (contracted to a fused multiply-add, the exact product passes the rounded max by up
    to half its ulp, past exp's range once scores reach 2^31). The scale is folded into the exponent so
    the common row needs no separate pass to scale it; scale 1 gives exactly `exp_shifted`."""
    total = shift * 0
    for c in range(seg.shape[0]):
        e = exp_nonpositive((seg[c] - shift) * scale)
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


@njit(inline="always", cache=True, fastmath=FASTMATH)
def online_row(s: Any, m: Any, l: Any, acc: Any, t: int, i0: int, bq: int, j0: int, kl: int, sq: int, left: int,
               right: int, scale: Any, softcap: Any, slopes: Any) -> None:
    """Row t (of n·rows) of one key block of the online softmax: s `[n, rows, cols]` holds raw q·k and
    leaves holding P; m, l `[n, rows]` are the running max (raw q·k for a `plain_row`, else of the
    transformed scores) and sum; acc `[n, rows, D]` is rescaled to the new max. Row r of a group is
    query i0 + r % bq of head r // bq."""
    rows, cols = s.shape[1], s.shape[2]
    g, r = t // rows, t % rows
    i = i0 + r % bq
    row = s[g, r]
    lo, hi = row_window(i, j0, cols, kl, sq, left, right)
    zero_outside(row, lo, hi)
    if lo == hi:
        return
    seg = row[lo:hi]
    slope = slopes[g, r // bq]
    # The common row keeps its max in raw q·k units (max(x·scale) = max(x)·scale for scale > 0): one
    # read-only max pass and the scaling folded into exp, no pass that scales in place (see
    # docs/performance/attention.md, "plain rows"). Every other row keeps the max of its transformed
    # scores (scale 1 below).
    if plain_row(scale, softcap, slope):
        mx = row_max(seg, scale)
        sc = scale
    else:
        mx = transform_row(seg, i + kl - sq, j0 + lo, scale, softcap, slope)
        sc = cast_like(1, scale)
    old = m[g, r]
    new = mx if mx > old else old
    if new == -np.inf:
        seg[:] = 0
        return
    total = exp_scaled(seg, sc, new)
    alpha = exp_nonpositive((old - new) * sc)
    if alpha != 1:
        a = acc[g, r]
        for d in range(a.shape[0]):
            a[d] *= alpha
    m[g, r] = new
    l[g, r] = l[g, r] * alpha + total


@njit(inline="always", cache=True, fastmath=FASTMATH)
def store_row(acc: Any, l: Any, out: Any, i0: int, t: int) -> None:
    """Row t of acc `[n, rows, D]` divided by its sum into out[g, r // bq, i0 + r % bq] in out's storage
    (f32, f64, or bf16 bits rounded once); a row that saw no admissible key (l = 0) becomes 0."""
    rows = acc.shape[1]
    bq = rows // out.shape[1]
    g, r = t // rows, t % rows
    a = acc[g, r]
    o = out[g, r // bq, i0 + r % bq]
    total = l[g, r]
    for k in range(a.shape[0]):
        o[k] = store_as(o, a[k] / total if total > 0 else total * cast_like(0, total))
