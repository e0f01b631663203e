"""`fuel serve` end to end (issue 43, deliverable 9): a real server process on 127.0.0.1 (SmolLM2, 4 slots,
MiniLM embeddings), driven by the real `openai` client. One server per configuration for the session; the
429 test has its own, with one slot and no queue. The soak runs once, 60 s at concurrency 8."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2"
STARTUP_S = 900  # the first start compiles the batched step's kernels (cached on disk after)
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colours are",
           "Water boils at", "My favourite animal is", "In 1492,", "The best way to learn is"]


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {s.name + (f"{{{s.labels['code']}}}" if "code" in s.labels else ""): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """A POST whose failure to connect reports the server's exit status and log."""
        try:
            return httpx.post(self.url + path, json=body, timeout=60)
        except httpx.TransportError as e:
            raise AssertionError(f"{e!r}; server exit status {self.proc.poll()}; its log:\n"
                                 f"{self.log.read_text()[-4000:]}") from e

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(*flags: str) -> Iterator[Server]:
    port = _free_port()
    log = Path(tempfile.mkstemp(prefix="fuel-serve-", suffix=".log")[1])
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "fuel", "serve", "--model", MODEL, "--host", "127.0.0.1",
                                 "--port", str(port), "--log-level", "warning", *flags], stdout=out, stderr=out)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.time() + STARTUP_S
        while True:
            assert proc.poll() is None, f"fuel serve exited {proc.returncode}:\n{log.read_text()}"
            assert time.time() < deadline, f"fuel serve did not start in {STARTUP_S} s:\n{log.read_text()}"
            try:
                if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.unlink()


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    yield from _start("--slots", "4", "--context", "1024", "--embedding-model", "minilm")


@pytest.fixture(scope="session")
def tiny_queue() -> Iterator[Server]:
    yield from _start("--slots", "1", "--context", "256", "--max-queue", "0")


def _complete(c: openai.OpenAI, prompt: str, **kw: Any) -> tuple[list[str], list[float], str]:
    """A completion's tokens, their logprobs and its finish reason."""
    extra = {"ignore_eos": kw.pop("ignore_eos")} if "ignore_eos" in kw else None
    r = c.completions.create(model=MODEL, prompt=prompt, logprobs=0, extra_body=extra, **kw)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    return lp.tokens, lp.token_logprobs, r.choices[0].finish_reason


def test_streaming_text_equals_non_streaming(server: Server) -> None:
    c = server.client()
    msgs = [{"role": "user", "content": "Name three fruits."}]
    whole = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)  # type: ignore
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,  # type: ignore
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole.choices[0].message.content
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    text = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    streamed = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == text.choices[0].text


def test_prefix_cache_hits_show_in_usage_and_metrics(server: Server) -> None:
    c = server.client()
    prompt = "A shared system prompt that many requests begin with. " * 8
    first = c.completions.create(model=MODEL, prompt=prompt + "First?", max_tokens=2, temperature=0)
    hits = server.metrics()["fuel_prefix_cache_hit_tokens_total"]
    second = c.completions.create(model=MODEL, prompt=prompt + "Second?", max_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 16 <= cached < second.usage.prompt_tokens  # whole blocks of the shared part
    assert server.metrics()["fuel_prefix_cache_hit_tokens_total"] - hits == cached


def test_concurrent_greedy_requests_equal_their_solo_output(server: Server) -> None:
    """Token for token, and each token's logprob bit for bit: the batch does not change a row's arithmetic."""
    c = server.client()
    solo = [_complete(c, p, max_tokens=16, temperature=0, ignore_eos=True) for p in PROMPTS]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: _complete(c, p, max_tokens=16, temperature=0, ignore_eos=True),
                                 PROMPTS))
    assert together == solo


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(server: Server) -> None:
    c = server.client()

    def sample(i: int) -> tuple[list[str], list[float], str]:
        return _complete(c, PROMPTS[i % 4], max_tokens=12, temperature=1.0, top_p=0.95, seed=100 + i)

    solo = [sample(i) for i in range(4)]
    with ThreadPoolExecutor(8) as pool:  # the seeded four among four greedy ones
        greedy = [pool.submit(_complete, c, p, max_tokens=12, temperature=0) for p in PROMPTS[4:]]
        together = list(pool.map(sample, range(4)))
        [g.result() for g in greedy]
    assert together == solo
    other = _complete(c, PROMPTS[0], max_tokens=12, temperature=1.0, top_p=0.95, seed=999)
    assert other[0] != solo[0][0]  # another seed draws other tokens


