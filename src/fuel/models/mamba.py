"""Mamba-1 and Mamba-2 mixer blocks built from Fuel's lazy graph ops, with Hugging Face's weight names.

    mixer = Mamba1Mixer(Mamba1Config.from_hf(hf_config), state)   # state: {"in_proj.weight": array, ...}
    out = mixer(x)                                               # x `[B, L, hidden]` -> `[B, L, hidden]`
    grads = fl.grad(loss, list(mixer.weights.values()))          # every weight is a leaf

The math is transformers' `MambaMixer` / `Mamba2Mixer` without a cache or attention mask (a whole
sequence from a zero state), which the tests check to float32 rounding in outputs and gradients.

**Mamba-1** (`MambaMixer`): in_proj splits into the hidden half and the gate half; a depthwise causal
conv (`fl.ops.causal_conv1d`, left-padded by K − 1, SiLU fused) over the hidden half gives u; x_proj
gives (dt_low, B, C); delta = dt_proj(dt_low) (its bias included); `fl.ops.selective_scan` with
A = −exp(A_log) and the softplus of delta inside the scan; then (y + D·u)·silu(gate) and out_proj.

**Mamba-2** (`Mamba2Mixer`): in_proj splits into gate `[I]`, xBC `[I + 2·G·N]` and dt `[H]`; the
causal conv + SiLU runs over xBC, which splits into x (heads `[H, P]`), B and C (`[G, N]` each, group
g serving heads g·H/G … (g + 1)·H/G − 1, transformers' `repeat_interleave`); dt = softplus(dt + dt_bias)
clamped to `time_step_limit`; `fl.ops.ssd_chunk_scan` with A = −exp(A_log) `[H]`; the D skip per head;
the gated RMS norm `MambaRMSNormGated`: (y·silu(gate)) normalised over each of G groups of I/G
channels (gate first, then norm), times norm.weight; then out_proj.

The SSD result does not depend on the chunk size but through rounding, so a sequence no longer than
`chunk_size` runs as one chunk of L, and a longer one that `chunk_size` does not divide is padded at
its end with zeros (causal: earlier outputs never see the padding) and cut back to L; a padded step
has dt = 0 (decay 1, no input), so the final state is the last real token's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

import fuel as fl
from fuel.errors import FuelError
from fuel.graph.tensor import Tensor

Shape = tuple[int, ...]


class MambaError(FuelError, ValueError):
    """A missing or misshaped mixer weight, an inconsistent config, or an input of the wrong shape."""


def _field(cfg: Mapping[str, Any] | Any, name: str, default: Any) -> Any:
    """`cfg[name]` for a mapping, `cfg.name` for a config object (transformers' own), else default."""
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


@dataclass(frozen=True)
class Mamba1Config:
    """The fields `MambaMixer` reads; names as in transformers' `MambaConfig`."""

    hidden_size: int
    state_size: int = 16
    conv_kernel: int = 4
    expand: int = 2
    time_step_rank: int | None = None  # None: ceil(hidden / 16), transformers' "auto"
    use_bias: bool = False
    use_conv_bias: bool = True

    @property
    def intermediate_size(self) -> int:
        return int(self.expand * self.hidden_size)

    @property
    def dt_rank(self) -> int:
        return math.ceil(self.hidden_size / 16) if self.time_step_rank is None else int(self.time_step_rank)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any] | Any) -> Mamba1Config:
        """From a transformers `MambaConfig` (or its `to_dict()`)."""
        rank = _field(cfg, "time_step_rank", None)
        return cls(hidden_size=int(_field(cfg, "hidden_size", 0)), state_size=int(_field(cfg, "state_size", 16)),
                   conv_kernel=int(_field(cfg, "conv_kernel", 4)), expand=int(_field(cfg, "expand", 2)),
                   time_step_rank=None if rank in (None, "auto") else int(rank),
                   use_bias=bool(_field(cfg, "use_bias", False)),
                   use_conv_bias=bool(_field(cfg, "use_conv_bias", True)))

    def weight_shapes(self) -> dict[str, Shape]:
        """Every weight the mixer needs, by its transformers name, with its shape."""
        h, i, n, r, k = self.hidden_size, self.intermediate_size, self.state_size, self.dt_rank, self.conv_kernel
        shapes: dict[str, Shape] = {
            "in_proj.weight": (2 * i, h), "conv1d.weight": (i, 1, k), "x_proj.weight": (r + 2 * n, i),
            "dt_proj.weight": (i, r), "dt_proj.bias": (i,), "A_log": (i, n), "D": (i,), "out_proj.weight": (h, i),
        }
        if self.use_bias:
            shapes |= {"in_proj.bias": (2 * i,), "out_proj.bias": (h,)}
        if self.use_conv_bias:
            shapes["conv1d.bias"] = (i,)
        return shapes


