"""The per-request steps of `fuel.models.sampling.Sampler` (the server's and `fuel generate`'s): logit_bias,
the repetition, presence and frequency penalties, the allowed-token mask, min_p and the logprobs of `choose`.

The oracle of the processed logits is written in torch from the documents: logit_bias added, transformers'
RepetitionPenaltyLogitsProcessor over prompt + generated ids, OpenAI's presence/frequency formula over the
generated ids (logit[j] -= c[j] * frequency + (c[j] > 0) * presence), the mask as -inf. The kept set and
probabilities are then transformers' warpers (Temperature, TopK, TopP, MinP, in that order), in float64 on
float32 logits, with ties broken by id as in tests/models/test_sampling.py.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from fuel.errors import DTypeError, FuelError, IndexOutOfRange, ParamError, ShapeError
from fuel.models.sampling import Sampler, _ranked_top
from tests.models.test_sampling import ALPHA, DRAWS, _chi_square_p_value


def _processed_by_torch(logits: np.ndarray, history: list[int], prompt_len: int, s: Sampler,
                        mask: np.ndarray | None) -> torch.Tensor:
    scores = torch.tensor(logits, dtype=torch.float64)[None]
    for j, b in (s.logit_bias or {}).items():
        scores[0, j] += b
    if history:
        scores = RepetitionPenaltyLogitsProcessor(s.repetition_penalty)(torch.tensor([history]), scores)
    c = torch.bincount(torch.tensor(history[prompt_len:], dtype=torch.long), minlength=len(logits)).double()
    scores = scores - (c * s.frequency_penalty + (c > 0).double() * s.presence_penalty)  # OpenAI's formula
    if mask is not None:
        scores = scores.masked_fill(~torch.tensor(mask)[None], -math.inf)
    return scores


def _warped_by_transformers(scores: torch.Tensor, s: Sampler) -> torch.Tensor:
    ids = torch.zeros((1, 0), dtype=torch.long)
    scores = TemperatureLogitsWarper(s.temperature)(ids, scores)
    if s.top_k:
        scores = TopKLogitsWarper(s.top_k)(ids, scores)
    if s.top_p < 1.0:
        scores = TopPLogitsWarper(s.top_p)(ids, scores)
    if s.min_p > 0.0:
        scores = MinPLogitsWarper(s.min_p)(ids, scores)
    return scores[0]


@st.composite
def _requests(draw: st.DrawFn, greedy: bool = False) -> tuple[np.ndarray, list[int], int, Sampler, np.ndarray | None]:
    """float32 logits (ties included), a history, and a Sampler with every step."""
    v = draw(st.integers(4, 40))
    logits = np.array(draw(st.lists(st.one_of(st.integers(-8, 8).map(lambda x: x / 4), st.floats(-6, 6)),
                                    min_size=v, max_size=v)), np.float32)
    history = draw(st.lists(st.integers(0, v - 1), max_size=30))
    prompt_len = draw(st.integers(0, len(history)))
    bias = draw(st.none() | st.dictionaries(st.integers(0, v - 1), st.floats(-4, 4), max_size=4))
    mask = draw(st.none() | st.lists(st.booleans(), min_size=v, max_size=v).filter(any).map(np.array))
    cut = st.one_of(st.just(1.0), st.floats(0.05, 1.0))
    s = Sampler(0.0 if greedy else draw(st.floats(0.2, 5.0)), draw(st.integers(0, v + 2)), draw(cut), None,
                draw(st.one_of(st.just(0.0), st.floats(0.01, 0.6))), draw(st.floats(-2, 2)), draw(st.floats(-2, 2)),
                draw(st.one_of(st.just(1.0), st.floats(0.3, 3.0))), bias)
    return logits, history, prompt_len, s, mask


@given(_requests())
def test_every_step_matches_transformers_and_openai(request_: tuple[Any, ...]) -> None:
    """The processed logits equal the torch oracle per element; the tokens fuel may draw (probability
    > 0) are those transformers' warpers leave finite once ties are broken by id (as in the test above);
    each probability is softmax over them, per element."""
    logits, history, prompt_len, s, mask = request_
    theirs = _processed_by_torch(logits, history, prompt_len, s, mask)
    ours = s.processed(logits, history, prompt_len=prompt_len, mask=mask)
    np.testing.assert_allclose(ours, theirs[0].numpy(), rtol=1e-12, atol=1e-12)
    x = theirs[0].numpy()
    finite = np.unique(x[np.isfinite(x)])
    assume(len(finite) == 1 or np.diff(finite).min() > 1e-6)
    ranked = np.sort(x[np.isfinite(x)])[::-1] / s.temperature
    w = np.exp(ranked - ranked[0])[:s.top_k or len(ranked)]
    assume(s.top_p == 1.0 or np.abs(np.cumsum(w / w.sum()) - s.top_p).min() > 1e-6)
    assume(s.min_p == 0.0 or np.abs(np.log(w) - math.log(s.min_p)).min() > 1e-6)
    warped = _warped_by_transformers(theirs - 1e-10 * torch.arange(len(x)), s)
    kept = torch.isfinite(warped).numpy()
    ids, p = s.distribution(logits, history, prompt_len=prompt_len, mask=mask)
    assert ids.tolist() == np.flatnonzero(kept).tolist()
    want = torch.softmax(torch.tensor(x)[kept] / s.temperature, 0).numpy()
    np.testing.assert_allclose(p, want, rtol=1e-6, atol=0)


@given(_requests(greedy=True), st.integers(0, 20))
def test_greedy_and_logprobs_match_torch(request_: tuple[Any, ...], top_logprobs: int) -> None:
    """Greedy is torch's argmax (the first maximum) of the processed logits; the chosen token's logprob and
    the top ones are torch.log_softmax of them per element, ranked by torch's stable sort of the processed
    logits, masked tokens left out."""
    logits, history, prompt_len, s, mask = request_
    theirs = _processed_by_torch(logits, history, prompt_len, s, mask)[0]
    choice = s.choose(logits, history, prompt_len=prompt_len, mask=mask, top_logprobs=top_logprobs)
    assert choice.token == int(torch.argmax(theirs)) == s(logits, history, prompt_len=prompt_len, mask=mask)
    lp = torch.log_softmax(theirs, 0)
    np.testing.assert_allclose(choice.logprob, float(lp[choice.token]), rtol=1e-9, atol=1e-12)
    order = torch.sort(theirs, descending=True, stable=True).indices[:top_logprobs]  # lp's rounding may tie
    order = order[torch.isfinite(lp[order])]
    assert [t for t, _ in choice.top] == order.tolist()
    np.testing.assert_allclose([v for _, v in choice.top], lp[order].numpy(), rtol=1e-9, atol=1e-12)
    sampled = Sampler(0.7, seed=1, presence_penalty=s.presence_penalty, logit_bias=s.logit_bias)
    c = sampled.choose(logits, history, prompt_len=prompt_len, mask=mask, top_logprobs=top_logprobs)
    assert mask is None or mask[c.token]
    theirs = _processed_by_torch(logits, history, prompt_len, sampled, mask)[0]
    np.testing.assert_allclose(c.logprob, float(torch.log_softmax(theirs, 0)[c.token]), rtol=1e-9, atol=1e-12)


def test_draws_with_every_step_follow_the_exact_distribution() -> None:
    """A chi-square test of seeded draws against transformers' kept set and float64 probabilities, with a
    bias, penalties, a mask and min_p all at work."""
    logits = np.array([0.5, 2.0, -1.0, 1.0, 0.2, 1.6, -0.5, 0.8, 0.0, 1.2, -2.0, 0.3, 1.9, 0.7], np.float32)
    history, prompt_len = [1, 3, 3, 9, 5, 5, 5, 12, 0], 4
    mask = np.ones(len(logits), bool)
    mask[[2, 7]] = False
    s = Sampler(1.2, 11, 0.9, 11, 0.3, 0.4, 0.3, 1.3, {4: 1.5, 10: -3.0})  # each cut drops tokens
    warped = _warped_by_transformers(_processed_by_torch(logits, history, prompt_len, s, mask), s)
    kept = np.flatnonzero(torch.isfinite(warped).numpy())
    p = torch.softmax(warped, 0).numpy()
    assert kept.tolist() == [1, 3, 4, 9, 11, 12, 13] and p[kept].min() > 0.004
    counts = np.bincount([s(logits, history, prompt_len=prompt_len, mask=mask) for _ in range(DRAWS)],
                         minlength=len(logits))
    assert np.flatnonzero(counts).tolist() == kept.tolist()
    assert _chi_square_p_value(counts[kept], p[kept]) > ALPHA


@given(v=st.integers(64, 6000), m=st.integers(1, 40), seed=st.integers(0, 2**16), masked=st.floats(0.0, 0.99))
def test_the_top_m_are_a_prefix_of_the_stable_ranking(v: int, m: int, seed: int, masked: float) -> None:
    """The partial ranking behind top_k, top_p and top_logprobs (the partition and the sampled bound of a
    large row included) is the prefix of NumPy's stable descending argsort, ties and -inf included."""
    rng = np.random.default_rng(seed)
    row = rng.integers(-20, 20, v).astype(np.float64) / 4  # many ties
    row[rng.random(v) < masked] = -np.inf
    row[rng.integers(v)] = 1.0  # at least one finite
    want = np.argsort(-row, kind="stable")[:m]
    assert _ranked_top(row, m).tolist() == want.tolist()


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.999])
def test_top_p_on_a_real_vocabulary_matches_transformers(top_p: float) -> None:
    """At SmolLM2's vocabulary (49152), the growing partial ranking finds transformers' nucleus."""
    logits = (np.random.default_rng(7).standard_normal(49152) * 3).astype(np.float32)
    s = Sampler(0.8, 0, top_p)
    kept = torch.isfinite(_warped_by_transformers(torch.tensor(logits, dtype=torch.float64)[None], s)).numpy()
    ids, p = s.distribution(logits)
    assert ids.tolist() == np.flatnonzero(kept).tolist()
    z = logits[ids].astype(np.float64) / 0.8
    np.testing.assert_allclose(p, np.exp(z - z.max()) / np.exp(z - z.max()).sum(), rtol=1e-9, atol=0)


