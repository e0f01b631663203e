"""Fuel: a lazy tensor graph with an open registry of fused ops and exact, fast CPU kernels.

`fuel.models` (the LLMs, BERT, Mamba) is an attribute imported on first use: `import fuel` does not
load the models or what they need (tokenizers, jinja2).
"""

from fuel.dispatch import cache_stamps  # noqa: F401  (first: cached kernels are stamped with their imports)

# isort: split
import types as _types
import typing as _typing

from fuel import ops
from fuel.dispatch.executor import realize, trace
from fuel.dispatch.impls import default_kernel_registry as kernels
from fuel.dtype import DEFAULT_FLOAT, DType, bf16, f16, f32, f64, i64, u8, u32, u64
from fuel.errors import (
    AxisIndexError,
    DTypeError,
    FuelError,
    IndexOutOfRange,
    KernelError,
    NoDecomposition,
    NotDifferentiable,
    ParamError,
    RankZeroError,
    RealizeInTrace,
    ShapeError,
    StaleInput,
)
from fuel.graph.autograd import grad
from fuel.graph.functions import assign, cache_write, concat, index_copy, pad, where
from fuel.graph.node import DynScalar, dyn
from fuel.graph.registry import default_registry
from fuel.graph.tensor import Tensor, full, matmul, ones, tensor, zeros
from fuel.quant import QuantType
from fuel.runtime.jit import jit
from fuel.runtime.threads import get_num_threads, serial, set_num_threads

if _typing.TYPE_CHECKING:
    from fuel import models as models

__all__ = [
    "DEFAULT_FLOAT",
    "AxisIndexError",
    "DType",
    "DTypeError",
    "DynScalar",
    "FuelError",
    "IndexOutOfRange",
    "KernelError",
    "NoDecomposition",
    "NotDifferentiable",
    "ParamError",
    "QuantType",
    "RankZeroError",
    "RealizeInTrace",
    "ShapeError",
    "StaleInput",
    "Tensor",
    "assign",
    "bf16",
    "cache_write",
    "concat",
    "default_registry",
    "dyn",
    "f16",
    "f32",
    "f64",
    "full",
    "get_num_threads",
    "grad",
    "i64",
    "index_copy",
    "jit",
    "kernels",
    "matmul",
    "ones",
    "ops",
    "pad",
    "realize",
    "serial",
    "set_num_threads",
    "tensor",
    "trace",
    "u8",
    "u32",
    "u64",
    "where",
    "zeros",
]


def __getattr__(name: str) -> _types.ModuleType:
    """`fuel.models`, imported on first use."""
    if name == "models":
        import fuel.models

        return fuel.models
    raise AttributeError(f"module 'fuel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "models"])
