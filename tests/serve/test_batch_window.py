"""The batched step on Gemma 3's sliding-window layers: PagedAttn with the model's left window against
LlamaModel's own steps (FlashAttn with the same window over a contiguous cache, which tests/models check
against transformers), past the window, where the window binds."""

from __future__ import annotations

import dataclasses

import numpy as np

from fuel.io.gguf import bundled_gguf
from fuel.models.llama import LlamaModel
from fuel.serve.batch_model import BatchedLlama

WINDOW = 6  # a small window (the model's is 512), so a short sequence passes it


def test_gemma_local_layers_see_their_window_only() -> None:
    """A 14-token prompt in chunks, then decode steps: each row's logits match the one-sequence model's
    (per-row tolerance, same argmax), and differ from what attending to every key gives (the model's own
    window, 512, never binds here)."""
    model = LlamaModel.load(bundled_gguf("gemma3"), capacity=32)
    assert model.cfg.gemma and model.cfg.sliding_window
    model.cfg = dataclasses.replace(model.cfg, sliding_window=WINDOW)
    ids = [2, 818, 5279, 529, 7001, 563, 236764, 1106, 2617, 3011, 531, 506, 12122, 236761]
    seq = model.sequence()
    want = [seq.prefill(ids)]
    bs = 4
    bm = BatchedLlama(model, num_blocks=10, block_size=bs)
    assert bm.max_context == 32
    blocks = np.array([7, 2, 9, 0, 5, 1, 3, 8])  # a shuffled table
    table = blocks.reshape(1, -1)
    got, pos = [], 0
    for chunk in (ids[:5], ids[5:]):
        n = len(chunk)
        p = np.arange(pos, pos + n)
        out = bm.step(np.array(chunk), p, blocks[p // bs] * bs + p % bs, np.repeat(table, n, 0), np.array([n - 1]))
        pos += n
    got.append(out[0])
    for _ in range(3):
        t = int(np.argmax(got[-1]))
        want.append(seq.decode(t))
        got.append(bm.step(np.array([t]), np.array([pos]), np.array([blocks[pos // bs] * bs + pos % bs]), table,
                           np.array([0]))[0])
        pos += 1
    for g, w in zip(got, want, strict=True):
        assert np.argmax(g) == np.argmax(w)
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-3 * float(np.abs(w).max()))  # per row
    wide = LlamaModel.load(bundled_gguf("gemma3"), capacity=32).prefill(ids)
    assert np.abs(wide - want[0]).max() > 50 * 2e-3 * float(np.abs(want[0]).max())
