"""Choosing the next token from a row of logits, per request: `Sampler` (shared by `fuel generate`,
`LLM.generate` and `fuel serve`) with OpenAI's and vLLM's sampling parameters.

One call runs these steps, in this order, on a float64 copy of the logits (the caller's array is
never written):

1. `logit_bias`: bias[j] is added to logit j (OpenAI's `logit_bias`).
2. `repetition_penalty` r (HF's and vLLM's), over every id in `history` (prompt and generated): a
   positive logit is divided by r, any other multiplied by it, once per distinct id.
3. `frequency_penalty` f and `presence_penalty` p (OpenAI's), over the GENERATED ids only
   (`history[prompt_len:]`): logit j -= c[j] * f + (c[j] > 0) * p, c[j] the count of j.
4. `mask` (structured output): a disallowed token's logit becomes -inf.
   These four give the *processed logits*. Arithmetic that overflows float64 saturates at its largest
   finite value: a finite logit never becomes infinite, so it is never masked by rounding.
5. `temperature == 0`: the argmax of the processed logits, the lowest id of equal maxima. Otherwise
   z = processed / temperature, cut to the `top_k` largest (0: all), then to the smallest set whose
   probability reaches `top_p` (1.0: all), then to the tokens whose probability is at least `min_p`
   times the largest's (0.0: all), and one token drawn from softmax(z) over what is left. The cuts are
   transformers' TopK, TopP and MinP warpers in that order, except at ties: `top_k` and `top_p` take a
   prefix of the ranking in which equal logits put the lower id first, so `top_k` keeps exactly k.

The logprobs a `Choice` reports are the log-softmax of the processed logits (after step 4), before the
temperature and the cuts. So they describe the distribution the request chose from as its bias,
penalties and grammar shaped it, and not the sampling knobs: a greedy and a sampled request with the
same prefix report the same numbers, every token the model could emit has a finite logprob (a token
cut by top_k, top_p or min_p is not -inf), and a token the mask forbids never appears among them.

Each Sampler draws with its own NumPy generator seeded by `seed`: a seeded Sampler's draws depend only
on its own calls (one uniform per sampled call, none for greedy), so a request's tokens never depend
on other requests. A Sampler is built per request; every argument is checked when it is built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from fuel.errors import DTypeError, IndexOutOfRange, ParamError, ShapeError

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
_BIG = np.finfo(np.float64).max


def is_int(v: Any) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def is_real(v: Any) -> bool:
    """A Python or NumPy integer or float, not a bool."""
    return isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool)


@dataclass(frozen=True)
class Choice:
    """The token chosen, its logprob, and the `top_logprobs` most likely tokens as (id, logprob), most
    likely first (equal logprobs: lower id first), tokens of logprob -inf (masked) left out. The logprobs
    are the log-softmax of the processed logits (module doc)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _real(name: str, v: Any, low: float, high: float, what: str, low_open: bool = False) -> float:
    """`v` as a float, if a real within [low, high] ((low, high] if `low_open`); else a ParamError."""
    if (not is_real(v) or not math.isfinite(v) or v < low or v > high or (low_open and v == low)):
        raise ParamError(f"sampler: {name} must be {what}, got {v!r}")
    return float(v)


def _bias_arrays(bias: Any) -> tuple[Mapping[int, float] | None, np.ndarray, np.ndarray]:
    """A read-only copy of `logit_bias` and its ids and values as arrays; each id an int >= 0, each
    bias a real in [-100, 100]."""
    if bias is None:
        return None, np.zeros(0, np.int64), np.zeros(0)
    if not isinstance(bias, Mapping):
        raise ParamError(f"sampler: logit_bias must be None or a mapping of token id to bias, got {bias!r}")
    copy: dict[int, float] = {}
    for k, v in bias.items():
        if not is_int(k) or k < 0:
            raise ParamError(f"sampler: logit_bias keys must be token ids (ints >= 0), got {k!r}")
        copy[int(k)] = _real(f"logit_bias[{k}]", v, -100.0, 100.0, "a real in [-100, 100]")
    ids = np.fromiter(copy.keys(), np.int64, len(copy))
    return MappingProxyType(copy), ids, np.fromiter(copy.values(), np.float64, len(copy))


