"""The frozen base model QLoRA trains over: a `LlamaModel` of its own (never the process's shared one, whose
captured steps would not see an adapter), with its projections as the GGUF file stores them (QMatMul over
the blocks) or re-quantised to NF4 (Nf4Matmul over bitsandbytes' bytes), and the training forward.

    model, tok = load_model("smollm2", capacity=256, quant="nf4")
    adapter.attach(model)
    loss = causal_loss(model, ids, targets)      # ids, targets [B, S]; targets -100 where not trained

**NF4.** Each projection's GGUF weight is dequantised to f32 (the values transformers' loader gives for the
same bytes, in its rotate-half row order) and quantised by `fuel.quant.nf4_quantize`, which gives
bitsandbytes' `quantize_4bit(w, blocksize, quant_type="nf4")` bytes and absmax. The token embedding and the
output head stay as the file stores them (QLoRA quantises the linear layers only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

import fuel as fl
from fuel.errors import ParamError, ShapeError
from fuel.graph.tensor import Tensor
from fuel.models.generate import LLM, describe, model_path
from fuel.models.llama import LlamaModel
from fuel.models.llama_weights import _Linear, _Projections
from fuel.models.tokenizer import GGUFTokenizer
from fuel.quant import QuantType, dequantize, nf4_quantize

QUANTS = ("gguf", "nf4")
IGNORE_INDEX = -100


@dataclass
class Nf4Linear:
    """A projection `x @ dequant(W)ᵀ` over an NF4 weight (bytes `[n, k/2]`, absmax `[n, k/block]`)."""

    packed: np.ndarray
    absmax: np.ndarray
    block_size: int

    @property
    def n(self) -> int:
        return int(self.packed.shape[0])

    def joins(self, other: Any) -> bool:  # `_Projections` stacks QMatMul weights only
        return False

    def __call__(self, x: Tensor) -> Tensor:
        return fl.ops.nf4_matmul(x, fl.tensor(self.packed), fl.tensor(self.absmax), self.block_size)

    @classmethod
    def of(cls, lin: _Linear, block_size: int) -> Nf4Linear:
        """The NF4 re-quantisation of a projection's weight (its rows in the loader's order)."""
        if lin.rows is not None:
            w = dequantize(np.ascontiguousarray(lin.rows), QuantType.of(lin.quant), lin.n, lin.k)
        else:
            assert lin.dense is not None
            w = np.ascontiguousarray(lin.dense.T)
        packed, absmax = nf4_quantize(w, block_size)
        for a in (packed, absmax):
            a.flags.writeable = False  # frozen: the base model's weights are constants of every step
        return cls(packed, absmax, block_size)


def requantize_nf4(model: LlamaModel, block_size: int = 64) -> None:
    """Replace every attention and FFN projection of `model` by its NF4 re-quantisation (in place; the model
    must not have run yet)."""
    for lw in model.layers:
        for group in ("qkv", "gate_up"):
            parts = lw[group].parts()
            lw[group] = _Projections({name: Nf4Linear.of(lin, block_size) for name, lin in parts.items()})  # type: ignore[misc]
        for name in ("o", "down"):
            lw[name] = Nf4Linear.of(lw[name], block_size)


def load_model(name_or_path: str = "smollm2", capacity: int = 256, quant: str = "gguf",
               block_size: int = 64) -> tuple[LlamaModel, GGUFTokenizer]:
    """A model of its own (bundled name or .gguf path) with KV caches of `capacity` tokens, its projections
    as stored (`quant="gguf"`) or re-quantised to NF4 (`"nf4"`), and its tokenizer."""
    if quant not in QUANTS:
        raise ParamError(f"lora: quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    path = model_path(name_or_path)
    f, tokenizer, _ = describe(path)
    model = LlamaModel(f, capacity, max_sequences=2)
    if quant == "nf4":
        requantize_nf4(model, block_size)
    return model, tokenizer


def load_llm(name_or_path: str, context: int, adapter_dir: str | os.PathLike[str], err: TextIO | None = None) -> LLM:
    """A generator (`fuel.models.generate.LLM`) over a model of its own with the adapter in `adapter_dir`
    attached (`fuel generate --lora DIR`). The adapter is read and checked against the file's header before
    the weights load."""
    from fuel.lora.adapter import LoraAdapter

    adapter = LoraAdapter.load(adapter_dir, describe(model_path(name_or_path))[2])
    model, tok = load_model(name_or_path, context)
    adapter.attach(model)
    if err is not None:
        err.write(f"LoRA adapter {adapter_dir}: r {adapter.config.r}, alpha {adapter.config.lora_alpha:g}, "
                  f"{', '.join(adapter.config.target_modules)}\n")
    return LLM(model, tok)


def causal_loss(model: LlamaModel, x: Tensor, targets: Tensor, batch: int = 1) -> Tensor:
    """Mean cross-entropy over the trained positions of `batch` sequences: x their embedding rows
    `[B·S, hidden]` (`embed_batch`), targets `[B·S]` i64 (each position's next token, IGNORE_INDEX where not
    trained)."""
    rows = x.shape[0]
    if targets.shape != (rows,):
        raise ShapeError(f"lora: targets must be [{rows}] (one per embedding row), got {list(targets.shape)}")
    logits = model.causal_logits(x, batch)
    return fl.ops.fused_softmax_cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)


def embed_batch(model: LlamaModel, ids: np.ndarray) -> np.ndarray:
    """The embedding rows `[B·S, hidden]` f32 of token ids `[B, S]` (the frozen table is read outside the
    graph, as the model's own steps do)."""
    a = np.asarray(ids)
    if a.ndim != 2 or a.dtype.kind not in "iu":
        raise ShapeError(f"lora: ids must be an int array [B, S], got {a.dtype} {list(a.shape)}")
    return model.embed([int(t) for t in a.reshape(-1)])