def test_stop_strings_across_token_boundaries(server: Server) -> None:
    c = server.client()
    tokens, _, _ = _complete(c, PROMPTS[1], max_tokens=32, temperature=0, ignore_eos=True)
    text = "".join(tokens)
    # a stop string made of the end of one token and the start of the next, first seen at that boundary
    for i in range(4, len(tokens) - 1):
        a, b = tokens[i], tokens[i + 1]
        if len(a) >= 2 and len(b) >= 2:
            stop = a[-2:] + b[:2]
            at = len("".join(tokens[:i + 1])) - 2
            if text.find(stop) == at:
                break
    else:
        pytest.fail(f"no two-character tokens to straddle in {tokens}")
    r = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=32, temperature=0, stop=[stop, "@@@"])
    assert r.choices[0].text == text[:at] and r.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=32, temperature=0, stop=stop,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == text[:at]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["stop"]


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_schema_output_validates(server: Server) -> None:
    c = server.client()
    r = c.chat.completions.create(
        model=MODEL, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Give a person's name and age as JSON."}],  # type: ignore
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,  # type: ignore
                                                                "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMA)


def test_embeddings_equal_fuel_embed(server: Server) -> None:
    from fuel.models.bert import embed

    sentences = ["A man is eating food.", "Someone eats.", "The sky is blue today."]
    r = server.client().embeddings.create(model="all-MiniLM-L6-v2", input=sentences)
    got = np.array([d.embedding for d in r.data], np.float32)
    assert np.array_equal(got, embed(sentences))


def test_each_error(server: Server) -> None:
    c = server.client()
    raw = httpx.post(server.url + "/v1/chat/completions", content=b'{"model": "smollm2", "messages": [', timeout=30)
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    msgs = [{"role": "user", "content": "Hi"}]
    cases: list[tuple[type[Exception], dict[str, Any], str]] = [
        (openai.BadRequestError, {"extra_body": {"frobnicate": 1}}, "frobnicate"),
        (openai.BadRequestError, {"temperature": 7}, "temperature"),
        (openai.BadRequestError, {"max_tokens": 2000}, "context_length_exceeded"),
        (openai.BadRequestError, {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frob"}}}}}}, "response_format"),
        (openai.NotFoundError, {"model": "gpt-4o"}, "gpt-4o"),
    ]
    for kind, kw, named in cases:
        with pytest.raises(kind) as info:
            c.chat.completions.create(**{"model": MODEL, "messages": msgs, **kw})  # type: ignore
        assert named in str(info.value.body), info.value.body  # type: ignore[attr-defined]
    long = "word " * 1100
    with pytest.raises(openai.BadRequestError) as too_long:
        c.completions.create(model=MODEL, prompt=long, max_tokens=1)
    assert too_long.value.code == "context_length_exceeded"


SAMPLING = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
    "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "seed": st.integers(0, 2**32),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4), "logprobs": st.integers(0, 5),
    "ignore_eos": st.booleans(), "stream": st.booleans(),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}])})


@given(SAMPLING)
@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_valid_sampling_is_served(server: Server, params: dict[str, Any]) -> None:
    """Every combination of in-range parameters is answered 200 by the real engine (no 5xx)."""
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3, **params})
    assert r.status_code == 200, (params, r.text)
    last = json.loads(r.text.split("data: ")[-2]) if params.get("stream") else r.json()
    assert "error" not in last, (params, r.text)


def test_full_queue_is_429_with_retry_after(tiny_queue: Server) -> None:
    c = tiny_queue.client()
    with c.completions.with_streaming_response.create(model=MODEL, prompt="Count:", max_tokens=200, stream=True,
                                                      extra_body={"ignore_eos": True}) as busy:
        next(busy.iter_lines())  # the one slot is running it
        with pytest.raises(openai.RateLimitError) as info:
            c.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert int(info.value.response.headers["retry-after"]) >= 1


def _settled(server: Server, timeout: float = 30) -> dict[str, float]:
    """The metrics once no request runs or waits."""
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        if (m["fuel_requests_running"] == 0 and m["fuel_requests_queued"] == 0) or time.time() > deadline:
            return m
        time.sleep(0.1)


def test_cancellation_frees_blocks(server: Server) -> None:
    c = server.client()
    generated = server.metrics()["fuel_generation_tokens_total"]
    for _ in range(2):
        with c.completions.with_streaming_response.create(model=MODEL, prompt=PROMPTS[2], max_tokens=400,
                                                          stream=True, extra_body={"ignore_eos": True}) as r:
            lines = r.iter_lines()
            [next(lines) for _ in range(6)]
            assert server.metrics()["fuel_kv_blocks_used"] > 0
        # the response is closed mid-stream: the sequence is cancelled and its blocks freed
    m = _settled(server)
    assert m["fuel_requests_running"] == 0 and m["fuel_kv_blocks_used"] == 0
    assert m["fuel_generation_tokens_total"] - generated < 2 * 400  # neither ran to its end


def test_soak(server: Server) -> None:
    """60 s at concurrency 8, a fifth of the requests leaving mid-stream: no 5xx, no leaked block, RSS at
    the end within 10% of RSS after the warm-up."""
    before = server.metrics()
    failures: list[str] = []
    counts = {"done": 0, "left": 0}
    lock = threading.Lock()
    stop_at = 0.0

    def client_loop(k: int) -> None:
        rng = random.Random(k)
        while time.time() < stop_at:
            leave = rng.random() < 0.2
            body = {"model": MODEL, "prompt": rng.choice(PROMPTS) + " " * rng.randint(0, 3), "stream": True,
                    "max_tokens": rng.randint(4, 48), "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 99)}
            try:
                with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                    if r.status_code >= 500:
                        failures.append(f"{r.status_code}: {r.read()!r}")
                        continue
                    for i, line in enumerate(r.iter_lines()):
                        if '"error"' in line:  # a generation that failed inside the engine
                            failures.append(line)
                        if leave and i >= 2:
                            break
                with lock:
                    counts["left" if leave else "done"] += 1
            except httpx.HTTPError as e:
                failures.append(repr(e))

    # warm-up: the soak's own load for a while, so the step shapes it runs are captured before RSS is read
    stop_at = time.time() + 12
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(client_loop, range(100, 108)))
    rss_warm = server.rss()
    stop_at = time.time() + 60
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(client_loop, range(8)))
    m = _settled(server)
    assert not failures, failures[:5]
    assert counts["done"] > 0 and counts["left"] > 0, counts
    five_xx = sum(v - before.get(k, 0) for k, v in m.items() if k.startswith("fuel_http_responses_total{5"))
    assert five_xx == 0
    assert m["fuel_kv_blocks_used"] == 0 and m["fuel_requests_running"] == 0
    rss_end = server.rss()
    assert rss_end <= 1.10 * rss_warm, (rss_warm, rss_end)
