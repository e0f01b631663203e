"""A Llama-family model's batched step over a paged KV cache: the rows of many sequences in one replay.

    bm = BatchedLlama(model, num_blocks=512, block_size=16)
    logits = bm.step(token_ids, positions, slots, block_tables, logit_rows)   # [len(logit_rows), vocab]

**One step, many sequences.** Row r of a step is one token of some sequence: its embedding, its position
`positions[r]` (the rope tables' row) and the cache slot its K/V row is written to (`slots[r]`). Each layer
is the model's own graph (`LlamaModel.qkv`, `after_attention`, `logits`) at M = rows: RmsNorm, QMatMul over
all M rows (each weight tile read once for every row), Rope, then the step's K/V rows scattered into the
layer's cache by `fl.index_copy`, and PagedAttn with every row its own batch entry (q `[M, heads, 1, D]`,
its sequence's block table and context length `positions[r] + 1`): a decode token and the rows of a prompt
chunk are the same kind of row, so a step mixes them freely. Only the rows in `logit_rows` go through the
output norm and head.

**Two kinds of step, each batch-invariant.** Every kernel of a step computes each row with arithmetic that
depends on neither M nor the other rows, within each of two row ranges, and attention reads a row's keys by
position whatever blocks hold them (docs/kernels.md, "Batch invariance"):
- up to `DECODE_ROWS` (16) rows, a *decode step*: QMatMul's decode path (the one-row kernel's arithmetic,
  `ROW_INVARIANT_ROWS`), and a float weight's row-invariant gemv;
- `DECODE_ROWS + 1` to `prompt_rows` rows, a *prompt step*: QMatMul's tile path (dequantised tiles times
  fuel's tile GEMM, whose every element is one fixed sequence of operations at any row count up to
  `weight_tiles.OWN_MAX_ROWS`). About 2.3x cheaper a row than the decode path from 64 rows on
  (docs/performance/serve.md), which is why prompts are read in such steps. A model with a float weight or
  a LoRA adapter (dense products, OpenBLAS past 16 rows) or a host without the tile kernel has
  `prompt_rows == DECODE_ROWS`: its prompts are read in decode-sized steps.
The two ranges round a row differently, so a sequence must give each of its positions the same kind of step
whatever else runs: the engine reads every prompt token in prompt steps and every generated one in decode
steps, alone or batched (`fuel.serve.engine`). Within that rule a sequence's logits are the same bytes
whatever else shares its steps.

**Captures.** The step is one `fl.jit` function; each (rows, logit rows) shape is its own capture, traced on
first use. The caches are `[num_blocks·block_size, kv_heads, D]` float32 arrays per layer, written in place.

**A contiguous layout: every step native.** Native replay posts a step's job only where its kernel reads its
arrays as they lie; a step over a strided view runs in Python, at every layer (`fuel.runtime.replay`). So at
M > 1 rows every operand is laid out as its reader wants it (`LlamaModel.row_qkv`): Q, K and V, and gate and
up, are each their own QMatMul (the stacked weight's rows of that projection, a view), not column slices of
one product; rope runs over rows `[M·heads, D]` with tables whose row r·heads + j is row r's position (`step`
repeats them per head), so q is PagedAttn's `[M, heads, 1, D]` and k, v are the cache rows `[M, kv_heads, D]`
as they come. Each element is computed as the stacked layout computes it (QMatMul's rows and rope are per
element), so the bytes are the same. One row keeps the decode step's layout (`LlamaModel.qkv`), whose slices
are contiguous already and whose stacked products are fewer jobs. The logits live in the capture's arena
(`reuse_outputs`): a fresh output past `replay.OUT_STAGE_MAX_BYTES` (a 49 152-token vocabulary at two rows)
would keep the head's product in Python; `step` returns a copy.

**Architectures.** The step does the model's math for every architecture it runs (`fuel.models.architectures`):
biases and per-head q/k norms come through `model.qkv` / `row_qkv`, post-norms and the activation through
`after_attention`, the final softcap through `model.logits`; PagedAttn gets the model's query scale, its
attention-logit softcap and each layer's left window (`cfg.window_left`, as `LlamaModel` gives FlashAttn:
Mistral's and Phi-3's every layer, Gemma 2's even layers, Gemma 3's five of six), so sequences hold the
model's capacity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

import fuel as fl
from fuel.cpu.quant import weight_tiles
from fuel.cpu.quant.qmatmul import ROW_INVARIANT_ROWS
from fuel.errors import ParamError
from fuel.graph.tensor import Tensor
from fuel.models.llama import LlamaModel

DECODE_ROWS = ROW_INVARIANT_ROWS  # the most rows of a decode step (module doc)
PROMPT_ROWS = weight_tiles.OWN_MAX_ROWS  # the most rows of a prompt step on the tile path (module doc)


def projections(model: LlamaModel) -> list[dict[str, Any]]:
    """Each layer's projections q, k, v, gate and up, each its own weight (views of the stacked rows)."""
    return [lw["qkv"].parts() | lw["gate_up"].parts() for lw in model.layers]


