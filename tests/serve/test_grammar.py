"""Structured output (fuel.serve.grammar) against independent oracles: `json.loads` and `jsonschema` judge the
documents, the GGUF tokenizer (itself checked against transformers) gives the tokens, and greedy decoding runs
on the bundled SmolLM2 with the mask applied to its logits."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs in the test environment
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fuel.errors import ParamError
from fuel.models import generate as gen
from fuel.models.tokenizer import GGUFTokenizer
from fuel.serve.grammar import Grammar, GrammarCompiler, GrammarError

CONTEXT = 256
MAX_TOKENS = 40

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "color": {"enum": ["red", "green", "blue"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "color", "age", "tags"],
    "additionalProperties": False,
}
JSON_OBJECT = {"type": "json_object"}


def schema_format(schema: Mapping[str, Any], name: str = "record") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def compact(doc: Any) -> str:
    """The JSON text the grammar asks for: OpenAI's separators, nothing else between tokens."""
    return json.dumps(doc, separators=(", ", ": "), ensure_ascii=False)


@pytest.fixture(scope="module")
def llm() -> gen.LLM:
    return gen.load("smollm2", CONTEXT)


@pytest.fixture(scope="module")
def compiler(llm: gen.LLM) -> GrammarCompiler:
    return GrammarCompiler(llm.tokenizer, llm.model.cfg.vocab)


@functools.cache
def special_ids(tok: GGUFTokenizer) -> np.ndarray:
    """Ids of the tokenizer's control tokens (from the tokenizers object, not from llguidance)."""
    return np.array(sorted(i for i, t in tok.tokenizer.get_added_tokens_decoder().items() if t.special), np.int64)


def check_mask(grammar: Grammar, tok: GGUFTokenizer, vocab: int) -> np.ndarray:
    """The grammar's mask, with what holds at every step: one bool per embedding row, something allowed, no
    id past the tokenizer's vocabulary, no control token but the end-of-generation ones."""
    allowed = grammar.mask()
    assert allowed.shape == (vocab,) and allowed.dtype == np.bool_
    assert allowed.any()
    assert not allowed[tok.vocab_size:].any()
    control = special_ids(tok)
    assert set(np.flatnonzero(allowed[control]).tolist()) <= {int(np.searchsorted(control, e)) for e in tok.eos_ids}
    return allowed


def greedy(llm: gen.LLM, grammar: Grammar, prompt: str) -> tuple[list[int], bool]:
    """Greedy decoding of a chat prompt with the mask applied to the logits: the ids chosen before an
    end-of-generation token, and whether the grammar reported a complete document."""
    tok, vocab = llm.tokenizer, llm.model.cfg.vocab
    seq = llm.model.sequence()
    logits = seq.prefill(tok.encode_chat([{"role": "user", "content": prompt}]))
    ids: list[int] = []
    for _ in range(MAX_TOKENS):
        allowed = check_mask(grammar, tok, vocab)
        t = int(np.argmax(np.where(allowed, logits, -np.inf)))
        assert allowed[t]
        if t in tok.eos_ids:
            break
        grammar.advance(t)  # raises GrammarError if llguidance's parser refuses what its mask allowed
        ids.append(t)
        if grammar.is_complete():
            after = check_mask(grammar, tok, vocab)
            assert set(np.flatnonzero(after).tolist()) == set(tok.eos_ids)
            break
        logits = seq.decode(t)
    return ids, grammar.is_complete()


def tokens_of(tok: GGUFTokenizer, text: str) -> list[int]:
    """The ids of `text`, for a text the vocabulary spells (SmolLM2's byte-level vocabulary lacks a few bytes,
    such as 0xF1 that starts plane-4 characters: they cannot be generated, so they are not drawn)."""
    ids = tok.encode(text, add_bos=False)
    assume(tok.decode(ids) == text)
    return ids


def feed(grammar: Grammar, ids: Sequence[int]) -> bool:
    """Whether the grammar takes `ids` token by token (each allowed by the mask first) and ends complete."""
    for t in ids:
        if not grammar.mask()[t]:
            return False
        grammar.advance(t)
    return grammar.is_complete()


