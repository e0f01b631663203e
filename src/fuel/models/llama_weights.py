"""What a Llama-family GGUF file holds, ready for the graph (`fuel.models.llama`): the hyper-parameters
(`LlamaConfig`), the rope tables, and each projection's weight (`_Linear`), grouped where one QMatMul can
serve several (`_Projections`).

**Rope layout.** llama.cpp's converter permutes the rows of Q and K inside each head so that its rope
rotates adjacent pairs; Fuel's Rope rotates halves (as Hugging Face does). `_Linear.of(t, heads)` reorders
the quantized rows back (whole rows of blocks, so the bytes are moved, never requantised). Gemma files are
not permuted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import fuel as fl
from fuel.errors import FuelError
from fuel.graph.tensor import Tensor
from fuel.io.gguf import GGUFFile, GGUFTensor
from fuel.models.architectures import ARCHITECTURES as ARCH_SPECS
from fuel.models.architectures import ArchSpec

ARCHITECTURES = (*ARCH_SPECS, "mamba")  # every architecture the models package runs (mamba: fuel.models.mamba_lm)
# llama.cpp's defaults for Gemma 2 files that do not carry the softcaps (its reference's values)
GEMMA2_SOFTCAPS = (50.0, 30.0)
_ARCH_OF_NAME = ArchSpec("")  # LlamaConfig's default spec: replaced by its architecture's


class ModelError(FuelError, ValueError):
    """A model file this module cannot run, or a request outside the model's limits."""