@dataclass(frozen=True)
class Mamba2Config:
    """The fields `Mamba2Mixer` reads; names as in transformers' `Mamba2Config`."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int = 128
    expand: int = 2
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 256
    use_bias: bool = False
    use_conv_bias: bool = True
    layer_norm_epsilon: float = 1e-5
    time_step_limit: tuple[float, float] = (0.0, math.inf)

    def __post_init__(self) -> None:
        i = self.intermediate_size
        if i != self.num_heads * self.head_dim:
            raise MambaError(f"mamba2: hidden_size * expand = {i} must equal num_heads * head_dim = "
                             f"{self.num_heads} * {self.head_dim}")
        if self.n_groups < 1 or self.num_heads % self.n_groups or i % self.n_groups:
            raise MambaError(f"mamba2: n_groups = {self.n_groups} must divide num_heads = {self.num_heads} "
                             f"and the intermediate size {i}")
        if self.chunk_size < 1:
            raise MambaError(f"mamba2: chunk_size must be >= 1, got {self.chunk_size}")

    @property
    def intermediate_size(self) -> int:
        return int(self.expand * self.hidden_size)

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x, B and C."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any] | Any) -> Mamba2Config:
        """From a transformers `Mamba2Config` (or its `to_dict()`)."""
        lo, hi = _field(cfg, "time_step_limit", (0.0, math.inf))
        return cls(hidden_size=int(_field(cfg, "hidden_size", 0)), num_heads=int(_field(cfg, "num_heads", 0)),
                   head_dim=int(_field(cfg, "head_dim", 0)), state_size=int(_field(cfg, "state_size", 128)),
                   expand=int(_field(cfg, "expand", 2)), n_groups=int(_field(cfg, "n_groups", 1)),
                   conv_kernel=int(_field(cfg, "conv_kernel", 4)), chunk_size=int(_field(cfg, "chunk_size", 256)),
                   use_bias=bool(_field(cfg, "use_bias", False)),
                   use_conv_bias=bool(_field(cfg, "use_conv_bias", True)),
                   layer_norm_epsilon=float(_field(cfg, "layer_norm_epsilon", 1e-5)),
                   time_step_limit=(float(lo), float(hi)))

    def weight_shapes(self) -> dict[str, Shape]:
        """Every weight the mixer needs, by its transformers name, with its shape."""
        h, i, nh, k = self.hidden_size, self.intermediate_size, self.num_heads, self.conv_kernel
        proj = i + self.conv_dim + nh  # gate, xBC, dt
        shapes: dict[str, Shape] = {
            "in_proj.weight": (proj, h), "conv1d.weight": (self.conv_dim, 1, k), "dt_bias": (nh,), "A_log": (nh,),
            "D": (nh,), "norm.weight": (i,), "out_proj.weight": (h, i),
        }
        if self.use_bias:
            shapes |= {"in_proj.bias": (proj,), "out_proj.bias": (h,)}
        if self.use_conv_bias:
            shapes["conv1d.bias"] = (self.conv_dim,)
        return shapes


def _load(state: Mapping[str, Any], shapes: dict[str, Shape], prefix: str, dtype: Any) -> dict[str, Tensor]:
    """One leaf per weight, converted once to `dtype`; MambaError names a missing or misshaped one."""
    out: dict[str, Tensor] = {}
    for name, shape in shapes.items():
        key = prefix + name
        if key not in state:
            raise MambaError(f"mamba: weight {key!r} is missing (expected shape {list(shape)})")
        arr = np.asarray(state[key])
        if arr.shape != shape:
            raise MambaError(f"mamba: weight {key!r} has shape {list(arr.shape)}, expected {list(shape)}")
        if not (np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16"):
            raise MambaError(f"mamba: weight {key!r} must be a float array, got {arr.dtype}")
        out[name] = fl.tensor(np.ascontiguousarray(arr, dtype=dtype))
    return out


def softplus(x: Tensor) -> Tensor:
    """log(1 + exp(x)) as max(x, 0) + log1p(e), e = exp(−|x|) in (0, 1], with log1p(e) = 2·atanh(z),
    z = e/(2 + e) in (0, 1/3], summed as the odd series z + z³/3 + … + z¹⁵/15 (truncation below 2e-9
    relative). Every term is positive, so the result and its autograd gradient (σ(x)) keep f32 accuracy
    where log(1 + e) would round 1 + e. Above 20 it equals x in f32, as PyTorch's threshold gives."""
    e = (-x.abs()).exp()
    z = e / (e + 2.0)
    w = z * z
    series = w * (1.0 / 15.0)
    for k in (13, 11, 9, 7, 5, 3):
        series = (series + 1.0 / k) * w
    return x.maximum(0.0) + z * (series + 1.0) * 2.0


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """`x @ wᵀ (+ b)` on rows `[n, in]`, written as BERT's dense layers so the pattern pass can fuse it."""
    y = x @ w.T
    return y if b is None else y + b


