"""The tokenizer of a Hugging Face model directory, as the same `GGUFTokenizer` a GGUF file gives.

    tok = GGUFTokenizer.from_hf_dir("path/to/Qwen2.5-0.5B-Instruct")   # or tokenizer_from_hf_dir(path)

Read from the directory:
- `tokenizer.json` (required): the `tokenizers` engine as the model ships it (normalizer, pre-tokenizer, BPE
  model, added tokens). Ids are encoded without its post-processor; BOS is added by `GGUFTokenizer.encode`.
- `tokenizer_config.json` (optional): `bos_token`, `eos_token`, `unk_token`, `pad_token`, ... (a string or an
  AddedToken dict with "content"), `add_bos_token`, and `chat_template` (a string, or a list of named templates
  from which "default" is taken).
- `chat_template.jinja` (optional): the template, which takes priority over the config's (transformers saves it
  there and reads it first).
- `generation_config.json` (optional): `eos_token_id` (an id or a list); generation stops at each.

As from GGUF metadata: `eos_ids` also holds the end-of-turn markers the vocabulary has as special tokens;
`add_bos` is the config's `add_bos_token`, else whether tokenizer.json's post-processor starts with BOS (the order
llama.cpp's converter reads them in). Every error names the file and the key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

# fuel.models.tokenizer imports this module only inside GGUFTokenizer.from_hf_dir, so this import has no cycle
from fuel.models.tokenizer import _END_OF_TURN, GGUFTokenizer, TokenizerError

__all__ = ["tokenizer_from_hf_dir"]

# The named special tokens transformers hands a chat template (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any, path: Path, key: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    if isinstance(value, str):
        return value
    raise TokenizerError(f"{path}: {key!r} should be a token string or an AddedToken object, got {value!r}")


def _chat_template(root: Path, config: dict[str, Any]) -> str | None:
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{jinja}: cannot be read: {exc}") from None
    where = root / "tokenizer_config.json"
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return str(named["default"])
        raise TokenizerError(f"{where}: 'chat_template' is a list of templates {sorted(map(str, named))} "
                             "with none named 'default'")
    raise TokenizerError(f"{where}: 'chat_template' should be a string or a list of named templates, "
                         f"got {type(value).__name__}")


def _eos_ids(value: Any, path: Path, n: int) -> list[int]:
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in ids):
        raise TokenizerError(f"{path}: 'eos_token_id' = {value!r} is not ids inside the vocabulary of {n} tokens")
    return [int(i) for i in ids]


def tokenizer_from_hf_dir(path: str | os.PathLike[str]) -> GGUFTokenizer:
    """The tokenizer of the Hugging Face model directory at `path` (see the module docstring)."""
    root = Path(path)
    file = root / "tokenizer.json"
    if not file.is_file():
        raise TokenizerError(f"{file}: not found; a Hugging Face model directory needs its tokenizer.json")
    try:
        tk = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        raise TokenizerError(f"{file}: the tokenizers library cannot read it: {exc}") from None
    config_path, gen_path = root / "tokenizer_config.json", root / "generation_config.json"
    config, gen = _read_json(config_path), _read_json(gen_path)

    vocab = tk.get_vocab(with_added_tokens=True)
    n = max(vocab.values(), default=-1) + 1
    tokens = [""] * n
    for text, i in vocab.items():
        tokens[i] = text

    def token_id(key: str) -> int | None:
        text = _token_text(config.get(key), config_path, key)
        if text is None:
            return None
        if text not in vocab:
            raise TokenizerError(f"{config_path}: {key!r} = {text!r} is not a token of {file.name}")
        return vocab[text]

    named = {key: token_id(key) for key in _NAMED}
    gen_eos = _eos_ids(gen.get("eos_token_id"), gen_path, n)
    eos_id = named["eos_token"] if named["eos_token"] is not None else (gen_eos[0] if gen_eos else None)
    if eos_id is None:
        raise TokenizerError(f"{config_path}: no 'eos_token' (nor an 'eos_token_id' in {gen_path.name}); "
                             "generation could not stop")
    bos_id = named["bos_token"]
    special = {i for i, t in tk.get_added_tokens_decoder().items() if t.special}
    eos_ids = frozenset({eos_id, *gen_eos} | {vocab[m] for m in _END_OF_TURN if vocab.get(m) in special})

    flag = config.get("add_bos_token")
    if flag is not None and not isinstance(flag, bool):
        raise TokenizerError(f"{config_path}: 'add_bos_token' should be true or false, got {flag!r}")
    if flag is None:  # does the post-processor put BOS first?
        with_special = tk.encode("a", add_special_tokens=True).ids
        flag = bos_id is not None and len(with_special) > len(tk.encode("a", add_special_tokens=False).ids) \
            and with_special[0] == bos_id
    template = _chat_template(root, config)
    return GGUFTokenizer(tk, tokens, bos_id=bos_id, eos_id=eos_id, eos_ids=eos_ids,
                         add_bos=bool(flag) and bos_id is not None, chat_template=template,
                         chat_template_from_file=template is not None,
                         special_tokens={k: tokens[i] for k, i in named.items() if i is not None})
