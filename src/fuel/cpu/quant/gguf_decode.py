"""QMatMul's decode kernels, two per GGUF type: one activation row (a decode token) and 2-16 rows.

They are named functions, one per type and row count, so that Numba's cache finds them again (factory
closures it does not), and they are separate so each compiles alone, on first use: the two paths in one
function took 54 s to compile for Q4_K, apart 13 s and 19 s (LLVM's time grows faster than the code).
The bodies are `gguf_gemv`'s drivers over `gguf_units`' decoders.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from fuel.cpu.quant.gguf_gemv import (
    BIAS,
    FACTOR_BIAS,
    SHARED,
    SUPER,
    activations_as_given,
    block_sums,
    bpair,
    fill_gemv_args,
    gemv_args,
    kpair,
    kpair_q4k_table,
    part_chunks,
    rows_many,
    rows_one,
)
from fuel.cpu.quant.gguf_units import (
    BYTE_ORDER_Q4_0,
    UNIT_ORDER_Q4_0,
    UNIT_ORDER_Q4K,
    _b_q4_0,
    _p_none,
    _p_q2k,
    _p_q3k,
    _p_q6k,
    _p_q45k,
    _t_q4_0,
    _t_q4_1,
    _v_q2k,
    _v_q3k,
    _v_q4_0,
    _v_q4_1,
    _v_q4k,
    _v_q5_0,
    _v_q5_1,
    _v_q5k,
    _v_q6k,
    _v_q8_0,
    _v_q8_1,
)
from fuel.cpu.quant.gguf_words import Q4K_LAYOUT, Q6K_LAYOUT, kpair_q4k, kpair_q6k, word_activations
from fuel.cpu.quant.nibble_tables import BYTE_LUT, LUT16, permute_job, permuted
from fuel.cpu.simd.driver import pair_chunk_count, row_kernel
from fuel.quant import QuantType
from fuel.runtime import jobs
from fuel.runtime.pool import task


@task()
def _q4_0_one(part: int, parts: int, argv: int) -> None:
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(a, SHARED), a.reshape(a.size), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(_v_q4_0, _p_none, 18, SHARED, a, w, out, c, sx, x, row, bpair)


@njit(inline="always", cache=True)
def _q4_0_permuted_rows(unit: Any, part: int, parts: int, argv: int) -> None:
    """A Q4_0 one-row part by a table decoder `unit`, the activations permuted to its lanes' order."""
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(activations_as_given(a), SHARED), a.reshape(a.size), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(unit, _p_none, 18, SHARED, a, w, out, c, sx, x, row, bpair)


@task()
def _q4_0_one_table(part: int, parts: int, argv: int) -> None:
    _q4_0_permuted_rows(_t_q4_0, part, parts, argv)


@task()
def _q4_0_one_bytes(part: int, parts: int, argv: int) -> None:
    _q4_0_permuted_rows(_b_q4_0, part, parts, argv)


@row_kernel()
def _q4_0_many(a: Any, w: Any, out: Any) -> None:
    sx, x, row = block_sums(a, SHARED), a.reshape(a.size), w.reshape(w.size)
    for c in prange(pair_chunk_count(w.shape[0])):
        rows_many(_v_q4_0, _p_none, 18, SHARED, a, w, out, c, sx, x, row)


@task()
def _q4_1_one(part: int, parts: int, argv: int) -> None:
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(a, SHARED | BIAS | FACTOR_BIAS), a.reshape(a.size), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(_v_q4_1, _p_none, 20, SHARED | BIAS | FACTOR_BIAS, a, w, out, c, sx, x, row, bpair)


@task()
def _q4_1_one_table(part: int, parts: int, argv: int) -> None:
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(activations_as_given(a), SHARED | BIAS | FACTOR_BIAS), a.reshape(a.size), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(_t_q4_1, _p_none, 20, SHARED | BIAS | FACTOR_BIAS, a, w, out, c, sx, x, row, bpair)


@row_kernel()
def _q4_1_many(a: Any, w: Any, out: Any) -> None:
    sx, x, row = block_sums(a, SHARED | BIAS | FACTOR_BIAS), a.reshape(a.size), w.reshape(w.size)
    for c in prange(pair_chunk_count(w.shape[0])):
        rows_many(_v_q4_1, _p_none, 20, SHARED | BIAS | FACTOR_BIAS, a, w, out, c, sx, x, row)


