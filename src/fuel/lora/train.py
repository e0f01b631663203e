"""Instruction fine-tuning data and the QLoRA training step.

**Examples.** An example is a (prompt, answer) pair rendered through the model's chat template: the user
turn with the generation prompt gives the prompt's tokens, the user and assistant turns together the whole
sequence (the template's closing `<|im_end|>` included, so the model learns to stop). The inputs are the
sequence but its last token, the targets the sequence from its second token, and the targets of every
prompt position are IGNORE_INDEX (-100): only the answer's tokens are trained. Sequences are cut at
`seq_len` and padded to it at the end (padding's targets ignored; causal attention keeps real rows from
seeing it), so every step has one shape and replays one capture.

**The step.** `LoraTrainer.step(ids, targets)` runs `fuel.optim.AdamW` over the adapter's tensors only:
one `fl.jit` replay of forward (through the frozen QMatMul/Nf4Matmul projections plus the adapters' terms),
backward and the in-place update (`opt.compile`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import fuel as fl
from fuel.errors import ParamError
from fuel.lora.adapter import AdapterError, LoraAdapter
from fuel.lora.model import IGNORE_INDEX, causal_loss, embed_batch
from fuel.models.llama import LlamaModel
from fuel.models.tokenizer import GGUFTokenizer

Example = tuple[str, str]


def encode_example(tok: GGUFTokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """(inputs, targets) of one example, unpadded: targets are the next tokens, IGNORE_INDEX over the prompt."""
    user = {"role": "user", "content": prompt}
    head = tok.encode_chat([user], add_generation_prompt=True)
    full = tok.encode_chat([user, {"role": "assistant", "content": answer}], add_generation_prompt=False)
    if full[:len(head)] != head or len(full) <= len(head):
        raise ParamError("lora: the chat template's rendering of the prompt is not a prefix of the prompt with "
                         "its answer, so the prompt tokens cannot be masked")
    targets = [IGNORE_INDEX] * (len(head) - 1) + full[len(head):]
    return full[:-1], targets


def encode_examples(tok: GGUFTokenizer, examples: Sequence[Example], seq_len: int, pad_id: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """ids and targets `[N, seq_len]` (i64) of the examples, cut at seq_len and padded to it."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ParamError(f"lora: seq_len must be an int >= 2, got {seq_len!r}")
    ids = np.full((len(examples), seq_len), pad_id, np.int64)
    targets = np.full((len(examples), seq_len), IGNORE_INDEX, np.int64)
    for i, (prompt, answer) in enumerate(examples):
        x, t = encode_example(tok, prompt, answer)
        ids[i, :min(len(x), seq_len)] = x[:seq_len]
        targets[i, :min(len(t), seq_len)] = t[:seq_len]
    if (targets == IGNORE_INDEX).all():
        raise ParamError(f"lora: seq_len {seq_len} cuts every answer off (the prompts fill it); give a larger "
                         "--seq-len")
    return ids, targets


def read_examples(path: str | os.PathLike[str]) -> list[Example]:
    """Examples from a JSON Lines file: one object a line with str "prompt" and "response" (or "instruction"
    and "output"); blank lines skipped. Errors name the file and line."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ParamError(f"lora: cannot read {p}: {e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ParamError(f"lora: {p}:{n}: not JSON ({e.msg})") from None
        pair = _pair(d) if isinstance(d, Mapping) else None
        if pair is None:
            raise ParamError(f'lora: {p}:{n}: expected an object with str "prompt" and "response" (or '
                             f'"instruction" and "output"), got {line[:80]!r}')
        out.append(pair)
    if not out:
        raise ParamError(f"lora: {p} holds no examples")
    return out


def _pair(d: Mapping[str, Any]) -> Example | None:
    for a, b in (("prompt", "response"), ("instruction", "output")):
        if isinstance(d.get(a), str) and isinstance(d.get(b), str) and d[a] and d[b]:
            return d[a], d[b]
    return None


def batches(n: int, batch: int, seed: int) -> Iterator[np.ndarray]:
    """Row indices of endless batches: each pass over the n examples in a new seeded order."""
    rng = np.random.default_rng(seed)
    order = np.empty(0, np.int64)
    while True:
        while len(order) < batch:
            order = np.concatenate([order, rng.permutation(n)])
        yield order[:batch]
        order = order[batch:]


class LoraTrainer:
    """AdamW over the adapter's tensors, the step captured once for `[batch, seq_len]` batches (module doc)."""

    def __init__(self, model: LlamaModel, adapter: LoraAdapter, batch: int, lr: float = 1e-3,
                 weight_decay: float = 0.0, max_grad_norm: float | None = None) -> None:
        from fuel.optim import AdamW

        if model.adapter is not adapter:
            raise AdapterError("lora: attach the adapter to the model before training it (adapter.attach(model))")
        self.model, self.adapter, self.batch = model, adapter, batch
        self.opt = AdamW(adapter.parameters(), lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        self._step = self.opt.compile(lambda x, t: causal_loss(model, x, t, batch))

    def step(self, ids: np.ndarray, targets: np.ndarray) -> float:
        """One update from ids and targets `[batch, S]`; the batch's loss before it."""
        if ids.shape != targets.shape or ids.ndim != 2 or ids.shape[0] != self.batch:
            raise ParamError(f"lora: a step takes ids and targets [{self.batch}, S], got {list(ids.shape)} and "
                             f"{list(targets.shape)}")
        self.adapter.training = True
        self.adapter.redraw_dropout()
        try:
            x = embed_batch(self.model, ids)
            return self._step(x, np.ascontiguousarray(targets.reshape(-1), np.int64))
        finally:
            self.adapter.training = False


def loss_of(model: LlamaModel, ids: np.ndarray, targets: np.ndarray) -> float:
    """The mean loss over the trained positions of ids/targets `[B, S]` (no update, no dropout)."""
    x = fl.tensor(embed_batch(model, ids))
    t = fl.tensor(np.ascontiguousarray(targets.reshape(-1), np.int64))
    return float(causal_loss(model, x, t, ids.shape[0]).numpy())
