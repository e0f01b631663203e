"""The engine's interface classes as SERVE_CONTRACT.md gives them, installed as `fuel.serve.engine` while the
real module cannot be imported (so the app's tests run against the fake engine)."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

from fuel.errors import FuelError


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampler: Any
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
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]


@dataclass
class Done:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None


class QueueFull(FuelError, RuntimeError):
    pass


@dataclass
class EngineStats:
    running: int
    queued: int
    blocks_used: int
    blocks_free: int
    prefix_hits: int
    prompt_tokens: int
    generated_tokens: int
    prefill_s: float
    decode_s: float
    requests: int


def install() -> tuple[Any, ...]:
    classes = (Done, EngineStats, Piece, QueueFull, Request, TokenLogprob)
    mod = types.ModuleType("fuel.serve.engine")
    for c in classes:
        setattr(mod, c.__name__, c)
    sys.modules["fuel.serve.engine"] = mod
    return classes