def _conv(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """transformers' `causal_conv1d_fn` with SiLU: x `[B, L, C]` -> `[B, L, C]` (conv padding K − 1 cut to
    L, which is left padding only). Without a conv bias the op gets zeros."""
    ch = x.shape[2]
    k = w.shape[2]
    xt = fl.pad(x.permute(0, 2, 1), ((0, 0), (0, 0), (k - 1, 0)))
    out = fl.ops.causal_conv1d(xt, w, fl.zeros((ch,), x.dtype) if bias is None else bias, True)
    return out.permute(0, 2, 1)


ConfigT = TypeVar("ConfigT", bound=Mamba1Config | Mamba2Config)


class _Mixer(Generic[ConfigT]):
    """Shared loading and input checks; `weights` maps transformers' names to the leaves."""

    def __init__(self, config: ConfigT, state: Mapping[str, Any], prefix: str = "", dtype: Any = np.float32) -> None:
        """`state`: arrays by transformers' parameter names (`prefix` + name, e.g. "backbone.layers.0.mixer.")."""
        self.config: ConfigT = config
        self.weights = _load(state, config.weight_shapes(), prefix, dtype)

    def _check(self, x: Tensor) -> tuple[int, int]:
        h = self.config.hidden_size
        if x.ndim != 3 or x.shape[2] != h or x.shape[1] < 1:
            raise MambaError(f"{type(self).__name__}: hidden states must be [B, L >= 1, {h}], got {list(x.shape)}")
        return x.shape[0], x.shape[1]


class Mamba1Mixer(_Mixer[Mamba1Config]):
    """transformers' `MambaMixer` (full-sequence form): `mixer(x [B, L, hidden]) -> [B, L, hidden]`."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(output `[B, L, hidden]`, the SSM state after the last token `[B, I, N]`)."""
        nb, seq = self._check(x)
        c, w = self.config, self.weights
        i, n, r = c.intermediate_size, c.state_size, c.dt_rank
        xz = _linear(x.reshape(nb * seq, c.hidden_size), w["in_proj.weight"], w.get("in_proj.bias"))
        gate = xz[:, i:]
        u = _conv(xz[:, :i].reshape(nb, seq, i), w["conv1d.weight"], w.get("conv1d.bias"))
        dbc = u.reshape(nb * seq, i) @ w["x_proj.weight"].T
        b = dbc[:, r:r + n].reshape(nb, seq, n)
        cm = dbc[:, r + n:].reshape(nb, seq, n)
        # transformers adds dt_proj's bias inside the scan, before its softplus: the same sum here
        delta = _linear(dbc[:, :r], w["dt_proj.weight"], w["dt_proj.bias"]).reshape(nb, seq, i)
        a = -w["A_log"].exp()
        y, last = fl.ops.selective_scan(u, delta, a, b, cm, delta_softplus=True)
        y = (y + u * w["D"]).reshape(nb * seq, i) * gate.silu()
        out = _linear(y, w["out_proj.weight"], w.get("out_proj.bias"))
        return out.reshape(nb, seq, c.hidden_size), last

    def __call__(self, x: Tensor) -> Tensor:
        return self.forward(x)[0]


class Mamba2Mixer(_Mixer[Mamba2Config]):
    """transformers' `Mamba2Mixer` (`torch_forward`'s chunked form): `mixer(x [B, L, hidden]) -> [B, L, hidden]`."""

    def _dt(self, dt: Tensor) -> Tensor:
        """softplus(dt + dt_bias), clamped to time_step_limit (a bound that cannot bind is skipped)."""
        lo, hi = self.config.time_step_limit
        dt = softplus(dt + self.weights["dt_bias"])
        if lo > 0.0:
            dt = dt.maximum(lo)
        if math.isfinite(hi):
            dt = dt.minimum(hi)
        return dt

    def _gated_norm(self, y: Tensor, gate: Tensor) -> Tensor:
        """`MambaRMSNormGated`: y·silu(gate), RMS-normalised per group of I/G channels, times the weight."""
        rows, i = y.shape
        g = self.config.n_groups
        h = (y * gate.silu()).reshape(rows, g, i // g)
        normed = fl.ops.rms_norm_last_dim(h, self.config.layer_norm_epsilon).reshape(rows, i)
        return normed * self.weights["norm.weight"]

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(output `[B, L, hidden]`, the SSM state after the last token `[B, H, P, N]`; end padding
        leaves it unchanged: a padded step has dt = 0, so decay 1 and no input)."""
        nb, seq = self._check(x)
        c, w = self.config, self.weights
        i, nh, p, n, g = c.intermediate_size, c.num_heads, c.head_dim, c.state_size, c.n_groups
        proj = _linear(x.reshape(nb * seq, c.hidden_size), w["in_proj.weight"], w.get("in_proj.bias"))
        gate = proj[:, :i]
        xbc = _conv(proj[:, i:i + c.conv_dim].reshape(nb, seq, c.conv_dim), w["conv1d.weight"], w.get("conv1d.bias"))
        dt = self._dt(proj[:, i + c.conv_dim:].reshape(nb, seq, nh))
        xs = xbc[:, :, :i].reshape(nb, seq, nh, p)

        def per_head(t: Tensor) -> Tensor:
            # group j serves heads j·H/G … (j + 1)·H/G − 1 (transformers' repeat_interleave on dim 2)
            t = t.reshape(nb, seq, g, 1, n).broadcast_to(nb, seq, g, nh // g, n)
            return t.reshape(nb, seq, nh, n)

        b = per_head(xbc[:, :, i:i + g * n])
        cm = per_head(xbc[:, :, i + g * n:])
        chunk = seq if seq <= c.chunk_size else c.chunk_size
        pad = -seq % chunk
        ins = [xs, dt, b, cm]
        if pad:
            ins = [fl.pad(t, ((0, 0), (0, pad), *([(0, 0)] * (t.ndim - 2)))) for t in ins]
        y, last = fl.ops.ssd_chunk_scan(ins[0], ins[1], -w["A_log"].exp(), ins[2], ins[3], chunk)
        if pad:
            y = y[:, :seq]
        y = (y + xs * w["D"].reshape(nh, 1)).reshape(nb * seq, i)
        out = _linear(self._gated_norm(y, gate), w["out_proj.weight"], w.get("out_proj.bias"))
        return out.reshape(nb, seq, c.hidden_size), last

    def __call__(self, x: Tensor) -> Tensor:
        return self.forward(x)[0]
