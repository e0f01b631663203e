"""`LLM.generate`'s per-request sampling arguments against transformers' `generate`: the penalties see the
prompt and the tokens generated so far, as the oracle's logits processors do (written in torch from the
documents: logit_bias added, transformers' RepetitionPenaltyLogitsProcessor over prompt + generated ids,
OpenAI's presence/frequency formula over the generated ids), in the Sampler's order."""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
)

from fuel.models import generate as gen

PROMPT = [{"role": "user", "content": "Name three colours."}]
STEPS = 24


class _Bias(LogitsProcessor):
    def __init__(self, bias: dict[int, float]) -> None:
        self.bias = bias

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for j, b in self.bias.items():
            scores[:, j] += b
        return scores


class _OpenAIPenalties(LogitsProcessor):
    """logits[j] -= c[j] * frequency + (c[j] > 0) * presence, c the counts of the ids after the prompt."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        c = torch.bincount(input_ids[0, self.prompt_len:], minlength=scores.shape[-1]).to(scores.dtype)
        return scores - (c * self.frequency + (c > 0).to(scores.dtype) * self.presence)


def _hf_tokens(model: Any, ids: list[int], eos: frozenset[int], processors: list[LogitsProcessor]) -> list[int]:
    torch.set_num_threads(1)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=STEPS, logits_processor=LogitsProcessorList(processors),
                             eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0], repetition_penalty=None,
                             temperature=None, top_p=None, top_k=None)
    toks = out[0, len(ids):].tolist()
    return toks[:next((i for i, t in enumerate(toks) if t in eos), len(toks))]


def test_greedy_with_bias_and_penalties_is_transformers(smollm2: gen.LLM, smollm2_hf: Any) -> None:
    """Greedy decoding with a bias, a repetition penalty and OpenAI's penalties gives transformers' tokens
    under the same processors; leaving out any one of the three gives another text (each takes effect)."""
    ids = smollm2.prompt_ids(PROMPT, chat=True)
    bias = {260: 1.0}  # " the"
    kw: dict[str, Any] = {"logit_bias": bias, "repetition_penalty": 1.1, "presence_penalty": 2.0,
                          "frequency_penalty": 2.0}
    g = smollm2.generate(PROMPT, STEPS, chat=True, **kw)
    assert "".join(g)
    want = _hf_tokens(smollm2_hf, ids, smollm2.tokenizer.eos_ids,
                      [_Bias(bias), RepetitionPenaltyLogitsProcessor(1.1), _OpenAIPenalties(len(ids), 2.0, 2.0)])
    assert g.tokens == want
    for left_out in (("logit_bias",), ("repetition_penalty",), ("presence_penalty", "frequency_penalty")):
        other = smollm2.generate(PROMPT, STEPS, chat=True, **{k: v for k, v in kw.items() if k not in left_out})
        "".join(other)
        assert other.tokens != g.tokens, left_out
