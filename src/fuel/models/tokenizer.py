"""Tokenizer and chat template of a model, built from its GGUF file's metadata or its Hugging Face directory.

    tok = GGUFTokenizer.from_gguf(bundled_gguf("smollm2"))       # or GGUFTokenizer.from_hf_dir(model_dir)
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])   # rendered template, then ids
    dec = tok.stream()
    for i in generated: print(dec.push(i), end="")              # never splits a UTF-8 character
    print(dec.flush())

**Why from metadata.** A GGUF file carries no `tokenizer.json`: it stores the vocabulary (`tokenizer.ggml.tokens`),
the merges or scores, each token's type and the special ids as metadata, under llama.cpp's key names. We rebuild a
`tokenizers.Tokenizer` (the Rust BPE engine) from those keys, so a model needs nothing but its one file and no
network. Two families are read:

- `gpt2`: byte-level BPE. The vocabulary and merges are used as stored (byte-level spelling, `Ġ` for space); the
  pre-tokenizer comes from `tokenizer.ggml.pre`, since the merges were learned on text split that way, with
  llama.cpp's regex for it (src/llama-vocab.cpp), which is the model's tokenizer.json regex: `gpt-2`; `smollm`
  (SmolLM2: every digit apart, then GPT-2's); `qwen2` (Qwen2/2.5/3: Llama-3's with single digits); `llama-bpe`
  (Llama-3: digits in threes; a pre-token found whole in the vocabulary is taken as is, before any merge, and BOS
  is added by default). Any other value is refused by name, with the known ones.
- `llama`: SentencePiece BPE (Mistral, Phi-3, Gemma). Spaces become `▁`, a `▁` is prepended unless the file sets
  `add_space_prefix` false (Gemma does), unknown characters fall back to `<0xNN>` byte tokens, and the file holds
  no merges, so they are derived from the vocabulary: each token's splits into two tokens, ranked by the token's
  score (SentencePiece merges the best-scoring pair first). The file stores Gemma's whitespace-run tokens with real
  spaces; they are respelled with `▁` and ranked first, as SentencePiece matches those user-defined pieces whole.

Control tokens (type 3) and the unknown token (type 2) are added as special tokens and user-defined ones (type 4)
as added tokens, so markers such as `<|im_start|>` or `<start_of_turn>` in a rendered chat prompt encode to one id
each. A Hugging Face directory needs none of this: its tokenizer.json is the engine (fuel.models.tokenizer_hf).

**The oracles** (tests/models/test_tokenizer.py) are transformers' own GGUF tokenizer loader, an independent
implementation over the same metadata, and llama.cpp (llama-cpp-python, vocab_only) reading the same file: ids,
decoded text and rendered chat prompts are compared with them. Where transformers is knowingly different (it does
not know `smollm`'s digit split; for a Mistral file it drops the extra `▁` SentencePiece gives text that starts
with a space) the test says so and checks llama.cpp's answer.

**Chat templates** are rendered as transformers renders them (fuel.models.chat_template: a jinja2 sandbox with its
globals, filters and variables). A file without a template whose vocabulary has Gemma's turn markers (the
Gemma-3-270M base file here) gets Gemma 3's instruct template, `GEMMA3_CHAT_TEMPLATE`.

**Streaming** decodes a short window of recent ids and emits only text that does not end in U+FFFD, so a character
split across byte tokens is printed once whole. One caveat: for a byte run that is invalid UTF-8 (a model can emit
one), SentencePiece's byte fallback turns the whole run into U+FFFD while the stream may already have printed its
valid start; for valid text the pieces concatenate to exactly `decode(ids)`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from fuel.errors import FuelError
from fuel.models.chat_template import GEMMA3_CHAT_TEMPLATE, ChatTemplate, TemplateError

__all__ = ["GEMMA3_CHAT_TEMPLATE", "GGUFTokenizer", "StreamDecoder", "TokenizerError", "lone_surrogate"]


class TokenizerError(FuelError, ValueError):
    """The GGUF metadata does not describe a tokenizer this module builds, or a tokenizer call is invalid."""


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in `text` (a code point UTF-8 cannot encode, which Python keeps
    for undecodable bytes of a command line or a file name), or None for valid Unicode text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


# llama.cpp's token types (enum llama_token_type), and our own mark for a whitespace run respelled with ▁.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _SPACE_RUN = 1, 2, 3, 4, -1

# Markers that end a turn or a document; generation stops at whichever of them the vocabulary has as a control
# token, besides `eos`, since chat templates close each turn with one (llama.cpp keeps a similar end-of-generation set).
_END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>",
                "<|end_of_text|>", "<EOT>", "<end_of_utterance>")

# Byte-level BPE pre-tokenizers by `tokenizer.ggml.pre`, as llama.cpp's llm_tokenizer_bpe splits (src/llama-vocab.cpp)
# and as each model's tokenizer.json writes the regex. "gpt2": ByteLevel's own GPT-2 regex; "digits": every digit
# apart first, then the GPT-2 regex (SmolLM2, StarCoder); otherwise a Split regex then ByteLevel without one.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's is Llama-3's with single digits (\p{N}, not \p{N}{1,3})
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS: dict[str, str] = {
    "gpt-2": "gpt2", "gpt2": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits",
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# llama.cpp looks a whole pre-token up in the vocabulary before merging for these (Llama-3's tokenizer.json says
# "ignore_merges": true), and adds BOS when the file does not say.
_WHOLE_WORD_PRE = ("llama3", "llama-v3", "llama-bpe")


def _require(metadata: Mapping[str, Any], key: str) -> Any:
    if key not in metadata:
        raise TokenizerError(f"GGUF metadata has no {key!r}; a tokenizer cannot be built without it")
    return metadata[key]


def _optional_id(metadata: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if not 0 <= int(value) < n_vocab:
        raise TokenizerError(f"GGUF metadata {key!r} = {value} is outside the vocabulary of {n_vocab} tokens")
    return int(value)


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    split = _PRE_SPLITS.get(pre)
    if split is None:
        raise TokenizerError(f"tokenizer.ggml.pre = {pre!r} is not supported for byte-level BPE; "
                             f"known: {sorted(_PRE_SPLITS)}")
    if split == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _build_byte_level(metadata: Mapping[str, Any], tokens: list[str]) -> Tokenizer:
    merges: list[tuple[str, str]] = []
    for line in _require(metadata, "tokenizer.ggml.merges"):
        pair = line.split(" ")  # byte-level tokens spell a space as Ġ, so a literal space only separates
        if len(pair) != 2:
            raise TokenizerError(f"tokenizer.ggml.merges: {line!r} is not two tokens separated by one space")
        merges.append((pair[0], pair[1]))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pre = str(metadata.get("tokenizer.ggml.pre", "gpt-2"))
    pre_tokenizer = _byte_level_pre_tokenizer(pre)
    try:
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre in _WHOLE_WORD_PRE))
    except Exception as exc:  # tokenizers raises a bare Exception for a merge of unknown tokens
        raise TokenizerError(f"tokenizer.ggml.merges: {exc}") from None
    tk.pre_tokenizer = pre_tokenizer
    tk.decoder = decoders.ByteLevel()
    return tk


def _build_sentencepiece(metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    scores = np.asarray(_require(metadata, "tokenizer.ggml.scores"), dtype=np.float64)
    if len(scores) != len(tokens):
        raise TokenizerError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    # BPE merges come from normal tokens and from the whitespace runs (respelled by the caller); control and other
    # added tokens are matched whole before BPE runs, so merges that build them would never fire.
    bpe_ids = [i for i, t in enumerate(types) if t in (_NORMAL, _SPACE_RUN)]
    # Best first: the whitespace runs (user-defined pieces, which SentencePiece matches whole; the file gives them
    # score -1000, which would rank them below ▁t and split "a  the" as a ▁ ▁the), then by score, ties by position.
    bpe_ids.sort(key=lambda i: (types[i] != _SPACE_RUN, -scores[i], i))
    # Every split of a token into two tokens, the longer left part first (a comprehension: ~1 s for 262k tokens).
    pieces = [tokens[i] for i in bpe_ids]
    merges = [(p[:c], p[c:]) for p in pieces for c in range(len(p) - 1, 0, -1) if p[:c] in vocab and p[c:] in vocab]
    unk_id = _optional_id(metadata, "tokenizer.ggml.unknown_token_id", len(tokens))
    unk = tokens[unk_id] if unk_id is not None else None
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # add_space_prefix (llama.cpp's default true for SentencePiece; Gemma's files say false) prepends the ▁ that
    # SentencePiece adds before the first word, and the decoder strips it again.
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", "▁")
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace]) if prefix else replace
    steps: list[decoders.Decoder] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tk.decoder = decoders.Sequence(steps)
    return tk


class GGUFTokenizer:
    """Encode, decode and render chat prompts for a model. Build with `from_gguf` or `from_metadata` (a GGUF
    file) or `from_hf_dir` (a Hugging Face directory); all give the same behaviour."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[str], *, bos_id: int | None, eos_id: int,
                 eos_ids: frozenset[int], add_bos: bool, chat_template: str | None,
                 chat_template_from_file: bool, special_tokens: Mapping[str, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.chat_template_from_file = chat_template_from_file
        # what a template sees as bos_token, eos_token, unk_token, pad_token (only the ones the vocabulary has)
        named = {"bos_token": None if bos_id is None else tokens[bos_id], "eos_token": tokens[eos_id]}
        self.special_tokens: dict[str, str] = {k: v for k, v in {**named, **(special_tokens or {})}.items()
                                               if v is not None}
        try:
            self._template = ChatTemplate(chat_template) if chat_template is not None else None
        except TemplateError as exc:
            raise TokenizerError(f"chat template does not parse: {exc}") from None

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], chat_template: str | None = None) -> GGUFTokenizer:
        """The tokenizer of the GGUF file at `path` (reads only its header)."""
        from fuel.io.gguf import open_gguf

        return cls.from_metadata(open_gguf(path).metadata, chat_template)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> GGUFTokenizer:
        """The tokenizer of a Hugging Face model directory: tokenizer.json, tokenizer_config.json (special
        tokens, add_bos_token, chat_template), chat_template.jinja and generation_config.json's eos ids where
        present (see fuel.models.tokenizer_hf)."""
        from fuel.models.tokenizer_hf import tokenizer_from_hf_dir

        return tokenizer_from_hf_dir(path)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], chat_template: str | None = None) -> GGUFTokenizer:
        """Build from a GGUF metadata dict. `chat_template`, if given, replaces the file's template."""
        kind = str(_require(metadata, "tokenizer.ggml.model"))
        tokens = [str(t) for t in _require(metadata, "tokenizer.ggml.tokens")]
        n = len(tokens)
        raw_types = metadata.get("tokenizer.ggml.token_type")
        types = [_NORMAL] * n if raw_types is None else np.asarray(raw_types, dtype=np.int64).tolist()
        if len(types) != n:
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        if kind == "gpt2":
            tk = _build_byte_level(metadata, tokens)
            default_bos = str(metadata.get("tokenizer.ggml.pre", "gpt-2")) in _WHOLE_WORD_PRE
        elif kind == "llama":
            # Gemma's files store its runs of spaces with real spaces; the normalizer turns spaces into ▁ before
            # BPE, so those tokens are only reachable spelled with ▁.
            runs = [i for i, t in enumerate(tokens) if types[i] == _USER_DEFINED and t and not t.strip(" ")]
            for i in runs:
                tokens[i], types[i] = tokens[i].replace(" ", "▁"), _SPACE_RUN
            tk = _build_sentencepiece(metadata, tokens, types)
            default_bos = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        else:
            raise TokenizerError(f"tokenizer.ggml.model = {kind!r} is not supported; expected 'gpt2' or 'llama'")
        # Control tokens, and the unknown token (<unk> in Llama/Mistral/Phi-3 files), are special: matched whole in
        # text and left out by decode(skip_special=True), as llama.cpp treats both.
        control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=True)
                   if ty in (_CONTROL, _UNKNOWN)]
        # The other user-defined tokens (runs of \n or \t, HTML tags) are matched whole, as llama.cpp does.
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types, strict=True)
                if ty == _USER_DEFINED]
        tk.add_special_tokens(control)
        tk.add_tokens(user)

        bos_id = _optional_id(metadata, "tokenizer.ggml.bos_token_id", n)
        eos_id = _optional_id(metadata, "tokenizer.ggml.eos_token_id", n)
        if eos_id is None:
            raise TokenizerError("GGUF metadata has no 'tokenizer.ggml.eos_token_id'; generation could not stop")
        ids = {t: i for i, t in enumerate(tokens) if types[i] == _CONTROL}
        eos_ids = frozenset({eos_id} | {ids[m] for m in _END_OF_TURN if m in ids})
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos)) and bos_id is not None

        from_file = chat_template is None and "tokenizer.chat_template" in metadata
        if chat_template is None:
            chat_template = metadata.get("tokenizer.chat_template")
        if chat_template is None and "<start_of_turn>" in ids and "<end_of_turn>" in ids:
            chat_template = GEMMA3_CHAT_TEMPLATE
        named = {name: _optional_id(metadata, f"tokenizer.ggml.{key}", n)
                 for name, key in (("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
        return cls(tk, tokens, bos_id=bos_id, eos_id=eos_id, eos_ids=eos_ids, add_bos=add_bos,
                   chat_template=None if chat_template is None else str(chat_template),
                   chat_template_from_file=from_file,
                   special_tokens={k: tokens[i] for k, i in named.items() if i is not None})

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.tokens[self.bos_id]

    @property
    def eos_token(self) -> str:
        return self.tokens[self.eos_id]

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special markers in it become their ids. `add_bos` defaults to the file's flag."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode: expects a str, got {type(text).__name__}")
        at = lone_surrogate(text)
        if at is not None:
            raise TokenizerError(f"encode: the text holds a lone surrogate {text[at]!r} at index {at}, which is "
                                 "not valid Unicode (UTF-8 cannot encode it)")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos):
            if self.bos_id is None:
                raise TokenizerError("encode(add_bos=True): this vocabulary has no bos token")
            ids = [self.bos_id, *ids]
        return ids

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        out = [int(i) for i in ids]
        bad = [i for i in out if not 0 <= i < len(self.tokens)]
        if bad:  # tokenizers would silently drop them
            raise TokenizerError(f"decode: ids {bad[:5]} are outside the vocabulary of {len(self.tokens)} tokens")
        return out

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of `ids`; `skip_special` leaves out control tokens such as `<bos>` or `<|im_end|>`."""
        return self.tokenizer.decode(self._check_ids(ids), skip_special_tokens=skip_special)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        """The chat template rendered for `messages` (dicts with "role" and "content"), as transformers'
        `apply_chat_template(..., tokenize=False)` renders it; `template_kwargs` (tools, documents,
        enable_thinking, ...) reach the template as variables."""
        if self._template is None:
            raise TokenizerError("this GGUF file has no tokenizer.chat_template; pass chat_template= to build one")
        try:
            return self._template.render(messages, add_generation_prompt=add_generation_prompt,
                                         special_tokens=self.special_tokens, **template_kwargs)
        except TemplateError as exc:
            raise TokenizerError(f"chat template: {exc}") from exc

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> list[int]:
        """Ids of the rendered chat prompt. Templates write their own BOS (Gemma's does), so BOS is added only
        when the file asks for one and the prompt does not already begin with it: never twice."""
        text = self.chat_prompt(messages, add_generation_prompt, **template_kwargs)
        starts_with_bos = self.bos_token is not None and text.startswith(self.bos_token)
        return self.encode(text, add_bos=self.add_bos and not starts_with_bos)

    def stream(self, skip_special: bool = True) -> StreamDecoder:
        """A decoder that turns ids into printable text pieces as they arrive."""
        return StreamDecoder(self, skip_special)


class StreamDecoder:
    """Incremental detokenisation: `push(id)` returns the new text (maybe ""), `flush()` what is left.

    Each step decodes the ids from `_prefix` on and compares it with the decode of `_prefix:_read`, the part
    already shown: decoding a window, not one id, keeps context (a SentencePiece decoder strips the leading space
    of a text's first token), and keeps each step short. Text ending in U+FFFD is held back: the last character's
    bytes are not all there yet."""

    def __init__(self, tokenizer: GGUFTokenizer, skip_special: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are already shown

    def push(self, token_id: int) -> str:
        self._ids.extend(self._tok._check_ids([token_id]))
        shown = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(text) <= len(shown) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(shown):]

    def flush(self) -> str:
        """The text still held back (an incomplete character shows as U+FFFD); later pushes continue after it."""
        shown = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(shown):]
