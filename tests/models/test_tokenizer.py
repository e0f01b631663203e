"""GGUFTokenizer against transformers' own GGUF tokenizer loader, an independent build from the same metadata.

Two known, legitimate differences, each checked here rather than skipped:

- SmolLM2 (`tokenizer.ggml.pre == "smollm"`): transformers does not know this pre-tokenizer and falls back to the
  plain GPT-2 split, while SmolLM2's own tokenizer.json (and llama.cpp) split every digit apart first. The two agree
  except where whitespace or a numeric character touches a digit ("x  1": ours and llama.cpp give [x, "ĠĠ", 1],
  transformers [x, Ġ, Ġ, 1]). Strings with numeric characters are compared with the oracle's pre-tokenizer set to
  SmolLM2's, and a few are pinned to the ids llama.cpp (llama-cpp-python 0.3.36, vocab_only) gives.
- Gemma-3-270M (a base model) carries no chat template; ours falls back to Gemma 3's instruct template, so the
  oracle renders that same template and a literal prompt pins the format.

The Gemma oracle is built with `GemmaTokenizer.from_pretrained(dir, gguf_file=...)`, the class AutoTokenizer
picks for this file: AutoTokenizer first reads the model config with gguf's slow reader (~20 s for the 262k
vocabulary); the tokenizer it then builds is the same (identical backend JSON and special tokens, checked once by
hand).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np
import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, pre_tokenizers

from fuel.errors import FuelError
from fuel.io.gguf import bundled_gguf, open_gguf
from fuel.models.tokenizer import GEMMA3_CHAT_TEMPLATE, GGUFTokenizer, TokenizerError
from tests.models import llama_cpp_golden as golden
from tests.models.tokenizer_files import (
    LLAMA3_SPECIALS,
    PRE_ALPHABET,
    PRE_CASES,
    PRE_TEXTS,
    SPM_PIECES,
    SPM_TEXTS,
    TEXTS,
    vocabulary_hash,
    write_spm_gguf,
    write_tokenizer_gguf,
)

# SmolLM2 ids from llama.cpp (see the module docstring), where transformers' GGUF loader splits digits differently.
SMOLLM2_LLAMA_CPP = {
    "x  1": [104, 256, 33],
    "a 1  22   333": [81, 216, 33, 256, 34, 34, 333, 35, 35, 35],
    "x\n 1": [104, 3805, 33],
    "a\x06b": [81, 82],  # SmolLM2's byte-level vocabulary has no token for byte 0x06: llama.cpp drops it
}

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hello 😀"}, {"role": "assistant", "content": "Hi! 日本語?"},
     {"role": "user", "content": "  Yes, please.\n"}],
]


class Pair:
    """Ours and the oracle for one model, plus the oracle with SmolLM2's real pre-tokenizer where it differs."""

    def __init__(self, name: str, ours: GGUFTokenizer, oracle: Any, digits_oracle: Tokenizer | None) -> None:
        self.name, self.ours, self.oracle, self.digits_oracle = name, ours, oracle, digits_oracle

    def oracle_ids(self, text: str) -> list[int]:
        if self.digits_oracle is not None and any(ch.isnumeric() for ch in text):
            return list(self.digits_oracle.encode(text, add_special_tokens=False).ids)
        return list(self.oracle.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def pair(request: pytest.FixtureRequest) -> Pair:
    name: str = request.param
    path = bundled_gguf(name)
    ours = GGUFTokenizer.from_metadata(open_gguf(path).metadata)
    if name == "gemma3":
        oracle = transformers.GemmaTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        oracle.chat_template = GEMMA3_CHAT_TEMPLATE  # the file has none; ours falls back to this one
        return Pair(name, ours, oracle, None)
    oracle = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    digits = Tokenizer.from_str(oracle.backend_tokenizer.to_str())
    digits.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return Pair(name, ours, oracle, digits)


def test_encode_matches_oracle(pair: Pair) -> None:
    for text in TEXTS:
        assert pair.ours.encode(text, add_bos=False) == pair.oracle_ids(text), text
        # The default follows the file's add_bos_token flag, as the oracle's default encode does.
        expected = ([pair.oracle.bos_token_id] if pair.oracle.add_bos_token else []) + pair.oracle_ids(text)
        assert pair.ours.encode(text) == expected, text


def test_flags_and_special_ids(pair: Pair) -> None:
    ours, oracle = pair.ours, pair.oracle
    assert ours.bos_id == oracle.bos_token_id and ours.eos_id == oracle.eos_token_id
    assert ours.add_bos == oracle.add_bos_token == (pair.name == "gemma3")
    assert ours.vocab_size == len(oracle)
    if pair.name == "smollm2":  # eos is <|im_end|>; <|endoftext|> ends a document
        assert (ours.bos_id, ours.eos_id, ours.eos_ids) == (1, 2, frozenset({0, 2}))
    else:  # <eos>, and <end_of_turn>, which closes each turn of the chat template
        assert (ours.bos_id, ours.eos_id, ours.eos_ids) == (2, 1, frozenset({1, 106}))
    for marker in ("<|im_start|>", "<|im_end|>") if pair.name == "smollm2" else ("<start_of_turn>", "<end_of_turn>"):
        (one,) = ours.encode(marker, add_bos=False)  # a chat marker is one id, not pieces of text
        assert one == oracle.convert_tokens_to_ids(marker)


@functools.cache
def ours_for(name: str) -> GGUFTokenizer:
    return GGUFTokenizer.from_metadata(open_gguf(bundled_gguf(name)).metadata)


def test_smollm2_digits_follow_llama_cpp() -> None:
    for text, ids in SMOLLM2_LLAMA_CPP.items():
        assert ours_for("smollm2").encode(text, add_bos=False) == ids, text


def test_bytes_without_a_token_as_the_oracle(pair: Pair) -> None:
    """A control byte the vocabulary cannot spell (SmolLM2 has no token for 0x06; Gemma falls back to <0x06>)
    is what the oracle makes of it: dropped by SmolLM2's, as by llama.cpp (SMOLLM2_LLAMA_CPP)."""
    for text in ("\x06", "a\x06b", "\x06\x07\x1b[0m"):
        ids = pair.ours.encode(text, add_bos=False)
        assert ids == pair.oracle_ids(text), text
        assert pair.ours.decode(ids) == pair.oracle.decode(ids), text
    assert ours_for("smollm2").encode("\x06", add_bos=False) == []
    assert ours_for("gemma3").encode("\x06", add_bos=False)


def test_decode_matches_oracle_and_round_trips(pair: Pair) -> None:
    for text in TEXTS:
        ids = pair.ours.encode(text)
        assert pair.ours.decode(ids) == pair.oracle.decode(ids), text
        assert pair.ours.decode(ids, skip_special=True) == pair.oracle.decode(ids, skip_special_tokens=True), text
        # Gemma's normalizer writes a space as ▁, so a literal ▁ in the input comes back as a space (so in the oracle)
        expected = text.replace("▁", " ") if pair.name == "gemma3" else text
        assert pair.ours.decode(pair.ours.encode(text, add_bos=False)) == expected, text


def test_chat_prompt_matches_oracle(pair: Pair) -> None:
    for messages in CHATS:
        for gen in (True, False):
            want = pair.oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert pair.ours.chat_prompt(messages, add_generation_prompt=gen) == want
        want_ids = pair.oracle.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                   return_dict=False)
        if pair.digits_oracle is not None:  # SmolLM2: re-encode the oracle's text with the real digit split
            want_ids = pair.oracle_ids(pair.oracle.apply_chat_template(messages, tokenize=False,
                                                                       add_generation_prompt=True))
        assert pair.ours.encode_chat(messages) == list(want_ids)


