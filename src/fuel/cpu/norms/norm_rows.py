"""Row functions of RmsNorm (3), LayerNorm (4) and their backwards (9, 8), for rms_norm_last_dim and
layer_norm_last_dim.

A row is walked in a fixed order by one thread, so results are bit-stable; it is read from memory
once and the later passes over it hit cache. f32 and f64 share these generic functions (the
scalars passed in carry the working type); bf16 rows arrive widened to f32. LayerNorm compensates
the rounding of its mean (see _ln_centre).

Huge rows: the fast path accumulates squares in the working type, which overflows from about 1e19
(f32, bf16) or 1e154 (f64) although the normalised answer is perfectly representable. Each row
checks its sums of squares (one scalar test per row; the backwards also sum g², in a pass they
make anyway, to bound g). A row whose sums are not finite is flagged and redone by `*_rescaled`:
its inputs are scaled by powers of two (exact) so that their largest magnitude lies in [0.5, 1),
eps by the square of that factor, and a backward's result is scaled back at the end. Rows holding
NaN or ±inf keep the fast path's IEEE result.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit

# Reassociation lets the row sums vectorise (one fixed order per build: still bit-stable);
# no nnan/ninf, so NaN and inf keep IEEE behaviour (the overflow checks rely on that).
FASTMATH = {"nsz", "reassoc", "contract", "arcp"}


# ---- reductions --------------------------------------------------------------------------------
# Only the reductions may reassociate (so they vectorise); they are separate, non-inlined
# functions so their fastmath flags stay on their own instructions. The elementwise passes use
# strict IEEE order: with reassociation LLVM may fold the compensated `(x - mu) - c` back into
# `x - (mu + c)`, which is exactly the rounding the compensation exists to avoid.


@njit(cache=True, fastmath=FASTMATH)
def _sum(x: Any, zero: Any) -> Any:
    s = zero
    for j in range(x.shape[0]):
        s += x[j]
    return s


@njit(cache=True, fastmath=FASTMATH)
def _sum_sq(x: Any, zero: Any) -> Any:
    s = zero
    for j in range(x.shape[0]):
        s += x[j] * x[j]
    return s


@njit(cache=True, fastmath=FASTMATH)
def _sums_1_2(d: Any, zero: Any) -> tuple[Any, Any]:
    """(Σd, Σd²)."""
    s = zero
    ss = zero
    for j in range(d.shape[0]):
        s += d[j]
        ss += d[j] * d[j]
    return s, ss


@njit(cache=True, fastmath=FASTMATH)
def _sums_dot(a: Any, b: Any, zero: Any) -> tuple[Any, Any, Any]:
    """(Σa·a, Σa·b, Σb·b)."""
    aa = zero
    ab = zero
    bb = zero
    for j in range(a.shape[0]):
        aa += a[j] * a[j]
        ab += a[j] * b[j]
        bb += b[j] * b[j]
    return aa, ab, bb


@njit(cache=True, fastmath=FASTMATH)
def _sum_and_dot(a: Any, b: Any, zero: Any) -> tuple[Any, Any, Any]:
    """(Σb, Σa·b, Σb·b)."""
    s = zero
    ab = zero
    bb = zero
    for j in range(a.shape[0]):
        s += b[j]
        ab += a[j] * b[j]
        bb += b[j] * b[j]
    return s, ab, bb


# ---- power-of-two rescaling (only the overflow fallback uses these) ---------------------------


@njit(cache=True)
def _scale_into(x: Any, o: Any) -> int:
    """o <- x·2^-k with k >= 0 the least that brings max|x| below 1; returns k, or -1 (o untouched)
    when x holds NaN or ±inf. Scaling by a power of two is exact (only values falling into the
    subnormals round, and those are negligible next to the row's maximum)."""
    m = 0.0
    for j in range(x.shape[0]):
        a = abs(x[j])
        if a > m or a != a:  # a NaN sticks
            m = a
    if not math.isfinite(m):
        return -1
    k = max(math.frexp(m)[1], 0)
    s = math.ldexp(1.0, -k)
    for j in range(x.shape[0]):
        o[j] = x[j] * s
    return k


@njit(cache=True)
def _scaled_eps(eps: Any, k: int, like: Any) -> Any:
    """eps·2^-2k rounded once to the working type of the row `like` (it may underflow: it is then
    negligible next to the rescaled row's mean square, which is at least 1/(4n))."""
    t = np.empty(1, like.dtype)
    t[0] = math.ldexp(float(eps), -2 * k)
    return t[0]


@njit(cache=True)
def _times_pow2(o: Any, k: int) -> None:
    """o <- o·2^k, rounded once (ldexp handles results that overflow or fall into the subnormals)."""
    if k != 0:
        for j in range(o.shape[0]):
            o[j] = math.ldexp(o[j], k)


@njit(cache=True)
def _constant(x: Any) -> bool:
    j = 1
    while j < x.shape[0] and x[j] == x[0]:
        j += 1
    return j >= x.shape[0]


# ---- rows (generic over f32/f64: the scalars eps, inv_n and one carry the working type) ------


@njit(inline="always", cache=True)
def _rms_apply(x: Any, o: Any, ss: Any, eps: Any, inv_n: Any, one: Any) -> None:
    r = one / np.sqrt(ss * inv_n + eps)
    for j in range(x.shape[0]):
        o[j] = x[j] * r


@njit(inline="always", cache=True)
def rms_row(x: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> bool:
    """False (o untouched) when Σx² overflowed."""
    ss = _sum_sq(x, one - one)  # (a literal 0 would widen f32 to f64)
    if not math.isfinite(ss):
        return False
    _rms_apply(x, o, ss, eps, inv_n, one)
    return True


@njit(cache=True)
def rms_row_rescaled(x: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> None:
    k = _scale_into(x, o)
    if k < 0:
        _rms_apply(x, o, _sum_sq(x, one - one), eps, inv_n, one)
    else:  # x/rms(x) is unchanged when x and sqrt(eps) are scaled alike
        _rms_apply(o, o, _sum_sq(o, one - one), _scaled_eps(eps, k, o), inv_n, one)


@njit(inline="always", cache=True)
def _ln_centre(x: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> tuple[Any, Any, bool]:
    """o <- x − μ (μ = Σx·inv_n, rounded); returns (c, r, ok): the true centred row is o − c,
    r = 1/sqrt(var + eps), and ok is False when Σ(x − μ)² overflowed (then c and r are garbage).
    c = Σ(x − μ)/n recovers what rounding μ lost, so a row with a large offset (|μ| ≫ std) keeps
    full precision. (x may be o.)"""
    n = x.shape[0]
    mu = _sum(x, one - one) * inv_n
    for j in range(n):
        o[j] = x[j] - mu
    sd, sdd = _sums_1_2(o, one - one)
    c = sd * inv_n
    var = (sdd - sd * c) * inv_n
    var = var if var > 0 else one - one  # the correction can round a zero variance below 0
    return c, one / np.sqrt(var + eps), math.isfinite(sdd)


@njit(inline="always", cache=True)
def _ln_finish(o: Any, c: Any, r: Any) -> None:
    for j in range(o.shape[0]):
        o[j] = (o[j] - c) * r


@njit(inline="always", cache=True)
def ln_row(x: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> bool:
    """False (o garbage) when Σ(x − μ)² overflowed."""
    c, r, ok = _ln_centre(x, o, eps, inv_n, one)
    if ok:
        _ln_finish(o, c, r)
    return ok


@njit(cache=True)
def ln_row_rescaled(x: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> None:
    k = _scale_into(x, o)
    if k < 0:
        c, r, _ = _ln_centre(x, o, eps, inv_n, one)
    elif _constant(x):
        # x − mean(x) is exactly 0; the rescaled sums would leave rounding noise over an eps that
        # underflowed.
        c, r = one - one, one - one
    else:
        c, r, _ = _ln_centre(o, o, _scaled_eps(eps, k, o), inv_n, one)
    _ln_finish(o, c, r)


@njit(inline="always", cache=True)
def ln_bwd_row(x: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any, check: bool) -> bool:
    """o = r·((g − mean g) − y·mean(g·y)), y = (x − μ)·r (kept in o between the passes). With
    `check`, returns False as soon as a sum is not finite (o is then garbage). (x may be o.)"""
    n = x.shape[0]
    c, r, ok = _ln_centre(x, o, eps, inv_n, one)
    if check and not ok:
        return False
    _ln_finish(o, c, r)
    sg, sgy, sgg = _sum_and_dot(o, g, one - one)
    # Σg² finite bounds |g| by sqrt(max float): no later product overflows unless the answer does.
    if check and not math.isfinite(sgg):
        return False
    mg = sg * inv_n
    mgy = sgy * inv_n
    for j in range(n):
        o[j] = r * ((g[j] - mg) - o[j] * mgy)
    return True


@njit(cache=True)
def ln_bwd_row_rescaled(x: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> None:
    """dx(x, g) = 2^(kg−kx)·dx(x·2^-kx, g·2^-kg) with eps scaled by 2^-2kx (dx is linear in g and
    scales as 1/std)."""
    gs = np.empty(g.shape[0], o.dtype)
    kg = _scale_into(g, gs)
    kx = _scale_into(x, o)
    if kg < 0 or kx < 0:
        ln_bwd_row(x, g, o, eps, inv_n, one, False)
        return
    if _constant(x):
        # y = 0 exactly: dx = (g − mean g)/sqrt(eps), where eps must not be rescaled away.
        mg = _sum(gs, one - one) * inv_n
        r = one / np.sqrt(eps)
        for j in range(o.shape[0]):
            o[j] = (gs[j] - mg) * r
        _times_pow2(o, kg)
    else:
        ln_bwd_row(o, gs, o, _scaled_eps(eps, kx, o), inv_n, one, False)
        _times_pow2(o, kg - kx)


@njit(inline="always", cache=True)
def rms_bwd_row(x: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any, check: bool) -> bool:
    """o = r·(g − x·Σ(g·x)/(n·den)), den = mean(x²) + eps, r = 1/sqrt(den). With `check`, returns
    False when Σx² or Σg² is not finite (o untouched). (x may be o.)"""
    n = x.shape[0]
    ss, sgx, sgg = _sums_dot(x, g, one - one)
    # Both finite bound |x| and |g| by sqrt(max float), so Σ(g·x) and every later product are too.
    if check and not (math.isfinite(ss) and math.isfinite(sgg)):
        return False
    den = ss * inv_n + eps
    r = one / np.sqrt(den)
    if n == 1:
        # The general form cancels g·x² against x·(g·x) and keeps only rounding noise; for one
        # element it is exactly g·eps/den^1.5.
        o[0] = g[0] * (eps / den) * r
        return True
    coeff = sgx * inv_n / den
    for j in range(n):
        o[j] = r * (g[j] - x[j] * coeff)
    return True


@njit(cache=True)
def _rms_bwd_one(x: float, g: float, eps: float) -> float:
    """g·eps/(x² + eps)^1.5 without overflow or premature underflow: every factor's exponent is
    taken out by frexp (x and sqrt(eps) by that of the larger, so the rescaled den is in [1/4, 2])
    and put back once by ldexp."""
    ep = math.frexp(max(abs(x), math.sqrt(eps)))[1]
    xs = math.ldexp(x, -ep)
    den = xs * xs + math.ldexp(eps, -2 * ep)
    gm, ge = math.frexp(g)
    em, ee = math.frexp(eps)
    return math.ldexp(gm * em / (den * math.sqrt(den)), ge + ee - 3 * ep)


@njit(cache=True)
def rms_bwd_row_rescaled(x: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> None:
    """dx(x, g) = 2^(kg−kx)·dx(x·2^-kx, g·2^-kg) with eps scaled by 2^-2kx."""
    gs = np.empty(g.shape[0], o.dtype)
    kg = _scale_into(g, gs)
    kx = _scale_into(x, o)
    if kg < 0 or kx < 0:
        rms_bwd_row(x, g, o, eps, inv_n, one, False)
    elif x.shape[0] == 1:  # its eps term is all there is, so eps must not underflow
        o[0] = _rms_bwd_one(float(x[0]), float(g[0]), float(eps))
    else:
        rms_bwd_row(o, gs, o, _scaled_eps(eps, kx, o), inv_n, one, False)
        _times_pow2(o, kg - kx)
