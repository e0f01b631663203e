"""Layers as plain classes: each owns its parameters (`fl.Tensor` leaves over NumPy arrays) and is callable.

Initialisation follows torch.nn's defaults (Linear: U(-1/√in, 1/√in) for weight and bias; Embedding: N(0, 1);
norms: weight 1, bias 0), drawn from NumPy's generator with `seed`, so the values are not torch's own: load a
state dict to start from given weights. Built from `fuel.ops` and Tensor methods only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fuel import ops
from fuel.dtype import DType, as_dtype, f32, i64
from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.tensor import Tensor, as_tensor, tensor

__all__ = ["Embedding", "LayerNorm", "Linear", "RMSNorm", "parameter"]


def parameter(values: np.ndarray, dtype: DType) -> Tensor:
    """A parameter: a leaf over a fresh, writable, C-contiguous array of `dtype` (values converted)."""
    arr = np.ascontiguousarray(np.asarray(values).astype(dtype.np, copy=True))
    return tensor(arr)


def _count(op: str, what: str, n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise ParamError(f"{op}: {what} must be a positive int, got {n!r}")
    return int(n)


def _eps(op: str, eps: Any) -> float:
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not (eps >= 0 and math.isfinite(eps)):
        raise ParamError(f"{op}: eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def _float_dtype(op: str, dtype: DType | str) -> DType:
    dt = as_dtype(dtype, op)
    if not dt.is_float:
        raise DTypeError(f"{op}: parameters need a float dtype, got {dt.value}")
    return dt


def _last_dim(op: str, x: Tensor, want: int, what: str) -> None:
    if x.ndim < 1 or x.shape[-1] != want:
        raise ShapeError(f"{op}: input's last dim must be {what} = {want}, got shape {list(x.shape)}")


class Linear:
    """`y = x @ weight.T + bias`, weight `[out_features, in_features]`, bias `[out_features]` (torch.nn.Linear)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: DType | str = f32,
                 seed: int | None = None) -> None:
        self.in_features = _count("Linear", "in_features", in_features)
        self.out_features = _count("Linear", "out_features", out_features)
        dt = _float_dtype("Linear", dtype)
        rng = np.random.default_rng(seed)
        bound = 1.0 / math.sqrt(self.in_features)
        self.weight = parameter(rng.uniform(-bound, bound, (self.out_features, self.in_features)), dt)
        self.bias = parameter(rng.uniform(-bound, bound, self.out_features), dt) if bias else None

    def __call__(self, x: Any) -> Tensor:
        t = as_tensor(x)
        _last_dim("Linear", t, self.in_features, "in_features")
        lead = t.shape[:-1]
        # one GEMM over all leading rows: the weight's gradient is one [out, rows] @ [rows, in] product
        y = t.reshape(-1, self.in_features) @ self.weight.transpose(0, 1)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


class Embedding:
    """`weight[ids]`, weight `[num_embeddings, embedding_dim]` (torch.nn.Embedding); ids are i64 of any shape."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: DType | str = f32,
                 seed: int | None = None) -> None:
        self.num_embeddings = _count("Embedding", "num_embeddings", num_embeddings)
        self.embedding_dim = _count("Embedding", "embedding_dim", embedding_dim)
        rng = np.random.default_rng(seed)
        self.weight = parameter(rng.standard_normal((self.num_embeddings, self.embedding_dim)),
                                _float_dtype("Embedding", dtype))

    def __call__(self, ids: Any) -> Tensor:
        t = as_tensor(ids)
        if t.dtype is not i64:
            raise DTypeError(f"Embedding: ids must be i64, got {t.dtype.value}")
        rows = self.weight.index_select(0, t.reshape(-1))
        return rows.reshape(*t.shape, self.embedding_dim)


class RMSNorm:
    """`x / sqrt(mean(x², last) + eps) * weight` over the last dim (torch.nn.RMSNorm, transformers' LlamaRMSNorm:
    the norm is computed in f32 at least and given back in x's dtype before the weight multiplies it)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: DType | str = f32) -> None:
        self.dim = _count("RMSNorm", "dim", dim)
        self.eps = _eps("RMSNorm", eps)
        self.weight = parameter(np.ones(self.dim), _float_dtype("RMSNorm", dtype))

    def __call__(self, x: Any) -> Tensor:
        t = as_tensor(x)
        _last_dim("RMSNorm", t, self.dim, "dim")
        return ops.rms_norm_last_dim(t, self.eps) * self.weight


class LayerNorm:
    """`(x - mean) / sqrt(var + eps) * weight + bias` over the last dim, population variance (torch.nn.LayerNorm
    with one normalised dim)."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, dtype: DType | str = f32) -> None:
        self.dim = _count("LayerNorm", "dim", dim)
        self.eps = _eps("LayerNorm", eps)
        dt = _float_dtype("LayerNorm", dtype)
        self.weight = parameter(np.ones(self.dim), dt)
        self.bias = parameter(np.zeros(self.dim), dt) if bias else None

    def __call__(self, x: Any) -> Tensor:
        t = as_tensor(x)
        _last_dim("LayerNorm", t, self.dim, "dim")
        y = ops.layer_norm_last_dim(t, self.eps) * self.weight
        return y + self.bias if self.bias is not None else y
