"""OpenAI's request bodies checked and turned into engine `Request`s (`parse_chat`, `parse_completion`).

Every parameter OpenAI documents for `/v1/chat/completions` and `/v1/completions` that the engine serves is
checked for type and range; a bad one is an `ApiError` with status 400 whose message names the parameter
and the value that came. A parameter the server does not know is a 400 naming it (OpenAI refuses unknown
parameters too), except `HARMLESS` ones the openai client may send, which have no effect here. Defaults
are OpenAI's (temperature 1). `ignore_eos` is llama.cpp's extension, for benchmarks. The response side
(the objects and chunks) is in `fuel.serve.responses`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fuel.errors import FuelError, ParamError
from fuel.models.sampling import Sampler, is_int, is_real

if TYPE_CHECKING:
    from fuel.serve.engine import Engine, Request

MAX_STOPS = 4
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "logit_bias", "seed", "stop", "n", "stream", "stream_options", "max_tokens",
            "response_format", "ignore_eos", "model")
HARMLESS = frozenset({"user", "metadata", "store", "service_tier"})
CHAT_PARAMS = frozenset({*SAMPLING, "messages", "max_completion_tokens", "logprobs", "top_logprobs", *HARMLESS})
COMPLETION_PARAMS = frozenset({*SAMPLING, "prompt", "logprobs", "echo", "best_of", *HARMLESS})
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

GrammarCompile = Callable[[Mapping[str, Any] | None], Any]


class ApiError(FuelError):
    """An HTTP error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

    status = 500
    kind = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class BadRequest(ApiError, ParamError):
    status = 400
    kind = "invalid_request_error"


class NotFound(ApiError):
    status = 404
    kind = "invalid_request_error"


def show(v: Any) -> str:
    """A value as the client sent it (JSON), cut short."""
    try:
        text = json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _bad(name: str, expected: str, v: Any) -> BadRequest:
    return BadRequest(f"{name} must be {expected}, got {show(v)}", param=name, code="invalid_value")


def number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float, *,
           lo_open: bool = False) -> float:
    """A real in [lo, hi] ((lo, hi] with lo_open); absent or null: `default`."""
    v = body.get(name)
    if v is None:
        return default
    ok = is_real(v) and math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        raise _bad(name, f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]", v)
    return float(v)


def integer(body: Mapping[str, Any], name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    """An integer in [lo, hi] (no upper bound when hi is None); absent or null: `default`."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():  # JSON writers may send 5.0
        v = int(v)
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        raise _bad(name, f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}", v)
    return int(v)


def boolean(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, "a boolean", v)
    return v


def check_keys(body: Any, allowed: frozenset[str], what: str) -> dict[str, Any]:
    """`body` as a dict whose keys are all known; else a 400 naming the unknown ones."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {show(body)}", code="invalid_body")
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise BadRequest(f"{what}: unrecognized request argument{'s' if len(unknown) > 1 else ''} supplied: "
                         f"{', '.join(unknown)}", param=unknown[0], code="unknown_parameter")
    return body


def vocab_of(engine: Engine) -> int:
    """The ids a prompt may hold: in the model's embedding table and the tokenizer's list."""
    return min(int(engine.llm.model.cfg.vocab), engine.tokenizer.vocab_size)


def check_model(body: Mapping[str, Any], served: str) -> str:
    v = body.get("model")
    if v is None:
        return served
    if not isinstance(v, str):
        raise _bad("model", "a string", v)
    if v != served:
        raise NotFound(f"the model {v!r} does not exist; this server serves {served!r}", param="model",
                       code="model_not_found")
    return v


def _text_of(content: Any, i: int) -> str:
    """A message's content: a string, or an array of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for j, p in enumerate(content):
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                    and set(p) <= {"type", "text"}):
                raise _bad(f"messages[{i}].content[{j}]", 'a text part {"type": "text", "text": "..."}', p)
            parts.append(p["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content", "a string or a non-empty array of text parts", content)


def chat_ids(engine: Engine, messages: Any) -> list[int]:
    """The ids of `messages` through the model's chat template."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty array of messages", messages)
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "an object with role and content", m)
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise BadRequest(f"messages[{i}]: unrecognized field {extra[0]!r} (tools and audio are not served)",
                             param=f"messages[{i}].{extra[0]}", code="unknown_parameter")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", f"one of {', '.join(ROLES)}", role)
        if "name" in m and not isinstance(m["name"], str):
            raise _bad(f"messages[{i}].name", "a string", m["name"])
        rendered.append({"role": ROLES[role], "content": _text_of(m.get("content"), i)})
    try:
        return engine.tokenizer.encode_chat(rendered)
    except FuelError as e:  # a template that refuses the conversation, text that is not valid Unicode
        raise BadRequest(f"messages: {e}", param="messages", code="invalid_value") from e


def _token_ids(v: list[Any], vocab: int, name: str) -> list[int]:
    for i, t in enumerate(v):
        if not is_int(t) or not 0 <= t < vocab:
            raise _bad(f"{name}[{i}]", f"a token id in [0, {vocab})", t)
    return [int(t) for t in v]