# -- greedy decoding on SmolLM2 --------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["Give me a JSON object with a name and an age.",
                                    "Describe a cat."])
def test_json_object_output_parses(llm: gen.LLM, compiler: GrammarCompiler, prompt: str) -> None:
    grammar = compiler.compile(JSON_OBJECT)
    assert grammar is not None
    ids, complete = greedy(llm, grammar, prompt)
    assert complete
    text = llm.tokenizer.decode(ids)
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("prompt", ["Describe a cat.", "Invent a robot character.", "Make up a person."])
def test_json_schema_output_validates(llm: gen.LLM, compiler: GrammarCompiler, prompt: str) -> None:
    grammar = compiler.compile(schema_format(SCHEMA))
    assert grammar is not None
    ids, complete = greedy(llm, grammar, prompt)
    assert complete
    text = llm.tokenizer.decode(ids)
    doc = json.loads(text)
    jsonschema.validate(doc, SCHEMA)
    assert list(doc) == list(SCHEMA["properties"])  # OpenAI's order: the schema's
    # the text re-tokenizes to ids the grammar takes too, and decodes back to itself
    again = llm.tokenizer.encode(text, add_bos=False)
    assert llm.tokenizer.decode(again) == text
    fresh = compiler.compile(schema_format(SCHEMA))
    assert fresh is not None and feed(fresh, again)


def test_complete_allows_only_eos_and_rejects_more(llm: gen.LLM, compiler: GrammarCompiler) -> None:
    tok = llm.tokenizer
    grammar = compiler.compile(JSON_OBJECT)
    assert grammar is not None
    assert not grammar.is_complete()
    assert feed(grammar, tok.encode('{"a": [1, {"b": null}]}', add_bos=False))
    assert set(np.flatnonzero(grammar.mask()).tolist()) == set(tok.eos_ids)
    with pytest.raises(GrammarError, match=r"grammar.advance: token \d+ is not allowed"):
        grammar.advance(tok.encode(" ", add_bos=False)[0])


@settings(max_examples=20)
@given(doc=st.dictionaries(st.text("abc", min_size=1, max_size=3), st.integers(0, 9), min_size=1, max_size=3))
def test_output_is_compact_json(llm: gen.LLM, compiler: GrammarCompiler, doc: dict[str, int]) -> None:
    """OpenAI's separators and no other whitespace: other spellings of the same object are refused."""
    tok = llm.tokenizer
    for text, takes in [(compact(doc), True), (json.dumps(doc, separators=(",", ":")), False),
                        (json.dumps(doc, indent=1), False), (" " + compact(doc), False)]:
        grammar = compiler.compile(JSON_OBJECT)
        assert grammar is not None
        assert feed(grammar, tokens_of(tok, text)) == takes, text


def test_schema_cannot_loosen_the_json_form(llm: gen.LLM, compiler: GrammarCompiler) -> None:
    """llguidance reads options from a schema's "x-guidance"; the compact form overrides them."""
    schema = {"type": "object", "x-guidance": {"whitespace_flexible": True, "item_separator": ",",
                                               "key_separator": ":"}}
    for text, takes in [('{"a": 1, "b": 2}', True), ('{"a":1,"b":2}', False), ('{\n"a": 1}', False)]:
        grammar = compiler.compile(schema_format(schema))
        assert grammar is not None
        assert feed(grammar, llm.tokenizer.encode(text, add_bos=False)) == takes, text


# -- documents from hypothesis, judged by json / jsonschema -------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | \
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3) |
                           st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)


@settings(max_examples=60)
@given(doc=json_values)
def test_json_object_takes_exactly_objects(llm: gen.LLM, compiler: GrammarCompiler, doc: Any) -> None:
    text = compact(doc)
    grammar = compiler.compile(JSON_OBJECT)
    assert grammar is not None
    assert feed(grammar, tokens_of(llm.tokenizer, text)) == isinstance(doc, dict), text


names = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12)
field_values = {
    "name": names | st.integers(0, 5),
    "color": st.sampled_from(["red", "green", "blue", "pink", "Red"]),
    "age": st.integers(-3, 125) | st.just("7"),
    "tags": st.lists(names, max_size=3) | st.just("x"),
}


@st.composite
def records(draw: st.DrawFn) -> dict[str, Any]:
    """Objects near SCHEMA, in its key order: some fields left out, some values out of range or of the
    wrong type, sometimes an extra key."""
    doc = {k: draw(v) for k, v in field_values.items() if draw(st.integers(0, 9)) > 0}
    if draw(st.integers(0, 9)) == 0:
        doc["extra"] = 1
    return doc


@settings(max_examples=80)
@given(doc=records())
def test_json_schema_takes_exactly_valid_documents(llm: gen.LLM, compiler: GrammarCompiler,
                                                   doc: dict[str, Any]) -> None:
    text = compact(doc)
    grammar = compiler.compile(schema_format(SCHEMA))
    assert grammar is not None
    valid = jsonschema.Draft202012Validator(SCHEMA).is_valid(doc)
    assert feed(grammar, tokens_of(llm.tokenizer, text)) == valid, text


def test_grammars_of_one_format_are_independent(llm: gen.LLM, compiler: GrammarCompiler) -> None:
    a, b = compiler.compile(JSON_OBJECT), compiler.compile(JSON_OBJECT)  # the second from the cache
    assert a is not None and b is not None
    start = b.mask()
    a.advance(llm.tokenizer.encode("{", add_bos=False)[0])
    assert not np.array_equal(a.mask(), start)
    assert np.array_equal(b.mask(), start)


def test_vocab_past_the_tokenizer_is_never_allowed(llm: gen.LLM) -> None:
    tok = llm.tokenizer
    vocab = tok.vocab_size + 40  # embedding rows the tokenizer has no token for
    grammar = GrammarCompiler(tok, vocab).compile(JSON_OBJECT)
    assert grammar is not None
    for t in tok.encode('{"k": "v"}', add_bos=False):
        allowed = check_mask(grammar, tok, vocab)
        grammar.advance(t)
    with pytest.raises(GrammarError, match=rf"grammar.advance: token must be an id in \[0, {vocab}\)"):
        grammar.advance(vocab)
    with pytest.raises(GrammarError, match="is not allowed"):
        grammar.advance(vocab - 1)
    assert allowed.shape == (vocab,)


def test_vocab_smaller_than_the_tokenizer_is_refused(llm: gen.LLM) -> None:
    with pytest.raises(GrammarError, match=r"vocab must be an int >= the tokenizer's 49152 tokens.*got 100"):
        GrammarCompiler(llm.tokenizer, 100)


# -- shapes ---------------------------------------------------------------------------------------------

def test_text_and_none_are_unconstrained(compiler: GrammarCompiler) -> None:
    assert compiler.compile(None) is None
    assert compiler.compile({"type": "text"}) is None


