"""What every language model of `fuel.models` shares beside its graph: the pool of sequences that run it, and
the token-embedding rows it reads outside the graph.

**The pool.** A model (`LlamaModel`, `MambaModel`) holds weights; a sequence (`KVSequence`, `MambaSequence`)
holds one generation's state and the steps captured over it. `SequencePool` lends idle sequences to
generations (`acquire`: the one whose tokens share the longest prefix with the new prompt, so a chat's next turn
runs only its new tokens), at most `max_sequences` at once, and takes them back (`release`). The model's own
sequence, `default`, serves `model.prefill/decode/reset/pos`. Every step of every sequence holds the model's
`lock`: one step at a time, from any thread.

**The embedding.** A token's row is dequantised outside the graph (`fuel.quant.dequantize_rows_into`): a lookup
of a few rows of a quantized table is not a graph op, and the rows are the step's input.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

import fuel as fl
from fuel.errors import ParamError
from fuel.models.llama_weights import ModelError
from fuel.quant import dequantize_rows_into, weight_rows


class PooledSequence(Protocol):
    """What the pool needs of a sequence."""

    @property
    def pos(self) -> int: ...

    def common_prefix(self, ids: Sequence[int]) -> int: ...

    def reset(self) -> None: ...

    def prefill(self, ids: Sequence[int]) -> np.ndarray: ...

    def decode(self, token: int) -> np.ndarray: ...


S = TypeVar("S", bound=PooledSequence)


class SequencePool(Generic[S]):
    """The sequences of one model (module doc). A model calls `set_limits` first, `start_pool` once its weights
    are loaded, and defines `sequence()`, which makes a new sequence of its own kind."""

    capacity: int
    max_sequences: int
    default: S

    def set_limits(self, capacity: Any, max_sequences: Any, context_length: int, what: str = "capacity") -> None:
        """Check and set `capacity` (tokens a sequence holds, at most the model's context) and `max_sequences`:
        called first, before any weight is read, so a bad request fails before the slow steps."""
        if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) or not (
                1 <= capacity <= context_length):
            raise ModelError(f"model: {what} must be an int in [1, {context_length}] (the model's context), "
                             f"got {capacity!r}")
        if isinstance(max_sequences, bool) or not isinstance(max_sequences, int) or max_sequences < 1:
            raise ModelError(f"model: max_sequences must be a positive int, got {max_sequences!r}")
        self.capacity, self.max_sequences = int(capacity), max_sequences

    def start_pool(self) -> None:
        """Make the lock, the pool and the model's own sequence (once the model can make sequences)."""
        self.lock = threading.RLock()  # held by every step of every sequence: one step at a time
        self._pool_lock = threading.Lock()
        self._idle: list[S] = []
        self._lent: list[S] = []
        self.default = self.sequence()

    def sequence(self) -> S:
        """A new sequence of this model, outside the pool (its caller owns it)."""
        raise NotImplementedError

    def sequences(self) -> list[S]:
        """Every sequence the pool knows: the model's own, the idle and the lent ones."""
        with self._pool_lock:
            return [self.default, *self._idle, *self._lent]

    def acquire(self, ids: Sequence[int] = ()) -> S:
        """A sequence lent for one generation: of the idle ones, the one whose tokens share the longest prefix
        with `ids` (that prefix's state is reused), else a new one. At most `max_sequences` are lent at once;
        `release` gives one back."""
        with self._pool_lock:
            if self._idle:
                best = max(self._idle, key=lambda s: s.common_prefix(ids))
                self._idle.remove(best)
            elif len(self._lent) >= self.max_sequences:
                raise ModelError(f"model: {len(self._lent)} sequences are in use on this model, its max_sequences; "
                                 "finish or close a generation first, or load the model with a larger max_sequences")
            else:
                best = self.sequence()
            self._lent.append(best)
        return best

    def release(self, seq: S) -> None:
        """Give a lent sequence back to the pool (its state stays for the next `acquire`)."""
        with self._pool_lock:
            if not any(s is seq for s in self._lent):
                raise ParamError("model.release: this sequence is not lent from this model's pool")
            self._lent = [s for s in self._lent if s is not seq]
            self._idle.append(seq)

    @property
    def sequences_in_use(self) -> int:
        return len(self._lent)

    # -- the model's own sequence ----------------------------------------------------------------

    @property
    def pos(self) -> int:
        """The model's own sequence's position: the tokens it holds."""
        return self.default.pos

    def reset(self) -> None:
        """Forget the model's own sequence: later tokens start at position 0."""
        self.default.reset()

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """`prefill` on the model's own sequence: the last token's logits."""
        return self.default.prefill(ids)

    def decode(self, token: int) -> np.ndarray:
        """`decode` on the model's own sequence: the next logits."""
        return self.default.decode(token)


class TokenEmbedding:
    """A model's token-embedding table `[vocab, hidden]` as `rows(ids)` reads it (module doc): the quantized
    table's block rows, or the float table, made once."""

    def __init__(self, t: Any) -> None:
        self.vocab, self.hidden = int(t.shape[0]), int(t.shape[1])
        self.quant_type = t.quant_type
        self._rows = None if t.quant_type is None else weight_rows(t.words, t.quant_type, t.n, t.k)
        self._table = None if t.quant_type is not None else t.array()  # rows are cast when copied out

    def rows(self, ids: Sequence[int]) -> np.ndarray:
        """The embedding rows of `ids`, float32 `[len(ids), hidden]`; an id outside the vocabulary is a
        ModelError."""
        out = np.empty((len(ids), self.hidden), np.float32)
        # A row is tiny work: in this thread, never waking a pool beside the spinning pool's worker
        # (docs/models.md, "Measurements": "embedding rows in the calling thread").
        with fl.serial():
            for r, t in enumerate(ids):
                if not 0 <= int(t) < self.vocab:
                    raise ModelError(f"model: token id {t} is outside the vocabulary [0, {self.vocab})")
                if self._rows is not None:
                    dequantize_rows_into(self._rows, self.quant_type, int(t), int(t) + 1, out[r:r + 1])
                else:
                    assert self._table is not None
                    out[r] = self._table[int(t)]
        return out