def prompt_rows_of(model: LlamaModel) -> int:
    """The most rows of one prompt step (module doc): `PROMPT_ROWS` where every projection of every layer is
    quantized (a float one's `rows` is None), no adapter applies and the host has the tile kernel, else
    `DECODE_ROWS`."""
    layers = zip(model.layers, projections(model), strict=True)
    quantized = all(lin.rows is not None for lw, parts in layers for lin in (*parts.values(), lw["o"], lw["down"]))
    return PROMPT_ROWS if quantized and model.adapter is None and weight_tiles.own_mode(PROMPT_ROWS) else DECODE_ROWS


class BatchedLlama:
    """The paged caches and the batched step of one `LlamaModel` (module doc)."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_context = self.context_of(model)
        self.max_blocks = math.ceil(self.max_context / block_size)  # a block table's length
        slots = (num_blocks * block_size, cfg.kv_heads, cfg.head_dim)
        # written now, not lazily by the kernel: the server's memory is all taken at start (calloc'd zeros
        # would be paged in as blocks are first used, so RSS would climb for as long as new blocks come)
        self.k_cache = [np.full(slots, 0.0, np.float32) for _ in range(cfg.layers)]
        self.v_cache = [np.full(slots, 0.0, np.float32) for _ in range(cfg.layers)]
        # each layer's projections, each its own weight (views of the stacked rows): M > 1's layout (module doc)
        self.linears = projections(model)
        self.prompt_rows = prompt_rows_of(model)
        # the logits live in the capture's arena, so the head runs natively at any row count (module doc)
        self._step = fl.jit(self._forward, reuse_outputs=True)
        self._fill = fl.jit(self._fill_forward)

    @staticmethod
    def context_of(model: LlamaModel) -> int:
        """The most positions one sequence may hold: the model's capacity (Gemma's window: module doc)."""
        return model.capacity

    def _forward(self, x: Tensor, slots: Tensor, block_table: Tensor, context_lens: Tensor, logit_rows: Tensor,
                 *tables: Tensor) -> Tensor:
        return self._layers(x, slots, block_table, context_lens, logit_rows, tables)

    def _fill_forward(self, x: Tensor, slots: Tensor, block_table: Tensor, context_lens: Tensor,
                      *tables: Tensor) -> Tensor:
        return self._layers(x, slots, block_table, context_lens, None, tables)

    def _layers(self, x: Tensor, slots: Tensor, block_table: Tensor, context_lens: Tensor, logit_rows: Tensor | None,
                tables: tuple[Tensor, ...]) -> Tensor:
        """The step's graph; without logit rows (prompt rows only, none the last) the last layer stops after
        its cache writes, and a one-element read of each cache keeps the writes in the graph."""
        model, cfg = self.model, self.cfg
        m, hd = x.shape[0], cfg.head_dim
        per = len(tables) // len(model.rope)  # tables per rope name: (cos, sin), or those of q's and k's rows
        rope = {n: tables[per * j:per * j + per] for j, n in enumerate(model.rope)}
        cache_shape = (self.num_blocks, self.block_size, cfg.kv_heads, hd)
        x = model.scaled_input(x)
        for i, lw in enumerate(model.layers):
            h = model._norm(x, lw["attn_norm"])
            if m == 1:  # the decode step's own layout: its slices of stacked products are contiguous already
                pairs = {n: (t[0], t[1]) for n, t in rope.items()}
                q, k, v = (t.reshape(1, t.shape[1], hd) for t in model.qkv(i, lw, h, pairs))
            else:
                q, k, v = model.row_qkv(i, lw, h, rope, self.linears[i])
            kc = fl.index_copy(fl.tensor(self.k_cache[i]), slots, k)
            vc = fl.index_copy(fl.tensor(self.v_cache[i]), slots, v)
            if logit_rows is None and i == cfg.layers - 1:
                return kc[:1, :1, :1] + vc[:1, :1, :1]
            a = fl.ops.paged_attn(q.reshape(m, cfg.heads, 1, hd), kc.reshape(*cache_shape), vc.reshape(*cache_shape),
                                  block_table, context_lens, softmax_scale=cfg.attn_scale, softcap=cfg.attn_softcap,
                                  window_size=cfg.window_left(i))  # [M, heads, 1, D]
            x = model.after_attention(lw, x, lw["o"](a.reshape(m, cfg.heads * hd)), self.linears[i] if m > 1 else None)
        assert logit_rows is not None
        return model.logits(x.index_select(0, logit_rows))

    def step(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, block_tables: np.ndarray,
             logit_rows: np.ndarray) -> np.ndarray:
        """Run one row per token (module doc) and return the logits `[len(logit_rows), vocab]` of the rows
        `logit_rows` picks (none: the rows' K/V are written and nothing else is computed). `block_tables`
        `[rows, max_blocks]` holds each row's sequence's blocks."""
        m = len(tokens)
        if not 1 <= m <= self.prompt_rows:
            raise ParamError(f"batched step: 1 to {self.prompt_rows} rows per step, got {m}")
        if not 0 <= len(logit_rows) <= m:
            raise ParamError(f"batched step: 0 to {m} logit rows, got {len(logit_rows)}")
        model = self.model
        x = model.embed(tokens.tolist())
        cfg = model.cfg
        repeats = (cfg.heads, cfg.kv_heads) if m > 1 else (1,)  # rope over rows: each row's table row per head
        tables = [np.repeat(t[positions], r, 0) for pair in model.rope.values() for r in repeats for t in pair]
        args = (x, slots.astype(np.int64), block_tables.astype(np.uint32), (positions + 1).astype(np.uint32))
        with model.lock:
            if not len(logit_rows):
                self._fill(*args, *tables)
                return np.empty((0, model.cfg.vocab), np.float32)
            out = self._step(*args, logit_rows.astype(np.int64), *tables)
            return np.array(out.numpy())  # a copy, taken before another step overwrites the arena's

    def warm(self, shapes: Sequence[tuple[int, int]], blocks: list[int]) -> None:
        """Capture the step for each (rows, logit rows) in `shapes` (a first call traces and plans it),
        writing its rows into `blocks` (blocks no sequence holds, enough for the most rows)."""
        for m, r in shapes:
            n = np.arange(m)  # one row a slot, positions within the context (the values do not matter)
            table = np.zeros((m, self.max_blocks), np.int64)
            table[:, :len(blocks)] = blocks
            slots = np.array(blocks)[n // self.block_size] * self.block_size + n % self.block_size
            self.step(np.zeros(m, np.int64), n % self.max_context, slots, table, np.arange(r))