def check_ids(ids: Any, vocab: int, what: str) -> list[int]:
    """`ids` as a list of ints, each a token id in [0, vocab); else a ModelError naming `what`."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | np.ndarray):
        raise ModelError(f"{what}: expects a sequence of token ids, got {type(ids).__name__}")
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise ModelError(f"{what}: token ids must be ints, got {t!r} ({type(t).__name__})")
        if not 0 <= t < vocab:
            raise ModelError(f"{what}: token id {t} is outside the vocabulary [0, {vocab})")
        out.append(int(t))
    return out


@dataclass(frozen=True)
class LlamaConfig:
    """A decoder's hyper-parameters, read from its source's metadata by `from_gguf` (`spec`: what its
    architecture's layers do, `fuel.models.architectures`)."""

    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    eps: float
    rope_base: float
    vocab: int
    context_length: int
    spec: ArchSpec = _ARCH_OF_NAME  # the architecture's own spec (ARCHITECTURES[arch]) unless given
    sliding_window: int | None = None
    local_rope_base: float | None = None
    attn_scale: float = 0.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rope_linear: float = 1.0  # `rope.scaling.factor` of linear scaling: positions are divided by it
    rope_orig_context: int | None = None  # `rope.scaling.original_context_length` (Phi-3 LongRoPE)
    rope_attn_factor: float | None = None  # `rope.scaling.attn_factor` as the file gives it

    def __post_init__(self) -> None:
        if self.spec is _ARCH_OF_NAME:
            if self.arch not in ARCH_SPECS:
                raise ModelError(f"LlamaConfig: architecture {self.arch!r} is not one of {', '.join(ARCH_SPECS)}")
            object.__setattr__(self, "spec", ARCH_SPECS[self.arch])

    @property
    def gemma(self) -> bool:
        """A Gemma architecture (norm weights stored with the +1, embeddings × √hidden)."""
        return self.spec.embed_scale

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> LlamaConfig:
        """The hyper-parameters of a source; a missing or malformed one is a FuelError naming the key and the
        file (`GGUFKeyError` for a missing key or tensor, `ModelError` for a value that is not a number or a
        feature the architecture does not support)."""
        arch = f.architecture
        spec = ARCH_SPECS.get(arch)
        if spec is None:
            raise ModelError(f"model: architecture {arch!r} is not supported by the decoder; supported: "
                             f"{', '.join(ARCH_SPECS)}")

        def number(key: str, kind: type, default: Any = ..., zero: bool = False) -> Any:
            value = f.hparam(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or (
                    kind is int and value != int(value)) or not math.isfinite(value) or value < 0 or (
                    value == 0 and not zero):
                raise ModelError(f"model: {f.path}: metadata {arch}.{key} must be a positive "
                                 f"{'integer' if kind is int else 'number'}, got {value!r}")
            return kind(value)

        def refuse(key: str, value: Any, why: str) -> ModelError:
            return ModelError(f"model: {f.path}: metadata {arch}.{key} = {value!r} is not supported by {arch}: {why}")

        heads, hidden = number("attention.head_count", int), number("embedding_length", int)
        head_dim = number("attention.key_length", int, hidden // heads)
        if (value_dim := number("attention.value_length", int, head_dim)) != head_dim:
            raise refuse("attention.value_length", value_dim, f"values must have the keys' head_dim {head_dim}")
        if (rope_dim := number("rope.dimension_count", int, head_dim)) != head_dim:
            raise refuse("rope.dimension_count", rope_dim, f"rope must rotate the whole head_dim {head_dim}")
        layers = number("block_count", int)
        window = None
        if spec.window_layers != "none":
            window = number("attention.sliding_window", int, 0, zero=True) or None  # 0: none (Phi-4's files)
        scaling = f.hparam("rope.scaling.type", "none")
        if scaling not in spec.rope_scaling:
            raise refuse("rope.scaling.type", scaling, f"supported: {', '.join(spec.rope_scaling)}")
        linear = number("rope.scaling.factor", float, 1.0) if scaling == "linear" else 1.0
        scale = f.hparam("attention.scale", None)
        if scale is None:
            # llama.cpp's rule for Gemma 2 files, which do not carry the scale: 27B (46 layers) scales by
            # hidden / heads, the others by head_dim
            scale = 1.0 / math.sqrt(hidden / heads if arch == "gemma2" and layers == 46 else head_dim)
        else:
            scale = number("attention.scale", float)
        caps = (None, None)
        if spec.softcaps:
            caps = (number("attn_logit_softcapping", float, GEMMA2_SOFTCAPS[0]),
                    number("final_logit_softcapping", float, GEMMA2_SOFTCAPS[1]))
        has_orig = f.hparam("rope.scaling.original_context_length", None) is not None
        attn_factor = f.hparam("rope.scaling.attn_factor", None)
        return cls(
            arch=arch, layers=layers, hidden=hidden, heads=heads,
            kv_heads=number("attention.head_count_kv", int, heads), head_dim=head_dim,
            ffn=number("feed_forward_length", int), eps=number("attention.layer_norm_rms_epsilon", float),
            rope_base=number("rope.freq_base", float, 10_000.0), vocab=f["token_embd.weight"].shape[0],
            context_length=number("context_length", int), spec=spec, sliding_window=window,
            local_rope_base=None if spec.local_rope_base is None else number(
                "rope.freq_base_swa", float, spec.local_rope_base),
            attn_scale=scale, attn_softcap=caps[0], final_softcap=caps[1], rope_linear=linear,
            rope_orig_context=number("rope.scaling.original_context_length", int) if has_orig else None,
            rope_attn_factor=None if attn_factor is None else number("rope.scaling.attn_factor", float),
        )

    def is_local(self, layer: int) -> bool:
        """Whether `layer` uses sliding-window attention (the spec's window layers, when the file sets one)."""
        return self.sliding_window is not None and self.spec.is_local(layer)

    def window_left(self, layer: int) -> int | None:
        """The left window of `layer`'s attention (FlashAttn's `window_size_left`): a query sees itself and
        the `sliding_window - 1` keys before it, as transformers' sliding masks do; None for global layers."""
        return self.sliding_window - 1 if self.sliding_window is not None and self.spec.is_local(layer) else None

    def rope_name(self, layer: int) -> str:
        """Which rope tables `layer` reads: "local" (Gemma 3's window layers, their own base) or "global"."""
        return "local" if self.local_rope_base is not None and self.is_local(layer) else "global"


def rope_tables(base: float, head_dim: int, positions: np.ndarray, factors: np.ndarray | None = None,
                scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin `[len(positions), head_dim]` float32 for rotate-half rope (angles in float64). `factors`
    `[head_dim/2]` divide each frequency (ggml's rope freq_factors: Llama 3's `rope_freqs.weight`, Phi-3's
    LongRoPE factors, a linear scaling's factor); `scale` multiplies cos and sin (LongRoPE's attn_factor)."""
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors is not None:
        inv_freq = inv_freq / np.asarray(factors, np.float64).reshape(-1)
    ang = np.outer(positions.astype(np.float64), inv_freq)
    ang = np.concatenate([ang, ang], axis=1)
    return (np.cos(ang) * scale).astype(np.float32), (np.sin(ang) * scale).astype(np.float32)


ROPE_FACTOR_TENSORS = {"freqs": ("rope_freqs.weight",),
                       "longrope": ("rope_factors_long.weight", "rope_factors_short.weight")}


def rope_factors(f: GGUFFile, cfg: LlamaConfig, capacity: int) -> tuple[np.ndarray | None, float]:
    """The global rope tables' per-frequency divisors `[head_dim/2]` (None: none) and cos/sin scale for a
    model of `capacity` positions: Llama 3's `rope_freqs.weight`; Phi-3's LongRoPE factors, the long ones
    when the capacity exceeds `rope.scaling.original_context_length` (llama.cpp's choice), scaled by
    `rope.scaling.attn_factor` or else by √(1 + ln(context/original)/ln(original)) (transformers' default);
    times a linear scaling's factor. A factor tensor the architecture does not read is a ModelError."""
    spec, arch = cfg.spec, cfg.arch
    wanted = ROPE_FACTOR_TENSORS.get(spec.rope_factors, ())
    for names in ROPE_FACTOR_TENSORS.values():
        for name in names:
            if name in f and name not in wanted:
                raise ModelError(f"model: {f.path}: tensor {name!r} (rope factors) is not supported by {arch}")
    factors, scale = None, 1.0
    if spec.rope_factors == "freqs" and wanted[0] in f:
        factors = f[wanted[0]].array()
    elif spec.rope_factors == "longrope" and (wanted[0] in f or wanted[1] in f):
        orig = cfg.rope_orig_context
        if orig is None:
            raise ModelError(f"model: {f.path}: LongRoPE factors need metadata {arch}.rope.scaling."
                             "original_context_length, which is missing")
        factors = f[wanted[0] if capacity > orig else wanted[1]].array()
        ctx = cfg.context_length
        scale = cfg.rope_attn_factor if cfg.rope_attn_factor is not None else (
            math.sqrt(1 + math.log(ctx / orig) / math.log(orig)) if ctx > orig else 1.0)
    elif spec.rope_factors == "longrope" and cfg.rope_attn_factor is not None:
        scale = cfg.rope_attn_factor
    if factors is not None and factors.size != cfg.head_dim // 2:
        raise ModelError(f"model: {f.path}: rope factors have {factors.size} values, expected head_dim / 2 = "
                         f"{cfg.head_dim // 2}")
    if cfg.rope_linear != 1.0:
        factors = (np.ones(cfg.head_dim // 2) if factors is None else factors.astype(np.float64)) * cfg.rope_linear
    return factors, scale


def _halves_order(rows: int, heads: int) -> np.ndarray:
    """The row order that turns llama.cpp's per-head pair layout (rows 2i, 2i + 1 rotate together)
    into the halves layout (rows i, i + D/2): row r of the result is row order[r] of the file."""
    d = rows // heads
    return np.arange(rows).reshape(heads, d // 2, 2).swapaxes(1, 2).reshape(-1)


def _as_words(rows: np.ndarray) -> np.ndarray:
    """uint8 rows of whole blocks as the u32 words QMatMul reads (zero-padded to a whole word at the end)."""
    flat = rows.reshape(-1)
    if flat.size % 4 == 0 and flat.flags.c_contiguous:
        return flat.view(np.uint32)
    padded = np.zeros(-(-flat.size // 4) * 4, np.uint8)
    padded[:flat.size] = flat
    return padded.view(np.uint32)


@dataclass
class _Linear:
    """A projection `x @ Wᵀ`: a quantized weight's block bytes `[n, row bytes]`, or a float weight
    transposed once (`dense`, `[k, n]`)."""

    rows: np.ndarray | None
    quant: str
    k: int
    n: int
    dense: np.ndarray | None = None

    @classmethod
    def of(cls, t: GGUFTensor, heads: int | None = None) -> _Linear:
        """The projection by weight t; `heads` reorders its rows per head (see `_halves_order`)."""
        if t.ndim != 2:
            raise ModelError(f"model: tensor {t.name!r} has shape {list(t.shape)}, expected a matrix")
        order = None if heads is None else _halves_order(t.n, heads)
        if t.is_quantized:
            t.words  # noqa: B018  (raises UnsupportedTensorType, naming the tensor, for a type QMatMul lacks)
            rows = t.raw().reshape(t.n, -1)
            return cls(rows if order is None else rows[order], t.type_name, t.k, t.n)
        w = t.array().astype(np.float32)
        return cls(None, t.type_name, t.k, t.n, np.ascontiguousarray((w if order is None else w[order]).T))

    def joins(self, other: _Linear) -> bool:
        return self.rows is not None and other.rows is not None and (self.quant, self.k) == (other.quant, other.k)

    def __call__(self, x: Tensor) -> Tensor:
        if self.rows is not None:
            return fl.ops.qmatmul(x, fl.tensor(_as_words(self.rows)), self.quant, self.k, self.n)
        assert self.dense is not None
        return x @ fl.tensor(self.dense)


class _Projections:
    """Projections of one input (Q, K, V; gate, up). Consecutive quantized ones of the same type run as
    one QMatMul over their stacked rows, whose output columns are then sliced: fewer, larger kernel
    calls in a decode step (one weight pass per group instead of one per projection)."""

    def __init__(self, parts: dict[str, _Linear]) -> None:
        self.groups: list[tuple[_Linear, list[tuple[str, int, int]]]] = []
        pending: list[tuple[str, _Linear]] = []
        for name, lin in [*parts.items(), ("", None)]:
            if pending and (lin is None or not pending[0][1].joins(lin)):
                self.groups.append(self._stack(pending))
                pending = []
            if lin is not None:
                pending.append((name, lin))

    @staticmethod
    def _stack(group: list[tuple[str, _Linear]]) -> tuple[_Linear, list[tuple[str, int, int]]]:
        spans, start = [], 0
        for name, lin in group:
            spans.append((name, start, start + lin.n))
            start += lin.n
        first = group[0][1]
        if len(group) == 1:
            return first, spans
        stacked = np.concatenate([lin.rows for _, lin in group if lin.rows is not None])
        return _Linear(stacked, first.quant, first.k, start), spans

    @classmethod
    def fused(cls, lin: _Linear, sizes: dict[str, int]) -> _Projections:
        """Projections stored as one weight (Phi-3's `attn_qkv`, its gate-then-up `ffn_up`): its output
        columns, in order, are those of each name, `sizes[name]` wide; a ModelError if they do not add up."""
        if sum(sizes.values()) != lin.n:
            want = " + ".join(map(str, sizes.values()))
            raise ModelError(f"model: a fused projection has {lin.n} rows, expected {want} ({', '.join(sizes)})")
        out = cls({})
        spans, start = [], 0
        for name, n in sizes.items():
            spans.append((name, start, start + n))
            start += n
        out.groups.append((lin, spans))
        return out

    def parts(self) -> dict[str, _Linear]:
        """Each projection alone by name: a stacked weight's rows of that projection (a view, no copy)."""
        out: dict[str, _Linear] = {}
        for lin, spans in self.groups:
            for name, a, b in spans:
                if len(spans) == 1:
                    out[name] = lin
                elif lin.rows is not None:
                    out[name] = _Linear(lin.rows[a:b], lin.quant, lin.k, b - a)
                else:
                    assert lin.dense is not None  # a fused float weight: its columns of that projection
                    out[name] = _Linear(None, lin.quant, lin.k, b - a, np.ascontiguousarray(lin.dense[:, a:b]))
        return out

    def __call__(self, x: Tensor, joined: tuple[str, str] | None = None) -> dict[str, Tensor]:
        """Each projection's output by name; with `joined` = (first, second), also `first+second`, their
        columns as one slice where one QMatMul gave both, adjacent."""
        out: dict[str, Tensor] = {}
        for lin, spans in self.groups:
            y = lin(x)
            for name, a, b in spans:
                out[name] = y if len(spans) == 1 else y[:, a:b]
            names = [name for name, _, _ in spans]
            if joined and joined[0] in names and names[names.index(joined[0]) + 1:][:1] == [joined[1]]:
                at = names.index(joined[0])
                out["+".join(joined)] = y[:, spans[at][1]:spans[at + 1][2]]
        return out

