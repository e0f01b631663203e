"""The serving engine: requests queue, then run together in batched steps over a paged KV cache.

    engine = Engine(load("smollm2"), slots=4)
    stream = engine.submit(Request(prompt_ids, max_tokens=64, sampler=Sampler()))
    for event in stream:              # Piece(text, token_ids, logprobs) ..., then Done(finish_reason, usage)
        ...
    engine.close()

**Continuous batching.** One thread runs steps. Before each step it admits queued requests into free slots
(up to `slots` sequences run at once), taking the cached blocks of each new prompt's longest cached prefix
(`kv_blocks.BlockPool`). A step is of one of two kinds (`batch_model`): a *decode step* gives one row to
every decoding sequence; a *prompt step* reads up to `prompt_rows` rows of the prompts still being read, in
arrival order, each prompt's next chunk. Waiting prompts go first while streams decode, until
`PAUSE_STEPS · prompt_rows` prompt rows have been read since their last token: a new request joins at the
next step, a burst of prompts (clients that came together) is read before decoding resumes, so its streams
then decode in step and the running ones pause once rather than at every prompt step, and a long prompt is
read a chunk per prompt step with the running streams getting a token at least after every such pause. A
finished or cancelled sequence leaves at once, its blocks released (the sealed ones stay cached).

**Invariance.** The two kinds round a row differently (prompt steps run QMatMul's tile path, decode steps
its decode path), so every prompt token is read in prompt steps and every generated token in decode steps,
alone or batched; within a kind a row's logits are the same bytes whatever shares its step (`batch_model`).
Each request samples with its own `Sampler` (its own seeded generator), and a cached block holds the bytes the
prompt would have computed: only blocks of prompt tokens are sealed (a generated token's K/V, from a decode
step, is not what a later prompt holding that token would compute). So a request's tokens are the same
whether it runs alone or among others.

**Shapes.** Each (rows, logit rows) shape is a capture of its own: a prompt step is padded to the next of a
few row counts (`prompt_buckets`; padding rows write spare slots and are never read) and its logit rows to
a power of two (repeating the last), so a steady load runs few shapes, which `warm` captures ahead.

**Sizing.** `slots` is at most `DECODE_ROWS`. The pool has room for every slot's full context plus one more
context of cached prefixes, so a running sequence always finds a block.

**Streams.** `submit` returns a `Stream` at once; the step thread puts events on it (through the caller's
asyncio loop when one is given). Text is decoded as it settles: a character split across tokens is sent
whole, and text a stop sequence may still claim is held back and never sent once it matches.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from itertools import pairwise
from typing import Any

import numpy as np

from fuel.errors import FuelError, ParamError
from fuel.models.generate import LLM
from fuel.models.generate_args import StopText
from fuel.serve.batch_model import DECODE_ROWS, BatchedLlama, prompt_rows_of
from fuel.serve.kv_blocks import ROOT, BlockPool
from fuel.serve.requests import Done, EngineStats, Piece, QueueFull, Request, Stream, TokenLogprob

__all__ = ["Done", "Engine", "EngineStats", "Piece", "QueueFull", "Request", "Stream", "TokenLogprob"]

log = logging.getLogger("fuel.serve")

PROMPT_STEP_ROWS = 256  # prompt rows a step reads by default (a step's cost: docs/performance/serve.md)
SMALLEST_BUCKET = 32  # a tile-path prompt step's fewest rows (above DECODE_ROWS, so QMatMul tiles it)
DECODE_BUCKET = 4  # a decode-sized prompt step (float models) runs a multiple of this many rows
PAUSE_STEPS = 4  # full prompt steps' rows read at most while streams wait for a token (module doc)


def _buckets(most: int) -> list[int]:
    """The row counts a prompt step is padded to, reading at most `most` rows: multiples of DECODE_BUCKET for
    decode-sized steps; else SMALLEST_BUCKET, 64, then multiples of 64 (at most 63 padding rows), and `most`."""
    if most <= DECODE_ROWS:
        return [*range(DECODE_BUCKET, most, DECODE_BUCKET), most]
    return sorted({SMALLEST_BUCKET, *range(64, most, 64), most})


class _Seq:
    """A running request: its tokens (prompt, then generated), how many have K/V in the cache, its blocks."""

    def __init__(self, req: Request, stream: Stream, tokenizer: Any) -> None:
        self.req, self.stream = req, stream
        self.tokens = list(req.prompt_ids)
        self.prompt_len = len(self.tokens)
        self.computed = 0
        self.blocks: list[int] = []
        self.sealed, self.parent = 0, ROOT
        self.cached = 0
        self.generated = 0
        self.text = tokenizer.stream()
        self.stop = StopText(req.stop)
        self.pending: Piece = Piece("", [], [])

    @property
    def decoding(self) -> bool:
        """Its prompt is read and its last sampled token is the one to run."""
        return self.generated > 0 and self.computed == len(self.tokens) - 1


class Engine:
    """Continuous batching over one model (module doc). Thread-safe: `submit` from any thread."""

    def __init__(self, llm: LLM, *, slots: int = 4, block_size: int = 16, max_queue: int = 64,
                 num_blocks: int | None = None, model_name: str = "fuel", prompt_rows: int = PROMPT_STEP_ROWS) -> None:
        for name, v, lo, hi in (("slots", slots, 1, DECODE_ROWS), ("block_size", block_size, 1, 4096),
                                ("max_queue", max_queue, 0, 1 << 20),
                                ("prompt_rows", prompt_rows, SMALLEST_BUCKET, 1 << 20)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ParamError(f"engine: {name} must be an int in [{lo}, {hi}], got {v!r}")
        self.llm, self.tokenizer, self.model_name = llm, llm.tokenizer, model_name
        self.slots, self.max_queue = slots, max_queue
        per_sequence = -(-BatchedLlama.context_of(llm.model) // block_size)
        blocks = num_blocks if num_blocks is not None else (slots + 1) * per_sequence
        if blocks < slots * per_sequence:
            raise ParamError(f"engine: num_blocks must be at least slots x blocks per sequence "
                             f"({slots} x {per_sequence}), got {blocks}")
        self.prompt_buckets = _buckets(min(prompt_rows, prompt_rows_of(llm.model)))
        most_padding = max(b - a for a, b in pairwise([0, *self.prompt_buckets])) - 1
        spare_blocks = -(-most_padding // block_size)  # the padding rows' (see _step), held for life
        self.batch = BatchedLlama(llm.model, blocks + spare_blocks, block_size)
        self.context = self.batch.max_context
        self.pool = BlockPool(blocks + spare_blocks, block_size)
        spare = [self.pool.allocate() for _ in range(spare_blocks)]
        self._spare_blocks = len(spare)  # not counted as used: no request holds them
        self._padding = [(spare[j // block_size], spare[j // block_size] * block_size + j % block_size)
                         for j in range(most_padding)]  # (block, slot) of each padding row
        self._pause_rows, self._paused = PAUSE_STEPS * self.prompt_buckets[-1], 0  # (module doc)
        self._waiting: deque[tuple[Request, Stream]] = deque()
        self._running: list[_Seq] = []
        self._cv = threading.Condition()
        self._closed = False
        self._counts = {"prompt_tokens": 0, "generated_tokens": 0, "prefill_s": 0.0, "decode_s": 0.0,
                        "requests": 0}
        self._thread = threading.Thread(target=self._loop, name="fuel-engine", daemon=True)
        self._thread.start()

    # -- the caller's side ----------------------------------------------------------------------------

    def submit(self, req: Request, loop: asyncio.AbstractEventLoop | None = None) -> Stream:
        """Queue a request; its events arrive on the returned stream. QueueFull past `max_queue` waiting."""
        n = len(req.prompt_ids)
        if isinstance(req.max_tokens, bool) or not isinstance(req.max_tokens, int) or req.max_tokens < 1:
            raise ParamError(f"engine: max_tokens must be an int >= 1, got {req.max_tokens!r}")
        if n < 1 or n >= self.context:
            raise ParamError(f"engine: the prompt has {n} tokens; it must have 1 to {self.context - 1} "
                             f"(the context is {self.context})")
        stream = Stream(self._wake, loop)
        with self._cv:
            if self._closed:
                raise ParamError("engine: closed")
            if len(self._waiting) + len(self._running) >= self.max_queue + self.slots:
                raise QueueFull(f"engine: {len(self._waiting)} requests are waiting (max_queue {self.max_queue})")
            self._waiting.append((req, stream))
            self._cv.notify()
        return stream

    def warm(self) -> int:
        """Capture the steps a steady load runs (each decoding count alone, each prompt bucket with one logit
        row, the largest with none) before any request comes, so the first requests do not wait for their
        tracing. Returns the shapes taken."""
        shapes = [(n, n) for n in range(1, self.slots + 1)]
        shapes += [(b, 1) for b in self.prompt_buckets] + [(self.prompt_buckets[-1], 0)]
        bs = self.pool.block_size
        with self._cv:
            if self._running or self._waiting:
                raise ParamError("engine: warm before the first request")
            shapes = [(m, r) for m, r in shapes if -(-m // bs) <= self.pool.free]  # a tiny pool: what fits
            blocks = [self.pool.allocate() for _ in range(-(-max(m for m, _ in shapes) // bs))]
            try:
                self.batch.warm(shapes, blocks)
            finally:
                self.pool.release(blocks)
        return len(shapes)

    def stats(self) -> EngineStats:
        with self._cv:
            c = dict(self._counts)
            return EngineStats(len(self._running), len(self._waiting), self.pool.used - self._spare_blocks,
                               self.pool.free, self.pool.hits, int(c["prompt_tokens"]), int(c["generated_tokens"]),
                               float(c["prefill_s"]), float(c["decode_s"]), int(c["requests"]))

    def close(self) -> None:
        """Stop the step thread; unfinished requests end "cancelled"."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    # -- the step thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._waiting and not self._running:
                    self._cv.wait()
                if self._closed:
                    break
                self._admit()
            self._drop_cancelled()
            if self._running:
                try:
                    self._step()
                except Exception as e:  # a fault of the engine, not of a request: end the step's requests
                    log.exception("engine step failed")
                    for s in list(self._running):
                        self._finish(s, "stop", error=f"engine error: {e}")
        for s in list(self._running):
            self._finish(s, "cancelled")
        with self._cv:
            for _, stream in self._waiting:
                stream._put(Done("cancelled", 0, 0, 0))
            self._waiting.clear()

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.slots:
            req, stream = self._waiting.popleft()
            if stream.cancelled:
                stream._put(Done("cancelled", len(req.prompt_ids), 0, 0))
                continue
            s = _Seq(req, stream, self.tokenizer)
            # the last prompt token always runs: its logits give the first new token
            s.blocks, s.parent = self.pool.match_prefix(s.tokens, len(s.tokens) - 1)
            s.sealed = len(s.blocks)
            s.computed = s.cached = s.sealed * self.pool.block_size
            self._running.append(s)

    def _drop_cancelled(self) -> None:
        for s in [s for s in self._running if s.stream.cancelled]:
            self._finish(s, "cancelled")

    def _step(self) -> None:
        """One batched step: a prompt step while prompts wait (while streams decode, until PAUSE_STEPS full
        prompt steps' rows are read), else a decode step (module doc)."""
        decoding = [s for s in self._running if s.decoding]
        prompt = len(decoding) < len(self._running) and (self._paused < self._pause_rows or not decoding)
        rows: list[tuple[_Seq, int]] = []  # (sequence, position)
        logit_of: list[tuple[_Seq, int]] = []  # (sequence, row)
        if prompt:  # each prompt's next chunk, in arrival order, up to the largest bucket
            most = self.prompt_buckets[-1]
            for s in self._running:
                if s.decoding or len(rows) == most:
                    continue
                c = min(len(s.tokens) - s.computed, most - len(rows))
                rows.extend((s, s.computed + j) for j in range(c))
                if s.computed + c == len(s.tokens):
                    logit_of.append((s, len(rows) - 1))
        else:
            for s in decoding:
                rows.append((s, s.computed))
                logit_of.append((s, len(rows) - 1))
        bs = self.pool.block_size
        for s, p in rows:
            while len(s.blocks) <= p // bs:
                s.blocks.append(self.pool.allocate())
        # a prompt step is padded to its bucket (module doc): each padding row is a distinct slot of the spare
        # blocks at position 0, its logits never read; no real row's bytes depend on it (batch_model)
        pad = next(b for b in self.prompt_buckets if b >= len(rows)) - len(rows) if prompt else 0
        m = len(rows) + pad
        tokens = np.array([s.tokens[p] for s, p in rows] + [0] * pad, np.int64)
        positions = np.array([p for _, p in rows] + [0] * pad, np.int64)
        slots = np.array([s.blocks[p // bs] * bs + p % bs for s, p in rows] + [t for _, t in self._padding[:pad]],
                         np.int64)
        tables = np.zeros((m, self.batch.max_blocks), np.int64)
        for r, (s, _) in enumerate(rows):
            tables[r, :len(s.blocks)] = s.blocks
        for j, (b, _) in enumerate(self._padding[:pad]):
            tables[len(rows) + j, 0] = b
        picked = [r for _, r in logit_of]
        if prompt and picked:  # a power of two of logit rows, the last repeated (module doc)
            picked += picked[-1:] * ((1 << (len(picked) - 1).bit_length()) - len(picked))
        start = time.perf_counter()
        logits = self.batch.step(tokens, positions, slots, tables, np.array(picked, np.int64))
        spent = time.perf_counter() - start
        with self._cv:
            if prompt:
                self._counts["prompt_tokens"] += len(rows)
            self._counts["prefill_s" if prompt else "decode_s"] += spent
        self._paused = self._paused + len(rows) if prompt else 0
        for s, _ in rows:
            s.computed += 1
        for s in {id(s): s for s, _ in rows}.values():
            while (s.sealed + 1) * bs <= min(s.computed, s.prompt_len):  # prompt blocks only (module doc)
                b = s.sealed
                s.parent = self.pool.seal(s.blocks[b], s.parent, s.tokens[b * bs:(b + 1) * bs])
                s.sealed += 1
        for j, (s, _) in enumerate(logit_of):
            try:
                self._next_token(s, logits[j])
            except FuelError as e:  # this request's sampler or grammar refused: it ends, the others go on
                log.warning("request ended by %s: %s", type(e).__name__, e)
                self._finish(s, "stop", error=str(e))

    def _next_token(self, s: _Seq, logits: np.ndarray) -> None:
        req = s.req
        mask = req.grammar.mask() if req.grammar is not None else None
        k = req.logprobs
        if k is None:  # the token alone: no log-sum-exp over the vocabulary (the same token either way)
            choice, t = None, req.sampler(logits, s.tokens, prompt_len=s.prompt_len, mask=mask)
        else:
            choice = req.sampler.choose(logits, s.tokens, prompt_len=s.prompt_len, mask=mask, top_logprobs=k)
            t = choice.token
        with self._cv:
            self._counts["generated_tokens"] += 1
        if t in self.tokenizer.eos_ids and not req.ignore_eos:
            self._finish(s, "stop")
            return
        s.tokens.append(t)
        s.generated += 1
        if req.grammar is not None:
            req.grammar.advance(t)
        s.pending.token_ids.append(t)
        if choice is not None:
            s.pending.logprobs.append(TokenLogprob(t, choice.logprob, list(choice.top)))
        text, stopped = s.stop.push(s.text.push(t))
        s.pending.text += text
        if stopped or (req.grammar is not None and req.grammar.is_complete()):
            self._finish(s, "stop", stopped=stopped)
        elif s.generated >= req.max_tokens or len(s.tokens) >= self.context:
            self._finish(s, "length")
        else:
            self._send(s)

    def _send(self, s: _Seq) -> None:
        if s.pending.token_ids or s.pending.text:
            s.stream._put(s.pending)
            s.pending = Piece("", [], [])

    def _finish(self, s: _Seq, reason: str, error: str | None = None, stopped: bool = False) -> None:
        if reason != "cancelled" and not stopped:
            text, stopped = s.stop.push(s.text.flush())
            s.pending.text += text + ("" if stopped else s.stop.flush())
        if reason != "cancelled":
            self._send(s)
        self._running.remove(s)
        self.pool.release(s.blocks)
        s.blocks = []
        with self._cv:
            self._counts["requests"] += 1
        s.stream._put(Done(reason, s.prompt_len, s.generated, s.cached, error))