def js(**spec: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": spec}


BAD_FORMATS: list[tuple[Any, str]] = [
    (["json_object"], r"response_format must be an object with a type, got list"),
    ({}, r"response_format: type must be one of \['json_object', 'json_schema', 'text'\], got None"),
    ({"type": "xml"}, r"type must be one of .* got 'xml'"),
    ({"type": "json_object", "schema": {}}, r"unknown key\(s\) \['schema'\] for type 'json_object'"),
    ({"type": "text", "json_schema": {}}, r"unknown key\(s\) \['json_schema'\] for type 'text'"),
    ({"type": "json_schema"}, r"type 'json_schema' needs a json_schema object .* got null"),
    ({"type": "json_schema", "json_schema": "x"}, r"needs a json_schema object .* got str"),
    (js(schema=SCHEMA), r"json_schema.name must be a string .* got None"),
    (js(name="has space", schema=SCHEMA), r"json_schema.name must be .* got 'has space'"),
    (js(name="n" * 65, schema=SCHEMA), r"json_schema.name must be a string of 1 to 64"),
    (js(name="n", schema=SCHEMA, strict="yes"), r"json_schema.strict must be a boolean, got str"),
    (js(name="n", schema=SCHEMA, description=3), r"json_schema.description must be a string, got int"),
    (js(name="n", schema=SCHEMA, extra=1), r"json_schema: unknown key\(s\) \['extra'\]"),
    (js(name="n"), r"json_schema: schema \(a JSON Schema object\) is required"),
    (js(name="n", schema=[1]), r"json_schema.schema must be a JSON Schema object, got list"),
    (js(name="n", schema={"type": "foo"}), r"invalid JSON schema: .*Invalid type: foo"),
    (js(name="n", schema={"type": "integer", "minimum": 5, "maximum": 1}),
     r"invalid JSON schema: .*minimum \(5\) is greater than maximum \(1\)"),
    (js(name="n", schema={"properties": {"a": {"$ref": "#/nope"}}}), r"invalid JSON schema: .*'/nope' does not exist"),
    (js(name="n", schema={"type": "object", "required": ["x"], "additionalProperties": False}),
     r"invalid JSON schema: .*required property 'x' is unsatisfiable"),
    (js(name="n", schema={"$ref": "#"}), r"the JSON schema admits no document"),  # builds, but no base case
    (js(name="n", schema={"$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}), r"admits no document"),
    (js(name="n", schema={"type": "array", "uniqueItems": True}), r'invalid JSON schema: .*\["uniqueItems"\]'),
    (js(name="n", schema={"type": "string", "pattern": "(["}), r"invalid JSON schema: regex parse error"),
    (js(name="n", schema={"type": "number", "maximum": float("nan")}),
     r"response_format is not JSON: Out of range float"),
    ({"type": "json_object", 1: 2, "b": 3}, r"unknown key\(s\) \[1, 'b'\] for type 'json_object'"),
]


@pytest.mark.parametrize(("response_format", "message"), BAD_FORMATS)
def test_invalid_formats_raise_grammar_error(compiler: GrammarCompiler, response_format: Any, message: str) -> None:
    before = copy.deepcopy(response_format)
    with pytest.raises(GrammarError, match=message) as info:
        compiler.compile(response_format)
    assert isinstance(info.value, ParamError)  # the app answers a ParamError with a 400
    assert "<state>" not in str(info.value)  # llguidance's parser dump stays out of client messages
    assert response_format == before  # nothing the caller passed is changed


def test_a_failed_schema_is_not_cached(compiler: GrammarCompiler) -> None:
    bad = js(name="n", schema={"type": "foo"})
    for _ in range(2):
        with pytest.raises(GrammarError, match="Invalid type: foo"):
            compiler.compile(bad)


# -- Gemma 3: a SentencePiece vocabulary of 262144 tokens --------------------------------------------------

def test_gemma3_tokenizer_compiles_and_masks() -> None:
    # The grammar needs the tokenizer and the vocabulary size, which the file's header gives without the weights.
    _, tok, cfg = gen.describe(gen.model_path("gemma3"))
    assert cfg.vocab == 262144
    compiler = GrammarCompiler(tok, cfg.vocab)
    doc = {"name": "Ünï ☃", "color": "green", "age": 41, "tags": ["a b", "🎉"]}
    grammar = compiler.compile(schema_format(SCHEMA))
    assert grammar is not None
    ids = tok.encode(compact(doc), add_bos=False)
    for t in ids:
        allowed = check_mask(grammar, tok, cfg.vocab)
        assert allowed[t]
        grammar.advance(t)
    assert grammar.is_complete()
    assert set(np.flatnonzero(grammar.mask()).tolist()) == set(tok.eos_ids)
    bad = compiler.compile(schema_format(SCHEMA))
    assert bad is not None
    assert not feed(bad, tok.encode(compact(doc | {"age": 121}), add_bos=False))
