"""The serving benchmark: the load generator's statistics on synthetic timings (checked against the
standard library's quantiles), its SSE client against a stand-in server (tests/fake_sse_server.py), and the
whole harness end to end on that stand-in: rounds, missing peers reported with their build command, JSON
and PNG. No real server runs here: llama-server is a benchmark-only peer (`make bench-env`)."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_serve as bs
from benchmarks import serve_load as sl

from tests import fake_sse_server as fake

FIRST_DELAY, GAP = 0.05, 0.01


def _p(values: list[float], q: int) -> float:
    """The oracle: the standard library's inclusive quantiles are NumPy's linear percentiles."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


requests_st = st.lists(st.tuples(st.floats(1e-3, 5.0), st.lists(st.floats(1e-4, 0.5), min_size=1, max_size=20),
                                 st.floats(0.0, 100.0)), min_size=2, max_size=12)


@settings(max_examples=60)
@given(requests_st, st.floats(0.1, 100.0))
def test_summary_of_synthetic_timings(reqs: list[tuple[float, list[float], float]], wall: float) -> None:
    """TTFT is the first text chunk's arrival minus the send; ITL pools every request's chunk gaps; tokens/s
    is every chunk (no usage sent) over the load's wall time."""
    timings, ttfts, gaps = [], [], []
    for ttft, itls, sent in reqs:
        chunks = [sent + ttft]
        for g in itls:
            chunks.append(chunks[-1] + g)
        timings.append(sl.RequestTiming(sent=sent, chunks=chunks))
        ttfts.append(ttft)
        gaps.extend(itls)
    s = sl.summarise(timings, wall)
    rel, eps = 1e-9, 1e-9  # ms; a gap is a difference of two sums of floats
    assert s["ttft_p50_ms"] == pytest.approx(statistics.median(ttfts) * 1e3, rel=rel, abs=eps)
    assert s["ttft_p99_ms"] == pytest.approx(_p(ttfts, 99) * 1e3, rel=rel, abs=eps)
    if len(gaps) >= 2:
        assert s["itl_p50_ms"] == pytest.approx(statistics.median(gaps) * 1e3, rel=rel, abs=eps)
        assert s["itl_p99_ms"] == pytest.approx(_p(gaps, 99) * 1e3, rel=rel, abs=eps)
    else:
        assert s["itl_p50_ms"] == s["itl_p99_ms"] == pytest.approx(gaps[0] * 1e3, rel=rel, abs=eps)
    n_tokens = sum(len(i) + 1 for _, i, _ in reqs)
    assert s["completion_tokens"] == n_tokens
    assert s["tokens_per_s"] == pytest.approx(n_tokens / wall, rel=1e-12)
    assert s["requests"] == len(reqs) and s["errors"] == 0 and s["tokens_per_chunk"] == 1.0


def test_summary_counts_usage_tokens_and_leaves_failed_requests_out() -> None:
    """Usage's completion_tokens wins over the chunk count (a chunk may carry several tokens); a failed
    request adds no latency and no tokens but is counted, with its error."""
    a = sl.RequestTiming(sent=0.0, chunks=[0.2, 0.3, 0.5], completion_tokens=6, prompt_tokens=128)
    b = sl.RequestTiming(sent=1.0, chunks=[1.4, 1.5], completion_tokens=4, prompt_tokens=126)
    bad = sl.RequestTiming(sent=0.0, chunks=[0.01], error="HTTP 500: boom")
    s = sl.summarise([a, bad, b], wall_s=2.0)
    assert s["completion_tokens"] == 10 and s["tokens_per_s"] == pytest.approx(5.0)
    assert s["requests"] == 3 and s["errors"] == 1 and s["first_error"] == "HTTP 500: boom"
    assert s["ttft_p50_ms"] == pytest.approx(300.0) and s["ttft_p99_ms"] == pytest.approx(200 + 200 * 0.99)
    assert s["itl_p50_ms"] == pytest.approx(100.0)  # gaps 100, 200, 100 ms
    assert s["itl_p99_ms"] == pytest.approx(100 + 100 * (0.99 * 2 - 1))
    assert s["tokens_per_chunk"] == pytest.approx(2.0) and s["prompt_tokens_per_request"] == pytest.approx(127)


def test_percentile_of_nothing_is_none_and_q_is_checked() -> None:
    assert sl.percentile([], 50) is None and sl.percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError, match=r"0\.\.100"):
        sl.percentile([1.0], 101)


