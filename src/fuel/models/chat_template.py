"""Chat templates rendered as transformers' `apply_chat_template(..., tokenize=False)` renders them.

    tpl = ChatTemplate(text)
    prompt = tpl.render(messages, add_generation_prompt=True, special_tokens={"bos_token": "<s>", ...})

The environment is the one transformers builds (`transformers.utils.chat_template_utils`): an immutable jinja2
sandbox with `trim_blocks`, `lstrip_blocks` and the `loopcontrols` extension; globals `raise_exception`,
`strftime_now`, a `dict` constructor and a `namespace` that refuses underscore-prefixed names; a `tojson` filter
that does not escape HTML and takes json.dumps' `ensure_ascii`, `indent`, `separators` and `sort_keys`; and the
`{% generation %}` block tag (training templates mark the assistant's text with it; rendering keeps the text).

What the template sees is what transformers passes: the messages with None-valued keys dropped (an OpenAI-style
`content=None` or `tool_calls=None` means "absent"), `tools` and `documents` (None unless given), the flag
`add_generation_prompt`, the tokenizer's special tokens (`bos_token`, `eos_token`, ... the ones it has), then any
extra keyword (`enable_thinking`, `date_string`, ...), which overrides a special token of the same name.
Nothing the caller passed is mutated: messages are copied before the template sees them.

A template error (`raise_exception`, an undefined operation) is a `TemplateError`; the caller turns it into its
own error type.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

__all__ = ["GEMMA3_CHAT_TEMPLATE", "ChatTemplate", "TemplateError"]

# Gemma 3's chat template (google/gemma-3-*-it tokenizer_config.json), for Gemma files that carry none.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML; chat templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` without exposing the dict type itself to the sandbox."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """jinja's namespace, refusing underscore-prefixed names (a way towards CPython internals). `self` comes
    through *args, as in jinja's own, so that `namespace(self=1)` works."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store the underscore-prefixed attribute {name!r}")


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja.ext.Extension declares it a plain set

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Macro) -> str:
        return str(caller())


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy(v) for v in value)
    return value


class ChatTemplate:
    """One compiled chat template. `text` is the jinja source; a syntax error raises `TemplateError`."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._template = _environment().from_string(text)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               special_tokens: Mapping[str, str], tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """The prompt for `messages`; `special_tokens` maps names such as "bos_token" to their text."""
        chat = [{k: _copy(v) for k, v in m.items() if v is not None} for m in messages]
        context: dict[str, Any] = {**special_tokens, **{k: _copy(v) for k, v in extra.items()}}
        return self._template.render(messages=chat, tools=_copy(tools), documents=_copy(documents),
                                     add_generation_prompt=add_generation_prompt, **context)
