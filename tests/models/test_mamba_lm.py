"""Fuel's Mamba-1 LM (`fuel.models.mamba_lm`) against transformers loading the same GGUF file.

transformers reads a `mamba` GGUF file itself (gguf-py dequantises every tensor, `ssm_a` becomes
A_log = log(−A), the conv weight gains its middle axis) and runs `MambaForCausalLM`'s PyTorch path in
float32: prefill through its own scan, greedy `generate` recurrently through its `MambaCache`. The files
are tiny random models (`fuel.testing.mamba_files`): F32 with its own output head, Q8_0 and random-block
Q4_K with the head tied to the embedding. Both sides read the same dequantised values, so the quantized
files are held to the F32 bound: 1e-4 of each logit row's largest magnitude.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from fuel.errors import FuelError, ParamError
from fuel.models.generate import LLM
from fuel.models.llama_weights import ModelError
from fuel.models.mamba_lm import MambaModel
from fuel.models.tokenizer import GGUFTokenizer
from fuel.testing.mamba_files import tiny_mamba_gguf

QTYPES = ("F32", "Q8_0", "Q6_K")
PROMPTS = ("The quick brown fox jumps over the lazy dog because",
           "def fibonacci(n):\n    return",
           "Once upon a time, in a land far away, there lived")
REL = 1e-4
GREEDY = 32


class Pair:
    """One file loaded by both sides, and its tokenizer."""

    def __init__(self, path: Path) -> None:
        torch.set_num_threads(1)
        self.path = path
        self.hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                       dtype=torch.float32).eval()
        self.fuel = MambaModel.load(path, capacity=256)
        self.tokenizer = GGUFTokenizer.from_metadata(self.fuel.file.metadata)

    def hf_logits(self, ids: list[int]) -> np.ndarray:
        """transformers' logits `[len(ids), vocab]` of one forward pass (no cache) over ids."""
        torch.set_num_threads(1)
        with torch.inference_mode():
            return self.hf(torch.tensor([ids])).logits[0].double().numpy()

    def hf_greedy(self, ids: list[int], steps: int) -> list[int]:
        """transformers' greedy continuation through `generate` with its cache (no end-of-text stop)."""
        torch.set_num_threads(1)
        with torch.inference_mode():
            out = self.hf.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
        return [int(t) for t in out[0, len(ids):]]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pair]:
    out = {}
    for seed, q in enumerate(QTYPES):
        d = tmp_path_factory.mktemp(f"mamba_{q}")
        out[q] = Pair(tiny_mamba_gguf(d / f"tiny-{q}.gguf", qtype=q, tied=q != "F32", seed=seed))
    return out


def assert_logits_close(got: np.ndarray, ref: np.ndarray) -> None:
    """|got − ref| <= REL · max|ref| per logit row."""
    got, ref = np.atleast_2d(got), np.atleast_2d(ref)
    assert got.shape == ref.shape
    err = np.abs(got - ref).max(axis=-1)
    bound = REL * np.abs(ref).max(axis=-1)
    assert (err <= bound).all(), f"max |fuel - transformers| per row {err}, bound {bound}"


@pytest.mark.parametrize("qtype", QTYPES)
def test_prefill_decode_and_continuation_match_transformers(pairs: dict[str, Pair], qtype: str) -> None:
    """Last-position logits after a prefill, after each decode step, and after a second prefill that continues
    the state (its scan starts from zero; the carried state's part is added)."""
    p = pairs[qtype]
    ids = p.tokenizer.encode(PROMPTS[0])
    assert len(ids) >= 10
    ref = p.hf_logits(ids)
    seq = p.fuel.sequence()
    assert_logits_close(seq.prefill(ids[:5]), ref[4])
    for t in range(5, 8):
        assert_logits_close(seq.decode(ids[t]), ref[t])
    assert_logits_close(seq.prefill(ids[8:]), ref[-1])
    assert seq.pos == len(ids)


@pytest.mark.parametrize("qtype", QTYPES)
def test_greedy_tokens_match_transformers_generate(pairs: dict[str, Pair], qtype: str) -> None:
    p = pairs[qtype]
    m = p.fuel
    seen: set[int] = set()
    for text in PROMPTS:
        ids = p.tokenizer.encode(text)
        want = p.hf_greedy(ids, GREEDY)
        m.reset()
        logits = m.prefill(ids)
        got = []
        for _ in range(GREEDY):
            got.append(int(np.argmax(logits)))
            if len(got) < GREEDY:
                logits = m.decode(got[-1])
        assert got == want, f"{text!r}: fuel {got}, transformers {want}"
        seen |= set(got)
    assert len(seen) > 6  # the continuations are not one token repeated


def test_generate_drives_it_and_a_next_turn_runs_only_its_new_tokens(pairs: dict[str, Pair]) -> None:
    """`fuel.models.generate.LLM` on the Mamba model: the greedy tokens are transformers'; a prompt continuing
    the first generation's tokens reuses that sequence's state (the pool lends it by common prefix)."""
    p = pairs["F32"]
    llm = LLM(p.fuel, p.tokenizer)
    ids = p.tokenizer.encode(PROMPTS[1])
    g = llm.generate(ids, max_tokens=6)
    text = "".join(g)
    want = p.hf_greedy(ids, 6)
    assert g.tokens == want[:len(g.tokens)] and text == p.tokenizer.decode(g.tokens)
    turn = [*ids, *g.tokens, *p.tokenizer.encode(" and then")]
    before = llm.stats.prompt_tokens
    g2 = llm.generate(turn, max_tokens=4)
    list(g2)
    assert llm.stats.prompt_tokens - before == len(turn) - (len(ids) + len(g.tokens) - 1)
    assert g2.tokens == p.hf_greedy(turn, 4)[:len(g2.tokens)]


