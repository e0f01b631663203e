"""`fuel.models.generate`: the text a generation yields, its own state, its end, its stop sequences and its
argument checks.

The real model (SmolLM2) is checked against transformers' greedy tokens (its own implementation and KV
cache): alone, interleaved with another generation, and from two threads. The plumbing (finish reasons,
the KV cache filling up, stop sequences, the pool's limit, the argument checks) runs on a tiny random
float32 Llama written by `fuel.testing.llama_files` (one layer; it greedily emits ASCII letters only and
never an end-of-turn token), whose steps capture in a fraction of a second.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuel.errors import FuelError, ParamError
from fuel.models import generate as gen
from fuel.models.generate_args import StopText
from fuel.models.llama import LlamaModel, ModelError
from fuel.models.tokenizer import GGUFTokenizer
from fuel.testing.llama_files import tiny_llama_gguf
from tests.models.oracles import hf_greedy

CHAT = ("What is the capital of France?", "Name three colours.", "Why is the sea salty?")


@pytest.fixture(scope="module")
def expected(smollm2: gen.LLM, smollm2_hf: Any) -> dict[str, list[int]]:
    """transformers' greedy answer (24 tokens at most) to each chat prompt."""
    tok = smollm2.tokenizer
    return {p: hf_greedy(smollm2_hf, tok.encode_chat([{"role": "user", "content": p}]), 24, tok.eos_ids)[0]
            for p in CHAT}