def test_chat_prompt_literal_format(pair: Pair) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    if pair.name == "smollm2":
        assert pair.ours.chat_template_from_file
        want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    else:
        assert not pair.ours.chat_template_from_file and pair.ours.chat_template == GEMMA3_CHAT_TEMPLATE
        want = "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert pair.ours.chat_prompt(messages) == want
    ids = pair.ours.encode_chat(messages)
    assert ids == pair.ours.encode(want, add_bos=False)
    if pair.name == "gemma3":  # the template writes <bos>, and add_bos_token is set: it must not come twice
        assert ids[0] == pair.ours.bos_id and ids.count(pair.ours.bos_id) == 1


def test_stream_decoder_concatenates_to_decode(pair: Pair) -> None:
    for text in TEXTS:
        ids = pair.ours.encode(text)
        for skip in (True, False):
            dec = pair.ours.stream(skip_special=skip)
            pieces = [dec.push(i) for i in ids]
            assert dec.flush() == "", text  # valid text is shown as soon as its last character is complete
            assert "".join(pieces) == pair.ours.decode(ids, skip_special=skip), text
            assert all("\ufffd" not in p for p in pieces), text  # no character was split


def test_stream_decoder_holds_split_characters(pair: Pair) -> None:
    # 𓀀 is four <0xNN> byte tokens in Gemma and several byte-level tokens in SmolLM2: nothing shows until it is whole.
    ids = pair.ours.encode("𓀀", add_bos=False)
    assert len(ids) >= 2
    dec = pair.ours.stream()
    assert [dec.push(i) for i in ids] == [""] * (len(ids) - 1) + ["𓀀"]
    dec = pair.ours.stream()
    assert dec.push(ids[0]) == ""
    flushed = dec.flush()  # an unfinished character is shown, as U+FFFD, only when flushed
    assert flushed and set(flushed) == {"\ufffd"}