@task()
def _q5_0_one(part: int, parts: int, argv: int) -> None:
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(a, SHARED), a.reshape(a.size), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(_v_q5_0, _p_none, 22, SHARED, a, w, out, c, sx, x, row, bpair)


@row_kernel()
def _q5_0_many(a: Any, w: Any, out: Any) -> None:
    sx, x, row = block_sums(a, SHARED), a.reshape(a.size), w.reshape(w.size)
    for c in prange(pair_chunk_count(w.shape[0])):
        rows_many(_v_q5_0, _p_none, 22, SHARED, a, w, out, c, sx, x, row)


@task()
def _q5_1_one(part: int, parts: int, argv: int) -> None:
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(a, SHARED | BIAS | FACTOR_BIAS), a.reshape(a.size), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(_v_q5_1, _p_none, 24, SHARED | BIAS | FACTOR_BIAS, a, w, out, c, sx, x, row, bpair)


@row_kernel()
def _q5_1_many(a: Any, w: Any, out: Any) -> None:
    sx, x, row = block_sums(a, SHARED | BIAS | FACTOR_BIAS), a.reshape(a.size), w.reshape(w.size)
    for c in prange(pair_chunk_count(w.shape[0])):
        rows_many(_v_q5_1, _p_none, 24, SHARED | BIAS | FACTOR_BIAS, a, w, out, c, sx, x, row)


@task()
def _q8_0_one(part: int, parts: int, argv: int) -> None:
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(a, SHARED), a.reshape(a.size), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(_v_q8_0, _p_none, 34, SHARED, a, w, out, c, sx, x, row, bpair)


@row_kernel()
def _q8_0_many(a: Any, w: Any, out: Any) -> None:
    sx, x, row = block_sums(a, SHARED), a.reshape(a.size), w.reshape(w.size)
    for c in prange(pair_chunk_count(w.shape[0])):
        rows_many(_v_q8_0, _p_none, 34, SHARED, a, w, out, c, sx, x, row)


@task()
def _q8_1_one(part: int, parts: int, argv: int) -> None:
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(a, SHARED), a.reshape(a.size), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(_v_q8_1, _p_none, 36, SHARED, a, w, out, c, sx, x, row, bpair)


@row_kernel()
def _q8_1_many(a: Any, w: Any, out: Any) -> None:
    sx, x, row = block_sums(a, SHARED), a.reshape(a.size), w.reshape(w.size)
    for c in prange(pair_chunk_count(w.shape[0])):
        rows_many(_v_q8_1, _p_none, 36, SHARED, a, w, out, c, sx, x, row)


@task()
def _q2k_one(part: int, parts: int, argv: int) -> None:
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(a, SUPER | BIAS), a.reshape(a.size), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(_v_q2k, _p_q2k, 84, SUPER | BIAS, a, w, out, c, sx, x, row, kpair)


@row_kernel()
def _q2k_many(a: Any, w: Any, out: Any) -> None:
    sx, x, row = block_sums(a, SUPER | BIAS), a.reshape(a.size), w.reshape(w.size)
    for c in prange(pair_chunk_count(w.shape[0])):
        rows_many(_v_q2k, _p_q2k, 84, SUPER | BIAS, a, w, out, c, sx, x, row)


@task()
def _q3k_one(part: int, parts: int, argv: int) -> None:
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(a, SUPER), a.reshape(a.size), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(_v_q3k, _p_q3k, 110, SUPER, a, w, out, c, sx, x, row, kpair)


@row_kernel()
def _q3k_many(a: Any, w: Any, out: Any) -> None:
    sx, x, row = block_sums(a, SUPER), a.reshape(a.size), w.reshape(w.size)
    for c in prange(pair_chunk_count(w.shape[0])):
        rows_many(_v_q3k, _p_q3k, 110, SUPER, a, w, out, c, sx, x, row)


@task()
def _q4k_one(part: int, parts: int, argv: int) -> None:
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(a, SUPER | SHARED | BIAS | FACTOR_BIAS), a.reshape(a.size), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(_v_q4k, _p_q45k, 144, SUPER | SHARED | BIAS | FACTOR_BIAS, a, w, out, c, sx, x, row, kpair)


@task()
def _q4k_one_table(part: int, parts: int, argv: int) -> None:
    a, w, out = gemv_args(argv)
    kind = SUPER | SHARED | BIAS | FACTOR_BIAS
    sx, x, row = block_sums(activations_as_given(a), kind), a.reshape(a.size), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(_v_q4k, _p_q45k, 144, kind, a, w, out, c, sx, x, row, kpair_q4k_table)