def text_of(llm: gen.LLM, toks: list[int]) -> str:
    return llm.tokenizer.decode(toks, skip_special=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> gen.LLM:
    path = tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", context=64, letters_only=True)
    model = LlamaModel.load(path, capacity=64)
    model.max_sequences = 3
    return gen.LLM(model, GGUFTokenizer.from_gguf(path))


# ---- one state per generation -------------------------------------------------------------------------


def test_generate_streams_transformers_greedy_text(smollm2: gen.LLM, expected: dict[str, list[int]]) -> None:
    g = smollm2.generate(CHAT[0], max_tokens=24, chat=True)
    assert "".join(g) == text_of(smollm2, expected[CHAT[0]])
    assert g.tokens == expected[CHAT[0]]


def test_interleaved_generations_give_what_each_gives_alone(smollm2: gen.LLM,
                                                            expected: dict[str, list[int]]) -> None:
    """Three generations stepped in turn on one model (as `zip` does, then on to the end of each): each
    yields transformers' greedy text for its own prompt."""
    gens = [smollm2.generate(p, max_tokens=24, chat=True) for p in CHAT]
    texts = ["", "", ""]
    live = set(range(3))
    while live:
        for i in sorted(live):
            try:
                texts[i] += next(gens[i])
            except StopIteration:
                live.discard(i)
    assert texts == [text_of(smollm2, expected[p]) for p in CHAT]
    assert smollm2.model.sequences_in_use == 0  # each gave its sequence back


def test_zip_of_two_generations(smollm2: gen.LLM, expected: dict[str, list[int]]) -> None:
    """`zip(generate(a), generate(b))`: the pairs are the pieces each yields alone, whose text is
    transformers'."""
    alone = [list(smollm2.generate(p, max_tokens=24, chat=True)) for p in CHAT[:2]]
    assert ["".join(a) for a in alone] == [text_of(smollm2, expected[p]) for p in CHAT[:2]]
    pairs = list(zip(*(smollm2.generate(p, max_tokens=24, chat=True) for p in CHAT[:2]), strict=False))
    assert len(pairs) == min(len(a) for a in alone)
    assert [x for x, _ in pairs] == alone[0][:len(pairs)] and [y for _, y in pairs] == alone[1][:len(pairs)]


def test_two_threads_on_one_model(smollm2: gen.LLM, expected: dict[str, list[int]]) -> None:
    """Two threads generate at once on one model (started together): each gets transformers' text."""
    start = threading.Barrier(2)
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            start.wait()
            results[i] = "".join(smollm2.generate(CHAT[i], max_tokens=24, chat=True))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [results[0], results[1]] == [text_of(smollm2, expected[p]) for p in CHAT[:2]]


def test_a_next_turn_runs_only_its_new_tokens(smollm2: gen.LLM, expected: dict[str, list[int]]) -> None:
    """The pool lends the sequence holding the conversation so far: the second turn's prompt runs from
    where the first turn's tokens end."""
    first = "".join(smollm2.generate(CHAT[2], max_tokens=24, chat=True))
    messages = [{"role": "user", "content": CHAT[2]}, {"role": "assistant", "content": first},
                {"role": "user", "content": "And why is it not sweet?"}]
    ids = smollm2.prompt_ids(messages)
    before = smollm2.stats.prompt_tokens
    second = smollm2.generate(messages, max_tokens=4)
    assert "".join(second)
    first_ids = smollm2.prompt_ids(CHAT[2], chat=True)
    assert smollm2.stats.prompt_tokens - before < len(ids) - len(first_ids)


def test_sampling_is_seeded_interleaved_or_not(smollm2: gen.LLM) -> None:
    kw: dict[str, Any] = {"max_tokens": 12, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 7}
    a = "".join(smollm2.generate("Once upon a time", **kw))
    b = "".join(smollm2.generate("Once upon a time", **kw))
    assert a == b and a
    x, y = smollm2.generate("Once upon a time", **kw), smollm2.generate("Once upon a time", **kw)
    both = [(next(x, ""), next(y, "")) for _ in range(40)]
    assert "".join(p for p, _ in both) == a == "".join(q for _, q in both)


def test_the_pool_lends_at_most_max_sequences(tiny: gen.LLM) -> None:
    gens = [tiny.generate("abc", max_tokens=8) for _ in range(4)]
    for g in gens[:3]:
        next(g)
    with pytest.raises(ModelError, match="3 sequences are in use"):
        next(gens[3])
    gens[0].close()
    assert "".join(tiny.generate("abc", max_tokens=8))
    for g in gens[1:3]:
        g.close()
    assert tiny.model.sequences_in_use == 0
    seq = tiny.model.sequence()
    with pytest.raises(ParamError, match="not lent"):
        tiny.model.release(seq)


# ---- how a generation ends ----------------------------------------------------------------------------


def test_the_last_token_is_not_run(tiny: gen.LLM) -> None:
    """max_tokens tokens are sampled and max_tokens - 1 decode steps run: the last token's logits would
    serve no one. A continuation runs it as part of its prompt."""
    before = tiny.stats.new_tokens
    g = tiny.generate("abc", max_tokens=5)
    text = "".join(g)
    assert len(g.tokens) == 5 and len(text) == 5 and g.finish_reason == "length" and not g.context_full
    assert tiny.stats.new_tokens - before == 4
    ids = tiny.prompt_ids("abc")
    seq = tiny.model.acquire(ids + g.tokens)
    try:
        assert seq.tokens == ids + g.tokens[:4]
    finally:
        tiny.model.release(seq)


def test_a_full_kv_cache_ends_with_length_and_says_so(tiny: gen.LLM) -> None:
    """With a prompt of n tokens a cache of 64 holds 64 - n generated tokens, and one more is sampled from
    the logits of the last position: 65 - n tokens, then "length" with context_full. A prompt of exactly
    64 tokens still gives one; 65 is an error before anything runs."""
    for n in (60, 64):
        g = tiny.generate("x" * n, max_tokens=100)
        assert len("".join(g)) == len(g.tokens) == 65 - n
        assert g.finish_reason == "length" and g.context_full
    with pytest.raises(ModelError, match="the prompt has 65 tokens, the KV cache holds 64"):
        tiny.generate("x" * 65, max_tokens=1)
    g = tiny.generate("x" * 60, max_tokens=5)
    assert len("".join(g)) == 5 and g.finish_reason == "length" and not g.context_full
    g = tiny.generate("x", max_tokens=0)
    assert list(g) == [] and g.finish_reason == "length"


def test_an_end_of_turn_token_ends_with_stop(smollm2: gen.LLM, expected: dict[str, list[int]]) -> None:
    want = expected[CHAT[0]]
    assert len(want) < 24, "transformers' answer ends with an end-of-turn token within 24 tokens"
    g = smollm2.generate(CHAT[0], max_tokens=24, chat=True)
    assert "".join(g) == text_of(smollm2, want) and g.finish_reason == "stop" and not g.context_full


# ---- stop sequences -----------------------------------------------------------------------------------


def test_stop_sequences_on_the_tiny_model(tiny: gen.LLM) -> None:
    text = "".join(tiny.generate("hello", max_tokens=40))
    assert len(text) == 40
    for stop in (text[10:13], [text[25:27], text[7:9]], text[0:2], text[38:40] + "#"):
        stops = [stop] if isinstance(stop, str) else stop
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        g = tiny.generate("hello", max_tokens=40, stop=stop)
        pieces = list(g)
        assert "".join(pieces) == text[:min(hits, default=40)]
        assert g.finish_reason == ("stop" if hits else "length")
        assert all(pieces), "no empty pieces"


def test_a_stop_sequence_across_multi_character_tokens(smollm2: gen.LLM, expected: dict[str, list[int]]) -> None:
    """A stop sequence that starts inside one token and ends inside a later one: the text ends before it."""
    toks = expected[CHAT[0]]
    pieces = [text_of(smollm2, toks[:i + 1])[len(text_of(smollm2, toks[:i])):] for i in range(len(toks))]
    text = "".join(pieces)
    k = next(i for i in range(2, len(pieces) - 2) if len(pieces[i]) >= 3)  # a token of 3+ characters
    at = sum(len(p) for p in pieces[:k]) + 1  # its second character ...
    stop = text[at:at + len(pieces[k]) + 1]  # ... to the next token's first: across two token boundaries
    g = smollm2.generate(CHAT[0], max_tokens=24, chat=True, stop=stop)
    assert "".join(g) == text[:text.find(stop)] and g.finish_reason == "stop"


def _settled(text: str, stops: list[str]) -> str:
    """The longest prefix of `text` that no stop sequence can still claim: before its earliest position
    from which the rest of `text` is the start of some stop sequence."""
    return text[:next(p for p in range(len(text) + 1) if any(s.startswith(text[p:]) and len(text) - p < len(s)
                                                            for s in stops) or p == len(text))]


@given(text=st.text("abc", max_size=30), stops=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1,
                                                        max_size=3), cuts=st.lists(st.integers(0, 30)))
