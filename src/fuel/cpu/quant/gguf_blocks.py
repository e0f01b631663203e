"""The GGUF dequantisers as functions of arrays (public as `fuel.quant.dequantize`, `weight_rows` and
`dequantize_rows_into`): a weight's rows of blocks decoded into float32 by each type's rows task (the table
`gguf_kernels.GGUF`), gguf-py's values bit for bit (`gguf_dequant`). The runtime picks the part count; each
row is one part's, decoded in one fixed order, so the bytes never depend on it.
"""

from __future__ import annotations

import numpy as np

from fuel.cpu.quant.gguf_dequant import ROWS_ARGS
from fuel.cpu.quant.gguf_kernels import GGUF
from fuel.errors import ShapeError
from fuel.quant import QuantType
from fuel.runtime import jobs

SECONDS_PER_VALUE = 0.5e-9  # one core's time to decode a value, for the part count


def rows_job(raw: np.ndarray, qt: QuantType, row0: int, row1: int, out: np.ndarray) -> jobs.Job:
    """The job out[:row1 - row0] <- the values of rows [row0, row1) of raw (uint8 [n, row bytes]), unchecked:
    the arrays as `dequantize_rows_into` checks them, alive until it has run."""
    argv = jobs.argv_of(ROWS_ARGS)
    k = out.shape[1]
    argv[0] = (raw.ctypes.data, raw.shape[0], raw.shape[1], row0, row1 - row0, k, out.ctypes.data)
    return jobs.job(GGUF[qt].rows, argv, (row1 - row0) * k * SECONDS_PER_VALUE, row1 - row0)


def _as_rows(raw: np.ndarray, qt: QuantType, n: int, k: int, op: str) -> np.ndarray:
    """raw's bytes as uint8 [n, k / block_elements * block_bytes], checked."""
    if n < 0 or k < 0 or k % qt.block_elements:
        raise ShapeError(f"{op}: {qt.ggml_name} needs k a multiple of {qt.block_elements}, got {k}")
    row_bytes = k // qt.block_elements * qt.block_bytes
    if not raw.flags.c_contiguous:
        raise ShapeError(f"{op}: the {qt.ggml_name} weight bytes must be C-contiguous")
    u8 = raw.reshape(-1).view(np.uint8)
    if u8.size != n * row_bytes:
        raise ShapeError(f"{op}: a [{n}, {k}] {qt.ggml_name} weight is {n * row_bytes} bytes "
                         f"({n} rows of {k // qt.block_elements} blocks of {qt.block_bytes}), got {u8.size}")
    return u8.reshape(n, row_bytes)


def dequantize(raw: np.ndarray, qt: QuantType, n: int, k: int) -> np.ndarray:
    """The float32 [n, k] values of a weight stored as n rows of k / block_elements blocks of type qt
    (raw: its bytes, as uint8 or any dtype viewed as bytes, C-contiguous)."""
    rows = _as_rows(raw, qt, n, k, "dequantize")
    out = np.empty((n, k), np.float32)
    if n and k:
        jobs.run(rows_job(rows, qt, 0, n, out))
    return out


def dequantize_rows_into(raw: np.ndarray, qt: QuantType, row0: int, row1: int, out: np.ndarray) -> None:
    """Dequantise rows [row0, row1) of a weight into out[:row1 - row0], allocating nothing: raw is the
    weight's bytes as C-contiguous uint8 [n, row bytes] (`weight_rows` makes it once), out a
    C-contiguous float32 [>= row1 - row0, k] buffer the caller reuses (rows past row1 - row0 untouched)."""
    op = "dequantize_rows_into"
    if raw.dtype != np.uint8 or raw.ndim != 2 or not raw.flags.c_contiguous or raw.shape[1] % qt.block_bytes:
        raise ShapeError(f"{op}: raw must be C-contiguous uint8 [n, whole {qt.ggml_name} blocks of "
                         f"{qt.block_bytes} bytes], got {raw.dtype} {list(raw.shape)}")
    n, k = raw.shape[0], raw.shape[1] // qt.block_bytes * qt.block_elements
    if not 0 <= row0 <= row1 <= n:
        raise ShapeError(f"{op}: rows [{row0}, {row1}) outside a weight of {n} rows")
    if (out.dtype != np.float32 or out.ndim != 2 or not out.flags.c_contiguous or out.shape[0] < row1 - row0
            or out.shape[1] != k):
        raise ShapeError(f"{op}: out must be C-contiguous float32 [>= {row1 - row0}, {k}], got "
                         f"{out.dtype} {list(out.shape)}")
    if row1 > row0 and k:
        jobs.run(rows_job(raw, qt, row0, row1, out))


def weight_rows(raw: np.ndarray, qt: QuantType, n: int, k: int) -> np.ndarray:
    """raw's bytes as the uint8 [n, row bytes] array `dequantize_rows_into` reads (a view; checked)."""
    return _as_rows(raw, qt, n, k, "weight_rows")
