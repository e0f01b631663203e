"""A Mamba-1 language model from a GGUF file (llama.cpp's `mamba` architecture), built from `fuel.ops`.

    model = MambaModel.load("mamba-130m.gguf", capacity=2048)
    logits = model.prefill(prompt_ids)        # the prompt through the selective scan; last token's logits
    logits = model.decode(next_id)            # one token: one replay of the captured recurrent step
    seq = model.acquire(prompt_ids)           # a sequence of its own (states, tokens, captured step) ...
    model.release(seq)                        # ... lent from the model's pool and given back

The sequence interface is `LlamaModel`'s (`fuel.models.generate.LLM` drives either); `capacity` bounds the
tokens a sequence runs (a state model has no cache to fill, so it is a limit, not memory).

**The file** is what llama.cpp's converter writes (`fuel.testing.mamba_files` writes one): metadata
`mamba.embedding_length`, `block_count`, `ssm.conv_kernel`, `ssm.inner_size`, `ssm.state_size`,
`ssm.time_step_rank`, `attention.layer_norm_rms_epsilon`; per layer `blk.N.attn_norm`, `ssm_in` (x then
gate), `ssm_conv1d.weight` `[I, K]` and `.bias`, `ssm_x` (dt_low, B, C), `ssm_dt.weight` and `.bias`,
`ssm_a` (A = −exp(A_log), stored as A), `ssm_d`, `ssm_out`; then `output_norm`, `token_embd` and
`output` (tied to the embedding when absent). Projections in any block type run through QMatMul
(`fuel.models.llama_weights._Linear`); the small vectors are read as float. Refused by name: other
architectures (Mamba-2's `mamba2` among them), Falcon-Mamba's `ssm.dt_b_c_rms` norms, a tensor of the
wrong shape, a tensor the architecture does not have.

**A layer** (transformers' `MambaBlock`): x + out_proj(mixer(rms_norm(x)·w)), the mixer as
`fuel.models.mamba.Mamba1Mixer`: in_proj → (x, gate); u = silu(causal_conv1d(x)); x_proj(u) →
(dt_low, B, C); delta = dt_proj(dt_low) + bias; the selective scan with softplus(delta) and A; then
(y + D·u)·silu(gate).

**State.** A sequence owns, per layer, its conv state `[1, I, K − 1]` (the last K − 1 inputs of the
conv) and its SSM state `[1, I, N]`, as transformers' `MambaCache` carries them. Prefill runs the prompt
through CausalConv1d (left-padded by the conv state) and SelectiveScan, whose final state it writes
back; the scan starts from zero, so a prompt continuing a sequence (pos > 0) adds the carried state's
part, which is linear in it: h_t gains exp(A·Σ_{s≤t} d_s)·h₀ and y_t that times C_t. Decode is one token
through the same layers, its SSM update the recurrence itself (h = exp(d·A)·h₀ + d·u·B, y = h·C, with
d = softplus(delta)), captured once per sequence with `fl.jit`: each replay reads the states and writes
the new ones in place with `fl.assign`, so a step allocates nothing but its logits. A state cannot be
rewound to an earlier token: a sequence keeps all its tokens or none (`common_prefix`, `rewind`).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import fuel as fl
from fuel.errors import ParamError
from fuel.graph.tensor import Tensor
from fuel.io.gguf import GGUFFile, open_gguf
from fuel.models.llama_weights import ModelError, _Linear, check_ids
from fuel.models.mamba import softplus
from fuel.models.sequence_pool import SequencePool, TokenEmbedding

ARCH = "mamba"


@dataclass(frozen=True)
class MambaConfig:
    """The hyper-parameters of a Mamba-1 GGUF file (llama.cpp's names in the comments)."""

    layers: int          # block_count
    hidden: int          # embedding_length
    inner: int           # ssm.inner_size
    state: int           # ssm.state_size
    rank: int            # ssm.time_step_rank
    conv: int            # ssm.conv_kernel
    eps: float           # attention.layer_norm_rms_epsilon
    vocab: int           # token_embd's rows
    context_length: int  # context_length (the converter writes 2^20)

    @classmethod
    def from_gguf(cls, src: Any) -> MambaConfig:
        """The hyper-parameters of a source (`GGUFFile` or any with its interface); a FuelError naming the
        key for a missing (`GGUFKeyError`) or malformed (`ModelError`) one, or an unsupported variant."""
        arch = src.architecture
        if arch == "mamba2":
            raise ModelError(f"model: {src.path}: architecture 'mamba2' (Mamba-2) is not supported; "
                             "fuel.models.mamba_lm runs Mamba-1 files (architecture 'mamba')")
        if arch != ARCH:
            raise ModelError(f"model: {src.path}: architecture {arch!r} is not a Mamba-1 file ('mamba')")
        norms = src.hparam("ssm.dt_b_c_rms", False)
        if norms:
            raise ModelError(f"model: {src.path}: metadata mamba.ssm.dt_b_c_rms = {norms!r} (Falcon-Mamba's RMS "
                             "norms on dt, B and C) is not supported")

        def number(key: str, kind: type, default: Any = ...) -> Any:
            value = src.hparam(key, default)
            if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating) or (
                    kind is int and value != int(value)) or not math.isfinite(value) or value <= 0:
                raise ModelError(f"model: {src.path}: metadata {arch}.{key} must be a positive "
                                 f"{'integer' if kind is int else 'number'}, got {value!r}")
            return kind(value)

        return cls(layers=number("block_count", int), hidden=number("embedding_length", int),
                   inner=number("ssm.inner_size", int), state=number("ssm.state_size", int),
                   rank=number("ssm.time_step_rank", int), conv=number("ssm.conv_kernel", int),
                   eps=number("attention.layer_norm_rms_epsilon", float), vocab=int(src["token_embd.weight"].shape[0]),
                   context_length=number("context_length", int, 2 ** 20))

    def tensor_shapes(self, tied: bool) -> dict[str, tuple[int, ...]]:
        """Every tensor of the file by name, with its shape in NumPy order."""
        h, i, n, r, k = self.hidden, self.inner, self.state, self.rank, self.conv
        shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (self.vocab, h), "output_norm.weight": (h,)}
        if not tied:
            shapes["output.weight"] = (self.vocab, h)
        for b in range(self.layers):
            p = f"blk.{b}."
            shapes |= {p + "attn_norm.weight": (h,), p + "ssm_in.weight": (2 * i, h), p + "ssm_conv1d.weight": (i, k),
                       p + "ssm_conv1d.bias": (i,), p + "ssm_x.weight": (r + 2 * n, i), p + "ssm_dt.weight": (i, r),
                       p + "ssm_dt.bias": (i,), p + "ssm_a": (i, n), p + "ssm_d": (i,), p + "ssm_out.weight": (h, i)}
        return shapes