def test_seeded_requests_repeat_and_never_depend_on_each_other() -> None:
    """Each Sampler draws from its own generator: two requests interleaved call for call give each the
    tokens it gives alone, and a seeded one repeats."""
    row = np.random.default_rng(3).standard_normal(300).astype(np.float32)

    def run(samplers: list[Sampler], steps: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in samplers]
        for _ in range(steps):
            for s, toks in zip(samplers, out, strict=True):
                toks.append(s(row, [7, 8, *toks], prompt_len=2))
        return out

    def make(seed: int) -> Sampler:
        return Sampler(0.9, 50, 0.95, seed, 0.02, 0.5, 0.5, 1.2, {3: 2.0})

    alone = [run([make(seed)], 40)[0] for seed in (1, 2)]
    assert run([make(1), make(2)], 40) == alone and alone[0] != alone[1]
    assert run([make(1), Sampler(0.0), make(2)], 40)[::2] == alone  # greedy draws nothing


def test_nothing_passed_in_is_written() -> None:
    logits = np.linspace(-1.0, 1.0, 12).astype(np.float32)
    history, mask, bias = [1, 2, 2, 11], np.arange(12) % 2 == 0, {2: 5.0}
    before = (logits.copy(), list(history), mask.copy())
    s = Sampler(0.5, 4, 0.9, 0, 0.1, 1.0, 1.0, 2.0, bias)
    s.choose(logits, history, prompt_len=1, mask=mask, top_logprobs=3)
    assert np.array_equal(logits, before[0]) and history == before[1] and np.array_equal(mask, before[2])
    bias[2] = -5.0  # the Sampler holds its own copy
    assert s.logit_bias == {2: 5.0} and s.processed(logits)[2] == float(logits[2]) + 5.0


