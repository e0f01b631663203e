"""Llama-family decoders (SmolLM2 / Llama, Gemma 3) from a GGUF file, built from `fuel.ops`.

    model = LlamaModel.load(bundled_gguf("smollm2"), capacity=2048)
    logits = model.prefill(prompt_ids)        # fills the KV cache, returns the last token's logits
    logits = model.decode(next_id)            # one token: one replay of the captured step
    seq = model.acquire(prompt_ids)           # a sequence of its own (KV cache, position, captures) ...
    logits = seq.prefill(prompt_ids[seq.common_prefix(prompt_ids):])
    model.release(seq)                        # ... lent from the model's pool and given back

**State.** The model holds the weights and builds the graph; the state of a sequence (its KV cache, its
position and the steps captured over that cache) is a `KVSequence` (`fuel.models.kv_sequence`), so any
number of sequences run on one model, interleaved and from several threads, each seeing only its own
cache (the model's lock runs one step at a time). `model.prefill/decode/reset/pos` act on the model's
own sequence, `model.default`; generations (`fuel.models.generate`) borrow sequences from the pool:
`acquire(ids)` lends the idle one whose cached tokens share the longest prefix with `ids` (a chat's next
turn runs only its new tokens) or a new one, up to `max_sequences` lent at once.

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
projection it would throw away, nor reads every weight again for a separate one-token step (docs/models.md,
"Measurements": "the last row's logits"). Other chunks stop after the last layer's cache writes.

**Adapters and training.** `model.set_adapter(hook)` (a `ProjectionHook`, e.g. a `fuel.lora.LoraAdapter`)
adds a term to each attention and FFN projection's output in every graph built while it is set (`project`);
it is refused once a sequence has captured a step, which would replay without it. `causal_logits` is the
training forward: B whole sequences with causal attention among their own rows and no KV cache, every row's
logits. The serving batch model (`fuel.serve.batch_model`) runs the o projection itself and takes no adapter.

**Token embedding** rows are dequantised outside the graph with the QMatMul decoders
(`fuel.quant.dequantize_rows_into`): a lookup of a few rows of a quantized table is not a graph op
(a gather over block bytes would need a dequantising gather kernel), and the rows are the step's input.

**Rope layout.** llama.cpp's converter permutes the rows of Q and K inside each head for its pair-rotating
rope; the loader moves them back (`fuel.models.llama_weights`).

**Gemma 3** adds: embeddings scaled by √hidden, RMS norms on q and k per head, norms after attention
and after the FFN, GeGLU with the tanh GELU, and sliding-window attention (window 512, which is
`window_size_left = 511`) on five of every six layers with rope base 10 000; the global layers use the
file's base. Its norm weights are stored with the +1 already added by the converter.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import fuel as fl
from fuel.errors import ParamError
from fuel.graph.tensor import Tensor
from fuel.io.gguf import GGUFFile, open_gguf
from fuel.models.kv_sequence import CACHE_ONLY, Caches, KVSequence
from fuel.models.llama_weights import (
    ARCHITECTURES,
    LlamaConfig,
    ModelError,
    _Linear,
    _Projections,
    check_ids,
    rope_tables,
)
from fuel.quant import dequantize_rows_into, weight_rows

# (layer, projection name, input rows x, the projection's output y) -> the output to use instead (y plus a term)
ProjectionHook = Callable[[int, str, Tensor, Tensor], Tensor]

__all__ = ["ARCHITECTURES", "KVSequence", "LlamaConfig", "LlamaModel", "ModelError", "ProjectionHook", "load",
           "rope_tables"]


def _gelu_tanh(x: Tensor) -> Tensor:
    """GELU, tanh form (Gemma's `gelu_pytorch_tanh`)."""
    return x * 0.5 * ((x + x * x * x * 0.044715) * math.sqrt(2.0 / math.pi)).tanh() + x * 0.5


class LlamaModel:
    """A loaded model: its weights, the graph of a step, and the pool of sequences that run it (module doc)."""

    def __init__(self, f: GGUFFile, capacity: int, progress: Callable[[str, int, int], None] | None = None, *,
                 max_sequences: int = 4) -> None:
        self.file = f
        self.cfg = cfg = LlamaConfig.from_gguf(f)
        if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) or not (
                1 <= capacity <= cfg.context_length):
            raise ModelError(f"model: KV-cache capacity must be an int in [1, {cfg.context_length}] (the model's "
                             f"context), got {capacity!r}")
        if isinstance(max_sequences, bool) or not isinstance(max_sequences, int) or max_sequences < 1:
            raise ModelError(f"model: max_sequences must be a positive int, got {max_sequences!r}")
        self.capacity, self.max_sequences = int(capacity), max_sequences
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
        positions = np.arange(capacity)
        self.rope = {"global": rope_tables(cfg.rope_base, cfg.head_dim, positions)}
        if cfg.local_rope_base is not None:
            self.rope["local"] = rope_tables(cfg.local_rope_base, cfg.head_dim, positions)
        # an adapter over the projections (LoRA, `fuel.lora`), read when a step's graph is built: `set_adapter`
        self.adapter: ProjectionHook | None = None
        self.lock = threading.RLock()  # held by every step of every sequence: one step at a time
        self._pool_lock = threading.Lock()
        self._idle: list[KVSequence] = []
        self._lent: list[KVSequence] = []
        self.default = KVSequence(self)

    @classmethod
    def load(cls, path: str | os.PathLike[str], capacity: int = 2048,
             progress: Callable[[str, int, int], None] | None = None, *, max_sequences: int = 4) -> LlamaModel:
        return cls(open_gguf(path), capacity, progress, max_sequences=max_sequences)

    def _layer(self, i: int) -> dict[str, Any]:
        f, cfg = self.file, self.cfg
        p = f"blk.{i}."
        permuted = not cfg.gemma  # llama.cpp permutes Q/K rows for its pair-rotating rope
        lw: dict[str, Any] = {
            "index": i,
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

    def _heads(self, x: Tensor, heads: int, batch: int = 1) -> Tensor:
        """`[B·S, heads·D]` → `[B, heads, S, D]` (rows of sequence b are b·S … b·S + S - 1)."""
        s = x.shape[0] // batch
        return x.reshape(batch, s, heads, self.cfg.head_dim).permute(0, 2, 1, 3)

    def set_adapter(self, hook: ProjectionHook | None) -> None:
        """Set (None: remove) the projections' adapter. A step already captured would replay as it was built,
        so a model any of whose sequences has captured a step is refused with a ModelError."""
        with self._pool_lock:
            seqs = [self.default, *self._idle, *self._lent]
        if any(j.captures for s in seqs for j in (s.decode_step, s.prefill_step, s.prefill_last_step)):
            raise ModelError("model: set_adapter: this model has captured steps, which would replay without the "
                             "change; set the adapter on a model that has not run (fuel.lora.load_model gives one)")
        self.adapter = hook

    def project(self, lw: dict[str, Any], name: str, x: Tensor, y: Tensor) -> Tensor:
        """Projection `name` ("q", "k", "v", "o", "gate", "up", "down") of layer lw: its output y of the
        input rows x, with the adapter's term added when one is set."""
        return y if self.adapter is None else self.adapter(lw["index"], name, x, y)

    def _write_kv(self, i: int, lw: dict[str, Any], h: Tensor, tables: dict[str, tuple[Tensor, Tensor]],
                  caches: Caches) -> tuple[Tensor, Tensor, Tensor]:
        """Layer i's queries, and its K/V caches with this step's rows written at `pos`."""
        q, k, v = self.qkv(i, lw, h, tables)
        pos = fl.dyn("pos")
        kc = fl.cache_write(fl.tensor(caches[0][i]), k, pos)
        vc = fl.cache_write(fl.tensor(caches[1][i]), v, pos)
        return q, kc, vc

    def qkv(self, i: int, lw: dict[str, Any], h: Tensor, tables: dict[str, tuple[Tensor, Tensor]], batch: int = 1
            ) -> tuple[Tensor, Tensor, Tensor]:
        """Layer i's queries, keys and values `[B, heads, S, D]` of the normed rows h `[B·S, hidden]` (B = batch
        sequences of S rows), rope applied with the tables' rows (row s of the tables is position s's)."""
        cfg = self.cfg
        p = lw["qkv"](h, joined=None if self.adapter is not None else ("q", "k"))
        if self.adapter is not None:
            p = {n: self.project(lw, n, h, p[n]) for n in ("q", "k", "v")}
        cos, sin = tables["local" if cfg.is_local(i) else "global"]
        if "q+k" in p and not cfg.gemma:  # one rope over Q's and K's heads: one step less per layer
            qk = fl.ops.rope(self._heads(p["q+k"], cfg.heads + cfg.kv_heads, batch), cos, sin)
            q, k, v = qk[:, :cfg.heads], qk[:, cfg.heads:], self._heads(p["v"], cfg.kv_heads, batch)
        else:
            q, k, v = (self._heads(p[n], hs, batch)
                       for n, hs in (("q", cfg.heads), ("k", cfg.kv_heads), ("v", cfg.kv_heads)))
            if cfg.gemma:
                q, k = self._norm(q, lw["attn_q_norm"]), self._norm(k, lw["attn_k_norm"])
            q, k = fl.ops.rope(q, cos, sin), fl.ops.rope(k, cos, sin)
        return q, k, v

    def _attend(self, i: int, lw: dict[str, Any], q: Tensor, kc: Tensor, vc: Tensor, k_len: str) -> Tensor:
        """Layer i's attention output projected, `[S, hidden]`, for the queries `[1, heads, S, D]`."""
        cfg = self.cfg
        local = cfg.is_local(i)
        window = (cfg.sliding_window - 1 if local and cfg.sliding_window else None, None)
        a = fl.ops.flash_attn(q, kc, vc, softmax_scale=cfg.attn_scale, causal=True, window_size=window,
                              k_len=fl.dyn(k_len))
        return self.output_projection(lw, a)

    def output_projection(self, lw: dict[str, Any], a: Tensor) -> Tensor:
        """The attention output `[B, heads, S, D]` as rows `[B·S, hidden]` through the o projection."""
        b, heads, s, d = a.shape
        rows = a.permute(0, 2, 1, 3).reshape(b * s, heads * d)
        return self.project(lw, "o", rows, lw["o"](rows))

    def forward(self, x: Tensor, table_args: Sequence[Tensor], caches: Caches, rows: Any = None) -> Tensor:
        """The logits `[S, vocab]` of the rows x `[S, hidden]` (a decode step), writing their K/V rows into
        `caches` (a sequence's per-layer K and V arrays) at DynScalar `pos`; with `rows` (a prefill chunk),
        those of the one row `rows` `[1]` picks (its keys end at DynScalar `last_len`), or with CACHE_ONLY
        none: the chunk's K/V rows written to the caches is all it does."""
        cfg = self.cfg
        names = list(self.rope)
        tables = {n: (table_args[2 * j], table_args[2 * j + 1]) for j, n in enumerate(names)}
        x = self.scaled_input(x)
        for i, lw in enumerate(self.layers):
            q, kc, vc = self._write_kv(i, lw, self._norm(x, lw["attn_norm"]), tables, caches)
            k_len = "k_len"
            if rows is CACHE_ONLY and i == cfg.layers - 1:
                # only the last layer's cache rows are needed: a one-element read of each cache keeps the
                # writes in the graph without copying a cache out or running the layer's rest
                return kc[:, :, :1, :1] + vc[:, :, :1, :1]
            if rows is not None and i == cfg.layers - 1:
                # the last layer past its cache writes runs for the row whose logits are wanted only
                q, x, k_len = q.index_select(2, rows), x.index_select(0, rows), "last_len"
            x = self.after_attention(lw, x, self._attend(i, lw, q, kc, vc, k_len))
        return self.logits(x)

    def after_attention(self, lw: dict[str, Any], x: Tensor, a: Tensor) -> Tensor:
        """The rest of a layer: the residual x `[S, hidden]` plus the projected attention a, then the gated
        FFN and its residual (Gemma's post-norms on both)."""
        cfg = self.cfg
        x = x + (self._norm(a, lw["post_attention_norm"]) if cfg.gemma else a)
        h = self._norm(x, lw["ffn_norm"])
        p = lw["gate_up"](h)
        gate, up = self.project(lw, "gate", h, p["gate"]), self.project(lw, "up", h, p["up"])
        act = (_gelu_tanh(gate) if cfg.gemma else gate.silu()) * up
        d = self.project(lw, "down", act, lw["down"](act))
        return x + (self._norm(d, lw["post_ffw_norm"]) if cfg.gemma else d)

    def causal_logits(self, x: Tensor, batch: int = 1) -> Tensor:
        """The logits `[B·S, vocab]` of B whole sequences given as their embedding rows x `[B·S, hidden]` (the
        rows of sequence b are b·S … b·S + S - 1, positions 0 … S - 1): causal attention within each sequence,
        no KV cache, every row's logits (a training step's forward; S at most the model's capacity)."""
        cfg = self.cfg
        rows = x.shape[0]
        if batch < 1 or rows % batch or not 1 <= rows // batch <= self.capacity:
            raise ModelError(f"model: causal_logits: {rows} rows are not {batch} sequences of 1 … {self.capacity} "
                             "(the capacity) rows each")
        s = rows // batch
        tables = {n: (fl.tensor(cos[:s]), fl.tensor(sin[:s])) for n, (cos, sin) in self.rope.items()}
        x = self.scaled_input(x)
        for i, lw in enumerate(self.layers):
            q, k, v = self.qkv(i, lw, self._norm(x, lw["attn_norm"]), tables, batch)
            window = (cfg.sliding_window - 1 if cfg.is_local(i) and cfg.sliding_window else None, None)
            a = fl.ops.flash_attn(q, k, v, softmax_scale=cfg.attn_scale, causal=True, window_size=window)
            x = self.after_attention(lw, x, self.output_projection(lw, a))
        return self.logits(x)

    def logits(self, x: Tensor) -> Tensor:
        """The logits `[S, vocab]` of the last layer's rows x."""
        return self.head(self._norm(x, self.out_norm))

    def scaled_input(self, x: Tensor) -> Tensor:
        """The embedding rows as the first layer reads them (Gemma scales them by √hidden)."""
        return x * float(np.float32(math.sqrt(self.cfg.hidden))) if self.cfg.gemma else x

    # -- sequences -------------------------------------------------------------------------------

    def sequence(self) -> KVSequence:
        """A new sequence of this model, outside the pool (its caller owns it)."""
        return KVSequence(self)

    def acquire(self, ids: Sequence[int] = ()) -> KVSequence:
        """A sequence lent for one generation: of the idle ones, the one whose cached tokens share the
        longest prefix with `ids` (its K/V rows of that prefix are reused), else a new one. At most
        `max_sequences` are lent at once; `release` gives one back."""
        with self._pool_lock:
            if self._idle:
                best = max(self._idle, key=lambda s: s.common_prefix(ids))
                self._idle.remove(best)
            elif len(self._lent) >= self.max_sequences:
                raise ModelError(f"model: {len(self._lent)} sequences are in use on this model, its max_sequences; "
                                 "finish or close a generation first, or load the model with a larger max_sequences")
            else:
                best = KVSequence(self)
            self._lent.append(best)
        return best

    def release(self, seq: KVSequence) -> None:
        """Give a lent sequence back to the pool (its cached tokens stay for the next `acquire`)."""
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
        """The model's own sequence's position: the tokens its KV cache holds."""
        return self.default.pos

    def reset(self) -> None:
        """Forget the model's own sequence: later tokens start at position 0 (the cache is overwritten)."""
        self.default.reset()

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """`KVSequence.prefill` on the model's own sequence."""
        return self.default.prefill(ids)

    def decode(self, token: int) -> np.ndarray:
        """`KVSequence.decode` on the model's own sequence."""
        return self.default.decode(token)

    @property
    def _decode(self) -> Any:
        """The model's own sequence's captured decode step (read by the benchmarks)."""
        return self.default.decode_step

    # -- running ---------------------------------------------------------------------------------

    def embed(self, ids: Sequence[int]) -> np.ndarray:
        """The embedding rows of `ids`, float32 `[len(ids), hidden]`."""
        out = np.empty((len(ids), self.cfg.hidden), np.float32)
        # A row is tiny work: in this thread, never waking a pool beside the spinning pool's worker
        # (docs/models.md, "Measurements": "embedding rows in the calling thread").
        with fl.serial():
            for r, t in enumerate(ids):
                if not 0 <= int(t) < self.cfg.vocab:
                    raise ModelError(f"model: token id {t} is outside the vocabulary [0, {self.cfg.vocab})")
                if self._embd_rows is not None and self._embd_qt is not None:
                    dequantize_rows_into(self._embd_rows, self._embd_qt, int(t), int(t) + 1, out[r:r + 1])
                else:
                    assert self._embd_table is not None
                    out[r] = self._embd_table[int(t)]
        return out

    def tables(self, start: int, rows: int) -> list[np.ndarray]:
        """The rope tables' rows of positions start … start + rows - 1, in `forward`'s argument order."""
        return [t[start:start + rows] for pair in self.rope.values() for t in pair]

    def check_ids(self, ids: Sequence[int], what: str) -> list[int]:
        """`ids` as a list of ints, each a token of the vocabulary; else a ModelError naming `what`."""
        return check_ids(ids, self.cfg.vocab, what)


def load(name_or_path: str = "smollm2", context: int = 2048) -> Any:
    """A bundled model (`smollm2`, `gemma3`) or a .gguf file with its tokenizer, as a
    `fuel.models.generate.LLM`: `load().generate("Hello", max_tokens=32)` yields text pieces."""
    from fuel.models.generate import load as load_llm

    return load_llm(name_or_path, context)
