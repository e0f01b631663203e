"""Structured output: OpenAI's `response_format` as a token mask per decoding step, on llguidance.

    compiler = GrammarCompiler(llm.tokenizer, llm.model.cfg.vocab)       # once per served model
    grammar = compiler.compile({"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}})
    while not grammar.is_complete():
        logits[~grammar.mask()] = -np.inf                                 # bool [vocab], True = allowed
        t = int(np.argmax(logits)); grammar.advance(t)

**Why llguidance.** It is a maintained engine (Microsoft / guidance-ai; llama.cpp and vLLM use it) with a Rust
core: a lexer over the token trie plus an Earley parser, so each token's mask is computed as it is needed,
with no precomputation per schema. It reads a Hugging Face `tokenizers` JSON directly, which is what
`GGUFTokenizer` builds from the GGUF metadata, so neither transformers nor torch is needed.

**The shapes** (OpenAI's): `None` or `{"type": "text"}` is no constraint (`compile` returns None);
`{"type": "json_object"}` is any JSON object; `{"type": "json_schema", "json_schema": {"name": str,
"schema": {...}, "strict": bool | None, "description": str}}` is a document valid against the schema. Any
other shape, an unknown key, or a schema llguidance rejects (unknown keyword, unsatisfiable, bad `$ref`) is
a `GrammarError` naming what is wrong; the server answers it with a 400.

**The JSON form.** Whatever the schema's own `x-guidance` says, output is compact JSON with OpenAI's
separators (`", "`, `": "`, also `json.dumps`'s defaults) and no other whitespace: a small model cannot
then pad a document with newlines until `max_tokens` runs out.

**The vocabulary.** The mask has the model's `vocab` entries: embedding rows past the tokenizer's tokens are
never allowed, nor are control tokens inside the document. The tokenizer's end-of-generation ids
(`GGUFTokenizer.eos_ids`) are allowed exactly when the document may end; once it must end
(`is_complete()`), they are the only tokens allowed.

**Properties come in the schema's order** (as OpenAI's do), so two schemas that differ only in key order are
two grammars.

**Cost.** `compile` caches the grammar text of each `response_format` (by its compact JSON, keys in their
given order; least recently used dropped past `cache_size`); a request then only builds its matcher.
`mask` fills a bitmask reused by the request and unpacks it to a new bool array.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import llguidance as llg
import numpy as np

from fuel.errors import ParamError
from fuel.models.tokenizer import GGUFTokenizer

__all__ = ["Grammar", "GrammarCompiler", "GrammarError"]

# Compact JSON with OpenAI's separators; overrides anything the schema's own "x-guidance" asks for.
_JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_KEYS = {"text": {"type"}, "json_object": {"type"},
         "json_schema": {"type", "json_schema"}}
_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
_NAME_MAX = 64  # OpenAI's limit on json_schema.name


class GrammarError(ParamError):
    """An invalid `response_format` or JSON schema, or a token the grammar does not allow."""


def _type_name(x: object) -> str:
    return "null" if x is None else type(x).__name__


def _schema_of(response_format: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The JSON schema a response_format asks for, or None for plain text; GrammarError for a bad shape."""
    kind = response_format.get("type")
    if kind not in _KEYS:
        raise GrammarError(f"response_format: type must be one of {sorted(_KEYS)}, got {kind!r}")
    extra = sorted(set(response_format) - _KEYS[kind], key=str)
    if extra:
        raise GrammarError(f"response_format: unknown key(s) {extra} for type {kind!r}; "
                           f"expected only {sorted(_KEYS[kind])}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise GrammarError("response_format: type 'json_schema' needs a json_schema object with name and schema, "
                           f"got {_type_name(spec)}")
    extra = sorted(set(spec) - _SCHEMA_KEYS, key=str)
    if extra:
        raise GrammarError(f"response_format.json_schema: unknown key(s) {extra}; expected {sorted(_SCHEMA_KEYS)}")
    name = spec.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= _NAME_MAX or \
            not all(c.isascii() and (c.isalnum() or c in "_-") for c in name):
        raise GrammarError("response_format.json_schema.name must be a string of 1 to 64 characters a-z, A-Z, "
                           f"0-9, _ or -, got {name!r}")
    if not isinstance(spec.get("strict"), bool | None):
        raise GrammarError(f"response_format.json_schema.strict must be a boolean, got {_type_name(spec['strict'])}")
    if not isinstance(spec.get("description", ""), str):
        raise GrammarError("response_format.json_schema.description must be a string, "
                           f"got {_type_name(spec['description'])}")
    if "schema" not in spec:
        raise GrammarError("response_format.json_schema: schema (a JSON Schema object) is required")
    schema = spec["schema"]
    if not isinstance(schema, Mapping):
        raise GrammarError(f"response_format.json_schema.schema must be a JSON Schema object, got "
                           f"{_type_name(schema)}")
    return schema


