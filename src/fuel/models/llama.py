"""Llama-family decoders (Llama / Llama 3 / Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3) from a GGUF file or
any source in its form, built from `fuel.ops`.

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

**The graph.** One decoder-layer recipe with per-architecture options (`fuel.models.decoder_layer`, read
from the architecture's `ArchSpec` in `fuel.models.architectures`): RmsNormLastDim (times the norm weight),
QMatMul for each quantized projection (Q/K/V, and gate/up, stacked into one where they share a block type),
Rope with the model's tables, an in-graph `cache_write` of the step's K/V rows into a fixed-capacity cache
`[1, Hkv, capacity, D]` at `fl.dyn("pos")`, FlashAttn over that cache with `k_len = fl.dyn("k_len")`
(causal, aligned bottom-right; the layer's window and the logit softcap where the architecture has them),
and a gated FFN (SwiGLU; GeGLU for Gemma). The output projection is the tied token embedding (a QMatMul on
its bytes) unless the file has its own.

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

**Rope tables.** One table pair per rope base: "global", and "local" for Gemma 3's window layers (base
10 000). The global tables carry the file's per-frequency factors (Llama 3's `rope_freqs.weight`, Phi-3's
LongRoPE factors chosen by the capacity, with their attn_factor) and a linear scaling's factor
(`llama_weights.rope_factors`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import fuel as fl
from fuel.graph.tensor import Tensor
from fuel.io.gguf import GGUFFile, open_gguf
from fuel.models.decoder_layer import DecoderGraph, ProjectionHook, layer_weights
from fuel.models.kv_sequence import CACHE_ONLY, Caches, KVSequence
from fuel.models.llama_weights import (
    ARCHITECTURES,
    LlamaConfig,
    ModelError,
    _Linear,
    check_ids,
    rope_factors,
    rope_tables,
)
from fuel.models.sequence_pool import SequencePool, TokenEmbedding

__all__ = ["ARCHITECTURES", "KVSequence", "LlamaConfig", "LlamaModel", "ModelError", "ProjectionHook", "load",
           "rope_tables"]


class LlamaModel(DecoderGraph, SequencePool[KVSequence]):
    """A loaded model: its weights, the graph of a step, and the pool of sequences that run it (module doc)."""

    def __init__(self, f: GGUFFile, capacity: int, progress: Callable[[str, int, int], None] | None = None, *,
                 max_sequences: int = 4) -> None:
        self.file = f
        self.cfg = cfg = LlamaConfig.from_gguf(f)
        self.set_limits(capacity, max_sequences, cfg.context_length, "KV-cache capacity")
        report = progress or (lambda what, i, n: None)
        self.layers: list[dict[str, Any]] = []
        for i in range(cfg.layers):
            report("weights", i, cfg.layers)
            self.layers.append(layer_weights(f, cfg, i))
        report("weights", cfg.layers, cfg.layers)
        self.out_norm = f["output_norm.weight"].array()
        self.head = _Linear.of(f["output.weight" if "output.weight" in f else "token_embd.weight"])  # tied if absent
        self.embedding = TokenEmbedding(f["token_embd.weight"])
        positions = np.arange(self.capacity)
        factors, scale = rope_factors(f, cfg, self.capacity)
        self.rope = {"global": rope_tables(cfg.rope_base, cfg.head_dim, positions, factors, scale)}
        if cfg.local_rope_base is not None:  # window layers: their own base, unscaled
            self.rope["local"] = rope_tables(cfg.local_rope_base, cfg.head_dim, positions)
        # an adapter over the projections (LoRA, `fuel.lora`), read when a step's graph is built: `set_adapter`
        self.adapter: ProjectionHook | None = None
        self.start_pool()

    @classmethod
    def load(cls, path: str | os.PathLike[str], capacity: int = 2048,
             progress: Callable[[str, int, int], None] | None = None, *, max_sequences: int = 4) -> LlamaModel:
        return cls(open_gguf(path), capacity, progress, max_sequences=max_sequences)

    # -- the graph -------------------------------------------------------------------------------

    def set_adapter(self, hook: ProjectionHook | None) -> None:
        """Set (None: remove) the projections' adapter. A step already captured would replay as it was built,
        so a model any of whose sequences has captured a step is refused with a ModelError."""
        if any(j.captures for s in self.sequences() for j in (s.decode_step, s.prefill_step, s.prefill_last_step)):
            raise ModelError("model: set_adapter: this model has captured steps, which would replay without the "
                             "change; set the adapter on a model that has not run (fuel.lora.load_model gives one)")
        self.adapter = hook

    def _write_kv(self, i: int, lw: dict[str, Any], h: Tensor, tables: dict[str, tuple[Tensor, Tensor]],
                  caches: Caches) -> tuple[Tensor, Tensor, Tensor]:
        """Layer i's queries, and its K/V caches with this step's rows written at `pos`."""
        q, k, v = self.qkv(i, lw, h, tables)
        pos = fl.dyn("pos")
        kc = fl.cache_write(fl.tensor(caches[0][i]), k, pos)
        vc = fl.cache_write(fl.tensor(caches[1][i]), v, pos)
        return q, kc, vc

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
            x = self.after_attention(lw, x, self.output_projection(lw, self.attention(i, q, kc, vc, k_len)))
        return self.logits(x)

    def causal_logits(self, x: Tensor, batch: int = 1) -> Tensor:
        """The logits `[B·S, vocab]` of B whole sequences given as their embedding rows x `[B·S, hidden]` (the
        rows of sequence b are b·S … b·S + S - 1, positions 0 … S - 1): causal attention within each sequence,
        no KV cache, every row's logits (a training step's forward; S at most the model's capacity)."""
        rows = x.shape[0]
        if batch < 1 or rows % batch or not 1 <= rows // batch <= self.capacity:
            raise ModelError(f"model: causal_logits: {rows} rows are not {batch} sequences of 1 … {self.capacity} "
                             "(the capacity) rows each")
        s = rows // batch
        tables = {n: (fl.tensor(cos[:s]), fl.tensor(sin[:s])) for n, (cos, sin) in self.rope.items()}
        x = self.scaled_input(x)
        for i, lw in enumerate(self.layers):
            q, k, v = self.qkv(i, lw, self._norm(x, lw["attn_norm"]), tables, batch)
            x = self.after_attention(lw, x, self.output_projection(lw, self.attention(i, q, k, v)))
        return self.logits(x)

    # -- sequences -------------------------------------------------------------------------------

    def sequence(self) -> KVSequence:
        """A new sequence of this model, outside the pool (its caller owns it)."""
        return KVSequence(self)

    @property
    def _decode(self) -> Any:
        """The model's own sequence's captured decode step (read by the benchmarks)."""
        return self.default.decode_step

    # -- running ---------------------------------------------------------------------------------

    def embed(self, ids: Sequence[int]) -> np.ndarray:
        """The embedding rows of `ids`, float32 `[len(ids), hidden]`."""
        return self.embedding.rows(ids)

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