def test_stop_text_emits_exactly_what_no_stop_can_claim(text: str, stops: list[str], cuts: list[int]) -> None:
    """Against a brute-force statement of the contract: the text before the stop sequence that completes
    first (the longer of two ending together), emitted as soon as no stop sequence can begin in it
    (whatever the cut into pieces)."""
    ends = [(e, e - len(s)) for e in range(len(text) + 1) for s in stops if text[:e].endswith(s)]
    hits = [min(ends)[1]] if ends else []
    want = text[:min(hits, default=len(text))]
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    filt, out, stopped = StopText(tuple(stops)), "", False
    for a, b in itertools.pairwise(bounds):
        piece, stopped = filt.push(text[a:b])
        out += piece
        if stopped:
            break
        assert out == _settled(text[:b], stops)
    if not stopped:
        out += filt.flush()
    assert out == want
    assert stopped == bool(hits)


# ---- argument checks ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"prompt": 3}, "prompt must be a str"),
    ({"prompt": [1, "a"]}, "prompt must be a str"),
    ({"prompt": []}, "prompt is empty"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": [100_000]}, "prompt: token id 100000 is outside the vocabulary"),
    ({"prompt": "a\udcffb"}, "prompt holds a lone surrogate"),
    ({"prompt": [{"role": "user"}]}, "chat message 0"),
    ({"prompt": [1, 2], "chat": True}, "chat=True"),
    ({"chat": "yes"}, "chat must be a bool"),
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": "5"}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"temperature": None}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": "x"}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"), ({"seed": "s"}, "seed"),
    ({"min_p": 1.5}, "min_p"), ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {3: 200.0}}, "logit_bias[3]"), ({"logit_bias": {100_000: 1.0}}, "logit_bias: token id 100000"),
    ({"stop": 3}, "stop"), ({"stop": [""]}, "stop"), ({"stop": ["a", 3]}, "stop"),
    ({"stop": "a\udcff"}, "stop sequence holds a lone surrogate"),
], ids=lambda v: repr(v) if isinstance(v, dict) else "")
def test_bad_arguments_are_fuel_errors_at_the_call(tiny: gen.LLM, kwargs: dict[str, Any], names: str) -> None:
    """Raised by `generate` itself (before any token runs), a FuelError naming the argument."""
    call = {"prompt": "abc", **kwargs}
    prompt = call.pop("prompt")
    with pytest.raises(FuelError, match=names.replace("(", r"\(").replace("[", r"\[")):
        tiny.generate(prompt, **call)
    assert tiny.model.sequences_in_use == 0


def test_token_id_prompts_run_as_given(tiny: gen.LLM) -> None:
    ids = tiny.prompt_ids("abc")
    assert "".join(tiny.generate(np.array(ids), max_tokens=6)) == "".join(tiny.generate("abc", max_tokens=6))


def test_a_dropped_generation_gives_its_sequence_back_at_once(tiny: gen.LLM) -> None:
    """Leaving a loop early and dropping the generation returns its sequence without waiting for the
    garbage collector (the steps do not hold the generation: no reference cycle)."""
    import gc

    gc.disable()
    try:
        for _ in range(5):  # more than max_sequences
            for piece in tiny.generate("abc", max_tokens=20):
                assert piece
                break
        assert tiny.model.sequences_in_use == 0
    finally:
        gc.enable()


def test_a_sequence_in_use_is_refused(tiny: gen.LLM) -> None:
    seq = tiny.model.acquire()
    try:
        sampler = gen.Sampler(0.0, 0, 1.0, None)
        a = tiny.stream(tiny.prompt_ids("abc"), 5, sampler, sequence=seq)
        b = tiny.stream(tiny.prompt_ids("abd"), 5, sampler, sequence=seq)
        next(a)
        with pytest.raises(ModelError, match="in use by another generation"):
            next(b)
        assert len("".join(a)) == 4
    finally:
        tiny.model.release(seq)


def test_generate_file_errors_are_fuel_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="unknown model 'nosuchmodel'"):
        gen.load("nosuchmodel")
    with pytest.raises(ModelError, match="no GGUF file"):
        gen.load(str(tmp_path / "missing.gguf"))
