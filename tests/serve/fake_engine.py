"""An engine with the contract's surface (`submit`, `stats`, `close`, `llm`, `tokenizer`, `model_name`,
`context`) that "generates" a fixed text through SmolLM2's real tokenizer, so the app's tests run without
the model. Requests are recorded (`requests`), each holds one KV "block" while it runs, and `gate` (when
cleared) pauses every generation after its first token, for disconnect tests."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

from fuel.models.generate import describe, model_path
from fuel.models.generate_args import StopText
from fuel.serve.engine import Done, EngineStats, Piece, QueueFull, Request, TokenLogprob

TEXT = " The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 🦊 done."


class FakeStream:
    def __init__(self, engine: FakeEngine, loop: asyncio.AbstractEventLoop | None) -> None:
        self.engine, self.loop = engine, loop
        self.queue: asyncio.Queue[Piece | Done] = asyncio.Queue()
        self.cancelled = threading.Event()

    def put(self, ev: Piece | Done) -> None:
        assert self.loop is not None
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()
        self.engine.cancels += 1

    async def __aiter__(self) -> Any:
        while True:
            ev = await self.queue.get()
            yield ev
            if isinstance(ev, Done):
                return


class FakeEngine:
    def __init__(self, *, context: int = 256, max_queue: int = 64, delay: float = 0.0, error: str | None = None,
                 cached: int = 0) -> None:
        _, self.tokenizer, cfg = describe(model_path("smollm2"))
        self.llm = SimpleNamespace(model=SimpleNamespace(cfg=cfg), tokenizer=self.tokenizer)
        self.model_name, self.context, self.max_queue = "fake-smollm2", context, max_queue
        self.delay, self.error, self.cached = delay, error, cached
        self.output = self.tokenizer.encode(TEXT, add_bos=False)
        self.requests: list[Request] = []
        self.gate = threading.Event()
        self.gate.set()
        self.running = self.blocks = self.cancels = self.generated = 0
        self.lock = threading.Lock()

    def submit(self, req: Request, loop: asyncio.AbstractEventLoop | None = None) -> FakeStream:
        assert isinstance(req, Request)
        assert loop is not None, "the app submits with its running loop"
        with self.lock:
            if self.running >= self.max_queue:
                raise QueueFull(f"engine: {self.running} requests are waiting (max_queue {self.max_queue})")
            self.requests.append(req)
            self.running += 1
            self.blocks += 1
        stream = FakeStream(self, loop)
        threading.Thread(target=self._run, args=(req, stream), daemon=True).start()
        return stream

    def _run(self, req: Request, stream: FakeStream) -> None:
        text, stop = self.tokenizer.stream(), StopText(req.stop)
        reason, n, stopped = "length", 0, False
        try:
            for i, t in enumerate(self.output + [self.tokenizer.eos_id]):
                if i == 1:
                    self.gate.wait()
                if stream.cancelled.is_set():
                    reason = "cancelled"
                    break
                if t == self.tokenizer.eos_id and not req.ignore_eos:
                    reason = "stop"
                    break
                n += 1
                lp = None if req.logprobs is None else TokenLogprob(t, -0.25 * (i + 1), [
                    (int(c), -0.25 * (i + 1) - j) for j, c in enumerate([t, 1, 2, 3, 4, 5, 6][:req.logprobs])])
                piece, stopped = stop.push(text.push(t))
                stream.put(Piece(piece, [t], [] if lp is None else [lp]))
                if stopped:
                    reason = "stop"
                    break
                if n == req.max_tokens:
                    break
                time.sleep(self.delay)
            if reason != "cancelled" and not stopped:
                rest, stopped = stop.push(text.flush())
                rest += "" if stopped else stop.flush()
                if rest:
                    stream.put(Piece(rest, [], []))
        finally:
            with self.lock:
                self.running -= 1
                self.blocks -= 1
                self.generated += n
            stream.put(Done(reason, len(req.prompt_ids), n, min(self.cached, len(req.prompt_ids)), self.error))

    def stats(self) -> EngineStats:
        with self.lock:
            return EngineStats(self.running, 0, self.blocks, 100 - self.blocks, self.cached, 7, self.generated,
                               0.5, 0.0, len(self.requests))

    def close(self) -> None:
        self.gate.set()