def test_overflowing_penalties_saturate() -> None:
    """A repetition penalty that overflows a logit leaves it at the largest float, never inf or -inf."""
    row = np.array([1.5e308, -1.5e308, 0.0, -np.inf])
    x = Sampler(repetition_penalty=0.5).processed(row, [0, 1, 3])
    assert x.tolist() == [np.finfo(np.float64).max, -7.5e307, 0.0, -np.inf]
    x = Sampler(repetition_penalty=2.0).processed(row, [0, 1])
    assert x.tolist() == [7.5e307, -np.finfo(np.float64).max, 0.0, -np.inf]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"min_p": -0.1}, r"sampler: min_p must be in \[0, 1\].*got -0.1"),
    ({"min_p": 1.5}, r"sampler: min_p must be in \[0, 1\].*got 1.5"),
    ({"min_p": "x"}, r"sampler: min_p .*got 'x'"),
    ({"presence_penalty": 2.5}, r"sampler: presence_penalty must be in \[-2, 2\].*got 2.5"),
    ({"presence_penalty": float("nan")}, r"sampler: presence_penalty .*got nan"),
    ({"frequency_penalty": -3}, r"sampler: frequency_penalty must be in \[-2, 2\].*got -3"),
    ({"frequency_penalty": None}, r"sampler: frequency_penalty .*got None"),
    ({"repetition_penalty": 0.0}, r"sampler: repetition_penalty must be finite and > 0.*got 0.0"),
    ({"repetition_penalty": -1.0}, r"sampler: repetition_penalty .*got -1.0"),
    ({"repetition_penalty": float("inf")}, r"sampler: repetition_penalty .*got inf"),
    ({"repetition_penalty": True}, r"sampler: repetition_penalty .*got True"),
    ({"logit_bias": [1, 2]}, r"sampler: logit_bias must be None or a mapping.*got \[1, 2\]"),
    ({"logit_bias": {-1: 1.0}}, r"sampler: logit_bias keys must be token ids.*got -1"),
    ({"logit_bias": {"7": 1.0}}, r"sampler: logit_bias keys must be token ids.*got '7'"),
    ({"logit_bias": {7: 101}}, r"sampler: logit_bias\[7\] must be a real in \[-100, 100\], got 101"),
    ({"logit_bias": {7: float("nan")}}, r"sampler: logit_bias\[7\] .*got nan"),
], ids=str)
def test_request_parameters_are_refused_when_built(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ParamError, match=match):
        Sampler(**kwargs)


