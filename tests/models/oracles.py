"""transformers as the oracle of the LLM tests: loading a bundled GGUF model in float32, and its greedy
continuation with its own KV cache.

The oracle runs on one thread. On this project's 2-core machines two OpenMP threads lose to one on
decode-sized steps: a SmolLM2 step is a few hundred small ops, and each parallel region waits for a
second core that fuel's spinning workers, OpenBLAS's or another process may hold (32 greedy steps
took 10-17 s on two threads and 3.1-3.3 s on one, measured in one process on a shared host). fuel's
own thread setting reaches torch through the OpenMP runtime they share, so the count is set at every
call, not once.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from fuel.io.gguf import bundled_gguf


@functools.cache
def hf_model(name: str) -> Any:
    """transformers' float32 model of a bundled GGUF file, loaded once per process (loading SmolLM2 takes
    ~20 s) and shared by every test directory that uses it: users must leave it as they found it."""
    torch.set_num_threads(1)
    path = bundled_gguf(name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def hf_greedy(model: Any, ids: list[int], steps: int,
              eos: frozenset[int] = frozenset()) -> tuple[list[int], np.ndarray]:
    """transformers' greedy continuation (up to `steps` tokens, or to a token of `eos`, left out) and its
    first-step logits; only the last position's logits are computed (`logits_to_keep=1`), the only ones
    read."""
    torch.set_num_threads(1)
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        first = out.logits[0, -1].double().numpy()
        toks: list[int] = []
        for _ in range(steps):
            t = int(out.logits[0, -1].argmax())
            if t in eos:
                break
            toks.append(t)
            if len(toks) < steps:  # the last token's own logits are not needed
                out = model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True,
                            logits_to_keep=1)
    return toks, first


def hf_logits(model: Any, ids: list[int], last: int) -> np.ndarray:
    """transformers' logits `[last, vocab]` of the last `last` positions of one forward pass over `ids`."""
    torch.set_num_threads(1)
    with torch.inference_mode():
        return model(torch.tensor([ids]), logits_to_keep=last).logits[0].double().numpy()