def prompt_ids(engine: Engine, prompt: Any) -> list[int]:
    """A completion's prompt: a string, an array of token ids, or an array holding one of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            ids = engine.tokenizer.encode(prompt)
        except FuelError as e:
            raise BadRequest(f"prompt: {e}", param="prompt", code="invalid_value") from e
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        ids = _token_ids(prompt, vocab_of(engine), "prompt")
    else:
        raise _bad("prompt", "a string or an array of token ids (one prompt per request)", prompt)
    if not ids:
        raise BadRequest("prompt is empty: it has no tokens", param="prompt", code="invalid_value")
    return ids


def stops_of(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    stops = [] if v is None else [v] if isinstance(v, str) else v
    if not (isinstance(stops, list) and len(stops) <= MAX_STOPS and all(isinstance(s, str) and s for s in stops)):
        raise _bad("stop", f"a non-empty string or an array of at most {MAX_STOPS} of them", v)
    return tuple(stops)


def logit_bias_of(body: Mapping[str, Any], vocab: int) -> dict[int, float] | None:
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad("logit_bias", "an object mapping token ids to biases in [-100, 100]", v)
    out = {}
    for k, b in v.items():
        if not (k.isascii() and k.isdigit() and int(k) < vocab):
            raise _bad("logit_bias", f"keyed by token ids in [0, {vocab})", k)
        if not (is_real(b) and -100.0 <= b <= 100.0):
            raise _bad(f"logit_bias[{k}]", "a number in [-100, 100]", b)
        out[int(k)] = float(b)
    return out


def max_tokens_of(body: Mapping[str, Any], n_prompt: int, context: int) -> int:
    """max_completion_tokens (else max_tokens): at least 1, and with the prompt within the context; absent,
    the rest of the context."""
    old = integer(body, "max_tokens", None, 1)  # the older name, still checked when both are given
    m = integer(body, "max_completion_tokens", old, 1)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if n_prompt >= context or (m is not None and n_prompt + m > context):
        asked = "" if m is None else f" and {name} = {m} (together {n_prompt + m})"
        raise BadRequest(f"this model's maximum context length is {context} tokens; the prompt has {n_prompt} "
                         f"tokens{asked}", param="max_tokens" if m is not None else "messages",
                         code="context_length_exceeded")
    return context - n_prompt if m is None else m


@dataclass(frozen=True)
class Parsed:
    """A checked request: the engine's Request and how to answer it."""

    request: Request
    model: str
    stream: bool
    include_usage: bool


def _sampling(body: Mapping[str, Any], engine: Engine, ids: list[int], logprobs: int | None,
              compile_grammar: GrammarCompile | None) -> tuple[Request, bool, bool]:
    from fuel.serve.engine import Request

    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        raise _bad("n", "1 (one choice per request is served)", body["n"])
    stream = boolean(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise BadRequest("stream_options is only allowed when stream is true", param="stream_options",
                             code="invalid_value")
        check_keys(opts, frozenset({"include_usage"}), "stream_options")
    include_usage = boolean(opts or {}, "include_usage")
    kwargs = {"temperature": number(body, "temperature", 1.0, 0.0, 2.0),
              "top_p": number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
              "top_k": integer(body, "top_k", 0, 0),
              "seed": integer(body, "seed", None, 0, 2**63 - 1),
              "min_p": number(body, "min_p", 0.0, 0.0, 1.0),
              "presence_penalty": number(body, "presence_penalty", 0.0, -2.0, 2.0),
              "frequency_penalty": number(body, "frequency_penalty", 0.0, -2.0, 2.0),
              "repetition_penalty": number(body, "repetition_penalty", 1.0, 0.0, math.inf, lo_open=True),
              "logit_bias": logit_bias_of(body, vocab_of(engine))}
    try:
        sampler = Sampler(**kwargs)  # type: ignore[arg-type]
    except ParamError as e:
        raise BadRequest(str(e), code="invalid_value") from e
    stop = stops_of(body)
    ignore_eos = boolean(body, "ignore_eos")
    max_tokens = max_tokens_of(body, len(ids), engine.context)
    rf = body.get("response_format")
    grammar = None
    if rf is not None and rf != {"type": "text"}:
        if not isinstance(rf, dict):
            raise _bad("response_format", 'an object such as {"type": "json_object"}', rf)
        if compile_grammar is None:
            raise BadRequest("response_format: this server has no grammar engine", param="response_format")
        try:
            grammar = compile_grammar(rf)
        except ParamError as e:  # GrammarError: an invalid schema or response_format
            raise BadRequest(f"response_format: {e}", param="response_format", code="invalid_value") from e
    req = Request(prompt_ids=ids, max_tokens=max_tokens, sampler=sampler, stop=stop, logprobs=logprobs,
                  grammar=grammar, ignore_eos=ignore_eos)
    return req, stream, include_usage


def parse_chat(body: Any, engine: Engine, compile_grammar: GrammarCompile | None = None) -> Parsed:
    """A `/v1/chat/completions` body as a Parsed request (a 400 or 404 ApiError when it is wrong)."""
    body = check_keys(body, CHAT_PARAMS, "chat.completions")
    model = check_model(body, engine.model_name)
    want = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not want:
        raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs", code="invalid_value")
    ids = chat_ids(engine, body.get("messages"))
    req, stream, usage = _sampling(body, engine, ids, (top or 0) if want else None, compile_grammar)
    return Parsed(req, model, stream, usage)


def parse_completion(body: Any, engine: Engine, compile_grammar: GrammarCompile | None = None) -> Parsed:
    """A `/v1/completions` body as a Parsed request (a 400 or 404 ApiError when it is wrong)."""
    body = check_keys(body, COMPLETION_PARAMS, "completions")
    model = check_model(body, engine.model_name)
    if boolean(body, "echo"):
        raise BadRequest("echo is not supported: the completion holds only the generated text", param="echo",
                         code="invalid_value")
    integer(body, "best_of", 1, 1, 1)
    logprobs = integer(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    if "prompt" not in body:
        raise BadRequest("prompt is required", param="prompt", code="missing_required_parameter")
    ids = prompt_ids(engine, body["prompt"])
    req, stream, usage = _sampling(body, engine, ids, logprobs, compile_grammar)
    return Parsed(req, model, stream, usage)
