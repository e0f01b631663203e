"""fuel.serve.app over the fake engine: routes, SSE, OpenAI-shaped errors, disconnects. The response shapes
are checked by the openai client's own models (it parses every answer here), the metrics by
prometheus-client's text parser."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import httpx
import numpy as np
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from fuel.serve.app import create_app
from tests.serve.fake_engine import TEXT, FakeEngine

MESSAGES = [{"role": "user", "content": "Hi"}]


class FixedEmbedder:
    """Vectors that name their sentence (its length and first character), 384 wide."""

    def embed(self, sentences: Any, *, normalize: bool = True, batch_size: int = 32) -> np.ndarray:
        out = np.zeros((len(sentences), 384), np.float32)
        for i, s in enumerate(sentences):
            out[i, :3] = len(s), ord(s[0]), 0.1
        return out

    def token_ids(self, sentences: Any) -> list[list[int]]:
        return [[0] * (len(s) + 2) for s in sentences]


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    e = FakeEngine(cached=5)
    yield e
    e.close()


@pytest.fixture(scope="module")
def client(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(create_app(cast(Any, engine), embedder=FixedEmbedder()), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def oai(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)


def test_chat_non_streaming_through_the_openai_client(oai: openai.OpenAI, engine: FakeEngine) -> None:
    r = oai.chat.completions.create(model=engine.model_name, messages=MESSAGES, max_tokens=100)  # type: ignore
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == TEXT and r.choices[0].finish_reason == "stop"
    n_prompt = len(engine.requests[-1].prompt_ids)
    assert r.usage is not None and r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == len(engine.output) and r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 5


def test_chat_streaming_equals_non_streaming(oai: openai.OpenAI, engine: FakeEngine) -> None:
    chunks = list(oai.chat.completions.create(model=engine.model_name, messages=MESSAGES, stream=True,  # type: ignore
                                              stream_options={"include_usage": True}, logprobs=True, top_logprobs=2))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXT
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(engine.output)
    content = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content or []]
    assert [x.token for x in content] == [engine.tokenizer.decode([t]) for t in engine.output]
    assert all(len(x.top_logprobs) == 2 and x.bytes == list(x.token.encode()) for x in content)


def test_completion_streaming_and_logprobs(oai: openai.OpenAI, engine: FakeEngine) -> None:
    whole = oai.completions.create(model=engine.model_name, prompt="Say", max_tokens=6, logprobs=3)
    assert whole.choices[0].finish_reason == "length"
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == whole.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert all(len(t) == 3 for t in lp.top_logprobs)
    chunks = list(oai.completions.create(model=engine.model_name, prompt="Say", max_tokens=6, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sse_framing(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])


def test_stop_string_is_cut(oai: openai.OpenAI, engine: FakeEngine) -> None:
    r = oai.chat.completions.create(model=engine.model_name, messages=MESSAGES, stop=["n fox"])  # type: ignore
    assert r.choices[0].message.content == TEXT[:TEXT.index("n fox")] and r.choices[0].finish_reason == "stop"


def test_embeddings_float_and_base64(oai: openai.OpenAI, client: TestClient) -> None:
    r = oai.embeddings.create(model="all-MiniLM-L6-v2", input=["ab", "xyz"])  # the client asks for base64
    want = FixedEmbedder().embed(["ab", "xyz"])
    assert np.array_equal(np.array([d.embedding for d in r.data], np.float32), want)
    assert r.usage.prompt_tokens == 4 + 5
    raw = client.post("/v1/embeddings", json={"input": "ab", "encoding_format": "float"}).json()
    assert raw["data"][0]["embedding"][:3] == pytest.approx([2, ord("a"), 0.1])
    b64 = client.post("/v1/embeddings", json={"input": "ab", "encoding_format": "base64"}).json()
    assert np.array_equal(np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4"), want[0])


def test_embeddings_404_without_a_model(engine: FakeEngine) -> None:
    with TestClient(create_app(cast(Any, engine))) as c:
        r = c.post("/v1/embeddings", json={"input": "x", "model": "all-MiniLM-L6-v2"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_models_health_tokenize(client: TestClient, engine: FakeEngine, oai: openai.OpenAI) -> None:
    assert [m.id for m in oai.models.list()] == [engine.model_name, "all-MiniLM-L6-v2"]
    assert oai.models.retrieve(engine.model_name).id == engine.model_name
    assert client.get("/v1/models/gpt-4").status_code == 404
    assert client.get("/health").json() == {"status": "ok"}
    ids = client.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert engine.tokenizer.decode(ids) == "Hello world"
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"content": "Hello world"}


@given(st.text(alphabet=st.characters(whitelist_categories=["L", "N", "P", "Zs"], max_codepoint=0xFFFF), max_size=40))
@settings(max_examples=30)
def test_tokenize_round_trips(client: TestClient, text: str) -> None:
    ids = client.post("/tokenize", json={"content": text, "add_special": False}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": ids}).json()["content"] == text


def _error(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return dict(err)


def test_errors_are_openai_shaped(client: TestClient) -> None:
    assert _error(client.post("/v1/chat/completions", content=b'{"messages": ['), 400)["code"] == "invalid_json"
    assert _error(client.post("/v1/completions", content=b"\xff\xfe\x00"), 400)["code"] == "invalid_json"
    assert _error(client.post("/v1/completions", content=b"[" * 100_000), 400)["code"] == "invalid_json"
    tools = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": []})
    assert _error(tools, 400)["param"] == "tools"
    assert _error(client.post("/v1/chat/completions", json={"messages": MESSAGES, "model": "gpt-4o"}), 404)["param"] \
        == "model"
    assert _error(client.get("/v1/nothing"), 404)["code"] == "not_found"
    r = client.get("/v1/chat/completions")
    assert _error(r, 405)["code"] == "method_not_allowed" and r.headers["allow"] == "POST"
    assert _error(client.post("/tokenize", json={"content": 5}), 400)["param"] == "content"
    assert _error(client.post("/detokenize", json={"tokens": [10**9]}), 400)["param"] == "tokens"
    assert _error(client.post("/v1/embeddings", json={"input": []}), 400)["param"] == "input"
    assert _error(client.post("/v1/embeddings", json={"input": "x", "dimensions": 3}), 400)["param"] == "dimensions"


def test_queue_full_is_429_with_retry_after() -> None:
    engine = FakeEngine(max_queue=0)
    with TestClient(create_app(cast(Any, engine))) as c:
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert _error(r, 429)["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1


def test_a_generation_error_is_a_500_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine(error="kernel exploded")
    with TestClient(create_app(cast(Any, engine)), raise_server_exceptions=False) as c:
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES})
        streamed = c.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True})
    assert _error(r, 500)["type"] == "server_error" and "kernel exploded" in r.json()["error"]["message"]
    assert "kernel exploded" in streamed.text and streamed.text.endswith("data: [DONE]\n\n")


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=12)
KEYS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n",
        "stream", "stream_options", "logprobs", "top_logprobs", "logit_bias", "response_format", "min_p",
        "content", "tokens", "input", "add_special", "encoding_format", "max_completion_tokens", "ignore_eos"]
VALUES = JSON | st.just([{"role": "user", "content": "hi"}]) | st.just("Hi") | st.just([1, 2])


@given(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize", "/detokenize"]),
       JSON | st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=6))
@settings(max_examples=300)
def test_no_client_input_gives_a_5xx(client: TestClient, route: str, body: Any) -> None:
    if isinstance(body, dict) and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body = {**body, "max_tokens": 2}
    r = client.post(route, content=json.dumps(body).encode())
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        _error(r, r.status_code)


def _metrics(client: TestClient) -> dict[str, float]:
    text = client.get("/metrics").text
    return {s.name + (f"{{{s.labels['code']}}}" if "code" in s.labels else ""): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_follow_the_engine(client: TestClient, engine: FakeEngine) -> None:
    m = _metrics(client)
    s = engine.stats()
    assert m["fuel_kv_blocks_used"] == s.blocks_used and m["fuel_kv_blocks_free"] == s.blocks_free
    assert m["fuel_generation_tokens_total"] == s.generated_tokens and m["fuel_prompt_tokens_total"] == 7
    assert m["fuel_prefill_tokens_per_second"] == 14.0 and m["fuel_decode_tokens_per_second"] == 0.0
    assert m["fuel_prefix_cache_hit_tokens_total"] == 5 and m["fuel_requests_running"] == s.running
    assert m["fuel_http_responses_total{200}"] >= 1


@pytest.fixture
def live() -> Iterator[tuple[FakeEngine, str]]:
    """A real uvicorn server on 127.0.0.1 over a fake engine whose generations pause after one token."""
    import uvicorn

    engine = FakeEngine()
    config = uvicorn.Config(create_app(cast(Any, engine)), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    engine.gate.clear()
    try:
        yield engine, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        engine.gate.set()
        server.should_exit = True
        thread.join(10)


def _wait(cond: Any, timeout: float = 10) -> None:
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(0.01)


def test_client_leaving_mid_stream_cancels_its_stream(live: tuple[FakeEngine, str]) -> None:
    engine, url = live
    with httpx.Client(base_url=url) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 20}) as r:
            assert next(r.iter_lines()).startswith("data: {") and engine.blocks == 1
        _wait(lambda: engine.cancels > 0)
        engine.gate.set()
        _wait(lambda: engine.blocks == 0)
        assert engine.cancels == 1 and engine.blocks == 0
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 200
        assert engine.cancels == 1  # a request that ends is not cancelled


def test_client_leaving_a_non_streamed_request_cancels_it(live: tuple[FakeEngine, str]) -> None:
    engine, url = live
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 20}, timeout=0.5)
    _wait(lambda: engine.cancels > 0)
    engine.gate.set()
    _wait(lambda: engine.blocks == 0)
    assert engine.cancels == 1 and engine.blocks == 0


def test_response_format_goes_through_the_grammar_compiler(client: TestClient, engine: FakeEngine) -> None:
    from fuel.serve.grammar import Grammar

    body = {"messages": MESSAGES, "max_tokens": 2}
    assert client.post("/v1/chat/completions", json={**body, "response_format": {"type": "text"}}).status_code == 200
    assert engine.requests[-1].grammar is None
    ok = client.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}})
    assert ok.status_code == 200 and isinstance(engine.requests[-1].grammar, Grammar)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}
    for rf in (bad_schema, {"type": "yaml"}, {"type": "json_schema"}):
        err = _error(client.post("/v1/chat/completions", json={**body, "response_format": rf}), 400)
        assert err["param"] == "response_format", err
