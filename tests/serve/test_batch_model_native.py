"""The batched serving step replays natively: every step of its capture is a job of the compiled loop, none runs
in Python between them, at a few rows of decode and at a full prompt chunk (a step left in Python costs the
replay loop, the kernel's entry and its checks at every layer). The rows' bytes are checked elsewhere: against
the one-sequence model and alone against batched (test_engine.py, test_batch_model_archs.py)."""

from __future__ import annotations

import numpy as np
import pytest

from fuel.io.gguf import bundled_gguf
from fuel.models.llama import LlamaModel
from fuel.runtime.jit import Capture
from fuel.serve.batch_model import BatchedLlama


def capture_of(bm: BatchedLlama, rows: int, logit_rows: int) -> Capture:
    """The step's capture for (rows, logit rows), traced and replayed once (native replay is prepared after the
    first call)."""
    blocks = [3, 1]
    bm.warm([(rows, logit_rows)] * 2, blocks)
    jit = bm._step if logit_rows else bm._fill
    (cap,) = [c for sig, c in jit._captures.items() if sig[0][0][0] == rows]
    return cap




@pytest.mark.parametrize(("name", "shapes"), [("smollm2", [(4, 4), (16, 1), (16, 16)]), ("gemma3", [(4, 4)])])
def test_the_batched_step_runs_no_step_in_python(name: str, shapes: list[tuple[int, int]]) -> None:
    model = LlamaModel.load(bundled_gguf(name), capacity=64)
    for rows, logit_rows in shapes:
        bm = BatchedLlama(model, num_blocks=8, block_size=16)
        cap = capture_of(bm, rows, logit_rows)
        assert cap.native is not None
        in_python = [item[2].step.spec.op.name if item[0] is None else item[2].op.name
                     for item in cap.native.items if len(item) != 2]
        assert in_python == [], (rows, logit_rows, in_python)
        out = bm.step(np.zeros(rows, np.int64), np.arange(rows), 3 * 16 + np.arange(rows),
                      np.full((rows, bm.max_blocks), 3), np.arange(logit_rows))
        assert out.shape == (logit_rows, model.cfg.vocab) and np.isfinite(out).all()