def test_stream_decoder_random_ids(pair: Pair) -> None:
    # Random ordinary tokens (Gemma's byte tokens left out: an invalid byte run is the documented exception).
    rng = np.random.default_rng(7)
    types = np.asarray(open_gguf(bundled_gguf(pair.name)).metadata["tokenizer.ggml.token_type"])
    pool = np.flatnonzero(types == 1)
    for _ in range(20):
        ids = rng.choice(pool, size=40).tolist()
        dec = pair.ours.stream()
        text = "".join(dec.push(i) for i in ids) + dec.flush()
        assert text == pair.ours.decode(ids)


def test_errors_are_clear() -> None:
    meta = dict(open_gguf(bundled_gguf("smollm2")).metadata)
    assert issubclass(TokenizerError, FuelError) and issubclass(TokenizerError, ValueError)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                "tokenizer.ggml.eos_token_id"):
        with pytest.raises(TokenizerError, match=re.escape(key)):
            GGUFTokenizer.from_metadata({k: v for k, v in meta.items() if k != key})
    with pytest.raises(TokenizerError, match="'bert' is not supported"):
        GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.model": "bert"})
    with pytest.raises(TokenizerError, match="'qwen9' is not supported"):
        GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "qwen9"})
    no_template = GGUFTokenizer.from_metadata({k: v for k, v in meta.items() if k != "tokenizer.chat_template"})
    with pytest.raises(TokenizerError, match=r"no tokenizer\.chat_template"):
        no_template.chat_prompt(CHATS[0])
    custom = GGUFTokenizer.from_metadata(meta, chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert custom.chat_prompt(CHATS[1]) == "[Be brief.][What is 2+2?]" and not custom.chat_template_from_file
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        custom.decode([1, 49152])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        custom.stream().push(-1)


def test_text_that_is_not_unicode_or_not_text_is_a_tokenizer_error() -> None:
    """A lone surrogate (undecodable bytes of a command line keep that form) cannot reach the Rust tokenizer,
    nor can a non-str; a file whose merges name unknown tokens is refused when it is read."""
    tok = ours_for("smollm2")
    with pytest.raises(TokenizerError, match=r"lone surrogate '\\udcff' at index 2"):
        tok.encode("ab\udcffc")
    with pytest.raises(TokenizerError, match="lone surrogate"):
        tok.encode_chat([{"role": "user", "content": "\ud800"}])
    with pytest.raises(TokenizerError, match="expects a str, got int"):
        tok.encode(3)  # type: ignore[arg-type]
    meta = dict(open_gguf(bundled_gguf("smollm2")).metadata)
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.merges"):
        GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.merges": ["nosuch token"]})


def test_template_errors_are_tokenizer_errors() -> None:
    """Gemma's template (SmolLM2's checks nothing) raises on turns that do not alternate."""
    with pytest.raises(TokenizerError, match="roles must alternate"):
        ours_for("gemma3").chat_prompt([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


# --- Byte-level pre-tokenizers of the new architectures' files (Qwen2/2.5/3: "qwen2"; Llama-3: "llama-bpe") ----
# SmolLM2's vocabulary and merges under another `tokenizer.ggml.pre` (tests/models/tokenizer_files.py). Two
# independent oracles: transformers' GGUF tokenizer loader, live, and llama.cpp (whose llm_tokenizer_bpe the
# regexes come from), whose answers are recorded (tests/models/llama_cpp_golden.py: llama-cpp-python is built only
# by `make bench-env`) for the fixed texts and a seeded sample of random ones.


class PrePair:
    def __init__(self, case: str, ours: GGUFTokenizer, hf: Any, cpp: Any = None) -> None:
        self.case, self.ours, self.hf, self.cpp = case, ours, hf, cpp


def recorded(kind: str, case: str, path: Any) -> dict[str, Any]:
    """llama.cpp's recorded answers for `case`, after checking they were made on the vocabulary at `path`."""
    found: dict[str, Any] = golden.load()[kind][case] if case else golden.load()[kind]
    assert found["vocabulary"] == vocabulary_hash(path), (
        f"{kind} {case}: the file's vocabulary is not the recorded one; "
        "re-record: python -m tests.models.llama_cpp_golden")
    return found


@pytest.fixture(scope="module", params=sorted(PRE_CASES))
def pre_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> PrePair:
    arch, pre = PRE_CASES[request.param]
    path = tmp_path_factory.mktemp(request.param) / "tok.gguf"
    write_tokenizer_gguf(path, arch, pre)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    return PrePair(request.param, GGUFTokenizer.from_gguf(path), hf, recorded("pre", request.param, path))


def test_pre_tokenizer_matches_transformers_and_llama_cpp(pre_pair: PrePair) -> None:
    for text in PRE_TEXTS:
        ours = pre_pair.ours.encode(text, add_bos=False)
        assert ours == pre_pair.hf.encode(text, add_special_tokens=False), text
        assert pre_pair.ours.decode(ours) == text, text
    cpp = pre_pair.cpp
    assert cpp["texts"][:len(PRE_TEXTS)] == PRE_TEXTS and cpp["texts"] == golden.pre_texts()
    for text, ids in zip(cpp["texts"], cpp["ids"], strict=True):
        assert pre_pair.ours.encode(text, add_bos=False) == ids, text


@settings(max_examples=150)
@given(st.text(alphabet=st.sampled_from(PRE_ALPHABET), max_size=40))
def test_pre_tokenizer_random_text(pre_pair: PrePair, text: str) -> None:
    assert pre_pair.ours.encode(text, add_bos=False) == pre_pair.hf.encode(text, add_special_tokens=False)


def test_pre_tokenizer_bos_default_follows_llama_cpp(pre_pair: PrePair) -> None:
    """A Llama-3 file without add_bos_token gets BOS (llama.cpp's default for llama-bpe); a Qwen2 file does not."""
    cpp = pre_pair.cpp
    assert pre_pair.ours.add_bos == cpp["add_bos"] == (pre_pair.case == "llama-bpe")
    assert pre_pair.ours.encode("Hi")[:1] == cpp["hi_with_bos"][:1]


@pytest.mark.parametrize("case", sorted(PRE_CASES))
def test_llama3_looks_whole_words_up_before_merging(case: str, tmp_path: Any) -> None:
    """A vocabulary word no merge builds: llama.cpp's llama-bpe takes it whole (Llama-3's "ignore_merges"), its
    qwen2 builds it from merges. Transformers' GGUF loader does not know ignore_merges, so llama.cpp is the oracle."""
    arch, pre = PRE_CASES[case]
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path, arch, pre, extra=("Ġquuxzz",))
    want = recorded("whole_word", case, path)["ids"]
    ours = GGUFTokenizer.from_gguf(path)
    assert ours.encode(golden.WHOLE_WORD_TEXT, add_bos=False) == want
    assert (ours.token_to_id("Ġquuxzz") in want) == (pre == "llama-bpe")


def test_generation_stops_where_llama_cpp_does(tmp_path: Any) -> None:
    """eos_ids is llama.cpp's end-of-generation set for a Llama-3-style file (eos <|eot_id|>): it also stops at
    <|end_of_text|>, <|eom_id|> and the ChatML markers SmolLM2's vocabulary has (llama.cpp's fill-in-the-middle
    separators, which chat does not use, are left out of the recording)."""
    path = golden.eog_file(tmp_path / "tok.gguf")
    ours = GGUFTokenizer.from_gguf(path)
    assert ours.eos_ids == set(recorded("eog", "", path)["ids"])
    assert ours.token_to_id("<|end_of_text|>") in ours.eos_ids


def test_unknown_pre_tokenizer_names_it_and_the_known_ones() -> None:
    meta = dict(open_gguf(bundled_gguf("smollm2")).metadata)
    with pytest.raises(TokenizerError, match=r"'tekken9' is not supported.*known: \[.*'llama-bpe'.*'qwen2'"):
        GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "tekken9"})


