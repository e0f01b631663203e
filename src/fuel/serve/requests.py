"""What a request to the serving engine is and what comes back: `Request`, the `Stream` of `Piece`s ended by
a `Done`, and the engine's counters (`EngineStats`). The engine (`fuel.serve.engine`) re-exports them.

A stream is filled by the engine's step thread and read by the caller: with `for` when submitted without an
event loop, or with `async for` when submitted with one (events then arrive through that loop, so a server's
handlers never block on the step thread).
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fuel.errors import FuelError, ParamError
from fuel.models.sampling import Sampler


@dataclass(frozen=True)
class Request:
    """One generation: prompt ids (checked by the caller against the vocabulary), at most `max_tokens`
    new tokens, its sampler, stop strings, `logprobs` (None, or k: the chosen token's and the k most
    likely), a structured-output grammar (`fuel.serve.grammar.Grammar`) and whether to run past EOS."""

    prompt_ids: list[int]
    max_tokens: int
    sampler: Sampler
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    grammar: Any = None
    ignore_eos: bool = False


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Piece:
    """Settled text and the tokens that gave it (a piece may carry tokens and no text yet)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]


@dataclass
class Done:
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None


class QueueFull(FuelError, RuntimeError):
    """The queue holds `max_queue` requests: try again later (the server answers 429)."""


@dataclass
class EngineStats:
    running: int
    queued: int
    blocks_used: int
    blocks_free: int
    prefix_hits: int  # prompt tokens served from the prefix cache
    prompt_tokens: int  # prompt tokens run through the model
    generated_tokens: int
    prefill_s: float
    decode_s: float
    requests: int  # finished


class Stream:
    """A request's events (module doc): iterate it, or `async for` when submitted with a loop."""

    def __init__(self, wake: Callable[[], None], loop: asyncio.AbstractEventLoop | None) -> None:
        self._wake, self._loop = wake, loop
        self._sync: queue.Queue[Piece | Done] = queue.Queue()
        self._async: asyncio.Queue[Piece | Done] | None = asyncio.Queue() if loop is not None else None
        self.cancelled = False
        self.done: Done | None = None

    def _put(self, ev: Piece | Done) -> None:
        if self._async is None:
            self._sync.put(ev)
            return
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._async.put_nowait, ev)
        except RuntimeError:  # the caller's loop is closed: nobody reads this stream any more
            self.cancelled = True

    def cancel(self) -> None:
        """Stop the generation; its blocks are released before the next step."""
        self.cancelled = True
        self._wake()

    def __iter__(self) -> Iterator[Piece | Done]:
        if self._async is not None:
            raise ParamError("stream: submitted with an event loop; read it with `async for`")
        while self.done is None:
            ev = self._sync.get()
            if isinstance(ev, Done):
                self.done = ev
            yield ev

    async def __aiter__(self) -> AsyncIterator[Piece | Done]:
        if self._async is None:
            raise ParamError("stream: submitted without an event loop; iterate it with `for`")
        while self.done is None:
            ev = await self._async.get()
            if isinstance(ev, Done):
                self.done = ev
            yield ev
