"""Choosing the next token from a row of logits: greedy, or sampled with temperature, top-k and top-p."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuel.errors import ParamError, ShapeError


def is_int(v: Any) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def is_real(v: Any) -> bool:
    """A Python or NumPy integer or float, not a bool."""
    return isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool)


@dataclass(frozen=True)
class Sampler:
    """`temperature == 0` is greedy (the first of equal maxima). Otherwise the logits are divided by
    the temperature, cut to the `top_k` largest (0: all), then to the smallest set whose probability
    reaches `top_p` (1.0: all), and one token is drawn from what is left with a generator seeded by
    `seed`, so a seeded run repeats exactly. Both cuts take a prefix of the ranking in which equal
    logits put the lower id first: a cut through ties keeps the lower ids, and `top_k` exactly k."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        """The one check of the arguments (`generate` and the CLI build their Sampler here): type and
        domain, each a ParamError naming it; NumPy scalars are kept as Python's."""
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        if not is_real(t) or not math.isfinite(t) or t < 0:
            raise ParamError(f"sampler: temperature must be finite and >= 0 (a real; 0: greedy), got {t!r}")
        if not is_int(k) or k < 0:
            raise ParamError(f"sampler: top_k must be >= 0 (an int; 0 keeps every token), got {k!r}")
        if not is_real(p) or not 0.0 < p <= 1.0:
            raise ParamError(f"sampler: top_p must be in (0, 1] (a real), got {p!r}")
        if seed is not None and (not is_int(seed) or seed < 0):
            raise ParamError(f"sampler: seed must be None or an int >= 0, got {seed!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "seed", None if seed is None else int(seed))
        object.__setattr__(self, "_rng", np.random.default_rng(self.seed))

    def __call__(self, logits: np.ndarray) -> int:
        """A token id from one row of logits ([V], or [1, ..., 1, V]); each logit finite or -inf (a masked
        token, never drawn), not all -inf."""
        a = np.asarray(logits, dtype=np.float64)
        if a.ndim > 1 and a.size != a.shape[-1]:
            raise ShapeError(f"sampler: expected one row of logits [V], got shape {list(a.shape)}")
        row = a.reshape(-1)
        if row.size == 0:
            raise ParamError("sampler: empty logits")
        bad = np.flatnonzero(np.isnan(row) | (row == np.inf))
        if bad.size:
            raise ParamError(f"sampler: logits must be finite or -inf (masked); token {bad[0]} is {row[bad[0]]}")
        if not (row > -np.inf).any():
            raise ParamError(f"sampler: every logit is -inf ({row.size} tokens): there is no token to draw")
        if self.temperature == 0.0:
            return int(np.argmax(row))
        order = np.argsort(-row, kind="stable")  # most likely first; ties keep the lower id first
        if self.top_k:
            order = order[:self.top_k]
        with np.errstate(over="ignore"):  # z <= 0 (the largest is finite): an overflow is -inf, weight 0
            z = (row[order] - row[order[0]]) / self.temperature
        p = np.exp(z)
        p /= p.sum()
        if self.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), self.top_p)) + 1  # the smallest prefix reaching top_p
            order, p = order[:keep], p[:keep] / p[:keep].sum()
        rng: np.random.Generator = self._rng  # type: ignore[attr-defined]
        return int(order[rng.choice(order.size, p=p)])
