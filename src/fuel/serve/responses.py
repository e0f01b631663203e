"""OpenAI's response objects for the engine's output: `chat.completion` and `text_completion` objects, their
streamed chunks (`chat.completion.chunk` with a `delta`, the first one carrying the role), the final usage
chunk (`choices: []`, sent when `stream_options.include_usage`), usage with
`prompt_tokens_details.cached_tokens`, and logprobs in each endpoint's shape: chat's
`{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`, completions' `{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fuel.models.tokenizer import GGUFTokenizer
    from fuel.serve.engine import Done, TokenLogprob


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def usage(done: Done) -> dict[str, Any]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


def token_text(tok: GGUFTokenizer, token: int) -> str:
    """A token's own text (special tokens spelled out; a token holding part of a character shows U+FFFD)."""
    return tok.decode([token])


def _entry(tok: GGUFTokenizer, token: int, logprob: float) -> dict[str, Any]:
    s = token_text(tok, token)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(tok: GGUFTokenizer, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {"content": [{**_entry(tok, lp.token, lp.logprob),
                         "top_logprobs": [_entry(tok, t, p) for t, p in lp.top]} for lp in lps]}


def completion_logprobs(tok: GGUFTokenizer, lps: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """`offset`: the characters of completion text before these tokens (text_offset counts from there)."""
    tokens, offsets = [], []
    for lp in lps:
        s = token_text(tok, lp.token)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    tops = []
    for lp in lps:
        top: dict[str, float] = {}
        for t, p in lp.top:
            top.setdefault(token_text(tok, t), p)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": tops,
            "text_offset": offsets}


class Builder:
    """The objects of one response (one id, one creation time), for either endpoint."""

    def __init__(self, chat: bool, model: str, tokenizer: GGUFTokenizer, logprobs: bool) -> None:
        self.chat, self.model, self.tok, self.logprobs = chat, model, tokenizer, logprobs
        self.id, self.created = new_id(chat), now()
        self.offset = 0  # completion characters streamed so far (text_offset of the next chunk)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def _logprobs(self, lps: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return chat_logprobs(self.tok, lps) if self.chat else completion_logprobs(self.tok, lps, offset)

    def whole(self, text: str, lps: Sequence[TokenLogprob], done: Done) -> dict[str, Any]:
        """The non-streamed answer."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                                      "logprobs": self._logprobs(lps), "finish_reason": done.finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage(done)}
        choice = {"index": 0, "text": text, "logprobs": self._logprobs(lps), "finish_reason": done.finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage(done)}

    def first(self) -> dict[str, Any] | None:
        """Chat's first chunk, carrying the role (completions have none)."""
        if not self.chat:
            return None
        return self._chunk({"role": "assistant", "content": ""}, None, None)

    def piece(self, text: str, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        chunk = self._chunk({"content": text} if self.chat else text, self._logprobs(lps, self.offset), None)
        self.offset += len(text)
        return chunk

    def last(self, done: Done) -> dict[str, Any]:
        """The chunk carrying finish_reason."""
        return self._chunk({} if self.chat else "", None, done.finish_reason)

    def usage_chunk(self, done: Done) -> dict[str, Any]:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(done)}

    def _chunk(self, delta: Any, logprobs: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}
