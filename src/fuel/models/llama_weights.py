"""What a Llama-family GGUF file holds, ready for the graph (`fuel.models.llama`): the hyper-parameters
(`LlamaConfig`), the rope tables, and each projection's weight (`_Linear`), grouped where one QMatMul can
serve several (`_Projections`).

**Rope layout.** llama.cpp's converter permutes the rows of Q and K inside each head so that its rope
rotates adjacent pairs; Fuel's Rope rotates halves (as Hugging Face does). `_Linear.of(t, heads)` reorders
the quantized rows back (whole rows of blocks, so the bytes are moved, never requantised). Gemma files are
not permuted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import fuel as fl
from fuel.errors import FuelError
from fuel.graph.tensor import Tensor
from fuel.io.gguf import GGUFFile, GGUFTensor

ARCHITECTURES = ("llama", "gemma3")
# Gemma 3 hard-codes these in its reference implementation; the GGUF file does not carry them.
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
GEMMA3_GLOBAL_EVERY = 6


class ModelError(FuelError, ValueError):
    """A model file this module cannot run, or a request outside the model's limits."""


def check_ids(ids: Any, vocab: int, what: str) -> list[int]:
    """`ids` as a list of ints, each a token id in [0, vocab); else a ModelError naming `what`."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | np.ndarray):
        raise ModelError(f"{what}: expects a sequence of token ids, got {type(ids).__name__}")
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise ModelError(f"{what}: token ids must be ints, got {t!r} ({type(t).__name__})")
        if not 0 <= t < vocab:
            raise ModelError(f"{what}: token id {t} is outside the vocabulary [0, {vocab})")
        out.append(int(t))
    return out


@dataclass(frozen=True)
class LlamaConfig:
    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    eps: float
    rope_base: float
    vocab: int
    context_length: int
    gemma: bool = False
    sliding_window: int | None = None
    local_rope_base: float | None = None
    attn_scale: float = 0.0

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> LlamaConfig:
        """The hyper-parameters of a file; a missing or malformed one is a FuelError naming the key and the
        file (`GGUFKeyError` for a missing key or tensor, `ModelError` for a value that is not a number)."""
        arch = f.architecture
        if arch not in ARCHITECTURES:
            raise ModelError(f"model: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")

        def number(key: str, kind: type, default: Any = ...) -> Any:
            value = f.hparam(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or (
                    kind is int and value != int(value)) or not math.isfinite(value) or value <= 0:
                raise ModelError(f"model: {f.path}: metadata {arch}.{key} must be a positive "
                                 f"{'integer' if kind is int else 'number'}, got {value!r}")
            return kind(value)

        heads, hidden = number("attention.head_count", int), number("embedding_length", int)
        head_dim = number("attention.key_length", int, hidden // heads)
        gemma = arch == "gemma3"
        window = number("attention.sliding_window", int) if gemma and f.hparam("attention.sliding_window",
                                                                                None) is not None else None
        return cls(
            arch=arch, layers=number("block_count", int), hidden=hidden, heads=heads,
            kv_heads=number("attention.head_count_kv", int, heads), head_dim=head_dim,
            ffn=number("feed_forward_length", int), eps=number("attention.layer_norm_rms_epsilon", float),
            rope_base=number("rope.freq_base", float, 10_000.0), vocab=f["token_embd.weight"].shape[0],
            context_length=number("context_length", int), gemma=gemma, sliding_window=window,
            local_rope_base=GEMMA3_LOCAL_ROPE_BASE if gemma else None,
            attn_scale=1.0 / math.sqrt(head_dim),
        )

    def is_local(self, layer: int) -> bool:
        """Whether `layer` uses sliding-window attention (Gemma 3: all but every sixth)."""
        return self.sliding_window is not None and (layer + 1) % GEMMA3_GLOBAL_EVERY != 0


def rope_tables(base: float, head_dim: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin `[len(positions), head_dim]` float32 for rotate-half rope (angles in float64)."""
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.outer(positions.astype(np.float64), inv_freq)
    ang = np.concatenate([ang, ang], axis=1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _halves_order(rows: int, heads: int) -> np.ndarray:
    """The row order that turns llama.cpp's per-head pair layout (rows 2i, 2i + 1 rotate together)
    into the halves layout (rows i, i + D/2): row r of the result is row order[r] of the file."""
    d = rows // heads
    return np.arange(rows).reshape(heads, d // 2, 2).swapaxes(1, 2).reshape(-1)


def _as_words(rows: np.ndarray) -> np.ndarray:
    """uint8 rows of whole blocks as the u32 words QMatMul reads (zero-padded to a whole word at the end)."""
    flat = rows.reshape(-1)
    if flat.size % 4 == 0 and flat.flags.c_contiguous:
        return flat.view(np.uint32)
    padded = np.zeros(-(-flat.size // 4) * 4, np.uint8)
    padded[:flat.size] = flat
    return padded.view(np.uint32)


@dataclass
class _Linear:
    """A projection `x @ Wᵀ`: a quantized weight's block bytes `[n, row bytes]`, or a float weight
    transposed once (`dense`, `[k, n]`)."""

    rows: np.ndarray | None
    quant: str
    k: int
    n: int
    dense: np.ndarray | None = None

    @classmethod
    def of(cls, t: GGUFTensor, heads: int | None = None) -> _Linear:
        """The projection by weight t; `heads` reorders its rows per head (see `_halves_order`)."""
        if t.ndim != 2:
            raise ModelError(f"model: tensor {t.name!r} has shape {list(t.shape)}, expected a matrix")
        order = None if heads is None else _halves_order(t.n, heads)
        if t.is_quantized:
            t.words  # noqa: B018  (raises UnsupportedTensorType, naming the tensor, for a type QMatMul lacks)
            rows = t.raw().reshape(t.n, -1)
            return cls(rows if order is None else rows[order], t.type_name, t.k, t.n)
        w = t.array().astype(np.float32)
        return cls(None, t.type_name, t.k, t.n, np.ascontiguousarray((w if order is None else w[order]).T))

    def joins(self, other: _Linear) -> bool:
        return self.rows is not None and other.rows is not None and (self.quant, self.k) == (other.quant, other.k)

    def __call__(self, x: Tensor) -> Tensor:
        if self.rows is not None:
            return fl.ops.qmatmul(x, fl.tensor(_as_words(self.rows)), self.quant, self.k, self.n)
        assert self.dense is not None
        return x @ fl.tensor(self.dense)


class _Projections:
    """Projections of one input (Q, K, V; gate, up). Consecutive quantized ones of the same type run as
    one QMatMul over their stacked rows, whose output columns are then sliced: fewer, larger kernel
    calls in a decode step (one weight pass per group instead of one per projection)."""

    def __init__(self, parts: dict[str, _Linear]) -> None:
        self.groups: list[tuple[_Linear, list[tuple[str, int, int]]]] = []
        pending: list[tuple[str, _Linear]] = []
        for name, lin in [*parts.items(), ("", None)]:
            if pending and (lin is None or not pending[0][1].joins(lin)):
                self.groups.append(self._stack(pending))
                pending = []
            if lin is not None:
                pending.append((name, lin))

    @staticmethod
    def _stack(group: list[tuple[str, _Linear]]) -> tuple[_Linear, list[tuple[str, int, int]]]:
        spans, start = [], 0
        for name, lin in group:
            spans.append((name, start, start + lin.n))
            start += lin.n
        first = group[0][1]
        if len(group) == 1:
            return first, spans
        stacked = np.concatenate([lin.rows for _, lin in group if lin.rows is not None])
        return _Linear(stacked, first.quant, first.k, start), spans

    def parts(self) -> dict[str, _Linear]:
        """Each projection alone by name: a stacked weight's rows of that projection (a view, no copy)."""
        out: dict[str, _Linear] = {}
        for lin, spans in self.groups:
            for name, a, b in spans:
                if len(spans) == 1:
                    out[name] = lin
                else:
                    assert lin.rows is not None  # only quantized weights are stacked
                    out[name] = _Linear(lin.rows[a:b], lin.quant, lin.k, b - a)
        return out

    def __call__(self, x: Tensor, joined: tuple[str, str] | None = None) -> dict[str, Tensor]:
        """Each projection's output by name; with `joined` = (first, second), also `first+second`, their
        columns as one slice where one QMatMul gave both, adjacent."""
        out: dict[str, Tensor] = {}
        for lin, spans in self.groups:
            y = lin(x)
            for name, a, b in spans:
                out[name] = y if len(spans) == 1 else y[:, a:b]
            names = [name for name, _, _ in spans]
            if joined and joined[0] in names and names[names.index(joined[0]) + 1:][:1] == [joined[1]]:
                at = names.index(joined[0])
                out["+".join(joined)] = y[:, spans[at][1]:spans[at + 1][2]]
        return out

