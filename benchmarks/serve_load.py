"""The serving benchmark's load generator: concurrent clients streaming OpenAI chat/completions over SSE.

Each client sends its requests one after another; the clients run concurrently. Every request records the
arrival time of each SSE chunk that carries text, so that

- time to first token (TTFT) is the first text chunk's arrival minus the send time;
- inter-token latency (ITL) is the gap between consecutive text chunks of one request (a chunk that carries
  several tokens counts once: the client waited that whole gap for it);
- aggregate output tokens/s is every request's completion tokens over the wall time of the whole load, from
  the first send to the last response's end.

Completion tokens come from the stream's usage object when the server sends one (`stream_options.
include_usage`), else from the number of text chunks (one token each on the servers that send no usage).
Percentiles interpolate linearly between the sorted values (NumPy's default), so p99 of a few values lies
near their maximum.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestTiming:
    """One streamed request: when it was sent, when each text chunk arrived (perf_counter seconds)."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    completion_tokens: int | None = None  # from the usage object, when the server sent one
    prompt_tokens: int | None = None
    finished: float | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    def gaps(self) -> list[float]:
        """The inter-token latencies of this request: gaps between consecutive text chunks."""
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) of `values` by linear interpolation; None when there are none."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must lie in 0..100, got {q}")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def summarise(timings: Sequence[RequestTiming], wall_s: float) -> dict[str, Any]:
    """The load's statistics: aggregate output tokens/s, TTFT and ITL p50/p99 (milliseconds), counts.
    Failed requests are counted and left out of the latencies; their tokens are not counted."""
    ok = [t for t in timings if t.error is None]
    ttfts = [x for x in (t.ttft for t in ok) if x is not None]
    gaps = [g for t in ok for g in t.gaps()]
    tokens = sum(t.tokens for t in ok)
    chunks = sum(len(t.chunks) for t in ok)
    prompts = [t.prompt_tokens for t in ok if t.prompt_tokens is not None]
    return {
        "requests": len(timings), "errors": len(timings) - len(ok),
        "first_error": next((t.error for t in timings if t.error is not None), None),
        "wall_s": wall_s, "completion_tokens": tokens, "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "ttft_p50_ms": _ms(percentile(ttfts, 50)), "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "itl_p50_ms": _ms(percentile(gaps, 50)), "itl_p99_ms": _ms(percentile(gaps, 99)),
        "tokens_per_chunk": tokens / chunks if chunks else None,
        "completion_tokens_per_request": tokens / len(ok) if ok else None,
        "prompt_tokens_per_request": sum(prompts) / len(prompts) if prompts else None,
    }


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text an OpenAI stream chunk carries: a chat delta's content or a completion's text."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    delta = c.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else c.get("text")
    return text if isinstance(text, str) else ""


async def stream_one(client: Any, url: str, body: dict[str, Any]) -> RequestTiming:
    """POST one streamed request with the httpx.AsyncClient `client` and time its chunks."""
    t = RequestTiming(sent=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                t.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return t
            done = False
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    t.error = f"error in stream: {json.dumps(chunk['error'])[:200]}"
                    return t
                if chunk_text(chunk):
                    t.chunks.append(now)
                usage = chunk.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    t.completion_tokens = int(usage["completion_tokens"])
                    t.prompt_tokens = usage.get("prompt_tokens")
            if not done:  # a server that drops a stream (llama-cpp-python's interrupting one) sends no [DONE]
                t.error = f"the stream ended without [DONE] after {len(t.chunks)} text chunks"
    except Exception as e:  # a refused connection or a broken stream is this request's result, not a crash
        t.error = f"{type(e).__name__}: {e}"
    t.finished = time.perf_counter()
    return t


async def run_load(url: str, per_client: Sequence[Sequence[dict[str, Any]]],
                   timeout_s: float = 600.0) -> tuple[list[RequestTiming], float]:
    """Run one client per entry of `per_client`, all at once, each sending its bodies in turn to `url`.
    Returns every request's timing and the wall time from the first send to the last response's end."""
    import httpx

    limits = httpx.Limits(max_connections=len(per_client) + 1, max_keepalive_connections=len(per_client) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:

        async def one_client(bodies: Sequence[dict[str, Any]]) -> list[RequestTiming]:
            return [await stream_one(client, url, b) for b in bodies]

        start = time.perf_counter()
        done = await asyncio.gather(*(one_client(b) for b in per_client))
        wall = time.perf_counter() - start
    return [t for client_timings in done for t in client_timings], wall