def test_chunk_text_reads_chat_deltas_and_completion_text() -> None:
    assert sl.chunk_text({"choices": [{"delta": {"content": "hi"}}]}) == "hi"
    assert sl.chunk_text({"choices": [{"delta": {"role": "assistant", "content": None}}]}) == ""
    assert sl.chunk_text({"choices": [{"text": "yo"}]}) == "yo"
    assert sl.chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    server = fake.make_server(0, FIRST_DELAY, GAP)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _body(engine: str, n: int, model: str = fake.MODEL) -> dict[str, Any]:
    return bs.request_body(engine, model, [{"role": "user", "content": "hello"}], n)


def test_load_against_a_fake_sse_server(fake_url: str) -> None:
    """3 clients x 2 requests of 5 tokens: every request is timed from its chunks (the role chunk has no
    text and is no token), TTFT covers the server's first delay, the chunks its gaps, usage gives the counts;
    every engine's body asks for exactly max_tokens (the stand-in refuses one that would stop at EOS)."""
    per_client = [[_body(e, 5), _body(e, 5)] for e in bs.ENGINES]
    timings, wall = asyncio.run(sl.run_load(fake_url + "/v1/chat/completions", per_client))
    assert [t.error for t in timings] == [None] * 6
    for t in timings:
        assert len(t.chunks) == 5 and t.completion_tokens == 5 and t.prompt_tokens == fake.PROMPT_TOKENS
        assert t.ttft is not None and t.ttft >= FIRST_DELAY
        # the last chunk left the server 4 gaps after the first (a loaded client may read two at once, so
        # single gaps have no lower bound)
        assert len(t.gaps()) == 4 and t.chunks[-1] - t.sent >= FIRST_DELAY + 4 * GAP
    s = sl.summarise(timings, wall)
    assert s["completion_tokens"] == 30 and s["errors"] == 0 and s["itl_p50_ms"] is not None
    assert s["ttft_p50_ms"] >= FIRST_DELAY * 1e3
    assert wall >= 2 * (FIRST_DELAY + 4 * GAP)  # each client's two requests ran one after the other


def test_http_errors_are_results_not_crashes(fake_url: str) -> None:
    timings, _ = asyncio.run(sl.run_load(fake_url + "/v1/chat/completions",
                                         [[_body("fuel", 3, model="nope")], [{"max_tokens": 3, "model": fake.MODEL,
                                                                              "stream": True}]]))
    assert timings[0].error is not None and timings[0].error.startswith("HTTP 404")
    assert timings[1].error is not None and timings[1].error.startswith("HTTP 400")
    dropped, _ = asyncio.run(sl.run_load(fake_url + "/v1/chat/completions", [[{**_body("fuel", 3), "user": "drop"}]]))
    assert dropped[0].error == "the stream ended without [DONE] after 3 text chunks"
    refused, _ = asyncio.run(sl.run_load("http://127.0.0.1:9/v1/chat/completions", [[_body("fuel", 3)]]))
    assert refused[0].error is not None and refused[0].chunks == []


def test_prompts_are_distinct_and_128_tokens_long() -> None:
    from fuel.io.bundled import bundled_gguf
    from fuel.models.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(bundled_gguf("smollm2"))
    ids = [tok.encode_chat(bs.prompt_messages(f"0-{c}-{i}", 128)) for c in range(2) for i in range(2)]
    assert {len(x) for x in ids} == {128}
    head = tok.encode_chat([{"role": "system", "content": ""}])  # the template's own lead-in
    assert len({tuple(x[:len(head) + 3]) for x in ids}) == 4  # they differ within 3 tokens of the text


def test_peer_commands_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server gets -np and a context of 512 tokens a slot with continuous batching; every server
    listens on 127.0.0.1 with 2 threads, without this machine's OpenBLAS settings."""
    cmd = bs.server_command("llama_server", "m.gguf", 8123, 4)
    assert cmd[cmd.index("-np") + 1] == "4" and cmd[cmd.index("-c") + 1] == "2048" and "--cont-batching" in cmd
    assert cmd[cmd.index("-t") + 1] == "2"
    for e in bs.ENGINES:
        c = bs.server_command(e, "m.gguf", 8123, 4)
        assert c[c.index("--host") + 1] == "127.0.0.1" and c[c.index("--port") + 1] == "8123"
    lcp = bs.server_command("llama_cpp_python", "m.gguf", 8123, 4)
    assert lcp[lcp.index("--n_threads") + 1] == "2" and lcp[lcp.index("--interrupt_requests") + 1] == "False"
    assert bs.server_command("fuel", "m.gguf", 1, 8)[-2:] == ["--slots", "8"]
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    env = bs.server_env()
    assert "OPENBLAS_CORETYPE" not in env and "OMP_WAIT_POLICY" not in env