# --- GGUFTokenizer.from_hf_dir: tokenizer.json + tokenizer_config.json (+ chat_template.jinja, generation_config) ---
# Directories written as published models write them, read by transformers' AutoTokenizer as the oracle. "smollm2":
# SmolLM2's tokenizer and its real special tokens, template in chat_template.jinja (how transformers saves it).
# "llama3": a Llama-3-style directory: BOS from the post-processor only, no add_bos_token, a list of named templates,
# eos ids from generation_config.json.

LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def _write_hf_dir(root: Any, kind: str) -> None:
    import json

    from tokenizers import processors

    smol = ours_for("smollm2")
    tk = Tokenizer.from_str(smol.tokenizer.to_str())
    files: dict[str, Any]
    if kind == "smollm2":
        (root / "chat_template.jinja").write_text(str(smol.chat_template), encoding="utf-8")
        files = {"tokenizer_config.json": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                           "unk_token": {"content": "<|endoftext|>", "special": True,
                                                         "__type": "AddedToken"},
                                           "pad_token": "<|im_end|>", "add_bos_token": False}}
    else:
        tk.add_special_tokens(LLAMA3_SPECIALS)
        bos = tk.token_to_id("<|begin_of_text|>")
        tk.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                                          special_tokens=[("<|begin_of_text|>", bos)])
        files = {"tokenizer_config.json": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                           "chat_template": [{"name": "tool_use", "template": "TOOLS"},
                                                             {"name": "default", "template": LLAMA3_TEMPLATE}]},
                 "generation_config.json": {"eos_token_id": [tk.token_to_id(t) for t in
                                                             ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]}}
    tk.save(str(root / "tokenizer.json"))
    for name, data in files.items():
        (root / name).write_text(json.dumps(data), encoding="utf-8")


