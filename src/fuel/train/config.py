"""The configuration of a `fuel train` run: defaults, then a TOML or JSON file, then command-line flags.

The defaults are nanoGPT's CPU Shakespeare run in Llama form (4 layers, 4 heads, dim 128, SwiGLU hidden 512,
block 64, batch 12, 2000 steps, AdamW lr 1e-3 with 100 (5%) warmup steps and a cosine decay to 1e-4, betas (0.9,
0.99), weight decay 0.1, gradient clipping at 1.0) on the built-in corpus with the byte tokenizer.

Every value is checked when the config is built, and a bad one is a ParamError naming the key, what it must
be and what came (`train: n_heads must divide dim, got dim 128 and n_heads 3`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fuel.errors import ParamError
from fuel.train.data import TOKENIZERS

EXPORTS = ("f32", "q8_0")


@dataclass(frozen=True)
class TrainConfig:
    data: str = "pydoc-topics"
    tokenizer: str = "byte"
    val_fraction: float = 0.1
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # 0: as many as n_heads
    hidden_dim: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    block_size: int = 64
    context_length: int = 2048  # what the exported GGUF declares; positions past block_size are untrained
    batch_size: int = 12
    steps: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = -1  # -1: 5% of steps (nanoGPT's 100 of 2000)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0: no clipping
    eval_interval: int = 250
    eval_iters: int = 20
    checkpoint_interval: int = 500
    seed: int = 1337
    export: tuple[str, ...] = EXPORTS

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        positive = ("dim", "n_layers", "n_heads", "hidden_dim", "block_size", "batch_size", "steps", "eval_interval",
                    "eval_iters", "checkpoint_interval", "context_length", "rope_theta", "norm_eps", "lr")
        for name in positive:
            if getattr(self, name) <= 0:
                _bad(name, "positive", getattr(self, name))
        if self.warmup_steps < -1:
            _bad("warmup_steps", ">= 0 (or -1: 5% of steps)", self.warmup_steps)
        for name in ("n_kv_heads", "seed", "weight_decay", "grad_clip", "min_lr"):
            if getattr(self, name) < 0:
                _bad(name, ">= 0", getattr(self, name))
        if not 0.0 < self.val_fraction < 1.0:
            _bad("val_fraction", "in (0, 1)", self.val_fraction)
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _bad(name, "in [0, 1)", getattr(self, name))
        if self.tokenizer not in TOKENIZERS:
            _bad("tokenizer", f"one of {', '.join(TOKENIZERS)}", self.tokenizer)
        bad = [e for e in self.export if e not in EXPORTS]
        if bad:
            _bad("export", f"a list of {', '.join(EXPORTS)} (or empty)", list(self.export))
        if self.dim % self.n_heads:
            raise ParamError(f"train: n_heads must divide dim, got dim {self.dim} and n_heads {self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ParamError(f"train: the head size dim / n_heads must be even (rope rotates pairs), got "
                             f"{self.dim} / {self.n_heads} = {self.dim // self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ParamError(f"train: n_kv_heads must divide n_heads, got n_heads {self.n_heads} and n_kv_heads "
                             f"{self.n_kv_heads}")
        if self.context_length < self.block_size:
            raise ParamError(f"train: context_length must be at least block_size, got context_length "
                             f"{self.context_length} and block_size {self.block_size}")
        if self.min_lr > self.lr:
            raise ParamError(f"train: min_lr must be at most lr, got min_lr {self.min_lr} and lr {self.lr}")
        if self.warmup >= self.steps:
            raise ParamError(f"train: warmup_steps must be below steps, got warmup_steps {self.warmup_steps} and "
                             f"steps {self.steps}")
        if "q8_0" in self.export and self.dim % 32:
            raise ParamError(f"train: a q8_0 export needs dim to be a multiple of 32 (Q8_0's block), got {self.dim}")

    @property
    def warmup(self) -> int:
        """The warmup steps of the schedule: warmup_steps, or 5% of steps for -1."""
        return self.steps // 20 if self.warmup_steps == -1 else self.warmup_steps

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["export"] = list(self.export)
        return d

    def replace(self, **changes: Any) -> TrainConfig:
        return from_mapping({**self.to_dict(), **changes})


def _bad(name: str, what: str, value: Any) -> None:
    raise ParamError(f"train: {name} must be {what}, got {value!r}")


def _check_type(name: str, value: Any, kind: Any) -> None:
    kind = str(kind)
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            _bad(name, "an integer", value)
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            _bad(name, "a finite number", value)
    elif kind == "str":
        if not isinstance(value, str) or not value:
            _bad(name, "a non-empty string", value)
    elif not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
        _bad(name, "a list of strings", value)


FIELDS = {f.name: str(f.type) for f in fields(TrainConfig)}


def from_mapping(values: Mapping[str, Any], source: str = "config") -> TrainConfig:
    """A config from `values` (keys are field names; missing keys keep their defaults)."""
    unknown = [k for k in values if k not in FIELDS]
    if unknown:
        raise ParamError(f"train: {source} has unknown keys {', '.join(map(repr, unknown))}; known: "
                         f"{', '.join(FIELDS)}")
    d = dict(values)
    if "export" in d:
        e = d["export"]
        d["export"] = tuple(x.strip() for x in e.split(",") if x.strip()) if isinstance(e, str) else (
            tuple(e) if isinstance(e, list | tuple) else e)
    for name, kind in FIELDS.items():
        if kind == "float" and isinstance(d.get(name), int) and not isinstance(d.get(name), bool):
            d[name] = float(d[name])
    return TrainConfig(**d)


def load_file(path: str | Path) -> dict[str, Any]:
    """The key/value table of a `.toml` or `.json` config file (checked by `from_mapping`)."""
    p = Path(path)
    try:
        if p.suffix == ".toml":
            with p.open("rb") as fh:
                data: Any = tomllib.load(fh)
        elif p.suffix == ".json":
            data = json.loads(p.read_text(encoding="utf-8"))
        else:
            raise ParamError(f"train: --config {p}: expected a .toml or .json file")
    except OSError as e:
        raise ParamError(f"train: --config {p}: cannot read it ({e.strerror or e})") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ParamError(f"train: --config {p}: not valid {p.suffix[1:].upper()} ({e})") from None
    if not isinstance(data, dict):
        raise ParamError(f"train: --config {p}: expected a table of keys, got {type(data).__name__}")
    return data


def parse_flag(name: str, text: str) -> Any:
    """A flag's text as the field's type (its domain is checked by the config)."""
    kind = FIELDS[name]
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        raise ParamError(f"train: --{name.replace('_', '-')} must be {'an integer' if kind == 'int' else 'a number'}"
                         f", got {text!r}") from None
    return text