def test_harness_end_to_end_on_a_fake_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rounds at concurrency 1 and 2 with `fuel` served by the stand-in (as a subprocess, as the real
    servers are) and llama-server not built: the missing peer is reported with `make bench-env`, not a
    crash, the rounds' medians and spreads come out, and the JSON (the rounds too, as they run) and PNG are
    written."""
    monkeypatch.setattr(bs, "LLAMA_SERVER", tmp_path / "no-llama-server")
    real_missing, real_command = bs.missing, bs.server_command
    monkeypatch.setattr(bs, "missing", lambda e: None if e == "fuel" else real_missing(e))
    monkeypatch.setattr(bs, "server_command", lambda e, m, port, slots: (
        [sys.executable, "-m", "tests.fake_sse_server", str(port), "0.02", "0.002"] if e == "fuel"
        else real_command(e, m, port, slots)))
    sizes = bs.Sizes(output=6, requests=2, rounds=2, concurrency=(1, 2), warmup_tokens=2, start_timeout_s=60)
    assert bs.main(str(tmp_path), sizes, engines=("fuel", "llama_server")) == 0
    data = json.loads((tmp_path / "serve.json").read_text())
    assert "make bench-env" in data["results"]["llama_server"]["1"]["error"]
    for c, n in (("1", 2), ("2", 4)):
        r = data["results"]["fuel"][c]
        assert len(r["rounds"]) == 2 and all(x["requests"] == n and x["errors"] == 0 for x in r["rounds"])
        assert r["median"]["completion_tokens_per_request"] == 6
        lo, hi = r["spread"]["tokens_per_s"]
        assert lo <= r["median"]["tokens_per_s"] <= hi
        assert r["median"]["ttft_p50_ms"] >= 20
    assert data["summary"]["targets"]["C=4: tokens/s >= 2x llama-server"] is None
    assert data["meta"]["threads"] == 2 and data["meta"]["sizes"]["rounds"] == 2
    assert (tmp_path / "serve.png").stat().st_size > 1000
    kept = json.loads((tmp_path / "serve-rounds.json").read_text())  # written after every measurement
    assert [len(kept["fuel"][c]) for c in ("1", "2")] == [2, 2] and kept["llama_server"] == {"1": [], "2": []}


def test_summary_ratios_and_targets() -> None:
    def at(tps: float, lat: float) -> dict[str, Any]:
        return {"median": {"tokens_per_s": tps, "ttft_p50_ms": lat, "ttft_p99_ms": lat, "itl_p50_ms": lat,
                           "itl_p99_ms": lat}}

    results = {"fuel": {"1": at(100, 10), "4": at(300, 20), "8": at(260, 40)},
               "llama_server": {"1": at(80, 10), "4": at(120, 25), "8": at(116, 30)},
               "llama_cpp_python": {"1": {"error": "not installed: make bench-env"}}}
    s = bs.summarise(results)
    assert s["fuel_c4_over_c1"] == pytest.approx(3.0)
    assert s["fuel_over"]["llama_server"]["4"]["tokens_per_s"] == pytest.approx(2.5)
    assert s["fuel_over"]["llama_server"]["8"]["itl_p50_ms"] == pytest.approx(40 / 30)
    assert s["targets"] == {"fuel tokens/s at C=4 >= 2.5x at C=1": True, "C=4: tokens/s >= 2x llama-server": True,
                            "C=4: TTFT and ITL p50/p99 <= llama-server": True,
                            "C=8: tokens/s >= 2x llama-server": True,
                            "C=8: TTFT and ITL p50/p99 <= llama-server": False}
    assert s["fuel_over"]["llama_cpp_python"]["1"]["tokens_per_s"] is None


def test_a_server_that_fails_to_start_is_a_result(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bs, "server_command", lambda e, m, port, slots: [
        sys.executable, "-c", "import sys; print('no such model file'); sys.exit(3)"])
    r = bs.measure("fuel", 1, bs.Sizes(start_timeout_s=30), 0, "missing.gguf")
    assert r == {"error": "fuel exited with 3: no such model file"}


def test_cli_flag_reaches_the_harness(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from fuel import cli

    calls: list[tuple[Any, ...]] = []

    def fake_main(*a: Any) -> int:
        calls.append(a)
        return 0

    monkeypatch.setattr(bs, "main", fake_main)
    for key in ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE"):  # _bench sets them: restore them afterwards
        monkeypatch.setenv(key, os.environ.get(key, "PASSIVE" if key.startswith("OMP") else "1"))
    assert cli.main(["bench", "--serve", "--out", str(tmp_path)]) == 0
    assert calls == [(str(tmp_path),)]
    with pytest.raises(SystemExit):
        cli.main(["bench", "--serve", "--models"])