@dataclass
class MambaLayer:
    """One block's weights: the projections as `_Linear`, the rest float32 (conv weight `[I, 1, K]`)."""

    norm: np.ndarray
    in_proj: _Linear
    conv_w: np.ndarray
    conv_b: np.ndarray
    x_proj: _Linear
    dt_proj: _Linear
    dt_bias: np.ndarray
    a: np.ndarray
    d: np.ndarray
    out_proj: _Linear


class MambaSequence:
    """One sequence on a `MambaModel`: its per-layer conv and SSM states, its tokens and its captured decode
    step (module doc). Steps hold the model's lock; `in_use` is held by the generation running on it."""

    def __init__(self, model: MambaModel) -> None:
        cfg = model.cfg
        self.model = model
        self.capacity = model.capacity
        self.conv_states = [np.zeros((1, cfg.inner, cfg.conv - 1), np.float32) for _ in range(cfg.layers)]
        self.ssm_states = [np.zeros((1, cfg.inner, cfg.state), np.float32) for _ in range(cfg.layers)]
        self.decode_step = fl.jit(lambda x: model.forward(x, self.conv_states, self.ssm_states, fresh=False)[0])
        self.tokens: list[int] = []
        self.in_use = threading.Lock()

    @property
    def pos(self) -> int:
        """The number of tokens the states have run."""
        return len(self.tokens)

    def common_prefix(self, ids: Sequence[int]) -> int:
        """len(tokens) when they are a proper prefix of `ids` (the state continues with the rest, at least one
        token, whose logits the caller needs), else 0: a state keeps all its tokens or none."""
        n = len(self.tokens)
        return n if n < len(ids) and list(ids[:n]) == self.tokens else 0

    def rewind(self, pos: int) -> None:
        """Keep all tokens (`pos` = `self.pos`) or none (`pos` = 0); a state cannot go back to a token between."""
        if isinstance(pos, bool) or not isinstance(pos, int) or pos not in (0, self.pos):
            raise ParamError(f"rewind: a Mamba sequence keeps all its tokens or none: pos must be 0 or {self.pos}, "
                             f"got {pos!r}")
        if pos == 0:
            self.reset()

    def reset(self) -> None:
        """Forget every token: the states are zero again."""
        self.tokens.clear()
        for s in (*self.conv_states, *self.ssm_states):
            s.fill(0.0)

    def _check_room(self, rows: int) -> None:
        if self.pos + rows > self.capacity:
            raise ModelError(f"model: {self.pos + rows} tokens do not fit the sequence's capacity of {self.capacity}; "
                             "load the model with a larger capacity")

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Run `ids` from the current state; the logits `[vocab]` after the last. Every id is checked first."""
        todo = self.model.check_ids(ids, "prefill")
        if not todo:
            raise ParamError("prefill: the prompt has no tokens")
        with self.model.lock:
            self._check_room(len(todo))
            x = fl.tensor(self.model.embed(todo))
            logits, writes = self.model.forward(x, self.conv_states, self.ssm_states, fresh=self.pos == 0)
            out = fl.realize(logits, *writes)[0]
            self.tokens.extend(todo)
            return np.asarray(out.numpy()).reshape(-1)

    def decode(self, token: int) -> np.ndarray:
        """Run one token: one replay of the captured step; its logits `[vocab]`."""
        (t,) = self.model.check_ids([token], "decode")
        with self.model.lock:
            self._check_room(1)
            out = self.decode_step(self.model.embed([t]))
            self.tokens.append(t)
            return np.asarray(out.numpy()).reshape(-1)


class MambaModel(SequencePool[MambaSequence]):
    """A loaded Mamba-1 model: its weights, the graph of a step, and the pool of sequences that run it."""

    def __init__(self, f: GGUFFile, capacity: int, progress: Callable[[str, int, int], None] | None = None, *,
                 max_sequences: int = 4) -> None:
        self.file = f
        self.cfg = cfg = MambaConfig.from_gguf(f)
        self.set_limits(capacity, max_sequences, cfg.context_length)
        shapes = cfg.tensor_shapes(tied="output.weight" not in f)
        extra = sorted(set(f.names()) - set(shapes))
        if extra:
            raise ModelError(f"model: {f.path}: tensor {extra[0]!r} is not part of a Mamba-1 model "
                             f"({len(extra)} unexpected: {', '.join(extra[:4])})")
        for name, shape in shapes.items():
            if tuple(f[name].shape) != shape:
                raise ModelError(f"model: {f.path}: tensor {name!r} has shape {list(f[name].shape)}, "
                                 f"expected {list(shape)}")
        report = progress or (lambda what, i, n: None)
        self.layers: list[MambaLayer] = []
        for i in range(cfg.layers):
            report("weights", i, cfg.layers)
            self.layers.append(self._layer(i))
        report("weights", cfg.layers, cfg.layers)
        self.out_norm = self._floats("output_norm.weight")
        self.head = _Linear.of(f["output.weight" if "output.weight" in f else "token_embd.weight"])
        self.embedding = TokenEmbedding(f["token_embd.weight"])
        self.start_pool()

    @classmethod
    def load(cls, path: str | os.PathLike[str], capacity: int = 2048,
             progress: Callable[[str, int, int], None] | None = None, *, max_sequences: int = 4) -> MambaModel:
        return cls(open_gguf(path), capacity, progress, max_sequences=max_sequences)

    def _floats(self, name: str) -> np.ndarray:
        """A norm, conv, bias, A or D tensor as float32 (llama.cpp keeps them float; a quantized one is
        dequantised where the source can)."""
        t = self.file[name]
        if not t.is_quantized:
            return np.asarray(t.array(), np.float32)
        if not hasattr(t, "dequantize"):
            raise ModelError(f"model: {self.file.path}: tensor {name!r} is {t.type_name}; it must be a float tensor")
        return np.asarray(t.dequantize(), np.float32)

    def _layer(self, i: int) -> MambaLayer:
        p, cfg = f"blk.{i}.", self.cfg
        lin = {n: _Linear.of(self.file[p + n + ".weight"]) for n in ("ssm_in", "ssm_x", "ssm_dt", "ssm_out")}
        return MambaLayer(norm=self._floats(p + "attn_norm.weight"), in_proj=lin["ssm_in"],
                          conv_w=self._floats(p + "ssm_conv1d.weight").reshape(cfg.inner, 1, cfg.conv),
                          conv_b=self._floats(p + "ssm_conv1d.bias"), x_proj=lin["ssm_x"], dt_proj=lin["ssm_dt"],
                          dt_bias=self._floats(p + "ssm_dt.bias"), a=self._floats(p + "ssm_a"),
                          d=self._floats(p + "ssm_d"), out_proj=lin["ssm_out"])

    # -- the graph -------------------------------------------------------------------------------

    def _norm(self, x: Tensor, w: np.ndarray) -> Tensor:
        return fl.ops.rms_norm_last_dim(x, self.cfg.eps) * fl.tensor(w)

    def _mixer(self, lw: MambaLayer, h: Tensor, conv_state: np.ndarray, ssm_state: np.ndarray, fresh: bool,
               writes: list[Tensor]) -> Tensor:
        """The mixer's output `[L, hidden]` of the normed rows h `[L, hidden]`, continuing from the states
        (from zero when `fresh`: the arrays are then not read); the in-place writes of their new values are
        appended to `writes`."""
        cfg = self.cfg
        seq, i, n, r, k = h.shape[0], cfg.inner, cfg.state, cfg.rank, cfg.conv
        xz = lw.in_proj(h)
        gate = xz[:, i:]
        xt = xz[:, :i].permute(1, 0).reshape(1, i, seq)
        cs, ss = fl.tensor(conv_state), fl.tensor(ssm_state)
        window = fl.pad(xt, ((0, 0), (0, 0), (k - 1, 0))) if fresh else fl.concat([cs, xt], axis=2)
        writes.append(fl.assign(cs, window[:, :, seq:]))
        u = fl.ops.causal_conv1d(window, fl.tensor(lw.conv_w), fl.tensor(lw.conv_b), True).reshape(i, seq)
        u = u.permute(1, 0)
        dbc = lw.x_proj(u)
        delta = lw.dt_proj(dbc[:, :r]) + fl.tensor(lw.dt_bias)
        b, c = dbc[:, r:r + n], dbc[:, r + n:]
        a = fl.tensor(lw.a)
        if seq == 1 and not fresh:  # a decode step: the recurrence itself, h = exp(d·A)·h0 + d·u·B, y = h·C
            d = softplus(delta)
            last = (d.reshape(1, i, 1) * a.reshape(1, i, n)).exp() * ss + (d * u).reshape(1, i, 1) * b.reshape(1, 1, n)
            y = (last * c.reshape(1, 1, n)).sum(2)
        else:
            y, last = fl.ops.selective_scan(u.reshape(1, seq, i), delta.reshape(1, seq, i), a, b.reshape(1, seq, n),
                                            c.reshape(1, seq, n), delta_softplus=True)
            y = y.reshape(seq, i)
        if seq > 1 and not fresh:  # the carried state's part: h_t += exp(A·Σ_{s<=t} d_s)·h0, y_t += C_t·that
            d = softplus(delta)
            cum = fl.tensor(np.tril(np.ones((seq, seq), np.float32))) @ d
            carried = (cum.reshape(seq, i, 1) * a.reshape(1, i, n)).exp() * ss
            y = y + (carried * c.reshape(seq, 1, n)).sum(2)
            last = last + carried[seq - 1:]
        writes.append(fl.assign(ss, last))
        y = (y + u * fl.tensor(lw.d)) * gate.silu()
        return lw.out_proj(y)

    def forward(self, x: Tensor, conv_states: list[np.ndarray], ssm_states: list[np.ndarray],
                fresh: bool) -> tuple[Tensor, list[Tensor]]:
        """The last row's logits `[1, vocab]` of the embedding rows x `[L, hidden]`, run from the given
        states (zero when `fresh`), and the writes of the new states into them (`fl.jit` runs them as its
        effects; an eager caller realises them with the logits)."""
        writes: list[Tensor] = []
        for lw, cs, ss in zip(self.layers, conv_states, ssm_states, strict=True):
            x = x + self._mixer(lw, self._norm(x, lw.norm), cs, ss, fresh, writes)
        last = x[x.shape[0] - 1:]
        return self.head(self._norm(last, self.out_norm)), writes

    # -- sequences -------------------------------------------------------------------------------

    def sequence(self) -> MambaSequence:
        """A new sequence of this model, outside the pool (its caller owns it)."""
        return MambaSequence(self)

    # -- running ---------------------------------------------------------------------------------

    def embed(self, ids: Sequence[int]) -> np.ndarray:
        """The embedding rows of `ids`, float32 `[len(ids), hidden]`."""
        return self.embedding.rows(ids)

    def check_ids(self, ids: Sequence[int], what: str) -> list[int]:
        """`ids` as a list of ints, each a token of the vocabulary; else a ModelError naming `what`."""
        return check_ids(ids, self.cfg.vocab, what)


__all__ = ["MambaConfig", "MambaLayer", "MambaModel", "MambaSequence"]