def _ranked_top(v: np.ndarray, m: int) -> np.ndarray:
    """Indices of the m largest of `v`, largest first, equal values by lower index first: a prefix of the
    stable descending ranking, found with partitions (O(n)) and a sort of the m kept only."""
    n = v.size
    if m <= 0:
        return np.zeros(0, np.int64)
    if m >= n:
        return np.argsort(-v, kind="stable")
    if 64 * m <= n:  # the m-th largest of every 8th value bounds a candidate set of about 8m from below;
        s = v[::8]   # it holds the m largest of v, since the sample's m largest are >= it
        cand = np.flatnonzero(v >= np.partition(s, s.size - m)[s.size - m])
        if cand.size < n // 2:
            return cand[_ranked_top(v[cand], m)]
    kth = np.partition(v, n - m)[n - m]  # the m-th largest
    above = np.flatnonzero(v > kth)
    idx = np.concatenate([above, np.flatnonzero(v == kth)[:m - above.size]])
    return idx[np.argsort(-v[idx], kind="stable")]


def _nucleus(v: np.ndarray, w: np.ndarray, top_p: float) -> np.ndarray:
    """Indices (ascending) of the smallest prefix of `v`'s ranking whose weights `w` (increasing with v)
    reach `top_p` of their sum. The ranking is built a growing prefix at a time: a peaked distribution
    never sorts the whole row."""
    n, total, m = v.size, w.sum(), min(v.size, 64)
    while True:
        top = _ranked_top(v, m)
        cum = np.cumsum(w[top]) / total
        if m == n or cum[-1] >= top_p:
            return np.sort(top[:min(int(np.searchsorted(cum, top_p)) + 1, m)])
        m = min(n, m * 8)