_ROW = np.zeros(8)


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda: Sampler(logit_bias={8: 1.0})(_ROW), IndexOutOfRange, r"logit_bias names token 8, outside .* 8 tokens"),
    (lambda: Sampler()(_ROW, [1, 8]), IndexOutOfRange, r"history holds token 8, outside the vocabulary of 8"),
    (lambda: Sampler()(_ROW, [1, -1]), IndexOutOfRange, r"history holds token -1"),
    (lambda: Sampler()(_ROW, [1.0, 2.0]), ParamError, r"history must be a flat sequence of token ids.*float64"),
    (lambda: Sampler()(_ROW, [[1, 2]]), ParamError, r"history must be a flat sequence.*\[1, 2\]"),
    (lambda: Sampler()(_ROW, [1, 2], prompt_len=3), ParamError, r"prompt_len must be an int in \[0, 2\].*got 3"),
    (lambda: Sampler()(_ROW, [1, 2], prompt_len=-1), ParamError, r"prompt_len .*got -1"),
    (lambda: Sampler()(_ROW, prompt_len=0.5), ParamError, r"prompt_len .*got 0.5"),
    (lambda: Sampler()(_ROW, mask=np.ones(8, np.int8)), DTypeError, r"mask must be a bool array.*int8"),
    (lambda: Sampler()(_ROW, mask=np.ones(7, bool)), ShapeError, r"mask must have shape \[8\].*\[7\]"),
    (lambda: Sampler(1.0)(_ROW, mask=np.zeros(8, bool)), ParamError, r"the mask allows none of the 8 tokens"),
    (lambda: Sampler()(np.r_[_ROW[:4], [-np.inf] * 4], mask=np.arange(8) >= 4), ParamError,
     r"every token the mask allows has logit -inf"),
    (lambda: Sampler().choose(_ROW, top_logprobs=21), ParamError, r"top_logprobs must be an int in \[0, 20\].*21"),
    (lambda: Sampler().choose(_ROW, top_logprobs=-1), ParamError, r"top_logprobs .*got -1"),
    (lambda: Sampler().choose(_ROW, top_logprobs=True), ParamError, r"top_logprobs .*got True"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_call_arguments_are_refused(call: Any, error: type[FuelError], match: str) -> None:
    with pytest.raises(error, match=match):
        call()
