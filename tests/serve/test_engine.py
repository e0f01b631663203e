"""The serving engine: batched steps against the one-sequence model, batch invariance, prefix caching,
chunked prefill, cancellation and the queue bound, on the bundled SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest

from fuel.errors import ParamError
from fuel.models.generate import LLM, load
from fuel.models.sampling import Sampler
from fuel.serve.batch_model import DECODE_ROWS
from fuel.serve.engine import Done, Engine, Piece, QueueFull, Request

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "Once upon a time, in a land far away, there lived a", "def fibonacci(n):",
           "The three primary colors are", "Translate to French: good morning", "A list of fruits:"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return load("smollm2", context=512)


@pytest.fixture(scope="module")
def engine(llm: LLM) -> Engine:
    eng = Engine(llm, slots=4, block_size=16)
    yield eng
    eng.close()


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.prompt_ids(text, chat=True)


def _run(stream: object) -> tuple[list[int], str, Done, list[float]]:
    tokens, text, logprobs = [], "", []
    done = None
    for ev in stream:  # type: ignore[attr-defined]
        if isinstance(ev, Piece):
            tokens += ev.token_ids
            text += ev.text
            logprobs += [lp.logprob for lp in ev.logprobs]
        else:
            done = ev
    assert isinstance(done, Done) and done.error is None, done
    return tokens, text, done, logprobs


def _greedy(ids: list[int], n: int, **kw: object) -> Request:
    return Request(ids, n, Sampler(), logprobs=0, **kw)  # type: ignore[arg-type]


def test_batched_logits_match_the_one_sequence_model_per_row(llm: LLM, engine: Engine) -> None:
    """The batched step (PagedAttn over blocks, index_copy into the cache) against LlamaModel's own
    prefill/decode (FlashAttn over a contiguous cache), which tests/models check against transformers and
    llama.cpp: each row's logits within a per-row tolerance, the same argmax."""
    ids = _ids(llm, PROMPTS[0])
    seq = llm.model.sequence()
    want = [seq.prefill(ids)]
    bm, bs = engine.batch, engine.pool.block_size
    blocks = [engine.pool.allocate() for _ in range(-(-(len(ids) + 3) // bs))]
    try:
        table = np.zeros((1, bm.max_blocks), np.int64)
        table[0, :len(blocks)] = blocks
        got = []
        pos = 0
        toks = list(ids)
        assert len(toks) - 5 > DECODE_ROWS
        for chunk in (toks[:5], toks[5:]):  # a decode-sized chunk, a prompt step's (tile path), three decode steps
            n = len(chunk)
            p = np.arange(pos, pos + n)
            out = bm.step(np.array(chunk), p, np.array([blocks[q // bs] * bs + q % bs for q in p]),
                          np.repeat(table, n, 0), np.array([n - 1]))
            pos += n
        got.append(out[0])
        for _ in range(3):
            t = int(np.argmax(got[-1]))
            want.append(seq.decode(t))
            out = bm.step(np.array([t]), np.array([pos]), np.array([blocks[pos // bs] * bs + pos % bs]),
                          table, np.array([0]))
            got.append(out[0])
            pos += 1
    finally:
        engine.pool.release(blocks)
    for g, w in zip(got, want, strict=True):
        assert np.argmax(g) == np.argmax(w)
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-3 * float(np.abs(w).max()))  # per row


def test_each_request_gives_alone_exactly_what_it_gives_in_a_batch(llm: LLM, engine: Engine) -> None:
    """Greedy and seeded requests, solo, then all at once (a long prompt joining while others decode):
    the same tokens and the same logprob bytes."""
    def requests() -> list[Request]:  # a Sampler's generator is its own: each run gets fresh ones
        reqs = [_greedy(_ids(llm, p), 12) for p in PROMPTS[:3]]
        seeded = Sampler(temperature=0.9, top_p=0.95, seed=7)
        return [*reqs, Request(_ids(llm, PROMPTS[3] * 6), 12, seeded, logprobs=2)]

    solo = [_run(engine.submit(r)) for r in requests()]
    streams = [engine.submit(r) for r in requests()]
    together = [_run(s) for s in streams]
    for (t1, x1, _, l1), (t2, x2, _, l2) in zip(solo, together, strict=True):
        assert t1 == t2 and x1 == x2 and l1 == l2
    assert all(len(t) > 0 for t, *_ in solo)


def test_a_repeated_prompt_reads_its_prefix_from_the_cache(llm: LLM, engine: Engine) -> None:
    ids = _ids(llm, "Repeat after me: " + "alpha beta gamma delta " * 8)
    first = _run(engine.submit(_greedy(ids, 6)))
    second = _run(engine.submit(_greedy(ids, 6)))
    # the chat template's system prompt may be cached by earlier requests; the second run has every full block
    assert second[2].cached_tokens == (len(ids) - 1) // 16 * 16 > first[2].cached_tokens
    assert first[0] == second[0] and first[3] == second[3]


def test_a_continued_conversation_gives_what_it_gives_on_a_cold_cache(llm: LLM, engine: Engine) -> None:
    """A prompt holding an earlier answer: that answer's K/V came from decode steps, which round differently
    from the prompt steps that read it now, so its blocks are never sealed; the request reuses the earlier
    prompt's blocks only, and its tokens are those of a fresh engine that never saw the first request."""
    first_ids = _ids(llm, "Name three rivers of Europe.")
    answer = _run(engine.submit(_greedy(first_ids, 20)))[0]
    ids = first_ids + answer + llm.tokenizer.encode(" And two more?", add_bos=False)
    warm = _run(engine.submit(_greedy(ids, 8)))
    assert warm[2].cached_tokens == len(first_ids) // 16 * 16  # the first prompt's whole blocks, none after
    fresh = Engine(llm, slots=1, block_size=16)
    try:
        cold = _run(fresh.submit(_greedy(ids, 8)))
    finally:
        fresh.close()
    assert cold[2].cached_tokens == 0 and warm[0] == cold[0] and warm[3] == cold[3]


def test_stop_strings_are_cut_and_never_sent(llm: LLM, engine: Engine) -> None:
    ids = _ids(llm, "Count from 1 to 10, separated by commas.")
    full = _run(engine.submit(_greedy(ids, 24)))[1]
    assert ", 4" in full, full
    _, text, done, _ = _run(engine.submit(_greedy(ids, 24, stop=(", 4",))))
    assert done.finish_reason == "stop" and text == full[:full.index(", 4")]


def test_cancelled_streams_free_their_blocks(llm: LLM, engine: Engine) -> None:
    streams = [engine.submit(_greedy(_ids(llm, p), 200)) for p in PROMPTS[:4]]
    for s in streams:
        for ev in s:
            if isinstance(ev, Piece) and ev.token_ids:
                s.cancel()
                break
    for s in streams:
        for _ in s:
            pass
        assert s.done is not None and s.done.finish_reason == "cancelled"
    assert engine.stats().blocks_used == 0 and engine.stats().running == 0


def test_the_queue_bound_and_bad_requests(llm: LLM) -> None:
    eng = Engine(llm, slots=1, max_queue=1)
    try:
        buckets = eng.prompt_buckets
        assert buckets == [32, 64, 128, 192, 256]  # SmolLM2 is quantized: prompt steps on the tile path
        assert eng.warm() == 2 + len(buckets) and eng.batch._step.captures == 1 + len(buckets)
        assert eng.batch._fill.captures == 1
        assert eng.stats().blocks_used == 0
        first = eng.submit(_greedy(_ids(llm, PROMPTS[0]), 40))
        eng.submit(_greedy(_ids(llm, PROMPTS[1]), 40))
        with pytest.raises(QueueFull, match="max_queue 1"):
            eng.submit(_greedy(_ids(llm, PROMPTS[2]), 40))
        first.cancel()
        with pytest.raises(ParamError, match="the context is 512"):
            eng.submit(_greedy([1] * 600, 4))
        with pytest.raises(ParamError, match="max_tokens must be an int >= 1, got 0"):
            eng.submit(_greedy([1, 2], 0))
    finally:
        eng.close()
    with pytest.raises(ParamError, match=f"slots must be an int in \\[1, {DECODE_ROWS}\\]"):
        Engine(llm, slots=DECODE_ROWS + 1)
    with pytest.raises(ParamError, match="prompt_rows must be an int in \\[32, "):
        Engine(llm, prompt_rows=16)