@task()
def _q4k_one_words(part: int, parts: int, argv: int) -> None:
    a, w, out = gemv_args(argv)
    kind = SUPER | SHARED | BIAS | FACTOR_BIAS
    sx, x, row = block_sums(a, kind), word_activations(a, Q4K_LAYOUT), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(_v_q4k, _p_q45k, 144, kind, a, w, out, c, sx, x, row, kpair_q4k)


@row_kernel()
def _q4k_many(a: Any, w: Any, out: Any) -> None:
    sx, x, row = block_sums(a, SUPER | SHARED | BIAS | FACTOR_BIAS), a.reshape(a.size), w.reshape(w.size)
    for c in prange(pair_chunk_count(w.shape[0])):
        rows_many(_v_q4k, _p_q45k, 144, SUPER | SHARED | BIAS | FACTOR_BIAS, a, w, out, c, sx, x, row)


@task()
def _q5k_one(part: int, parts: int, argv: int) -> None:
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(a, SUPER | SHARED | BIAS | FACTOR_BIAS), a.reshape(a.size), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(_v_q5k, _p_q45k, 176, SUPER | SHARED | BIAS | FACTOR_BIAS, a, w, out, c, sx, x, row, kpair)


@row_kernel()
def _q5k_many(a: Any, w: Any, out: Any) -> None:
    sx, x, row = block_sums(a, SUPER | SHARED | BIAS | FACTOR_BIAS), a.reshape(a.size), w.reshape(w.size)
    for c in prange(pair_chunk_count(w.shape[0])):
        rows_many(_v_q5k, _p_q45k, 176, SUPER | SHARED | BIAS | FACTOR_BIAS, a, w, out, c, sx, x, row)


@task()
def _q6k_one(part: int, parts: int, argv: int) -> None:
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(a, SUPER), a.reshape(a.size), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(_v_q6k, _p_q6k, 210, SUPER, a, w, out, c, sx, x, row, kpair)


@task()
def _q6k_one_words(part: int, parts: int, argv: int) -> None:
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(a, SUPER), word_activations(a, Q6K_LAYOUT), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(_v_q6k, _p_q6k, 210, SUPER, a, w, out, c, sx, x, row, kpair_q6k)


@row_kernel()
def _q6k_many(a: Any, w: Any, out: Any) -> None:
    sx, x, row = block_sums(a, SUPER), a.reshape(a.size), w.reshape(w.size)
    for c in prange(pair_chunk_count(w.shape[0])):
        rows_many(_v_q6k, _p_q6k, 210, SUPER, a, w, out, c, sx, x, row)


KERNELS: dict[QuantType, tuple[Any, Any]] = {
    QuantType.Q4_0: (_q4_0_one, _q4_0_many),
    QuantType.Q4_1: (_q4_1_one, _q4_1_many),
    QuantType.Q5_0: (_q5_0_one, _q5_0_many),
    QuantType.Q5_1: (_q5_1_one, _q5_1_many),
    QuantType.Q8_0: (_q8_0_one, _q8_0_many),
    QuantType.Q8_1: (_q8_1_one, _q8_1_many),
    QuantType.Q2K: (_q2k_one, _q2k_many),
    QuantType.Q3K: (_q3k_one, _q3k_many),
    QuantType.Q4K: (_q4k_one, _q4k_many),
    QuantType.Q5K: (_q5k_one, _q5k_many),
    QuantType.Q6K: (_q6k_one, _q6k_many),
}


# One-row kernels decoding 4-bit codes by table, with the order their lanes hold a unit's elements in: they
# read the activations permuted to it. The same products and sums as the kernels in KERNELS, each lane's
# elements in another order. AVX-512 hosts look 16 codes up by one vpermps (`nibble_codes`): 4096² Q4_0 at
# R = 1 in 0.43 ms warm and 0.53 ms from memory against 0.49 and 0.59 (interleaved medians, two threads);
# Q4_K goes by unit pairs (the low and high nibbles of the same bytes: `gguf_gemv.kpair_q4k_table`). AVX2
# hosts look a block's 32 codes up as bfloat16 bits by byte shuffles (`nibble_codes32`) and its f16 scale up
# in `F16_VALUES`: 4096² Q4_0 one row on one Zen 3 core in 1.16-1.19 ms against 1.35-1.36, two threads with
# the weight evicted 0.66-0.72 against 0.75 (interleaved medians).
TABLE_KERNELS: dict[QuantType, tuple[Any, np.ndarray]] = {
    QuantType.Q4_0: (_q4_0_one_table, UNIT_ORDER_Q4_0),
    QuantType.Q4_1: (_q4_1_one_table, UNIT_ORDER_Q4_0),
    QuantType.Q4K: (_q4k_one_table, UNIT_ORDER_Q4K),
} if LUT16 else {QuantType.Q4_0: (_q4_0_one_bytes, BYTE_ORDER_Q4_0)} if BYTE_LUT else {}
USE_TABLES = bool(TABLE_KERNELS)  # tests turn it off to run the portable kernels on the same host