@pytest.fixture(scope="module", params=["smollm2", "llama3"])
def hf_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Any, Any]:
    root = tmp_path_factory.mktemp(f"hf-{request.param}")
    _write_hf_dir(root, request.param)
    oracle = transformers.AutoTokenizer.from_pretrained(str(root))
    return request.param, root, GGUFTokenizer.from_hf_dir(root), oracle


def test_hf_dir_matches_transformers(hf_pair: tuple[str, Any, Any, Any]) -> None:
    kind, root, ours, oracle = hf_pair
    assert isinstance(ours, GGUFTokenizer)
    assert (ours.bos_id, ours.eos_id) == (oracle.bos_token_id, oracle.eos_token_id)
    assert ours.add_bos == (kind == "llama3")
    for text in TEXTS:
        assert ours.encode(text) == oracle.encode(text), text  # BOS exactly where transformers adds it
        ids = ours.encode(text, add_bos=False)
        assert ours.decode(ids) == oracle.decode(ids), text
        assert ours.decode(ids, skip_special=True) == oracle.decode(ids, skip_special_tokens=True), text
    for messages in CHATS:
        for gen in (True, False):
            want = oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.chat_prompt(messages, add_generation_prompt=gen) == want
    if kind == "llama3":  # generation stops at every id generation_config.json lists
        want_eos = transformers.GenerationConfig.from_pretrained(str(root)).eos_token_id
        # and at the end-of-turn markers the vocabulary has: SmolLM2's <|endoftext|> (0) and <|im_end|> (2)
        assert ours.eos_ids == frozenset(want_eos) | {0, 2} and len(want_eos) == 3
        assert ours.encode_chat(CHATS[0]).count(ours.bos_id) == 1  # the template writes BOS; it is not added twice


def test_hf_dir_behaves_as_the_gguf_file(tmp_path: Any) -> None:
    """The same model's tokenizer from its GGUF file and from its directory: the same ids, stops and prompt."""
    _write_hf_dir(tmp_path, "smollm2")
    hf, gguf_tok = GGUFTokenizer.from_hf_dir(tmp_path), ours_for("smollm2")
    assert (hf.bos_id, hf.eos_id, hf.eos_ids, hf.add_bos, hf.vocab_size) == \
        (gguf_tok.bos_id, gguf_tok.eos_id, gguf_tok.eos_ids, gguf_tok.add_bos, gguf_tok.vocab_size)
    assert hf.chat_template == gguf_tok.chat_template and hf.chat_template_from_file
    for text in TEXTS:
        assert hf.encode(text) == gguf_tok.encode(text), text
    for messages in CHATS:
        assert hf.encode_chat(messages) == gguf_tok.encode_chat(messages)


