"""Prometheus metrics of a served engine, read from `Engine.stats()` at each scrape.

The collectors live in a registry of their own (`registry(engine)`), not prometheus-client's global one,
so several apps in one process (tests, Ray replicas) each report their own engine. Names follow
Prometheus' conventions: counters end in `_total`; the throughputs are each phase's tokens over its
seconds since the engine started (0 before the phase has run).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from fuel.serve.engine import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class HttpCounts:
    """Responses answered, by status code (the app counts them; a soak reads its 5xx here)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_status: dict[int, int] = {}

    def add(self, status: int) -> None:
        with self._lock:
            self.by_status[status] = self.by_status.get(status, 0) + 1

    def snapshot(self) -> dict[int, int]:
        with self._lock:
            return dict(self.by_status)


class EngineCollector(Collector):
    def __init__(self, engine: Engine, http: HttpCounts) -> None:
        self.engine, self.http = engine, http

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        yield GaugeMetricFamily("fuel_requests_running", "Requests in the running batch", value=s.running)
        yield GaugeMetricFamily("fuel_requests_queued", "Requests waiting for a slot", value=s.queued)
        yield CounterMetricFamily("fuel_prompt_tokens", "Prompt tokens of the requests served",
                                  value=s.prompt_tokens)
        yield CounterMetricFamily("fuel_generation_tokens", "Tokens generated", value=s.generated_tokens)
        yield GaugeMetricFamily("fuel_prefill_tokens_per_second", "Prompt tokens per second of prefill",
                                value=s.prompt_tokens / s.prefill_s if s.prefill_s > 0 else 0.0)
        yield GaugeMetricFamily("fuel_decode_tokens_per_second", "Generated tokens per second of decode",
                                value=s.generated_tokens / s.decode_s if s.decode_s > 0 else 0.0)
        yield GaugeMetricFamily("fuel_kv_blocks_used", "KV-cache blocks held by sequences", value=s.blocks_used)
        yield GaugeMetricFamily("fuel_kv_blocks_free", "KV-cache blocks free", value=s.blocks_free)
        yield CounterMetricFamily("fuel_prefix_cache_hit_tokens", "Prompt tokens read from the prefix cache",
                                  value=s.prefix_hits)
        responses = CounterMetricFamily("fuel_http_responses", "HTTP responses by status code", labels=["code"])
        for code, n in sorted(self.http.snapshot().items()):
            responses.add_metric([str(code)], n)
        yield responses


def registry(engine: Engine, http: HttpCounts) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(engine, http))
    return reg


def scrape(reg: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format."""
    return generate_latest(reg)
