"""The arguments of a generation (`fuel.models.generate`), checked before anything runs: each error a
`ParamError` (a `ModelError` for a token id outside the vocabulary) naming the argument and what came.
The sampling arguments are checked by `Sampler` itself, once, wherever it is built."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fuel.errors import ParamError
from fuel.models.llama_weights import check_ids
from fuel.models.sampling import is_int
from fuel.models.tokenizer import GGUFTokenizer, lone_surrogate


def check_text(text: str, what: str) -> None:
    """A ParamError naming `what` for text that is not valid Unicode (a lone surrogate, which UTF-8 cannot
    encode: e.g. undecodable bytes of a command line)."""
    at = lone_surrogate(text)
    if at is not None:
        raise ParamError(f"generate: {what} holds a lone surrogate {text[at]!r} at index {at}; "
                         "text must be valid Unicode (encodable as UTF-8)")


def stops_of(stop: Any) -> tuple[str, ...]:
    """`stop` (None, a str or a list/tuple of str) as a tuple of non-empty strings."""
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, list | tuple) or not all(isinstance(s, str) and s for s in stops):
        raise ParamError(f"generate: stop must be None, a non-empty str or a list of them, got {stop!r}")
    for s in stops:
        check_text(s, "a stop sequence")
    return tuple(stops)


def encode_prompt(tok: GGUFTokenizer, vocab: int, prompt: Any, chat: Any = False) -> list[int]:
    """The ids of a prompt: a str (with `chat`, the model's chat template for one user message around it),
    a list of chat messages (dicts with str "role" and "content"; always templated) or a list of token ids
    (run as given, each in [0, vocab)). Checked: a ParamError (ModelError for a token id) names what is
    wrong, an empty prompt included."""
    if not isinstance(chat, bool):
        raise ParamError(f"generate: chat must be a bool, got {chat!r}")
    if isinstance(prompt, str):
        check_text(prompt, "the prompt")
        ids = tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    elif isinstance(prompt, list | tuple) and prompt and all(isinstance(m, Mapping) for m in prompt):
        for i, m in enumerate(prompt):
            if not all(isinstance(m.get(k), str) for k in ("role", "content")):
                raise ParamError(f"generate: chat message {i} must have str 'role' and 'content', got {m!r}")
            check_text(m["content"], f"chat message {i}")
        ids = tok.encode_chat(prompt)
    elif isinstance(prompt, list | tuple | np.ndarray) and all(is_int(t) for t in prompt):
        if chat:
            raise ParamError("generate: chat=True wraps a str prompt in the chat template; token ids run as given")
        ids = check_ids(prompt, vocab, "generate: prompt")
    else:
        raise ParamError("generate: prompt must be a str, a list of token ids or a list of chat messages, "
                         f"got {_describe(prompt)}")
    if not ids:
        raise ParamError("generate: the prompt is empty (it has no tokens)")
    return ids


def _describe(v: Any) -> str:
    if isinstance(v, list | tuple):
        kinds = sorted({type(x).__name__ for x in v})
        return f"an empty {type(v).__name__}" if not v else f"a {type(v).__name__} of {', '.join(kinds)}"
    return type(v).__name__


class StopText:
    """The text of a generation with its stop sequences cut (`fuel.models.generate`'s module doc): `push` a
    piece, get what is settled and whether a stop sequence was reached; `flush` the held end once no token
    follows. Shared by `fuel generate` and the serving engine."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops, self.held = stops, ""

    def push(self, piece: str) -> tuple[str, bool]:
        if not self.stops:
            return piece, False
        held = self.held + piece
        hits = [(i + len(s), i) for s, i in ((s, held.find(s)) for s in self.stops) if i >= 0]
        if hits:  # the stop sequence that completes first (a longer one first where two end together)
            self.held = ""
            return held[:min(hits)[1]], True
        # the longest end of the text that begins a stop sequence stays held
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(held)), 0, -1)
                    if held.endswith(s[:k])), default=0)
        self.held = held[len(held) - keep:]
        return held[:len(held) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
