"""LoRA adapters over a frozen `fuel.models.llama.LlamaModel`, saved and loaded in PEFT's format.

    adapter = LoraAdapter.create(model.cfg, LoraConfig(r=8, lora_alpha=16), seed=0)
    adapter.attach(model)             # every step built from now on adds the adapters' terms
    adapter.save("adapter/")          # adapter_model.safetensors + adapter_config.json (PEFT's)
    adapter = LoraAdapter.load("adapter/", model.cfg)

**The term.** A target projection `y = x @ Wᵀ` (W frozen: GGUF blocks through QMatMul, or NF4 through
Nf4Matmul) becomes `y + (x @ Aᵀ) @ Bᵀ · s` with `A [r, in]`, `B [out, r]` and `s = lora_alpha / r`
(`lora_alpha / √r` with `use_rslora`), as PEFT's `lora.Linear` computes it. With `lora_dropout = p > 0`
the adapter's input is `x · mask / (1 − p)`, the mask a {0, 1} array the adapter owns per projection
and redraws before each training step (`redraw_dropout`); at inference (`training = False`) x is used as is.

**Parameters.** `A` and `B` of every target are plain `fl.Tensor` leaves over writable arrays the adapter
owns (`parameters()`, in `state_dict()` order), so an optimizer writes them in place and captured steps see
the new values. They are initialised as PEFT's default: A Kaiming-uniform with bound `1/√in` (torch's
`kaiming_uniform_(a=√5)`), B zero, so a new adapter leaves the model's output unchanged.

**Frozen weights.** The base model's weights get no gradient. QMatMul's blocks (u32) and NF4's codes (u8)
are integer data: `fl.grad` refuses them with a DTypeError ("grad: cannot differentiate with respect to a
u32 tensor"). NF4's absmax is a float, read-only constant; Nf4Matmul's VJP could give it a gradient, but
only the adapters' tensors (`parameters()`) are passed to `fl.grad` or the optimizer, and gradients are
built lazily, so none is ever computed. Gradients reach the adapters through the quantized ops'
activation VJPs (the transposed QMatMul / Nf4Matmul of the same bytes).

**PEFT's names.** `base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight` and
`base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight`; the config is
`adapter_config.json` with `peft_type: "LORA"`, `r`, `lora_alpha`, `target_modules` (the `*_proj` names),
`lora_dropout`, `use_rslora`. Rows of q and k are in transformers' (rotate-half) order, the order fuel's
loader gives them, so an adapter loads unchanged in `peft.PeftModel.from_pretrained` over transformers'
model of the same GGUF file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import fuel as fl
from fuel.errors import DTypeError, FuelError, ParamError, ShapeError
from fuel.graph.tensor import Tensor
from fuel.models.llama import LlamaConfig, LlamaModel

# fuel's projection names and PEFT's (transformers' module names), in the order a layer runs them
PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
               "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
MODULE_OF = {p.split(".")[1]: name for name, p in PROJECTIONS.items()}  # "q_proj" -> "q"
ALL_TARGETS = tuple(MODULE_OF)
WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
PREFIX = "base_model.model.model.layers."


class AdapterError(FuelError, ValueError):
    """An adapter directory or config this module cannot use (missing files, an unsupported PEFT option)."""


def projection_shape(cfg: LlamaConfig, name: str) -> tuple[int, int]:
    """(in_features, out_features) of projection `name` of a layer."""
    q_out, kv_out = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return {"q": (cfg.hidden, q_out), "k": (cfg.hidden, kv_out), "v": (cfg.hidden, kv_out), "o": (q_out, cfg.hidden),
            "gate": (cfg.hidden, cfg.ffn), "up": (cfg.hidden, cfg.ffn), "down": (cfg.ffn, cfg.hidden)}[name]


def peft_key(layer: int, name: str, which: str) -> str:
    """PEFT's key of layer `layer`'s projection `name` (fuel's: "q" ... "down"), matrix `which` ("A"/"B")."""
    return f"{PREFIX}{layer}.{PROJECTIONS[name]}.lora_{which}.weight"


@dataclass(frozen=True)
class LoraConfig:
    """rank r, lora_alpha, lora_dropout and the target modules (PEFT's `*_proj` names)."""

    r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = ALL_TARGETS
    use_rslora: bool = False
    base_model_name_or_path: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int | np.integer) or self.r < 1:
            raise ParamError(f"lora: r must be a positive int, got {self.r!r}")
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, int | float) or not (
                math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ParamError(f"lora: lora_alpha must be a positive number, got {self.lora_alpha!r}")
        p = self.lora_dropout
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p < 1.0:
            raise ParamError(f"lora: lora_dropout must be a number in [0, 1), got {p!r}")
        targets = (self.target_modules,) if isinstance(self.target_modules, str) else tuple(self.target_modules)
        unknown = [t for t in targets if t not in MODULE_OF]
        if not targets or unknown:
            raise ParamError(f"lora: target_modules must be some of {', '.join(ALL_TARGETS)}, got {list(targets)}")
        object.__setattr__(self, "target_modules", tuple(t for t in ALL_TARGETS if t in targets))

    @property
    def scale(self) -> float:
        """s in `y + x Aᵀ Bᵀ s`: lora_alpha / r (lora_alpha / √r with use_rslora), as PEFT's `scaling`."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_peft(self) -> dict[str, Any]:
        """adapter_config.json's content, loadable by `peft.PeftConfig.from_pretrained`."""
        return {**self.extra, "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(self.r),
                "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout,
                "target_modules": list(self.target_modules), "bias": "none", "fan_in_fan_out": False,
                "use_rslora": self.use_rslora, "use_dora": False, "init_lora_weights": True,
                "inference_mode": True, "modules_to_save": None, "layers_to_transform": None,
                "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
                "base_model_name_or_path": self.base_model_name_or_path}

    @classmethod
    def from_peft(cls, d: Mapping[str, Any], where: str = CONFIG_NAME) -> LoraConfig:
        """A config from adapter_config.json's content; a PEFT option this adapter cannot honour is an
        AdapterError naming it (DoRA, biases, fan_in_fan_out, per-module ranks, layer subsets, ...)."""
        if d.get("peft_type") != "LORA":
            raise AdapterError(f"lora: {where}: peft_type must be 'LORA', got {d.get('peft_type')!r}")
        unsupported = {"use_dora": False, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
                       "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}
        for key, default in unsupported.items():
            if d.get(key, default) not in (default, None, [], {}):
                raise AdapterError(f"lora: {where}: {key}={d[key]!r} is not supported (expected {default!r})")
        targets = d.get("target_modules")
        if isinstance(targets, str):  # PEFT allows a regex; only a plain module name is understood here
            targets = [targets]
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise AdapterError(f"lora: {where}: target_modules must be a list of module names, got {targets!r}")
        for key in ("r", "lora_alpha"):
            if key not in d:
                raise AdapterError(f"lora: {where}: {key} is missing")
        known = {"peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora",
                 "base_model_name_or_path"}
        return cls(r=d["r"], lora_alpha=d["lora_alpha"], lora_dropout=d.get("lora_dropout", 0.0) or 0.0,
                   target_modules=tuple(targets), use_rslora=bool(d.get("use_rslora", False)),
                   base_model_name_or_path=d.get("base_model_name_or_path"),
                   extra={k: v for k, v in d.items() if k not in known})


class LoraAdapter:
    """The A and B matrices of every target projection of every layer, and the hook that adds their terms
    to a model's steps (module doc)."""

    def __init__(self, cfg: LlamaConfig, config: LoraConfig, weights: Mapping[tuple[int, str], tuple[np.ndarray,
                                                                                                        np.ndarray]]):
        self.cfg, self.config = cfg, config
        self.training = False
        self.arrays: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
        self.tensors: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
        for layer in range(cfg.layers):
            for module in config.target_modules:
                name = MODULE_OF[module]
                a, b = (np.ascontiguousarray(m, np.float32).copy() for m in weights[(layer, name)])
                self.arrays[(layer, name)] = (a, b)
                self.tensors[(layer, name)] = (fl.tensor(a), fl.tensor(b))
        self._masks: dict[tuple[int, str], np.ndarray] = {}
        self._rng = np.random.default_rng(0)

    @classmethod
    def create(cls, cfg: LlamaConfig, config: LoraConfig | None = None, seed: int = 0) -> LoraAdapter:
        """A new adapter initialised as PEFT's default (A Kaiming-uniform, B zero) from `seed`."""
        config = config or LoraConfig()
        rng = np.random.default_rng(seed)
        weights = {}
        for layer in range(cfg.layers):
            for module in config.target_modules:
                name = MODULE_OF[module]
                fan_in, fan_out = projection_shape(cfg, name)
                bound = 1.0 / math.sqrt(fan_in)
                a = rng.uniform(-bound, bound, (config.r, fan_in)).astype(np.float32)
                weights[(layer, name)] = (a, np.zeros((fan_out, config.r), np.float32))
        adapter = cls(cfg, config, weights)
        adapter._rng = np.random.default_rng(seed + 1)
        return adapter

    # -- the graph -------------------------------------------------------------------------------

    def __call__(self, layer: int, name: str, x: Tensor, y: Tensor) -> Tensor:
        """The projection's output y of rows x `[M, in]` plus this adapter's term (y alone if not a target)."""
        ab = self.tensors.get((layer, name))
        if ab is None:
            return y
        a, b = ab
        if self.training and self.config.lora_dropout > 0:
            x = x * fl.tensor(self._mask(layer, name, x.shape))
        return y + ((x @ a.T) @ b.T) * float(np.float32(self.config.scale))

    def _mask(self, layer: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The dropout mask of a projection for inputs of `shape`: {0, 1/(1 − p)}, redrawn in place by
        `redraw_dropout` (a captured step reads the array at each call)."""
        m = self._masks.get((layer, name))
        if m is None or m.shape != shape:
            m = self._masks[(layer, name)] = np.empty(shape, np.float32)
            self._draw(m)
        return m

    def _draw(self, m: np.ndarray) -> None:
        p = self.config.lora_dropout
        m[...] = (self._rng.random(m.shape) >= p).astype(np.float32) / np.float32(1.0 - p)

    def redraw_dropout(self) -> None:
        """New dropout masks for the next training step (nothing to do with lora_dropout = 0)."""
        for m in self._masks.values():
            self._draw(m)

    def attach(self, model: LlamaModel) -> None:
        """Add this adapter's terms to every step of `model` built from now on (`LlamaModel.set_adapter`: a
        model that has captured steps is refused; `fuel.lora.load_model` gives one that has not run)."""
        if model.cfg != self.cfg:
            raise ShapeError(f"lora: the adapter is for a model of {self.cfg.layers} layers, hidden {self.cfg.hidden}; "
                             f"the model has {model.cfg.layers} layers, hidden {model.cfg.hidden}")
        model.set_adapter(self)

    # -- state -----------------------------------------------------------------------------------

    def parameters(self) -> list[Tensor]:
        """Every A and B leaf, in `state_dict()`'s order: what an optimizer updates."""
        return [t for ab in self.tensors.values() for t in ab]

    def state_dict(self) -> dict[str, np.ndarray]:
        """PEFT's keys to (copies of) the current A and B arrays."""
        out = {}
        for (layer, name), (a, b) in self.arrays.items():
            out[peft_key(layer, name, "A")], out[peft_key(layer, name, "B")] = a.copy(), b.copy()
        return out

    def load_state_dict(self, state: Mapping[str, Any], where: str = "state") -> None:
        """Copy PEFT-keyed arrays into this adapter's arrays (in place: captured steps see them). Every key
        must be known and present, with this adapter's shape and a float dtype; else a FuelError naming it."""
        want = {peft_key(layer, name, w): (layer, name, w) for layer, name in self.arrays for w in "AB"}
        unknown = sorted(set(state) - set(want))
        if unknown:
            raise ParamError(f"lora: {where}: unknown key {unknown[0]!r} (this adapter targets "
                             f"{', '.join(self.config.target_modules)} of {self.cfg.layers} layers)")
        missing = [k for k in want if k not in state]
        if missing:
            raise ParamError(f"lora: {where}: missing key {missing[0]!r}")
        for key, (layer, name, w) in want.items():
            value = np.asarray(state[key])
            target = self.arrays[(layer, name)][0 if w == "A" else 1]
            if value.shape != target.shape:
                raise ShapeError(f"lora: {where}: {key} has shape {list(value.shape)}, expected "
                                 f"{list(target.shape)}")
            if value.dtype.kind != "f" and value.dtype.name != "bfloat16":
                raise DTypeError(f"lora: {where}: {key} must be a float array, got {value.dtype}")
        for key, (layer, name, w) in want.items():
            self.arrays[(layer, name)][0 if w == "A" else 1][...] = np.asarray(state[key]).astype(np.float32)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write `adapter_model.safetensors` and `adapter_config.json` (PEFT's format) into `directory`."""
        from fuel.nn.state import safe_save

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        safe_save(self.state_dict(), d / WEIGHTS_NAME, metadata={"format": "pt"})
        (d / CONFIG_NAME).write_text(json.dumps(self.config.to_peft(), indent=2) + "\n", encoding="utf-8")
        return d

    @classmethod
    def load(cls, directory: str | os.PathLike[str], cfg: LlamaConfig) -> LoraAdapter:
        """An adapter saved by `save` or by PEFT (`save_pretrained`) for a model of `cfg`."""
        from fuel.nn.state import safe_load

        d = Path(directory)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (d / name).is_file():
                raise AdapterError(f"lora: {d} has no {name} (an adapter directory holds {CONFIG_NAME} and "
                                   f"{WEIGHTS_NAME})")
        try:
            raw = json.loads((d / CONFIG_NAME).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise AdapterError(f"lora: {d / CONFIG_NAME} is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise AdapterError(f"lora: {d / CONFIG_NAME} must hold a JSON object")
        config = LoraConfig.from_peft(raw, str(d / CONFIG_NAME))
        adapter = cls.create(cfg, config)
        try:
            state = safe_load(d / WEIGHTS_NAME)
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            raise AdapterError(f"lora: {d / WEIGHTS_NAME} is not a safetensors file: {e}") from None
        adapter.load_state_dict(state, str(d / WEIGHTS_NAME))
        return adapter


def target_names(targets: Iterable[str]) -> tuple[str, ...]:
    """PEFT module names from fuel's ("q") or PEFT's ("q_proj") names; "all" is every projection."""
    out: list[str] = []
    for t in targets:
        if t == "all":
            out.extend(ALL_TARGETS)
        elif t in MODULE_OF:
            out.append(t)
        elif t in PROJECTIONS:
            out.append(PROJECTIONS[t].split(".")[1])
        else:
            raise ParamError(f"lora: unknown target {t!r}; expected all or some of "
                             f"{', '.join([*PROJECTIONS, *ALL_TARGETS])}")
    return tuple(dict.fromkeys(out))


__all__: Sequence[str] = ["ALL_TARGETS", "AdapterError", "LoraAdapter", "LoraConfig", "peft_key",
                          "projection_shape", "target_names"]
