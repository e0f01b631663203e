"""GGUF test files and checks shared by the GGUF reader and QMatMul tests: small files written with gguf-py's
own writer, Q8_0 weights quantised by gguf-py, and a GGUF tensor's matmul against float64."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT

import fuel as fl
from fuel.io import GGUFTensor
from fuel.testing.oracle import assert_close_contraction


def write_gguf(path: Path, tensors: list[tuple[str, np.ndarray, GT | None]], kv: dict[str, Any] | None = None,
           endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE, alignment: int | None = None) -> Path:
    """A GGUF file at path through gguf-py's own writer: tensors (name, array, raw GGML type or None for
    a float array), metadata key -> (value, GGUFValueType, sub-type for arrays)."""
    w = gguf.GGUFWriter(str(path), "test", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (val, vtype, sub) in (kv or {}).items():
        w.add_key_value(key, val, vtype, sub)
    for name, arr, raw_dtype in tensors:
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    finish(w)
    return path


def finish(w: gguf.GGUFWriter) -> None:
    """Write out and close a GGUF writer whose metadata and tensors are all added."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def q8_0_weight(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A random [n, k] weight quantised to Q8_0 by gguf-py: (raw block bytes, gguf-py's dequantisation)."""
    w = rng.standard_normal((n, k)).astype(np.float32)
    q = gguf.quants.quantize(w, GT.Q8_0)
    return q, gguf.quants.dequantize(q, GT.Q8_0)


def check_gguf_matmul(t: GGUFTensor, rng: np.random.Generator, m: int = 3) -> None:
    """t.matmul of m random rows against float64 (gguf-py's values) at f32 contraction tolerance."""
    a = rng.standard_normal((m, t.k)).astype(np.float32)
    w = t.dequantize().astype(np.float64)
    out = t.matmul(a)
    assert isinstance(out, fl.Tensor) and out.shape == (m, t.n) and out.dtype == fl.f32
    ref = a.astype(np.float64) @ w.T
    scale = np.abs(a).astype(np.float64) @ np.abs(w).T
    assert_close_contraction(out.numpy(), ref, scale, fl.f32)
