"""Chat prompts rendered by GGUFTokenizer against transformers' `apply_chat_template(..., tokenize=False)`.

The templates are the models' own (tests/models/templates/, from llama.cpp's models/templates and, for
Mistral-7B-Instruct-v0.3, the mistralai "v3" template case of llama.cpp's tests/test-chat-template.cpp; see
templates/README.md), plus SmolLM2's from its bundled GGUF file and Gemma 3's (GEMMA3_CHAT_TEMPLATE).

Ours is built from GGUF metadata: SmolLM2's vocabulary with the model's turn markers appended as control tokens and
its bos/eos ids. The oracle is a `PreTrainedTokenizerFast` over that same tokenizer with the model's bos/eos tokens
and the template set, so only the rendering is under test, and both render at the same moment (Llama-3.1 writes
today's date through `strftime_now`). Where a template raises (Gemma's system role, roles that do not alternate),
both must raise.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jinja2
import pytest
import transformers
from tokenizers import Tokenizer

from fuel.io.gguf import bundled_gguf, open_gguf
from fuel.models.tokenizer import GEMMA3_CHAT_TEMPLATE, GGUFTokenizer, TokenizerError

TEMPLATES = Path(__file__).parent / "templates"


# model -> (template file or source, bos token or None, eos token, the turn markers its template writes)
MODELS: dict[str, tuple[str, str | None, str, tuple[str, ...]]] = {
    "smollm2": ("<gguf>", "<|im_start|>", "<|im_end|>", ()),
    "gemma3": ("<gemma3>", "<bos>", "<eos>", ("<start_of_turn>", "<end_of_turn>")),
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", None, "<|im_end|>", ()),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", None, "<|im_end|>", ("<think>", "</think>")),
    "phi3.5": ("microsoft-Phi-3.5-mini-instruct.jinja", "<s>", "<|endoftext|>",
               ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")),
    "mistral-v0.3": ("mistralai-Mistral-7B-Instruct-v0.3.jinja", "<s>", "</s>", ("[INST]", "[/INST]")),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>", ("[INST]", "[/INST]")),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>",
                 ("<|start_header_id|>", "<|end_header_id|>")),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>",
                 ("<|start_header_id|>", "<|end_header_id|>")),
    "gemma2": ("google-gemma-2-2b-it.jinja", "<bos>", "<eos>", ("<start_of_turn>", "<end_of_turn>")),
}

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
CHATS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "Hi there"}],
    "system+user": [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    "multi-turn": [{"role": "user", "content": "Hello 😀 <b>&'\"</b>"},
                   {"role": "assistant", "content": "  Hi! 日本語?\n", "tool_calls": None},
                   {"role": "user", "content": "Again,\n\nplease."}],
    "system+multi-turn": [SYSTEM, {"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"},
                          {"role": "user", "content": "Three"}],
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, e.g. \"Zürich\" <today>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "a city"}},
                   "required": ["city"]}}}]
TOOL_MODELS = ("qwen2.5", "qwen3", "llama3.1", "llama3.2", "mistral-v0.3", "mistral-nemo")


@functools.cache
def _smollm2_metadata() -> dict[str, Any]:
    return dict(open_gguf(bundled_gguf("smollm2")).metadata)


def template_text(model: str) -> str:
    source = MODELS[model][0]
    if source == "<gguf>":
        return str(_smollm2_metadata()["tokenizer.chat_template"])
    if source == "<gemma3>":
        return GEMMA3_CHAT_TEMPLATE
    return (TEMPLATES / source).read_text(encoding="utf-8")


@functools.cache
def pair(model: str) -> tuple[GGUFTokenizer, Any]:
    """Ours from GGUF metadata, and the oracle over the same tokenizer with the same special tokens."""
    _, bos, eos, markers = MODELS[model]
    meta = {k: v for k, v in _smollm2_metadata().items()
            if k not in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.unknown_token_id",
                         "tokenizer.ggml.padding_token_id", "tokenizer.chat_template")}
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    for t in (bos, eos, *markers):
        if t is not None and t not in tokens:
            tokens.append(t)
            types.append(3)
    meta.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                 "tokenizer.ggml.eos_token_id": tokens.index(eos)})
    if bos is not None:
        meta["tokenizer.ggml.bos_token_id"] = tokens.index(bos)
    text = template_text(model)
    ours = GGUFTokenizer.from_metadata(meta, chat_template=text)
    oracle = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(ours.tokenizer.to_str()),
                                                  bos_token=bos, eos_token=eos)
    oracle.chat_template = text
    return ours, oracle


def _render_oracle(oracle: Any, messages: list[dict[str, Any]], gen: bool, **kw: Any) -> str | type[Exception]:
    try:
        return str(oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw))
    except jinja2.exceptions.TemplateError:
        return TokenizerError


def _render_ours(ours: GGUFTokenizer, messages: list[dict[str, Any]], gen: bool, **kw: Any) -> str | type[Exception]:
    try:
        return ours.chat_prompt(messages, add_generation_prompt=gen, **kw)
    except TokenizerError:
        return TokenizerError


@pytest.mark.parametrize("model", sorted(MODELS))
def test_chat_prompt_equals_transformers(model: str) -> None:
    ours, oracle = pair(model)
    rendered = 0
    for name, messages in CHATS.items():
        for gen in (True, False):
            want = _render_oracle(oracle, messages, gen)
            assert _render_ours(ours, messages, gen) == want, (name, gen)
            rendered += want is not TokenizerError
    assert rendered >= 4  # each model renders at least its system-free chats, in both modes


def test_gemma_system_role_raises_in_both() -> None:
    for model in ("gemma2",):
        ours, oracle = pair(model)
        with pytest.raises(jinja2.exceptions.TemplateError, match="System role not supported"):
            oracle.apply_chat_template(CHATS["system+user"], tokenize=False)
        with pytest.raises(TokenizerError, match="System role not supported"):
            ours.chat_prompt(CHATS["system+user"])


@pytest.mark.parametrize("model", ["gemma2", "gemma3", "mistral-v0.3", "mistral-nemo"])
def test_roles_that_do_not_alternate_raise_in_both(model: str) -> None:
    ours, oracle = pair(model)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="alternate"):
        oracle.apply_chat_template(bad, tokenize=False)
    with pytest.raises(TokenizerError, match="alternate"):
        ours.chat_prompt(bad)


@pytest.mark.parametrize("model", TOOL_MODELS)
def test_tools_render_as_transformers(model: str) -> None:
    """Tool schemas reach the template (`tojson`, `tojson(indent=4)` in Llama-3's) as transformers passes them."""
    ours, oracle = pair(model)
    messages = CHATS["user"]
    want = _render_oracle(oracle, messages, True, tools=TOOLS)
    assert want is not TokenizerError and "get_weather" in str(want)
    assert _render_ours(ours, messages, True, tools=TOOLS) == want
    assert ours.encode_chat(messages, tools=TOOLS) == list(oracle.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_template_variables_reach_the_template() -> None:
    """Qwen3's enable_thinking and Llama-3.1's date_string are template variables, as in transformers."""
    for model, kw in (("qwen3", {"enable_thinking": False}), ("llama3.1", {"date_string": "01 Jan 2030"})):
        ours, oracle = pair(model)
        want = _render_oracle(oracle, CHATS["user"], True, **kw)
        assert want != _render_oracle(oracle, CHATS["user"], True)  # the variable changes the prompt
        assert _render_ours(ours, CHATS["user"], True, **kw) == want


def test_messages_are_not_mutated() -> None:
    ours, _ = pair("qwen3")
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "<think>\nr\n</think>\n\na", "tool_calls": None},
                {"role": "user", "content": "again"}]
    before = [dict(m) for m in messages]
    ours.chat_prompt(messages, tools=TOOLS)
    assert messages == before
