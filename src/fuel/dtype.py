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
    U64 = "u64"
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
    def is_int(self) -> bool:
        return not self.is_float

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

    @property
    def sum_dtype(self) -> DType:
        """What a sum of this type gives: floats keep their type (half types accumulate in f32 inside the
        kernel and round once), integers widen to 64 bits as NumPy's do: unsigned to u64, signed to i64."""
        if self.is_float or self is DType.I64:
            return self
        return DType.U64

    @property
    def mean_dtype(self) -> DType:
        """What a mean of this type gives: floats keep their type, integers give DEFAULT_FLOAT."""
        return self if self.is_float else DEFAULT_FLOAT

    def __repr__(self) -> str:
        return f"fuel.{self.value}"

    __str__ = __repr__


f32, f64, bf16, f16 = DType.F32, DType.F64, DType.BF16, DType.F16
u8, u32, u64, i64 = DType.U8, DType.U32, DType.U64, DType.I64
FLOAT_DTYPES: tuple[DType, ...] = (f32, f64, bf16, f16)
# The float a value gets when nothing else fixes it: fl.full/zeros/ones, an integer tensor with a Python
# float, true division of integers, the mean of an integer tensor. f32, not NumPy's f64, because the
# kernels are written for f32 first.
DEFAULT_FLOAT: DType = f32

_TO_NUMPY: dict[DType, np.dtype[Any]] = {
    f32: np.dtype(np.float32),
    f64: np.dtype(np.float64),
    bf16: np.dtype(ml_dtypes.bfloat16),
    f16: np.dtype(np.float16),
    u8: np.dtype(np.uint8),
    u32: np.dtype(np.uint32),
    u64: np.dtype(np.uint64),
    i64: np.dtype(np.int64),
}
_FROM_NUMPY: dict[np.dtype[Any], DType] = {v: k for k, v in _TO_NUMPY.items()}


def from_numpy(dtype: Any, op: str = "tensor") -> DType:
    """The Fuel type of a NumPy dtype; raises DTypeError for types Fuel does not store."""
    dt = np.dtype(dtype)
    try:
        return _FROM_NUMPY[dt]
    except KeyError:
        known = ", ".join(str(np.dtype(v)) for v in _TO_NUMPY.values())
        raise DTypeError(f"{op}: numpy dtype {dt} is not one Fuel stores ({known})") from None


def as_dtype(dtype: DType | str | Any, op: str = "dtype") -> DType:
    """Accept a DType, its short name ('bf16') or a NumPy dtype; anything else is a DTypeError for `op`."""
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, str):
        for d in DType:
            if d.value == dtype.lower():
                return d
    try:
        if dtype is None:  # np.dtype(None) is float64, which would hide a missing argument
            raise TypeError
        return _FROM_NUMPY[np.dtype(dtype)]
    except (TypeError, ValueError, KeyError):
        names = ", ".join(d.value for d in DType)
        raise DTypeError(f"{op}: {dtype!r} is not a dtype Fuel stores; valid names: {names}") from None


def round_to(x: np.ndarray, dtype: DType) -> np.ndarray:
    """Round an array once to `dtype` (round-to-nearest-even for BF16/F16)."""
    return np.asarray(x).astype(dtype.np)