# One-row kernels decoding codes in place in 32-bit words (`gguf_words`), for the types the host has no table
# kernel for (a table kernel comes first). They read the activations as given and permute them themselves
# (each part its own copy: 0.2 ns an element), so their jobs can be posted again. 4096², one row, Zen 3 (AVX2):
# Q4_K 0.62-0.65 ms against 0.94-0.97 (two threads); Q6_K 1.6 against 2.3-2.5 ms (one thread). On an AVX-512
# Xeon (interleaved in one process) Q6_K takes 0.92x the portable kernel's time (one core, L2-resident) and
# 0.93x (two threads, weight evicted); Q4_K keeps its table kernel there (0.82x; words 0.88x).
WORD_KERNELS: dict[QuantType, Any] = {QuantType.Q4K: _q4k_one_words, QuantType.Q6K: _q6k_one_words}
USE_WORDS = True  # tests turn it off to run the portable kernels on the same host


# One core decodes and multiplies about this many weights a second at R = 1 (10-15 G measured).
WEIGHTS_PER_SECOND = 12e9


def gemv(qt: QuantType, a: np.ndarray, w: np.ndarray, out: np.ndarray) -> jobs.Job | None:
    """out [m, n] <- a [m, k] @ dequant(w)ᵀ for 1 <= m <= DECODE_ROWS (w: n rows of raw block bytes). One
    row (a decode token) runs on the spinning pool: its cores join within microseconds, so even a
    [576, 576] weight is split. Returns the one-row job where it reads a, w and out themselves, so that it
    can be posted again for the same arrays (`fuel.runtime.jobs`); None otherwise (several rows, or
    a table kernel, which reads a per-call permuted copy of a)."""
    if a.shape[0] != 1:
        KERNELS[qt][1](a, w, out)
        return None
    launch = one_row_job(qt, a, w, out)
    if launch is None:  # a table kernel
        one, order = TABLE_KERNELS[qt]
        xp = permuted(a, order)  # alive until the job ends: the job holds only its address
        jobs.run(_one_row_launch(one, xp[:1], w, out))  # x as given is read from the row after
        return None
    jobs.run(launch)
    return launch


def table_jobs(qt: QuantType, a: np.ndarray, w: np.ndarray,
               out: np.ndarray) -> tuple[jobs.Job, jobs.Job, tuple[np.ndarray, ...]]:
    """The one-row call of a type `one_row_job` leaves to a table kernel as two jobs, the activations
    permuted into a scratch of their own and the kernel reading it, and the arrays they point at besides
    a, w and out."""
    one, order = TABLE_KERNELS[qt]
    permute, scratch, keep = permute_job(a, order)
    return permute, _one_row_launch(one, scratch[:1], w, out), keep


def one_row_job(qt: QuantType, a: np.ndarray, w: np.ndarray, out: np.ndarray) -> jobs.Job | None:
    """The job of one activation row a [1, k] against w into out [1, n], posted as it is at every call
    (the native replay's form too); None where a table kernel serves the type, which reads a per-call
    permuted copy of a."""
    if USE_TABLES and qt in TABLE_KERNELS:
        return None
    if USE_WORDS and qt in WORD_KERNELS:
        return _one_row_launch(WORD_KERNELS[qt], a, w, out)
    return _one_row_launch(KERNELS[qt][0], a, w, out)


def _one_row_launch(task: Any, a: np.ndarray, w: np.ndarray, out: np.ndarray) -> jobs.Job:
    """The job of one activation row a [1, k] against w (n rows of raw block bytes) into out [1, n]."""
    argv = np.empty(6, np.int64)
    fill_gemv_args(a, w, out, argv)
    n = w.shape[0]
    return jobs.job(task, argv, n * a.shape[1] / WEIGHTS_PER_SECOND, pair_chunk_count(n))
