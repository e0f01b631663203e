"""One sequence on a `LlamaModel`: its KV cache, its position and the steps captured over that cache.

    seq = model.acquire(ids)                  # lent by the model's pool (or model.sequence(): owned)
    logits = seq.prefill(ids[seq.common_prefix(ids):])   # runs from seq.pos on: the prefix is cached
    logits = seq.decode(next_id)              # one token: one replay of the captured step
    model.release(seq)

**Why per sequence.** The KV cache is state: two generations writing one cache (two iterators stepped in
turn, two threads) would each attend over the other's rows. So each sequence owns its caches, one
`[1, Hkv, capacity, D]` float32 array per layer for K and for V, and its own `fl.jit` captures of the
decode step and the prefill chunks. A capture reads the arrays it traced (its native replay holds their
addresses), so it is bound to one sequence's caches: switching sequences copies nothing and re-traces
nothing. The weights are the model's, shared by every capture. A sequence's first decode and first
prefill chunk of each size trace and plan their step (`fuel generate` does it in its warm-up); the
model's pool lends sequences again, so a server or a chat pays that once per sequence, not per request.

**Threads.** Every step holds the model's lock (an RLock): steps of any sequences of one model run one at
a time, in whatever order their callers interleave them, from any threads. One sequence is not meant to
be stepped from two threads at once (its tokens would interleave); the pool lends each to one caller.

**Tokens.** `tokens` are the ids whose K/V rows the cache holds, positions 0 … pos − 1: what prefill and
decode ran, cut back by `rewind`. A chunk's padding rows (prefill) lie past the position and are
overwritten by later tokens, never read.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

import fuel as fl
from fuel.errors import ParamError
from fuel.models.llama_weights import ModelError

if TYPE_CHECKING:
    from fuel.models.llama import LlamaModel

PREFILL_BUCKETS = (8, 16, 32, 64, 128, 256)
CACHE_ONLY: Any = object()  # `LlamaModel.forward`'s rows for a prefill chunk whose logits nobody reads
Caches = tuple[list[np.ndarray], list[np.ndarray]]  # per layer: K caches, V caches


class KVSequence:
    """A sequence's KV cache, position (`pos`, the length of `tokens`) and captured steps; see the module doc."""

    def __init__(self, model: LlamaModel) -> None:
        cfg = model.cfg
        self.model = model
        self.capacity = model.capacity
        shape = (1, cfg.kv_heads, model.capacity, cfg.head_dim)
        self.k_cache = [np.zeros(shape, np.float32) for _ in range(cfg.layers)]
        self.v_cache = [np.zeros(shape, np.float32) for _ in range(cfg.layers)]
        caches: Caches = (self.k_cache, self.v_cache)
        self.decode_step = fl.jit(lambda x, *tables: model.forward(x, tables, caches))
        self.prefill_step = fl.jit(lambda x, *tables: model.forward(x, tables, caches, rows=CACHE_ONLY))
        self.prefill_last_step = fl.jit(lambda x, row, *tables: model.forward(x, tables, caches, rows=row))
        self.tokens: list[int] = []
        self.in_use = threading.Lock()  # held by the generation running on this sequence

    @property
    def pos(self) -> int:
        """The next token's position: the number of tokens the cache holds."""
        return len(self.tokens)

    def common_prefix(self, ids: Sequence[int]) -> int:
        """How many leading ids of `ids` the cache already holds."""
        n, limit = 0, min(len(ids), len(self.tokens))
        while n < limit and ids[n] == self.tokens[n]:
            n += 1
        return n

    def rewind(self, pos: int) -> None:
        """Keep the first `pos` tokens; later ones start there (their cache rows are overwritten)."""
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos <= self.pos:
            raise ParamError(f"rewind: pos must be an int in [0, {self.pos}] (the tokens cached), got {pos!r}")
        del self.tokens[pos:]

    def reset(self) -> None:
        """Forget every token: later ones start at position 0."""
        self.tokens.clear()

    def _check_room(self, rows: int) -> None:
        if self.pos + rows > self.capacity:
            raise ModelError(f"model: {self.pos + rows} tokens do not fit the KV cache of {self.capacity}; "
                             "load the model with a larger capacity")

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Run the prompt `ids` from the current position; the logits `[vocab]` after its last token.
        Every id is checked before anything runs."""
        todo = self.model.check_ids(ids, "prefill")
        if not todo:
            raise ParamError("prefill: the prompt has no tokens")
        with self.model.lock:
            self._check_room(len(todo))
            return self._prefill(todo)

    def _prefill(self, todo: list[int]) -> np.ndarray:
        model, cfg = self.model, self.model.cfg
        logits = np.empty(0, np.float32)
        while todo:
            bucket = next((b for b in PREFILL_BUCKETS if b >= len(todo)), PREFILL_BUCKETS[-1])
            chunk, todo = todo[:bucket], todo[bucket:]
            pos = self.pos
            # the padding's cache rows must fit too (they lie past the live length, never read)
            if len(chunk) == 1 or pos + bucket > self.capacity:
                # one token, or too close to the end for a padded chunk: one token at a time
                for t in chunk:
                    logits = self._decode(t)
                continue
            x = np.zeros((bucket, cfg.hidden), np.float32)
            x[:len(chunk)] = model.embed(chunk)
            # the chunk's queries align with the keys' end (causal), padding included; see LlamaModel
            env = {"pos": pos} | ({"k_len": pos + bucket} if cfg.layers > 1 else {})
            tables = model.tables(pos, bucket)
            if todo:
                self.prefill_step(x, *tables, **env)
            else:  # the last chunk: the logits after its last live row
                row = np.array([len(chunk) - 1], np.int64)
                out = self.prefill_last_step(x, row, *tables, **env, last_len=pos + len(chunk))
                logits = np.asarray(out.numpy()).reshape(-1)
            self.tokens.extend(chunk)
        return logits

    def decode(self, token: int) -> np.ndarray:
        """Run one token at the current position; its logits `[vocab]`."""
        (t,) = self.model.check_ids([token], "decode")
        with self.model.lock:
            self._check_room(1)
            return self._decode(t)

    def _decode(self, t: int) -> np.ndarray:
        pos = self.pos
        out = self.decode_step(self.model.embed([t]), *self.model.tables(pos, 1), pos=pos, k_len=pos + 1)
        self.tokens.append(t)
        return np.asarray(out.numpy()).reshape(-1)