@pytest.mark.parametrize("field", ["d", "conv_b"])
def test_the_oracle_notices_a_dropped_d_skip_or_conv_bias(pairs: dict[str, Pair], field: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Each detail moves the logits far past the tolerance: Fuel without the D skip (or the conv bias) in
    every layer is far from transformers, so the tests above can tell."""
    p = pairs["F32"]
    ids = p.tokenizer.encode(PROMPTS[2])
    ref = p.hf_logits(ids)[-1]
    for layer in p.fuel.layers:
        monkeypatch.setattr(layer, field, np.zeros_like(getattr(layer, field)))
    seq = p.fuel.sequence()
    err = np.abs(seq.prefill(ids) - ref).max()
    assert err > 100 * REL * np.abs(ref).max()


def test_a_decode_step_is_one_replay_writing_the_sequences_states_in_place(pairs: dict[str, Pair]) -> None:
    p = pairs["Q8_0"]
    seq = p.fuel.sequence()
    ids = p.tokenizer.encode(PROMPTS[0])
    seq.prefill(ids[:4])
    arrays = [*seq.conv_states, *seq.ssm_states]
    before = [a.copy() for a in arrays]
    for t in ids[4:7]:
        seq.decode(t)
    assert seq.decode_step.captures == 1
    assert all(a is b for a, b in zip(arrays, [*seq.conv_states, *seq.ssm_states], strict=True))
    assert all(not np.array_equal(a, b) for a, b in zip(arrays, before, strict=True))
    other = p.fuel.sequence()  # another sequence's states are its own
    other.prefill(ids[:2])
    assert_logits_close(seq.decode(ids[7]), p.hf_logits(ids[:8])[-1])


@settings(max_examples=12)
@given(chunks=st.lists(st.tuples(st.integers(1, 4), st.booleans()), min_size=1, max_size=5))
def test_any_split_into_prefills_and_decodes_matches_transformers(pairs: dict[str, Pair],
                                                                  chunks: list[tuple[int, bool]]) -> None:
    p = pairs["F32"]
    ids = p.tokenizer.encode(PROMPTS[2])[:14]
    ref = p.hf_logits(ids)
    m = p.fuel
    m.reset()
    for size, by_decode in chunks:
        run = ids[m.pos:m.pos + size]
        if not run:
            break
        logits = m.decode(run[0]) if by_decode and len(run) == 1 else m.prefill(run)
        assert_logits_close(logits, ref[m.pos - 1])


def test_sequences_keep_all_their_tokens_or_none(pairs: dict[str, Pair]) -> None:
    m = pairs["F32"].fuel
    seq = m.sequence()
    seq.prefill([5, 6, 7])
    assert seq.common_prefix([5, 6, 7, 8]) == 3
    assert seq.common_prefix([5, 6, 7]) == 0  # no token left to give logits: start again
    assert seq.common_prefix([5, 9, 7, 8]) == 0
    with pytest.raises(ParamError, match="pos must be 0 or 3, got 1"):
        seq.rewind(1)
    seq.rewind(3)
    assert seq.pos == 3
    seq.rewind(0)
    assert seq.pos == 0 and not any(a.any() for a in (*seq.conv_states, *seq.ssm_states))
    with pytest.raises(ModelError, match=r"token id 4096 is outside the vocabulary \[0, 4096\)"):
        seq.prefill([1, 4096])
    with pytest.raises(ModelError, match="300 tokens do not fit the sequence's capacity of 256"):
        seq.prefill([1] * 300)
    with pytest.raises(ParamError, match="not lent from this model's pool"):
        m.release(seq)


def _write(tmp_path: Path, **kw: Any) -> Path:
    return tiny_mamba_gguf(tmp_path / "m.gguf", layers=1, **kw)


@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"arch": "mamba2"}, ModelError, "architecture 'mamba2' \\(Mamba-2\\) is not supported"),
    ({"dt_b_c_rms": True}, ModelError, "mamba.ssm.dt_b_c_rms = True .*is not supported"),
    ({"drop": ["mamba.ssm.state_size"]}, FuelError, "mamba.ssm.state_size"),
    ({"hparams": {"ssm.time_step_rank": 0}}, ModelError, "mamba.ssm.time_step_rank must be a positive integer, got 0"),
    ({"drop": ["blk.0.ssm_d"]}, FuelError, "blk.0.ssm_d"),
    ({"hparams": {"ssm.state_size": 8}}, ModelError, r"tensor 'blk.0.ssm_x.weight' has shape \[48, 512\], "
                                                     r"expected \[32, 512\]"),
    ({"extra": {"blk.0.ssm_norm.weight": np.ones(512, np.float32)}}, ModelError,
     "tensor 'blk.0.ssm_norm.weight' is not part of a Mamba-1 model"),
], ids=["mamba2", "falcon_mamba", "missing_key", "bad_value", "missing_tensor", "wrong_shape", "unexpected_tensor"])
def test_files_it_cannot_run_are_refused_by_name(tmp_path: Path, kw: dict[str, Any], error: type[Exception],
                                                 match: str) -> None:
    path = _write(tmp_path, **kw)
    with pytest.raises(error, match=match):
        MambaModel.load(path, capacity=16)


def test_capacity_is_checked(tmp_path: Path) -> None:
    path = _write(tmp_path)
    with pytest.raises(ModelError, match=r"capacity must be an int in \[1, 1048576\]"):
        MambaModel.load(path, capacity=0)
