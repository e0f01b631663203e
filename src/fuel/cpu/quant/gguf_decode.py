"""QMatMul's decode jobs (activation rows R <= DECODE_ROWS): which of a type's tasks (`gguf_kernels.GGUF`)
serves a call, and its job (`gguf_gemv.GEMV_ARGS`).

One row (a decode token) takes the type's table kernel where the host has one (the activations permuted
to its lanes' order first), else its words kernel, else the portable one; 2-16 rows take that kernel's
many-row form (`gguf_many`), which computes each row exactly as the one-row kernel does: a row's bytes do
not depend on how many rows come with it. Each task is compiled alone, on first use: one function holding
both paths compiled for several times as long (docs/performance/quant.md, "gguf_decode").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from fuel.cpu.quant import gguf_kernels as gk
from fuel.cpu.quant import gguf_units
from fuel.cpu.quant.gguf_gemv import GEMV_ARGS, fill_gemv_args
from fuel.cpu.quant.gguf_kernels import GGUF
from fuel.cpu.quant.gguf_types import VARIANTS
from fuel.cpu.quant.nibble_tables import permute_job, permuted
from fuel.cpu.simd.driver import pair_chunk_count
from fuel.quant import QuantType
from fuel.runtime import jobs

# One-row kernels decoding 4-bit codes by table, their many-row forms, and the order their lanes hold a unit's
# elements in: they read the activations permuted to it. The same products and sums as the portable kernels,
# each lane's elements in another order (docs/performance/quant.md, "table kernels").
TABLE_KERNELS: dict[QuantType, tuple[Any, Any, np.ndarray]] = {qt: k.table for qt, k in GGUF.items() if k.table}
USE_TABLES = bool(TABLE_KERNELS)  # tests turn it off to run the portable kernels on the same host

# One-row kernels decoding codes in place in 32-bit words (`gguf_words`), for the types the host has no table
# kernel for (a table kernel comes first). They read the activations as given and permute them themselves
# (each part its own copy), so their jobs can be posted again (docs/performance/quant.md, "gguf_words").
WORD_KERNELS: dict[QuantType, tuple[Any, Any]] = {qt: k.words for qt, k in GGUF.items() if k.words}
USE_WORDS = True  # tests turn it off to run the portable kernels on the same host

# The decode kernels by kind of host: (`TABLE_KERNELS`, `USE_WORDS`) as an AVX-512 host and an AVX2 host set
# them (each takes the table variants of `gguf_types.VARIANTS` its `nibble_tables` flag enables, and the words
# kernels: Q4_K where no table serves it, Q6_K), and the portable kernels alone (no table, no words), which a
# host without either flag runs but for the words kernels. Every kernel runs on every host (a lookup the
# host lacks is emulated), so the tests force each choice on any host (`host_way`), and `fuel compile`
# compiles them all.
HOST_FLAGS = {"avx512": "LUT16", "avx2": "BYTE_LUT", "portable": ""}


def _tables(flag: str) -> dict[QuantType, tuple[Any, Any, np.ndarray]]:
    return {v.qt: (*(getattr(gk, name) for name in v.tasks()), getattr(gguf_units, v.order))
            for v in VARIANTS if v.order and v.host == flag}


HOST_WAYS: dict[str, tuple[dict[QuantType, tuple[Any, Any, np.ndarray]], bool]] = {
    host: (_tables(flag), bool(flag)) for host, flag in HOST_FLAGS.items()}


@contextmanager
def host_way(name: str) -> Iterator[None]:
    """Within it, QMatMul's decode jobs are the kernels host `name` of `HOST_WAYS` picks (this module's
    choice, process-wide: for tests and `fuel compile`, never while another thread decodes)."""
    global TABLE_KERNELS, USE_TABLES, USE_WORDS
    tables, words = HOST_WAYS[name]
    before = TABLE_KERNELS, USE_TABLES, USE_WORDS
    TABLE_KERNELS, USE_TABLES, USE_WORDS = tables, bool(tables), words
    try:
        yield
    finally:
        TABLE_KERNELS, USE_TABLES, USE_WORDS = before


WEIGHTS_PER_SECOND = 12e9  # one core's rate decoding and multiplying weights at R = 1, for the part count


def gemv(qt: QuantType, a: np.ndarray, w: np.ndarray, out: np.ndarray) -> jobs.Job | None:
    """out [m, n] <- a [m, k] @ dequant(w)ᵀ for 1 <= m <= DECODE_ROWS (w: n rows of raw block bytes), each row
    of out the same bytes whatever m. Returns the job it ran where that job reads a, w and out themselves, so
    that it can be posted again for the same arrays (`fuel.runtime.jobs`): every many-row job (each part
    lays out its own copy of the rows) and the one-row jobs but a table kernel's, which reads a per-call
    permuted copy of a (None then)."""
    launch = many_rows_job(qt, a, w, out) if a.shape[0] != 1 else one_row_job(qt, a, w, out)
    if launch is None:  # a table kernel
        one, _, order = TABLE_KERNELS[qt]
        xp = permuted(a, order)  # alive until the job ends: the job holds only its address
        jobs.run(_job(one, xp[:1], w, out))  # x as given is read from the row after
        return None
    jobs.run(launch)
    return launch


def table_jobs(qt: QuantType, a: np.ndarray, w: np.ndarray,
               out: np.ndarray) -> tuple[jobs.Job, jobs.Job, tuple[np.ndarray, ...]]:
    """The one-row call of a type `one_row_job` leaves to a table kernel as two jobs, the activations
    permuted into a scratch of their own and the kernel reading it, and the arrays they point at besides
    a, w and out."""
    one, _, order = TABLE_KERNELS[qt]
    permute, scratch, keep = permute_job(a, order)
    return permute, _job(one, scratch[:1], w, out), keep


def one_row_job(qt: QuantType, a: np.ndarray, w: np.ndarray, out: np.ndarray) -> jobs.Job | None:
    """The job of one activation row a [1, k] against w into out [1, n], posted as it is at every call
    (the native replay's form too); None where a table kernel serves the type, which reads a per-call
    permuted copy of a."""
    if USE_TABLES and qt in TABLE_KERNELS:
        return None
    if USE_WORDS and qt in WORD_KERNELS:
        return _job(WORD_KERNELS[qt][0], a, w, out)
    return _job(GGUF[qt].one, a, w, out)


def many_rows_job(qt: QuantType, a: np.ndarray, w: np.ndarray, out: np.ndarray) -> jobs.Job:
    """The job of 2 <= m <= DECODE_ROWS activation rows a [m, k] (as given) against w into out [m, n]: the
    many-row form of the one-row kernel `one_row_job` or `table_jobs` gives, which permutes the activations
    itself."""
    if USE_TABLES and qt in TABLE_KERNELS:
        return _job(TABLE_KERNELS[qt][1], a, w, out)
    if USE_WORDS and qt in WORD_KERNELS:
        return _job(WORD_KERNELS[qt][1], a, w, out)
    return _job(GGUF[qt].many, a, w, out)


def _job(task: Any, a: np.ndarray, w: np.ndarray, out: np.ndarray) -> jobs.Job:
    """The job of activation rows a [m, k] against w (n rows of raw block bytes) into out [m, n]."""
    argv = jobs.argv_of(GEMV_ARGS)
    fill_gemv_args(a, w, out, argv)
    n = w.shape[0]
    return jobs.job(task, argv, a.shape[0] * n * a.shape[1] / WEIGHTS_PER_SECOND, pair_chunk_count(n))