@dataclass(frozen=True)
class Sampler:
    """The sampling parameters of one request and its generator (module doc: the order of the steps).

    `temperature` >= 0 (0: greedy); `top_k` >= 0 (0: all); `top_p` in (0, 1]; `seed` None or >= 0;
    `min_p` in [0, 1]; `presence_penalty` and `frequency_penalty` in [-2, 2]; `repetition_penalty` > 0
    (1: none); `logit_bias` None or {token id: bias in [-100, 100]} (kept as a read-only copy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        """The one check of the arguments (`generate`, the CLI and the server build their Sampler here):
        type and domain, each a ParamError naming the argument and the value; NumPy scalars are kept as
        Python's."""
        k, seed = self.top_k, self.seed
        t = _real("temperature", self.temperature, 0.0, math.inf, "finite and >= 0 (a real; 0: greedy)")
        if not is_int(k) or k < 0:
            raise ParamError(f"sampler: top_k must be >= 0 (an int; 0 keeps every token), got {k!r}")
        p = _real("top_p", self.top_p, 0.0, 1.0, "in (0, 1] (a real)", low_open=True)
        if seed is not None and (not is_int(seed) or seed < 0):
            raise ParamError(f"sampler: seed must be None or an int >= 0, got {seed!r}")
        values = {"temperature": t, "top_k": int(k), "top_p": p, "seed": None if seed is None else int(seed),
                  "min_p": _real("min_p", self.min_p, 0.0, 1.0, "in [0, 1] (a real; 0: no cut)"),
                  "presence_penalty": _real("presence_penalty", self.presence_penalty, -2.0, 2.0,
                                            "in [-2, 2] (a real)"),
                  "frequency_penalty": _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0,
                                             "in [-2, 2] (a real)"),
                  "repetition_penalty": _real("repetition_penalty", self.repetition_penalty, 0.0, math.inf,
                                              "finite and > 0 (a real; 1: none)", low_open=True)}
        bias, bias_ids, bias_values = _bias_arrays(self.logit_bias)
        for name, v in {**values, "logit_bias": bias}.items():
            object.__setattr__(self, name, v)
        object.__setattr__(self, "_bias", (bias_ids, bias_values))
        object.__setattr__(self, "_rng", np.random.default_rng(self.seed))

    def __call__(self, logits: np.ndarray, history: Sequence[int] | np.ndarray = (), *, prompt_len: int = 0,
                 mask: np.ndarray | None = None) -> int:
        """A token id from one row of logits ([V], or [1, ..., 1, V]); each logit finite or -inf (a masked
        token, never chosen). `history`: the prompt's ids then the generated ones, `prompt_len` of them
        the prompt's; `mask`: None or a bool array [V], True where a token is allowed."""
        return self._choose(logits, history, prompt_len, mask, None).token

    def choose(self, logits: np.ndarray, history: Sequence[int] | np.ndarray = (), *, prompt_len: int = 0,
               mask: np.ndarray | None = None, top_logprobs: int = 0) -> Choice:
        """As calling the sampler, with the chosen token's logprob and the `top_logprobs` (0..20) most
        likely tokens' (`Choice`)."""
        if not is_int(top_logprobs) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ParamError(f"sampler: top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}")
        return self._choose(logits, history, prompt_len, mask, int(top_logprobs))

    # ---- the steps -------------------------------------------------------------------------------------

    def _choose(self, logits: Any, history: Any, prompt_len: Any, mask: Any, top: int | None) -> Choice:
        x = self.processed(logits, history, prompt_len=prompt_len, mask=mask)
        token = int(np.argmax(x)) if self.temperature == 0.0 else self._draw(x)
        if top is None:
            return Choice(token, math.nan)
        hi = x.max()
        with np.errstate(over="ignore"):  # x - hi may overflow to -inf (|x| near the float's limit): weight 0
            lse = float(hi + np.log(np.exp(x - hi).sum()))
        best = _ranked_top(x, top)
        best = best[x[best] > -np.inf]
        return Choice(token, float(x[token] - lse), tuple((int(i), float(x[i] - lse)) for i in best))

    def processed(self, logits: Any, history: Sequence[int] | np.ndarray = (), *, prompt_len: int = 0,
                  mask: np.ndarray | None = None) -> np.ndarray:
        """The processed logits (steps 1-4 of the module doc) as a new float64 array [V], every argument
        checked: at least one token is left with a finite logit."""
        x = _row(logits)
        n = x.size
        ids, values = self._bias  # type: ignore[attr-defined]
        if ids.size:
            if ids.max() >= n:
                raise IndexOutOfRange(f"sampler: logit_bias names token {int(ids.max())}, outside the "
                                      f"vocabulary of {n} tokens")
            x[ids] += values
        hist = _history(history, n)
        if not is_int(prompt_len) or not 0 <= prompt_len <= hist.size:
            raise ParamError(f"sampler: prompt_len must be an int in [0, {hist.size}] (the history's length), "
                             f"got {prompt_len!r}")
        if self.repetition_penalty != 1.0 and hist.size:
            seen = np.unique(hist)
            s, r = x[seen], self.repetition_penalty
            with np.errstate(over="ignore"):
                x[seen] = np.where(s > 0, s / r, s * r)
            x[seen] = np.where(np.isfinite(s), np.clip(x[seen], -_BIG, _BIG), s)  # saturate, keep -inf
        if (self.frequency_penalty or self.presence_penalty) and hist.size > prompt_len:
            gen, counts = np.unique(hist[prompt_len:], return_counts=True)
            x[gen] -= counts * self.frequency_penalty + self.presence_penalty  # |shift| < 1e6: cannot overflow
        if mask is not None:
            allowed = _mask(mask, n)
            x[~allowed] = -np.inf
        if not (x > -np.inf).any():
            raise ParamError(f"sampler: every token the mask allows has logit -inf ({n} tokens): "
                             "there is no token to choose")
        return x

    def distribution(self, logits: Any, history: Sequence[int] | np.ndarray = (), *, prompt_len: int = 0,
                     mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """What a call draws from: the ids it can choose (ascending) and their probabilities (float64,
        summing to 1); greedy: the argmax alone."""
        x = self.processed(logits, history, prompt_len=prompt_len, mask=mask)
        if self.temperature == 0.0:
            return np.array([np.argmax(x)]), np.ones(1)
        ids, w = self._kept(x)
        return ids, w / w.sum()

    def _kept(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids (ascending) that step 5 keeps from the processed logits `x`, and their weights
        exp((x - max) / temperature), each > 0."""
        ids = np.arange(x.size) if not 0 < self.top_k < x.size else np.sort(_ranked_top(x, self.top_k))
        v = x[ids] if ids.size < x.size else x
        with np.errstate(over="ignore"):  # z <= 0 (the largest is finite): an overflow is -inf, weight 0
            w = np.exp((v - v.max()) / self.temperature)
        keep = _nucleus(v, w, self.top_p) if self.top_p < 1.0 else None
        if self.min_p > 0.0:  # the largest weight is exp(0) = 1: min_p of it is min_p
            keep = np.flatnonzero(w >= self.min_p) if keep is None else keep[w[keep] >= self.min_p]
        keep = np.flatnonzero(w > 0.0) if keep is None else keep[w[keep] > 0.0]
        return ids[keep], w[keep]

    def _draw(self, x: np.ndarray) -> int:
        """A draw from the processed logits `x` (step 5 with temperature > 0): one uniform from the
        generator, inverted through the kept tokens' cumulative weights in id order."""
        ids, w = self._kept(x)
        c = np.cumsum(w)
        rng: np.random.Generator = self._rng  # type: ignore[attr-defined]
        j = int(np.searchsorted(c, rng.random() * c[-1], side="right"))
        return int(ids[min(j, ids.size - 1)])


def _row(logits: Any) -> np.ndarray:
    """One row of logits as a new float64 array [V]: each finite or -inf, not all -inf."""
    a = np.array(logits, dtype=np.float64)  # a copy: the caller's logits are never written
    if a.ndim > 1 and a.size != a.shape[-1]:
        raise ShapeError(f"sampler: expected one row of logits [V], got shape {list(a.shape)}")
    row = a.reshape(-1)
    if row.size == 0:
        raise ParamError("sampler: empty logits")
    if not (row < np.inf).all():  # nan compares false
        bad = np.flatnonzero(~(row < np.inf))[0]
        raise ParamError(f"sampler: logits must be finite or -inf (masked); token {bad} is {row[bad]}")
    if not (row > -np.inf).any():
        raise ParamError(f"sampler: every logit is -inf ({row.size} tokens): there is no token to draw")
    return row


def _history(history: Any, n: int) -> np.ndarray:
    """The history as int64 ids [L], each in [0, n)."""
    h = history if isinstance(history, np.ndarray) else np.asarray(history)
    if h.size == 0:
        return np.zeros(0, np.int64)
    if h.ndim != 1 or h.dtype.kind not in "iu":
        raise ParamError(f"sampler: history must be a flat sequence of token ids (ints), got an array of "
                         f"{h.dtype} and shape {list(h.shape)}")
    lo, hi = int(h.min()), int(h.max())
    if lo < 0 or hi >= n:
        raise IndexOutOfRange(f"sampler: history holds token {lo if lo < 0 else hi}, outside the vocabulary "
                              f"of {n} tokens")
    return h.astype(np.int64, copy=False)


def _mask(mask: Any, n: int) -> np.ndarray:
    """The allowed-token mask as a bool array [n], allowing at least one token."""
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        raise DTypeError(f"sampler: mask must be a bool array (True: allowed), got dtype {m.dtype}")
    if m.shape != (n,):
        raise ShapeError(f"sampler: mask must have shape [{n}] (one per logit), got {list(m.shape)}")
    if not m.any():
        raise ParamError(f"sampler: the mask allows none of the {n} tokens: there is no token to choose")
    return m
