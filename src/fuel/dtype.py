"""Element types: the closed set Fuel stores, their NumPy storage and accumulation types."""

from __future__ import annotations

import enum
from typing import Any

import ml_dtypes
import numpy as np

from fuel.errors import DTypeError


class DType(enum.Enum):
    F32 = "f32"
    F64 = "f64"
    BF16 = "bf16"
    F16 = "f16"
    U8 = "u8"
    U32 = "u32"
    I64 = "i64"

    @property
    def np(self) -> np.dtype[Any]:
        """The NumPy dtype arrays of this type are stored with."""
        return _TO_NUMPY[self]

    @property
    def itemsize(self) -> int:
        return int(_TO_NUMPY[self].itemsize)

    @property
    def is_float(self) -> bool:
        return self in (DType.F32, DType.F64, DType.BF16, DType.F16)

    @property
    def is_half(self) -> bool:
        return self in (DType.BF16, DType.F16)

    @property
    def acc(self) -> DType:
        """Accumulation type: F64 for F64, F32 for every other float (half types widen)."""
        if self is DType.F64:
            return DType.F64
        if self.is_float:
            return DType.F32
        return self

    def __repr__(self) -> str:
        return f"fuel.{self.value}"

    __str__ = __repr__


f32, f64, bf16, f16 = DType.F32, DType.F64, DType.BF16, DType.F16
u8, u32, i64 = DType.U8, DType.U32, DType.I64
FLOAT_DTYPES: tuple[DType, ...] = (f32, f64, bf16, f16)

_TO_NUMPY: dict[DType, np.dtype[Any]] = {
    f32: np.dtype(np.float32),
    f64: np.dtype(np.float64),
    bf16: np.dtype(ml_dtypes.bfloat16),
    f16: np.dtype(np.float16),
    u8: np.dtype(np.uint8),
    u32: np.dtype(np.uint32),
    i64: np.dtype(np.int64),
}
_FROM_NUMPY: dict[np.dtype[Any], DType] = {v: k for k, v in _TO_NUMPY.items()}


def from_numpy(dtype: Any) -> DType:
    """The Fuel type of a NumPy dtype; raises DTypeError for types Fuel does not store."""
    dt = np.dtype(dtype)
    try:
        return _FROM_NUMPY[dt]
    except KeyError:
        known = ", ".join(str(np.dtype(v)) for v in _TO_NUMPY.values())
        raise DTypeError(f"tensor: numpy dtype {dt} is not one Fuel stores ({known})") from None


def as_dtype(dtype: DType | str | Any) -> DType:
    """Accept a DType, its short name ('bf16') or a NumPy dtype."""
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, str):
        for d in DType:
            if d.value == dtype.lower() or d.name == dtype.upper():
                return d
    return from_numpy(dtype)


def round_to(x: np.ndarray, dtype: DType) -> np.ndarray:
    """Round an array once to `dtype` (round-to-nearest-even for BF16/F16)."""
    return np.asarray(x).astype(dtype.np)
