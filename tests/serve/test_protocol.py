"""fuel.serve.protocol: OpenAI request bodies -> engine Requests, every wrong parameter a 400 naming it."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuel.serve.protocol import ApiError, parse_chat, parse_completion
from tests.serve.fake_engine import FakeEngine

ENGINE = FakeEngine(context=256)
VOCAB = int(ENGINE.llm.model.cfg.vocab)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": ENGINE.model_name, "messages": MESSAGES, **kw}


def error_of(parse: Any, body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, ENGINE)
    return info.value


def test_chat_request_carries_every_parameter() -> None:
    body = chat(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5,
                repetition_penalty=1.1, logit_bias={"42": -100, "7": 2.5}, seed=11, stop=["\n\n", "END"],
                max_completion_tokens=17, logprobs=True, top_logprobs=3, ignore_eos=True, stream=True,
                stream_options={"include_usage": True}, user="u", n=1)
    p = parse_chat(body, ENGINE)
    r, s = p.request, p.request.sampler
    # the template's rendering, as the model's own chat template gives it (the system turn first)
    text = ENGINE.tokenizer.decode(r.prompt_ids)
    assert text.index("Be brief.") < text.index("Hi") and text.rstrip().endswith("assistant")
    assert (r.max_tokens, r.stop, r.logprobs, r.ignore_eos, r.grammar) == (17, ("\n\n", "END"), 3, True, None)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.7, 0.9, 40, 0.05, 11)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.1)
    assert dict(s.logit_bias) == {42: -100.0, 7: 2.5}
    assert (p.stream, p.include_usage, p.model) == (True, True, ENGINE.model_name)


def test_defaults_are_openai_s() -> None:
    p = parse_chat({"messages": MESSAGES}, ENGINE)
    r = p.request
    assert r.sampler.temperature == 1.0 and r.sampler.top_p == 1.0 and r.logprobs is None and r.stop == ()
    assert r.max_tokens == ENGINE.context - len(r.prompt_ids)  # the rest of the context
    assert (p.stream, p.include_usage) == (False, False)


@pytest.mark.parametrize("prompt", ["Hello there", ["Hello there"]])
def test_completion_prompt_text(prompt: Any) -> None:
    r = parse_completion({"prompt": prompt, "max_tokens": 5, "logprobs": 2}, ENGINE).request
    assert ENGINE.tokenizer.decode(r.prompt_ids, skip_special=True) == "Hello there"
    assert (r.max_tokens, r.logprobs) == (5, 2)


@pytest.mark.parametrize("prompt", [[1, 2, VOCAB - 1], [[1, 2, VOCAB - 1]]])
def test_completion_prompt_ids(prompt: Any) -> None:
    assert parse_completion({"prompt": prompt}, ENGINE).request.prompt_ids == [1, 2, VOCAB - 1]


# (parameter, a value out of its range or of the wrong type); each is a 400 naming the parameter and the value
BAD = [("temperature", 2.5), ("temperature", -0.1), ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5),
       ("top_k", -1), ("top_k", 2.5), ("min_p", 1.5), ("presence_penalty", 3), ("frequency_penalty", -2.5),
       ("repetition_penalty", 0), ("seed", -1), ("seed", True), ("n", 2), ("max_tokens", 0),
       ("max_completion_tokens", -5), ("stop", ["a", "b", "c", "d", "e"]), ("stop", ""), ("stop", [1]),
       ("logit_bias", {"x": 1}), ("logit_bias", {str(VOCAB): 1}), ("logit_bias", {"1": 101}),
       ("logit_bias", [1]), ("stream", "yes"), ("top_logprobs", 21), ("ignore_eos", 1),
       ("response_format", "json"), ("model", 3)]


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_out_of_range_is_400_naming_it(name: str, value: Any) -> None:
    extra = {"logprobs": True} if name == "top_logprobs" else {}
    e = error_of(parse_chat, chat(**{name: value}, **extra))
    assert e.status == 400 and e.param is not None and e.param.startswith(name), e.message
    shown = next(iter(value.items())) if isinstance(value, dict) else [value]
    assert name in e.message and any(json.dumps(v) in e.message for v in shown), e.message


@given(st.sampled_from(["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"]),
       st.floats(allow_nan=True, allow_infinity=True))
@settings(max_examples=60)
def test_numbers_in_range_pass_and_out_of_range_fail(name: str, v: float) -> None:
    lo, hi = {"temperature": (0, 2), "top_p": (0, 1), "min_p": (0, 1)}.get(name, (-2, 2))
    ok = math.isfinite(v) and (lo < v if name == "top_p" else lo <= v) and v <= hi
    if ok:
        assert getattr(parse_chat(chat(**{name: v}), ENGINE).request.sampler, name) == v
    else:
        assert error_of(parse_chat, chat(**{name: v})).param == name


@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
def test_unknown_parameters_are_named(parse: Any) -> None:
    body = chat(tools=[], frobnicate=1) if parse is parse_chat else {"prompt": "x", "suffix": "y"}
    e = error_of(parse, body)
    assert e.status == 400 and e.code == "unknown_parameter"
    assert ("tools" in e.message and "frobnicate" in e.message) if parse is parse_chat else "suffix" in e.message


def test_unknown_model_is_404() -> None:
    e = error_of(parse_chat, chat(model="gpt-4o"))
    assert e.status == 404 and e.code == "model_not_found" and "gpt-4o" in e.message


def test_prompt_plus_max_tokens_past_the_context_is_400() -> None:
    n = len(parse_chat(chat(max_tokens=1), ENGINE).request.prompt_ids)
    assert parse_chat(chat(max_tokens=ENGINE.context - n), ENGINE).request.max_tokens == ENGINE.context - n
    e = error_of(parse_chat, chat(max_tokens=ENGINE.context - n + 1))
    assert e.status == 400 and e.code == "context_length_exceeded" and str(ENGINE.context) in e.message
    long = error_of(parse_completion, {"prompt": [1] * ENGINE.context})  # no room for one token
    assert long.code == "context_length_exceeded"


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"), ({"messages": [{"role": "user"}]}, "messages[0]"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MESSAGES, "stream": True, "stream_options": {"other": 1}}, "other"),
])
def test_bad_messages_and_combinations(body: dict[str, Any], param: str) -> None:
    e = error_of(parse_chat, body)
    assert e.status == 400 and e.param is not None and e.param.startswith(param), (e.param, e.message)


@pytest.mark.parametrize(("prompt", "param"), [([], "prompt"), ("", "prompt"), ([0, VOCAB], "prompt[1]"),
                                               ([-1], "prompt[0]"), (["a", "b"], "prompt"), (None, "prompt"),
                                               ([1.5], "prompt")])
def test_bad_completion_prompts(prompt: Any, param: str) -> None:
    e = error_of(parse_completion, {"prompt": prompt})
    assert e.status == 400 and e.param == param, e.message


def test_both_max_token_names_are_checked() -> None:
    assert parse_chat(chat(max_tokens=9, max_completion_tokens=5), ENGINE).request.max_tokens == 5
    assert error_of(parse_chat, chat(max_tokens=-3, max_completion_tokens=5)).param == "max_tokens"


def test_chat_content_parts_join() -> None:
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    a = parse_chat({"messages": [{"role": "user", "content": parts}]}, ENGINE).request.prompt_ids
    b = parse_chat({"messages": [{"role": "user", "content": "Hello"}]}, ENGINE).request.prompt_ids
    assert a == b


def test_body_is_not_mutated() -> None:
    body = chat(stop="x", logit_bias={"1": 1.0}, stream=True, stream_options={"include_usage": True})
    import copy

    before = copy.deepcopy(body)
    parse_chat(body, ENGINE)
    assert body == before
