"""The batched serving step on the new architectures' details: Qwen2's Q/K/V biases, Gemma 2's attention-logit
and final softcaps, query scale and even-layer sliding window (16 keys, passed here), Phi-3's fused Q/K/V and
gate/up weights (the step's own products read each projection's rows of them) and Qwen3's per-head q/k norms
(over the step's rows of heads). Each row's logits match
`LlamaModel`'s own steps on the same tokens (FlashAttn over a contiguous cache, which
tests/models/test_arch_oracle.py checks against transformers), and a sequence's rows are the same bytes whether
or not another sequence shares its steps: in Q8_0 files (QMatMul's rows) and in an F32 file (the dense products
of up to 16 rows run through the row-invariant gemv loop)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fuel.models.llama import LlamaModel
from fuel.serve.batch_model import BatchedLlama
from fuel.testing.arch_files import VOCAB, write_arch_gguf

BS = 4  # block size
A_BLOCKS = np.array([7, 2, 9, 0, 5, 1, 3, 8])  # shuffled tables
B_BLOCKS = np.array([11, 4, 13, 6, 10, 12, 14, 15])


def slots(blocks: np.ndarray, pos: np.ndarray) -> np.ndarray:
    return blocks[pos // BS] * BS + pos % BS


def run(bm: BatchedLlama, steps: list[list[tuple[np.ndarray, list[int], int, bool]]]) -> list[np.ndarray]:
    """Each step's rows: per sequence (its block table, its tokens, its first position, whether its last row's
    logits are wanted), all in one `bm.step`; the logits wanted, in order."""
    out = []
    for step in steps:
        tok, pos, slot, table, want = [], [], [], [], []
        for blocks, ids, start, logits in step:
            p = np.arange(start, start + len(ids))
            tok += ids
            pos += p.tolist()
            slot += slots(blocks, p).tolist()
            table += [blocks] * len(ids)
            if logits:
                want.append(len(tok) - 1)
        got = bm.step(np.array(tok), np.array(pos), np.array(slot), np.stack(table), np.array(want, np.int64))
        out += list(got)
    return out


def close(got: np.ndarray, want: np.ndarray) -> None:
    assert np.argmax(got) == np.argmax(want)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))  # per row


@pytest.mark.parametrize(("name", "qtype"), [("qwen2", "Q8_0"), ("gemma2", "Q8_0"), ("qwen2", "F32"), ("phi3", "Q8_0"),
                                           ("qwen3", "Q8_0")])
def test_batched_rows_equal_the_model_and_each_other(tmp_path: Path, name: str, qtype: str) -> None:
    model = LlamaModel.load(write_arch_gguf(tmp_path / f"{name}.gguf", name, qtype), capacity=32)
    rng = np.random.default_rng(7)
    a, b = rng.integers(3, VOCAB, 24).tolist(), rng.integers(3, VOCAB, 7).tolist()
    sa, sb = model.sequence(), model.sequence()
    want = [sb.prefill(b), sa.prefill(a)]
    ta, tb = int(np.argmax(want[1])), int(np.argmax(want[0]))
    want += [sa.decode(ta), sb.decode(tb)]
    ta2 = int(np.argmax(want[2]))
    want.append(sa.decode(ta2))

    bm = BatchedLlama(model, num_blocks=16, block_size=BS)
    got = run(bm, [
        [(A_BLOCKS, a[:8], 0, False), (B_BLOCKS, b, 0, True)],  # a prompt chunk beside a whole prompt (15 rows)
        [(A_BLOCKS, a[8:], 8, True)],
        [(A_BLOCKS, [ta], 24, True), (B_BLOCKS, [tb], 7, True)],  # two decode rows in one step
        [(A_BLOCKS, [ta2], 25, True)]])
    for g, w in zip(got, want, strict=True):
        close(g, w)

    alone = run(BatchedLlama(model, num_blocks=16, block_size=BS), [
        [(A_BLOCKS, a[:8], 0, False)], [(A_BLOCKS, a[8:], 8, True)], [(A_BLOCKS, [ta], 24, True)],
        [(A_BLOCKS, [ta2], 25, True)]])
    for g, w in zip(alone, [got[1], got[2], got[4]], strict=True):
        np.testing.assert_array_equal(g, w)  # batch invariance: the same bytes without sequence b's rows