def _error(matcher: llg.LLMatcher) -> str:
    """llguidance's error message, without the parser-state dump it appends."""
    return matcher.get_error().replace("<non-verbose/>", "").strip()


def _canonical(x: Any, what: str) -> str:
    """Compact JSON of `x`, keys in their given order: a schema's property order is the output's order."""
    try:
        return json.dumps(x, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"{what} is not JSON: {exc}") from None


class GrammarCompiler:
    """Compiles `response_format`s for one model's tokenizer and vocabulary. Build it once per served model:
    reading the tokenizer into llguidance is the costly part. Thread-safe."""

    def __init__(self, tokenizer: GGUFTokenizer, vocab: int, *, cache_size: int = 128) -> None:
        if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < tokenizer.vocab_size:
            raise GrammarError(f"GrammarCompiler: vocab must be an int >= the tokenizer's {tokenizer.vocab_size} "
                               f"tokens (the model's embedding rows), got {vocab!r}")
        if not isinstance(cache_size, int) or cache_size < 0:
            raise GrammarError(f"GrammarCompiler: cache_size must be an int >= 0, got {cache_size!r}")
        self.vocab = vocab
        self.eos_ids = frozenset(tokenizer.eos_ids)
        try:
            self._tok = llg.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=vocab,
                                        eos_token=sorted(self.eos_ids))
        except (ValueError, RuntimeError) as exc:
            raise GrammarError(f"GrammarCompiler: llguidance cannot read this model's tokenizer: {exc}") from None
        self._limits = llg.LLParserLimits(verbose_errors=False)  # errors go to clients: no parser dumps
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, response_format: Mapping[str, Any] | None) -> Grammar | None:
        """The grammar of one request (None: unconstrained text); GrammarError for an invalid shape or schema."""
        if response_format is None:
            return None
        if not isinstance(response_format, Mapping):
            raise GrammarError(f"response_format must be an object with a type, got {_type_name(response_format)}")
        schema = _schema_of(response_format)
        if schema is None:
            return None
        key = _canonical(response_format, "response_format")
        with self._lock:
            text = self._cache.get(key)
            if text is not None:
                self._cache.move_to_end(key)
        if text is None:
            try:  # the key's JSON holds the schema's: it is JSON too
                text = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_JSON_OPTIONS)
            except ValueError as exc:
                raise GrammarError(f"response_format: invalid JSON schema: {exc}") from None
        grammar = Grammar(self, llg.LLMatcher(self._tok, text, log_level=0, limits=self._limits))
        with self._lock:  # only grammars that built go in the cache
            self._cache[key] = text
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar


class Grammar:
    """One request's grammar state: `mask()` before each token, `advance(token)` after it is chosen."""

    def __init__(self, compiler: GrammarCompiler, matcher: llg.LLMatcher) -> None:
        self.vocab = compiler.vocab
        self.eos_ids = compiler.eos_ids
        self._m = matcher
        self._bits = np.zeros((self.vocab + 31) // 32, np.int32)  # llguidance's bit layout: token i is bit i % 32
        self._filled = False  # whether _bits holds the mask of the current state
        if matcher.is_error():
            raise GrammarError(f"response_format: invalid JSON schema: {_error(matcher)}")
        # Some schemas build but admit no document (a $ref cycle with no base case): the first mask finds out,
        # so the request is refused here rather than failing at its first token.
        self._fill()
        if matcher.is_error():
            raise GrammarError(f"response_format: the JSON schema admits no document: {_error(matcher)}")

    def _fill(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"grammar.mask: the grammar is in an error state: {_error(self._m)}")
        if not self._filled:
            self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            self._filled = True

    def mask(self) -> np.ndarray:
        """bool [vocab]: True for the tokens allowed next (a new array each call). GrammarError if the grammar
        broke down (llguidance met one of its resource limits)."""
        self._fill()
        if self._m.is_error():
            raise GrammarError(f"grammar.mask: the grammar is in an error state: {_error(self._m)}")
        return np.unpackbits(self._bits.view(np.uint8), count=self.vocab, bitorder="little").view(np.bool_)

    def advance(self, token: int) -> None:
        """Consume the chosen token; GrammarError if the grammar does not allow it (the caller ignored the mask)."""
        if not isinstance(token, int | np.integer) or isinstance(token, bool) or not 0 <= int(token) < self.vocab:
            raise GrammarError(f"grammar.advance: token must be an id in [0, {self.vocab}), got {token!r}")
        if self._m.is_error():
            raise GrammarError(f"grammar.advance: the grammar is in an error state: {_error(self._m)}")
        self._filled = False
        if not self._m.consume_token(int(token)):
            raise GrammarError(f"grammar.advance: token {int(token)} is not allowed here "
                               f"(it was masked out): {_error(self._m)}")

    def is_complete(self) -> bool:
        """The output is a complete document and nothing may follow it but an end-of-generation token."""
        return bool(self._m.is_stopped()) and not self._m.is_error()
