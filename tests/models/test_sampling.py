"""The sampler (`fuel.models.sampling.Sampler`) against exact float64 probabilities and transformers' warpers.

The distribution a sampler draws from is softmax(logits / temperature) over the kept tokens, renormalised:
transformers' Temperature, TopK and TopP warpers (in that order, in float64) give the kept set, the
probabilities are computed here in float64, and seeded draws are held to them by a chi-square test;
tokens outside the kept set must never be drawn.

Ties at a cut, which transformers settles otherwise, are fuel's documented rule: equal logits rank the
lower token id first, and both cuts take a prefix of that ranking. So `top_k` keeps exactly k tokens
(transformers' TopK keeps every token equal to the k-th), and a `top_p` cut through equal logits keeps
the lower ids (TopP keeps as many, the higher ids). Temperature 0 is greedy: the first of equal maxima.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from fuel.errors import FuelError, ParamError
from fuel.models.sampling import Sampler

DRAWS = 5000  # per case: a chi-square p-value below ALPHA fails it
ALPHA = 1e-3


def _kept_by_transformers(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The ids transformers' warpers keep (finite scores after them), computed in float64."""
    scores = torch.tensor(logits, dtype=torch.float64)[None]
    ids = torch.zeros((1, 0), dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return np.flatnonzero(torch.isfinite(scores[0]).numpy())


def _exact(logits: np.ndarray, temperature: float, kept: np.ndarray) -> np.ndarray:
    """float64 probabilities over the vocabulary: softmax(logits / temperature) on kept, zero elsewhere."""
    z = np.asarray(logits, np.float64)[kept] / temperature
    w = np.exp(z - z.max())
    p = np.zeros(len(logits))
    p[kept] = w / w.sum()
    return p


def _chi_square_p_value(counts: np.ndarray, p: np.ndarray) -> float:
    """P(chi2 >= statistic) with len(p) - 1 degrees of freedom, over the tokens with p > 0."""
    expected = counts.sum() * p
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = torch.tensor((len(p) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


# (logits, temperature, top_k, top_p): every kept probability is at least 0.4%, so each kept token is
# expected 20 times or more in DRAWS.
CASES: list[tuple[list[float], float, int, float]] = [
    ([0.3, -0.5, 1.2, 0.0], 1.0, 0, 1.0),
    ([0.4, -0.6, 0.9, 0.1, -1.0, 0.7, 0.0, -0.3], 0.5, 0, 1.0),
    (list(np.round(np.random.default_rng(1).standard_normal(16), 3)), 2.0, 0, 1.0),
    ([0.2, 1.5, -0.4, 1.1, 0.9, -2.0, 0.0, 0.6, 1.4, -1.2], 0.7, 3, 1.0),
    ([0.5, 2.0, -1.0, 1.0, 0.2, 1.6, -0.5, 0.8, 0.0, 1.2, -2.0, 0.3], 1.3, 0, 0.8),
    (list(np.round(np.random.default_rng(2).standard_normal(16), 3)), 0.8, 6, 0.9),
]


@pytest.mark.parametrize(("logits", "temperature", "top_k", "top_p"), CASES,
                         ids=["T1", "T0.5", "T2 V16", "top_k 3", "top_p 0.8", "top_k 6 top_p 0.9"])
def test_draws_follow_the_exact_distribution(logits: list[float], temperature: float, top_k: int,
                                             top_p: float) -> None:
    row = np.array(logits)
    kept = _kept_by_transformers(row, temperature, top_k, top_p)
    p = _exact(row, temperature, kept)
    assert p[kept].min() > 0.004
    sampler = Sampler(temperature, top_k, top_p, seed=len(logits) + 1)  # any seed: p-values are uniform over seeds
    counts = np.bincount([sampler(row) for _ in range(DRAWS)], minlength=len(row))
    outside = np.setdiff1d(np.flatnonzero(counts), kept)
    assert outside.size == 0, f"drew tokens {outside.tolist()} outside the kept set {kept.tolist()}"
    p_value = _chi_square_p_value(counts[kept], p[kept])
    assert p_value > ALPHA, f"counts {counts[kept].tolist()} against {np.round(DRAWS * p[kept], 1).tolist()}"


@pytest.mark.parametrize(("logits", "top_k", "top_p", "kept", "theirs"), [
    ([1.0, 3.0, 3.0, 3.0, 0.0], 2, 1.0, [1, 2], [1, 2, 3]),  # TopK keeps every tie with the k-th
    ([0.0, 0.0, 0.0, 0.0], 0, 0.5, [0, 1], [2, 3]),  # 0.25 each: the first two reach 0.5 exactly
    ([2.0, 1.0, 1.0, 1.0, 1.0, -1.0], 0, 0.6, [0, 1, 2], [0, 3, 4]),
], ids=["top_k", "top_p exact", "top_p through ties"])
def test_ties_at_a_cut_keep_the_lower_ids(logits: list[float], top_k: int, top_p: float, kept: list[int],
                                          theirs: list[int]) -> None:
    """The cuts take a prefix of the ranking in which equal logits put the lower id first; the tied tokens
    kept are equally likely."""
    row = np.array(logits)
    assert _kept_by_transformers(row, 1.0, top_k, top_p).tolist() == theirs
    sampler = Sampler(1.0, top_k, top_p, seed=3)
    counts = np.bincount([sampler(row) for _ in range(DRAWS)], minlength=len(row))
    assert np.flatnonzero(counts).tolist() == kept
    p = _exact(row, 1.0, np.array(kept))
    assert _chi_square_p_value(counts[kept], p[kept]) > ALPHA


def _kept_by_fuel(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[list[int], np.ndarray]:
    ids, p = Sampler(temperature, top_k, top_p).distribution(logits)
    return ids.tolist(), p


@given(logits=st.lists(st.one_of(st.integers(-8, 8).map(lambda v: v / 4), st.floats(-6, 6)), min_size=4, max_size=16),
       temperature=st.floats(0.05, 5.0), top_k=st.integers(0, 18), top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)))
def test_kept_set_and_probabilities_match_transformers(logits: list[float], temperature: float, top_k: int,
                                                       top_p: float) -> None:
    """Every cut keeps the tokens transformers' warpers keep once ties are broken by id (each logit lowered
    by 1e-10 · id, far below the gaps between distinct logits), and each kept token's probability is
    softmax(logits / temperature) over the kept ones."""
    row = np.array(logits)
    distinct = np.unique(row)
    assume(len(distinct) == 1 or np.diff(distinct).min() > 1e-6)
    z = np.sort(row)[::-1] / temperature
    cut = np.exp(z - z[0])[:top_k or len(row)]
    cum = np.cumsum(cut / cut.sum())
    assume(top_p == 1.0 or np.abs(cum - top_p).min() > 1e-6)  # a cut decided by rounding is no rule's
    theirs = _kept_by_transformers(row - 1e-10 * np.arange(len(row)), temperature, top_k, top_p)
    ids, p = _kept_by_fuel(row, temperature, top_k, top_p)
    assert sorted(ids) == theirs.tolist()
    want = _exact(row, temperature, np.array(ids))[ids]
    np.testing.assert_allclose(p, want, rtol=1e-12, atol=0)


@given(logits=st.lists(st.integers(-3, 3).map(float), min_size=1, max_size=16), top_k=st.integers(0, 5),
       top_p=st.floats(0.05, 1.0), seed=st.integers(0, 100))
def test_temperature_zero_is_greedy(logits: list[float], top_k: int, top_p: float, seed: int) -> None:
    """The first of equal maxima, whatever the cuts and the seed."""
    row = np.array(logits)
    assert Sampler(0.0, top_k, top_p, seed)(row) == np.flatnonzero(row == row.max())[0]


def test_a_seeded_run_repeats() -> None:
    row = np.array([0.1, 0.4, -0.2, 0.3, 0.0])

    def run(seed: int) -> list[int]:
        sampler = Sampler(0.9, 4, 0.95, seed=seed)
        return [sampler(row) for _ in range(200)]

    first = run(5)
    assert first == run(5) and first != run(6)
    assert set(first) == {0, 1, 3, 4}


def test_masked_tokens_are_never_drawn() -> None:
    """-inf is a masked token: never drawn, the others as softmax over them (transformers' warpers agree)."""
    row = np.array([0.5, -np.inf, 1.0, 0.2, -np.inf, -0.3])
    kept = _kept_by_transformers(row, 0.9, 0, 0.95)
    assert kept.tolist() == [0, 2, 3, 5]
    sampler = Sampler(0.9, 0, 0.95, seed=4)
    counts = np.bincount([sampler(row) for _ in range(DRAWS)], minlength=len(row))
    assert np.flatnonzero(counts).tolist() == kept.tolist()
    assert _chi_square_p_value(counts[kept], _exact(row, 0.9, kept)[kept]) > ALPHA
    assert Sampler()(row) == 2


@pytest.mark.parametrize(("logits", "temperature"), [([0.0, 1.0, 2.0], 1e-310), ([1e308, -1e308, 0.0], 0.5),
                                                     ([-1e308, 1e308, 1e308], 1e-3)], ids=str)
def test_extreme_scales_draw_the_limit(logits: list[float], temperature: float) -> None:
    """Where logits / temperature overflows, the distribution is its limit: all mass on the largest
    logits (the lower id of equal ones after a cut to one)."""
    row = np.array(logits)
    best = np.flatnonzero(row == row.max())
    draws = {Sampler(temperature, 0, 1.0, seed)(row) for seed in range(20)}
    assert draws <= set(best.tolist()) and Sampler(temperature, 1, 1.0, 0)(row) == best[0]


@pytest.mark.parametrize(("logits", "match"), [
    ([0.0, np.nan, 1.0], r"token 1 is nan"), ([0.0, np.inf, 1.0], r"token 1 is inf"),
    ([-np.inf, -np.inf], r"every logit is -inf"), (np.zeros((2, 3)), r"one row of logits.*\[2, 3\]"),
], ids=["nan", "inf", "all masked", "two rows"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logits_no_draw_can_come_from_are_refused(logits: Any, match: str, temperature: float) -> None:
    with pytest.raises(FuelError, match=match):
        Sampler(temperature, seed=0)(np.asarray(logits))
    assert Sampler(temperature, seed=0)(np.zeros((1, 1, 3))) in (0, 1, 2)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"seed": -1}, r"sampler: seed must be None or an int >= 0, got -1"),
    ({"temperature": -0.5}, r"sampler: temperature must be finite and >= 0"),
    ({"temperature": float("nan")}, r"sampler: temperature must be finite and >= 0"),
    ({"top_k": -1}, r"sampler: top_k must be >= 0"),
    ({"top_p": 0.0}, r"sampler: top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"sampler: top_p must be in \(0, 1\]"),
])
def test_parameters_out_of_their_domain_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(FuelError, match=match):
        Sampler(**kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"temperature": "hot"}, r"sampler: temperature .*got 'hot'"),
    ({"temperature": None}, r"sampler: temperature .*got None"),
    ({"temperature": True}, r"sampler: temperature .*got True"),
    ({"top_k": 2.5}, r"sampler: top_k .*an int.*got 2.5"),
    ({"top_k": True}, r"sampler: top_k .*got True"),
    ({"top_p": "x"}, r"sampler: top_p .*got 'x'"),
    ({"seed": 1.5}, r"sampler: seed must be None or an int >= 0, got 1.5"),
    ({"seed": "s"}, r"sampler: seed .*got 's'"),
])
def test_parameters_of_the_wrong_type_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ParamError, match=match):
        Sampler(**kwargs)


def test_numpy_scalars_are_taken_as_python_numbers() -> None:
    s = Sampler(np.float32(0.5), np.int64(3), np.float64(0.25), np.uint8(7))
    assert (s.temperature, s.top_k, s.top_p, s.seed) == (0.5, 3, 0.25, 7)
    assert [type(v) for v in (s.temperature, s.top_k, s.top_p, s.seed)] == [float, int, float, int]
    row = np.linspace(0.0, 1.0, 16)
    assert s(row) == Sampler(0.5, 3, 0.25, 7)(row)
