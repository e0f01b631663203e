"""The GGUF container format, as `fuel.io.gguf` reads it: the errors, ggml's type table, the metadata
value types, and a cursor over the header bytes (metadata and tensor directory, little-endian)."""

from __future__ import annotations

import importlib
import struct
from typing import Any

import ml_dtypes
import numpy as np

from fuel.errors import FuelError
from fuel.quant import QuantType


class GGUFError(FuelError, ValueError):
    """A GGUF file is malformed, or something it does not hold was asked of it."""


class GGUFKeyError(GGUFError, KeyError):
    """A metadata key or a tensor the file does not have (a KeyError too, as a mapping's lookup raises).
    Its message names the key and the file."""

    def __str__(self) -> str:  # KeyError's own would quote the message as a repr
        return str(self.args[0]) if self.args else ""


class GGUFNotFound(GGUFError, FileNotFoundError):
    """The GGUF file does not exist."""


class UnsupportedTensorType(GGUFError):
    """A tensor's ggml type is one this operation cannot read (e.g. an IQ type)."""


class MissingDependency(FuelError, ImportError):
    """An optional package is needed (the `models` extra: `pip install 'fuel[models]'`)."""


GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SUPPORTED_VERSIONS = (2, 3)

# ggml type id -> (name, elements per block, bytes per block), as ggml's type_traits: the block types
# QMatMul reads as `QuantType` has them (Q8_1 is ggml's block_q8_1, 36 bytes; gguf-py's table says 40).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    **{q.ggml_type: (q.ggml_name, q.block_elements, q.block_bytes) for q in QuantType},
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}

# Types stored element by element, with their NumPy dtype.
PLAIN_TYPES: dict[int, np.dtype[Any]] = {
    0: np.dtype("<f4"),
    1: np.dtype("<f2"),
    24: np.dtype("i1"),
    25: np.dtype("<i2"),
    26: np.dtype("<i4"),
    27: np.dtype("<i8"),
    28: np.dtype("<f8"),
    30: np.dtype(ml_dtypes.bfloat16),
}
FLOAT_TYPES = frozenset({0, 1, 28, 30})

# GGUF metadata value types: id -> (name, struct format) for scalars; 8 string, 9 array.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("u8", "<B"),
    1: ("i8", "<b"),
    2: ("u16", "<H"),
    3: ("i16", "<h"),
    4: ("u32", "<I"),
    5: ("i32", "<i"),
    6: ("f32", "<f"),
    7: ("bool", "<?"),
    10: ("u64", "<Q"),
    11: ("i64", "<q"),
    12: ("f64", "<d"),
}
_ARRAY_DTYPES: dict[int, str] = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                                 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


def ggml_type_name(type_id: int) -> str:
    """"Q4_K" for 12; "type 99" for an id this module does not know."""
    return GGML_TYPES[type_id][0] if type_id in GGML_TYPES else f"type {type_id}"


def need_gguf(what: str) -> Any:
    try:
        return importlib.import_module("gguf")
    except ImportError as exc:
        raise MissingDependency(
            f"{what} needs the 'gguf' package (the models extra): pip install 'fuel[models]' "
            f"or pip install 'gguf>=0.19,<0.20'; importing it failed: {exc}"
        ) from exc


# ---------------------------------------------------------------------------------------------------------
# Header parsing


class Cursor:
    """Reads GGUF header values from a byte buffer, advancing `pos`."""

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header: {what} needs {n} bytes at offset {self.pos}, "
                            f"the file has {len(self.buf)}")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(v)

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(v)

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        s = str(self.buf[self.pos:self.pos + n], "utf-8", "surrogateescape")
        self.pos += n
        return s

    def strings(self, count: int, what: str) -> list[str]:
        buf, pos, size, unpack = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > size:
                    raise IndexError
                append(str(buf[pos:pos + n], "utf-8", "surrogateescape"))
                pos += n
        except (struct.error, IndexError):
            raise GGUFError(f"{self.path}: truncated GGUF header in {what} (string {len(out)} of {count}, "
                            f"offset {pos})") from None
        self.pos = pos
        return out

    def value(self, vtype: int, what: str) -> tuple[Any, str]:
        """One metadata value of GGUF value type `vtype` and its type's name."""
        if vtype in _SCALARS:
            name, fmt = _SCALARS[vtype]
            size = struct.calcsize(fmt)
            self.need(size, what)
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
            self.pos += size
            return (bool(v) if vtype == 7 else v), name
        if vtype == _STRING:
            return self.string(what), "string"
        if vtype == _ARRAY:
            itype = self.u32(what)
            count = self.u64(what)
            if itype in _ARRAY_DTYPES:
                dt = np.dtype(_ARRAY_DTYPES[itype])
                self.need(count * dt.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).astype(dt.newbyteorder("="))
                self.pos += count * dt.itemsize
                return arr, f"array[{_SCALARS[itype][0]}]"
            if itype == _STRING:
                return self.strings(count, what), "array[string]"
            if itype != _ARRAY:
                raise GGUFError(f"{self.path}: {what}: unknown GGUF value type {itype} in an array")
            items: list[Any] = []
            inner = "array[?]"
            for _ in range(count):
                v, inner = self.value(itype, what)
                items.append(v)
            return items, f"array[{inner}]"
        raise GGUFError(f"{self.path}: {what}: unknown GGUF value type {vtype}")
