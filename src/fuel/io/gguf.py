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
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fuel.errors import ShapeError
from fuel.io.bundled import bundled_gguf
from fuel.io.gguf_format import (
    DEFAULT_ALIGNMENT,
    FLOAT_TYPES,
    GGML_TYPES,
    GGUF_MAGIC,
    PLAIN_TYPES,
    SUPPORTED_VERSIONS,
    Cursor,
    GGUFError,
    GGUFKeyError,
    GGUFNotFound,
    MissingDependency,
    UnsupportedTensorType,
    ggml_type_name,
    need_gguf,
)
from fuel.io.source import ModelSource
from fuel.quant import QuantType

if TYPE_CHECKING:
    from fuel.graph.tensor import Tensor, TensorLike

__all__ = [
    "GGUFError",
    "GGUFFile",
    "GGUFKeyError",
    "GGUFNotFound",
    "GGUFTensor",
    "MissingDependency",
    "UnsupportedTensorType",
    "bundled_gguf",
    "open_gguf",
]


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
        gguf = need_gguf("dequantize")
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


class GGUFFile(ModelSource[GGUFTensor]):
    """A GGUF file, mapped read-only: `metadata`, and `tensors` by name (in file order); hparam, names and
    lookups as every `fuel.io.source.ModelSource` has them."""

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
        cur = Cursor(buf, where)
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


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Map a GGUF file read-only and parse its header (metadata and tensor directory)."""
    return GGUFFile(path)
