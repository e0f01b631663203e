"""Reference for FusedSoftmaxCrossEntropy (17): float64 log-sum-exp minus the target logit."""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.errors import IndexOutOfRange
from fuel.graph.registry.fused_softmax_cross_entropy import FusedSoftmaxCrossEntropyParams as Params
from fuel.testing.reference import Case, randn, register


def _rows(xs: list[np.ndarray], params: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logits as [rows, V], flat targets, flat mask of the rows that count), targets checked."""
    x, t = xs
    v = x.shape[-1]
    flat_t = t.reshape(-1).astype(np.int64)
    valid = flat_t != params.ignore_index
    bad = valid & ((flat_t < 0) | (flat_t >= v))
    if bad.any():
        raise IndexOutOfRange(f"cross-entropy reference: target {int(flat_t[bad][0])} out of range [0, {v})")
    return x.reshape(flat_t.size, v), flat_t, valid


def _reduce(per_row: np.ndarray, valid: np.ndarray, shape: tuple[int, ...], params: Any) -> np.ndarray:
    if params.reduction == "none":
        return per_row.reshape(shape)
    total = float(np.sum(per_row))
    if params.reduction == "mean":
        n = int(np.count_nonzero(valid))
        total = total / n if n else 0.0
    return np.array(total)


def cross_entropy64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    """Per row (max − x_t) + log1p((e_t − 1) + Σ_{j≠t} e_j) with e = exp(x − max): a loss near 0 (the
    target holding nearly all the mass) keeps its relative accuracy."""
    x, flat_t, valid = _rows(xs, params)
    loss = np.zeros(flat_t.size)
    if valid.any():
        xv, tv = x[valid], flat_t[valid]
        at = np.arange(tv.size)
        m = xv.max(-1, keepdims=True)
        with np.errstate(invalid="ignore", over="ignore"):
            e = np.exp(xv - m)
            et = e[at, tv]
            e[at, tv] = 0.0
            loss[valid] = (m[:, 0] - xv[at, tv]) + np.log1p((et - 1.0) + e.sum(-1))
    return _reduce(loss, valid, xs[1].shape, params)


def cross_entropy_scale(xs: list[np.ndarray], params: Any, ref: np.ndarray) -> np.ndarray:
    """Per row 1 + Σ_j softmax_j·|x_j − max| (0 at ignored rows), summed or averaged as the output is:
    the size of the log-sum-exp's absolute error from rounding x − max and from the exp."""
    x, flat_t, valid = _rows(xs, params)
    s = np.zeros(flat_t.size)
    if valid.any():
        xv = x[valid]
        with np.errstate(invalid="ignore", over="ignore"):
            d = xv - xv.max(-1, keepdims=True)
            p = np.exp(d) / np.exp(d).sum(-1, keepdims=True)
            s[valid] = 1.0 + np.nan_to_num(np.sum(p * np.abs(d), -1))
    return _reduce(s, valid, xs[1].shape, params)


def targets_for(rng: np.random.Generator, shape: tuple[int, ...], v: int, ignore: int | None = None,
                frac: float = 0.25) -> np.ndarray:
    """Class ids in [0, v), with about `frac` of them set to `ignore` (when given)."""
    t = rng.integers(0, max(v, 1), shape, dtype=np.int64)
    if ignore is not None:
        t[rng.random(shape) < frac] = ignore
    return t


def _cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    dt = dtypes[0]
    out = []
    # The first three (one per reduction, nothing empty) are the ones the gradient test checks.
    for label, shape, red, ii, sc in [
        ("mean, some ignored", (7, 33), "mean", -100, 3.0),
        ("sum, ignore a class id", (2, 3, 64), "sum", 3, 3.0),
        ("none", (3, 1000), "none", -100, 3.0),
        ("mean, rank-1 logits", (40,), "mean", -100, 2.0),
        ("none, V=1", (5, 1), "none", -100, 1.0),
        ("mean, zero rows", (0, 8), "mean", -100, 1.0),
        ("sum, wide range", (4, 257), "sum", -100, 30.0),
        ("none, wide range", (6, 129), "none", -100, 30.0),
        ("mean, 32k vocabulary", (2, 32000), "mean", -100, 3.0),
    ]:
        x = randn(rng, shape, dt, sc)
        t = targets_for(rng, shape[:-1], shape[-1], ii)
        out.append(Case(f"{label} {list(shape)}", (x, t), Params(red, ii)))
    x = randn(rng, (3, 9), dt)
    for red in ("mean", "sum", "none"):
        out.append(Case(f"{red}, all ignored", (x, np.full(3, -100, np.int64)), Params(red, -100)))
    return out


register("FusedSoftmaxCrossEntropy", cross_entropy64, _cases, cross_entropy_scale)