def test_hf_dir_errors_name_the_file_and_key(tmp_path: Any) -> None:
    import json

    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not found"):
        GGUFTokenizer.from_hf_dir(tmp_path)
    _write_hf_dir(tmp_path, "smollm2")
    cfg = tmp_path / "tokenizer_config.json"
    good = json.loads(cfg.read_text())
    cases = [({**good, "bos_token": "<nosuch>"}, r"tokenizer_config\.json: 'bos_token' = '<nosuch>' is not a token"),
             ({**good, "add_bos_token": "yes"}, r"tokenizer_config\.json: 'add_bos_token' should be true or false"),
             ({**good, "eos_token": None}, r"tokenizer_config\.json: no 'eos_token'"),
             ({**good, "eos_token": 5}, r"tokenizer_config\.json: 'eos_token' should be a token string"),
             ({**good, "chat_template": 3}, r"tokenizer_config\.json: 'chat_template' should be a string")]
    (tmp_path / "chat_template.jinja").unlink()
    for data, message in cases:
        cfg.write_text(json.dumps(data))
        with pytest.raises(TokenizerError, match=message):
            GGUFTokenizer.from_hf_dir(tmp_path)
    cfg.write_text(json.dumps({**good, "chat_template": [{"name": "rag", "template": "x"}]}))
    with pytest.raises(TokenizerError, match=r"'chat_template' is a list of templates \['rag'\] with none named"):
        GGUFTokenizer.from_hf_dir(tmp_path)
    cfg.write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: cannot be read as JSON"):
        GGUFTokenizer.from_hf_dir(tmp_path)
    cfg.write_text(json.dumps(good))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 10**9]}))
    with pytest.raises(TokenizerError, match=r"generation_config\.json: 'eos_token_id' = \[2, 1000000000\]"):
        GGUFTokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: the tokenizers library cannot read it"):
        GGUFTokenizer.from_hf_dir(tmp_path)


# --- SentencePiece `llama` files without Gemma's quirks: Mistral (arch llama) and Phi-3 -----------------------------
# The vocabulary of tests/models/tokenizer_files.py. llama.cpp (recorded) is the oracle for both architectures;
# transformers' GGUF loader too for phi3, live (for arch llama it builds a Metaspace pre-tokenizer, which drops the
# extra ▁ SentencePiece and llama.cpp give to text that starts with a space or follows a special token).


@pytest.fixture(scope="module", params=["llama", "phi3"])
def spm_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, PrePair, Any]:
    path = tmp_path_factory.mktemp(f"spm-{request.param}") / "tok.gguf"
    write_spm_gguf(path, request.param)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    cpp = recorded("spm", request.param, path)
    return request.param, PrePair(request.param, GGUFTokenizer.from_gguf(path), hf), cpp


def test_sentencepiece_llama_and_phi3_match_llama_cpp(spm_pair: tuple[str, PrePair, Any]) -> None:
    arch, p, cpp = spm_pair
    assert p.ours.add_bos and p.ours.bos_id == 1 and p.ours.eos_id == 2
    assert cpp["texts"][:len(SPM_TEXTS)] == SPM_TEXTS and cpp["texts"] == golden.spm_texts()
    for text, ids, with_bos in zip(cpp["texts"], cpp["ids"], cpp["ids_with_bos"], strict=True):
        ours = p.ours.encode(text, add_bos=False)
        assert ours == ids, text
        assert p.ours.encode(text) == with_bos, text
    if arch == "phi3":
        for text in SPM_TEXTS:
            ours = p.ours.encode(text, add_bos=False)
            assert ours == p.hf.encode(text, add_special_tokens=False), text
            assert p.ours.decode(ours) == p.hf.decode(ours), text


@settings(max_examples=100)
@given(st.lists(st.sampled_from(SPM_PIECES), max_size=12).map("".join))
def test_sentencepiece_random_text_matches_transformers_on_phi3(spm_pair: tuple[str, PrePair, Any], text: str) -> None:
    arch, p, _ = spm_pair
    if arch == "phi3":  # arch llama's random texts are llama.cpp's recorded sample, above
        assert p.ours.encode(text, add_bos=False) == p.hf.encode(text, add_special_tokens=False)
