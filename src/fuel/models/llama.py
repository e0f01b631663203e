"""Llama-family decoders (SmolLM2 / Llama, Gemma 3) from a GGUF file, built from `fuel.ops`.

    model = LlamaModel.load(bundled_gguf("smollm2"), capacity=2048)
    logits = model.prefill(prompt_ids)        # fills the KV cache, returns the last token's logits
    logits = model.decode(next_id)            # one token: one replay of the captured step

**The graph.** Every layer is RmsNormLastDim (times the norm weight), QMatMul for each quantized
projection, Rope with the model's tables, an in-graph `cache_write` of the step's K/V rows into a
fixed-capacity cache `[1, Hkv, capacity, D]` at `fl.dyn("pos")`, FlashAttn over that cache with
`k_len = fl.dyn("k_len")` (causal, aligned bottom-right), and a gated FFN (SwiGLU; GeGLU for Gemma).
The output projection is the tied token embedding (a QMatMul on its bytes) unless the file has its own.

**Capture and replay.** Decode is one `fl.jit` capture of a one-token step, replayed for every token
with new pos/k_len. Prefill runs the prompt in chunks of a few bucketed lengths (8 … 256 rows, each
one capture), padded at the end: the causal mask keeps real rows from seeing the padding, whose cache
rows lie past the live length and are overwritten by later tokens. In the last chunk's capture the last
layer, past its cache writes, runs for the last live row only (an `index_select` of an input row index;
its keys end at DynScalar `last_len`), which gives the logits: prefill never computes the `[S, vocab]`
projection it would throw away, nor reads every weight again for a separate one-token step (Gemma-3's
128-token prefill: ~8% of its time). Other chunks stop after the last layer's cache writes.

**Token embedding** rows are dequantised outside the graph with the QMatMul decoders
(`gguf_blocks.dequantize_rows_into`): a lookup of a few rows of a quantized table is not a graph op
(a gather over block bytes would need a dequantising gather kernel), and the rows are the step's input.

**Rope layout.** llama.cpp's converter permutes the rows of Q and K inside each head so that its rope
rotates adjacent pairs; Fuel's Rope rotates halves (as Hugging Face does). `_unpermute_rows` reorders
the quantized rows back (whole rows of blocks, so the bytes are moved, never requantised). Gemma files
are not permuted.

**Gemma 3** adds: embeddings scaled by √hidden, RMS norms on q and k per head, norms after attention
and after the FFN, GeGLU with the tanh GELU, and sliding-window attention (window 512, which is
`window_size_left = 511`) on five of every six layers with rope base 10 000; the global layers use the
file's base. Its norm weights are stored with the +1 already added by the converter.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import fuel as fl
from fuel.dispatch.cpu.gguf_blocks import dequantize_rows_into, weight_rows
from fuel.dispatch.threads import serial
from fuel.errors import FuelError, ParamError
from fuel.graph.tensor import Tensor
from fuel.io.gguf import GGUFFile, GGUFTensor, open_gguf

ARCHITECTURES = ("llama", "gemma3")
# Gemma 3 hard-codes these in its reference implementation; the GGUF file does not carry them.
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
GEMMA3_GLOBAL_EVERY = 6
PREFILL_BUCKETS = (8, 16, 32, 64, 128, 256)
CACHE_ONLY: Any = object()  # `_forward`'s rows for a prefill chunk whose logits nobody reads


class ModelError(FuelError, ValueError):
    """A model file this module cannot run, or a request outside the model's limits."""


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
        arch = f.architecture
        if arch not in ARCHITECTURES:
            raise ModelError(f"model: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
        heads = int(f.hparam("attention.head_count"))
        hidden = int(f.hparam("embedding_length"))
        head_dim = int(f.hparam("attention.key_length", hidden // heads))
        gemma = arch == "gemma3"
        window = f.hparam("attention.sliding_window", None) if gemma else None
        return cls(
            arch=arch, layers=int(f.hparam("block_count")), hidden=hidden, heads=heads,
            kv_heads=int(f.hparam("attention.head_count_kv", heads)), head_dim=head_dim,
            ffn=int(f.hparam("feed_forward_length")), eps=float(f.hparam("attention.layer_norm_rms_epsilon")),
            rope_base=float(f.hparam("rope.freq_base", 10_000.0)), vocab=f["token_embd.weight"].shape[0],
            context_length=int(f.hparam("context_length")), gemma=gemma,
            sliding_window=None if window is None else int(window),
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


def _gelu_tanh(x: Tensor) -> Tensor:
    """GELU, tanh form (Gemma's `gelu_pytorch_tanh`)."""
    return x * 0.5 * ((x + x * x * x * 0.044715) * math.sqrt(2.0 / math.pi)).tanh() + x * 0.5


class LlamaModel:
    """A loaded model with its KV cache and captured steps; see the module doc."""

    def __init__(self, f: GGUFFile, capacity: int, progress: Callable[[str, int, int], None] | None = None) -> None:
        self.file = f
        self.cfg = cfg = LlamaConfig.from_gguf(f)
        if not 1 <= capacity <= cfg.context_length:
            raise ModelError(f"model: KV-cache capacity must be in [1, {cfg.context_length}] (the model's context), "
                             f"got {capacity}")
        self.capacity = capacity
        report = progress or (lambda what, i, n: None)
        self.layers: list[dict[str, Any]] = []
        for i in range(cfg.layers):
            report("weights", i, cfg.layers)
            self.layers.append(self._layer(i))
        report("weights", cfg.layers, cfg.layers)
        self.out_norm = f["output_norm.weight"].array()
        embd = f["token_embd.weight"]
        self.head = _Linear.of(f["output.weight" if "output.weight" in f else "token_embd.weight"])  # tied if absent
        # what `embed` reads per token, made once: the quantized table's rows, or the float table
        self._embd_qt = embd.quant_type
        self._embd_rows = None if embd.quant_type is None else weight_rows(embd.words, embd.quant_type, embd.n, embd.k)
        self._embd_table = embd.array() if embd.quant_type is None else None
        shape = (1, cfg.kv_heads, capacity, cfg.head_dim)
        self.k_cache = [np.zeros(shape, np.float32) for _ in range(cfg.layers)]
        self.v_cache = [np.zeros(shape, np.float32) for _ in range(cfg.layers)]
        positions = np.arange(capacity)
        self.rope = {"global": rope_tables(cfg.rope_base, cfg.head_dim, positions)}
        if cfg.local_rope_base is not None:
            self.rope["local"] = rope_tables(cfg.local_rope_base, cfg.head_dim, positions)
        self._decode = fl.jit(lambda x, *tables: self._forward(x, tables))
        self._prefill = fl.jit(lambda x, *tables: self._forward(x, tables, rows=CACHE_ONLY))
        self._prefill_last = fl.jit(lambda x, row, *tables: self._forward(x, tables, rows=row))
        self.pos = 0

    @classmethod
    def load(cls, path: str | os.PathLike[str], capacity: int = 2048,
             progress: Callable[[str, int, int], None] | None = None) -> LlamaModel:
        return cls(open_gguf(path), capacity, progress)

    def _layer(self, i: int) -> dict[str, Any]:
        f, cfg = self.file, self.cfg
        p = f"blk.{i}."
        permuted = not cfg.gemma  # llama.cpp permutes Q/K rows for its pair-rotating rope
        lw: dict[str, Any] = {
            "attn_norm": f[p + "attn_norm.weight"].array(),
            "qkv": _Projections({"q": _Linear.of(f[p + "attn_q.weight"], cfg.heads if permuted else None),
                                 "k": _Linear.of(f[p + "attn_k.weight"], cfg.kv_heads if permuted else None),
                                 "v": _Linear.of(f[p + "attn_v.weight"])}),
            "o": _Linear.of(f[p + "attn_output.weight"]),
            "ffn_norm": f[p + "ffn_norm.weight"].array(),
            "gate_up": _Projections({"gate": _Linear.of(f[p + "ffn_gate.weight"]),
                                     "up": _Linear.of(f[p + "ffn_up.weight"])}),
            "down": _Linear.of(f[p + "ffn_down.weight"]),
        }
        if cfg.gemma:
            for name in ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"):
                lw[name] = f[p + name + ".weight"].array()
        return lw

    # -- the graph -------------------------------------------------------------------------------

    def _norm(self, x: Tensor, w: np.ndarray) -> Tensor:
        return fl.ops.rms_norm_last_dim(x, self.cfg.eps) * fl.tensor(w)

    def _heads(self, x: Tensor, heads: int) -> Tensor:
        """`[S, heads·D]` → `[1, heads, S, D]`."""
        s = x.shape[0]
        return x.reshape(1, s, heads, self.cfg.head_dim).permute(0, 2, 1, 3)

    def _write_kv(self, i: int, lw: dict[str, Any], h: Tensor,
                  tables: dict[str, tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
        """Layer i's queries, and its K/V caches with this step's rows written at `pos`."""
        cfg = self.cfg
        p = lw["qkv"](h, joined=("q", "k"))
        cos, sin = tables["local" if cfg.is_local(i) else "global"]
        if "q+k" in p and not cfg.gemma:  # one rope over Q's and K's heads: one step less per layer
            qk = fl.ops.rope(self._heads(p["q+k"], cfg.heads + cfg.kv_heads), cos, sin)
            q, k, v = qk[:, :cfg.heads], qk[:, cfg.heads:], self._heads(p["v"], cfg.kv_heads)
        else:
            q, k, v = (self._heads(p[n], hs) for n, hs in (("q", cfg.heads), ("k", cfg.kv_heads), ("v", cfg.kv_heads)))
            if cfg.gemma:
                q, k = self._norm(q, lw["attn_q_norm"]), self._norm(k, lw["attn_k_norm"])
            q, k = fl.ops.rope(q, cos, sin), fl.ops.rope(k, cos, sin)
        pos = fl.dyn("pos")
        kc = fl.cache_write(fl.tensor(self.k_cache[i]), k, pos)
        vc = fl.cache_write(fl.tensor(self.v_cache[i]), v, pos)
        return q, kc, vc

    def _attend(self, i: int, lw: dict[str, Any], q: Tensor, kc: Tensor, vc: Tensor, k_len: str) -> Tensor:
        """Layer i's attention output projected, `[S, hidden]`, for the queries `[1, heads, S, D]`."""
        cfg = self.cfg
        local = cfg.is_local(i)
        window = (cfg.sliding_window - 1 if local and cfg.sliding_window else None, None)
        a = fl.ops.flash_attn(q, kc, vc, softmax_scale=cfg.attn_scale, causal=True, window_size=window,
                              k_len=fl.dyn(k_len))
        s = q.shape[2]
        return lw["o"](a.permute(0, 2, 1, 3).reshape(s, cfg.heads * cfg.head_dim))

    def _forward(self, x: Tensor, table_args: Sequence[Tensor], rows: Tensor | None = None) -> Tensor:
        """The logits `[S, vocab]` of the rows x `[S, hidden]` (a decode step); with `rows` (a prefill chunk),
        those of the one row `rows` `[1]` picks (its keys end at DynScalar `last_len`), or with CACHE_ONLY
        none: the chunk's K/V rows written to the caches is all it does."""
        cfg = self.cfg
        names = list(self.rope)
        tables = {n: (table_args[2 * j], table_args[2 * j + 1]) for j, n in enumerate(names)}
        if cfg.gemma:
            x = x * float(np.float32(math.sqrt(cfg.hidden)))
        for i, lw in enumerate(self.layers):
            q, kc, vc = self._write_kv(i, lw, self._norm(x, lw["attn_norm"]), tables)
            k_len = "k_len"
            if rows is CACHE_ONLY and i == cfg.layers - 1:
                # only the last layer's cache rows are needed: a one-element read of each cache keeps the
                # writes in the graph without copying a cache out or running the layer's rest
                return kc[:, :, :1, :1] + vc[:, :, :1, :1]
            if rows is not None and i == cfg.layers - 1:
                # the last layer past its cache writes runs for the row whose logits are wanted only
                q, x, k_len = q.index_select(2, rows), x.index_select(0, rows), "last_len"
            a = self._attend(i, lw, q, kc, vc, k_len)
            x = x + (self._norm(a, lw["post_attention_norm"]) if cfg.gemma else a)
            h = self._norm(x, lw["ffn_norm"])
            p = lw["gate_up"](h)
            act = _gelu_tanh(p["gate"]) if cfg.gemma else p["gate"].silu()
            d = lw["down"](act * p["up"])
            x = x + (self._norm(d, lw["post_ffw_norm"]) if cfg.gemma else d)
        return self.head(self._norm(x, self.out_norm))

    # -- running ---------------------------------------------------------------------------------

    def embed(self, ids: Sequence[int]) -> np.ndarray:
        """The embedding rows of `ids`, float32 `[len(ids), hidden]`."""
        out = np.empty((len(ids), self.cfg.hidden), np.float32)
        # One row is a microsecond of work: in this thread, not Numba's pool (waking it beside the spinning
        # pool's worker cost ~1.5 ms a decode token).
        with serial():
            for r, t in enumerate(ids):
                if not 0 <= int(t) < self.cfg.vocab:
                    raise ModelError(f"model: token id {t} is outside the vocabulary [0, {self.cfg.vocab})")
                if self._embd_rows is not None and self._embd_qt is not None:
                    dequantize_rows_into(self._embd_rows, self._embd_qt, int(t), int(t) + 1, out[r:r + 1])
                else:
                    assert self._embd_table is not None
                    out[r] = self._embd_table[int(t)]
        return out

    def _tables(self, start: int, rows: int) -> list[np.ndarray]:
        return [t[start:start + rows] for pair in self.rope.values() for t in pair]

    def _check_room(self, rows: int) -> None:
        if self.pos + rows > self.capacity:
            raise ModelError(f"model: {self.pos + rows} tokens do not fit the KV cache of {self.capacity}; "
                             "load the model with a larger capacity")

    def reset(self) -> None:
        """Forget the conversation: later tokens start at position 0 (the cache is overwritten)."""
        self.pos = 0

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Run the prompt `ids` from the current position; the logits `[vocab]` after its last token."""
        if not ids:
            raise ParamError("prefill: the prompt has no tokens")
        self._check_room(len(ids))
        todo = list(ids)
        logits = np.empty(0, np.float32)
        while todo:
            bucket = next((b for b in PREFILL_BUCKETS if b >= len(todo)), PREFILL_BUCKETS[-1])
            chunk, todo = todo[:bucket], todo[bucket:]
            # the padding's cache rows must fit too (they lie past the live length, never read)
            if len(chunk) == 1 or min(self.pos, self.capacity - bucket) != self.pos:
                # one token, or too close to the end for a padded chunk: one token at a time
                for t in chunk:
                    logits = self.decode(t)
                continue
            x = np.zeros((bucket, self.cfg.hidden), np.float32)
            x[:len(chunk)] = self.embed(chunk)
            # the chunk's queries align with the keys' end (causal), padding included; see _forward
            env = {"pos": self.pos} | ({"k_len": self.pos + bucket} if self.cfg.layers > 1 else {})
            tables = self._tables(self.pos, bucket)
            if todo:
                self._prefill(x, *tables, **env)
            else:  # the last chunk: the logits after its last live row
                row = np.array([len(chunk) - 1], np.int64)
                out = self._prefill_last(x, row, *tables, **env, last_len=self.pos + len(chunk))
                logits = np.asarray(out.numpy()).reshape(-1)
            self.pos += len(chunk)
        return logits

    def decode(self, token: int) -> np.ndarray:
        """Run one token at the current position; its logits `[vocab]`."""
        self._check_room(1)
        out = self._decode(self.embed([token]), *self._tables(self.pos, 1), pos=self.pos, k_len=self.pos + 1)
        self.pos += 1
        return np.asarray(out.numpy()).reshape(-1)


def load(name_or_path: str = "smollm2", context: int = 2048) -> Any:
    """A bundled model (`smollm2`, `gemma3`) or a .gguf file with its tokenizer, as a
    `fuel.models.generate.LLM`: `load().generate("Hello", max_tokens=32)` yields text pieces."""
    from fuel.models.generate import load as load_llm

    return load_llm(name_or_path, context)

