"""Prepared decode jobs (`fuel.runtime.jobs`), through QMatMul's one-row path and FlashAttn's decode: a
call with the same arrays posts the remembered job and reads their current values (and FlashAttn's k_len of
the call); other arrays, a shape changed in place, another params object or a dead array never reuse it.
Values against gguf-py's dequantisation in float64 and torch's attention."""

from __future__ import annotations

import gc

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from fuel.cpu.attention import flash_attn as attention_cpu
from fuel.cpu.attention.flash_attn import flash_attn_kernel
from fuel.cpu.quant import gguf_decode
from fuel.cpu.quant import qmatmul as gguf_cpu
from fuel.dtype import DType
from fuel.errors import DTypeError, ParamError
from fuel.graph.registry.flash_attn import FlashAttnParams
from fuel.graph.registry.qmatmul import QMatMulParams
from fuel.quant import QuantType
from fuel.runtime import jobs
from fuel.testing.oracle import assert_close_contraction
from fuel.testing.reference.qmatmul import as_words, random_weight

N, K = 40, 64
Call = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, QMatMulParams]  # a, w, w in float64, out, params


def _weight(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(raw Q8_0 blocks as u32 words, their float64 dequantisation [N, K])."""
    q = gguf.quants.quantize(rng.standard_normal((N, K)).astype(np.float32), GGMLQuantizationType.Q8_0)
    raw = np.frombuffer(q.tobytes(), np.uint8)
    want = gguf.quants.dequantize(q, GGMLQuantizationType.Q8_0).astype(np.float64)
    return np.concatenate([raw, np.zeros(-raw.size % 4, np.uint8)]).view(np.uint32), want


def _check(a: np.ndarray, w64: np.ndarray, out: np.ndarray) -> None:
    a64 = a.astype(np.float64)
    assert_close_contraction(out, a64 @ w64.T, np.abs(a64) @ np.abs(w64.T), DType.F32)


@pytest.fixture
def call() -> Call:
    rng = np.random.default_rng(0)
    w, w64 = _weight(rng)
    return rng.standard_normal((1, K)).astype(np.float32), w, w64, np.empty((1, N), np.float32), \
        QMatMulParams(quant_type=QuantType.Q8_0, k=K, n=N)


def test_same_arrays_reuse_the_job_and_read_their_current_values(call: Call) -> None:
    a, w, w64, out, params = call
    gguf_cpu.qmatmul_kernel([a, w], out, params)
    launch = gguf_cpu._LAUNCHES.find((a, w, out), params)
    assert launch is not None
    _check(a, w64, out)
    a *= -3  # new values in the same buffer: the remembered job reads them
    gguf_cpu.qmatmul_kernel([a, w], out, params)
    assert gguf_cpu._LAUNCHES.find((a, w, out), params) is launch
    _check(a, w64, out)


def test_q4k_word_job_reused_with_new_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_K's one-row job by words (the AVX2 hosts' way, forced here on any host) permutes the activations
    inside the job: a reposted job reads the caller's current values, not a copy from its first call."""
    monkeypatch.setattr(gguf_decode, "USE_TABLES", False)
    monkeypatch.setattr(gguf_decode, "USE_WORDS", True)
    rng = np.random.default_rng(3)
    n, k = 24, 512
    raw = random_weight(rng, QuantType.Q4K, n, k)
    w64 = gguf.quants.dequantize(raw, GGMLQuantizationType.Q4_K).astype(np.float64).reshape(n, k)
    a, out = rng.standard_normal((1, k)).astype(np.float32), np.empty((1, n), np.float32)
    w, params = as_words(raw), QMatMulParams(quant_type=QuantType.Q4K, k=k, n=n)
    gguf_cpu.qmatmul_kernel([a, w], out, params)
    launch = gguf_cpu._LAUNCHES.find((a, w, out), params)
    assert launch is not None
    _check(a, w64, out)
    a[:] = rng.standard_normal((1, k)) * 1e-3
    gguf_cpu.qmatmul_kernel([a, w], out, params)
    assert gguf_cpu._LAUNCHES.find((a, w, out), params) is launch
    _check(a, w64, out)


def test_other_arrays_params_or_shapes_are_not_matched(call: Call) -> None:
    a, w, w64, out, params = call
    gguf_cpu.qmatmul_kernel([a, w], out, params)
    assert gguf_cpu._LAUNCHES.find((a.copy(), w, out), params) is None
    assert gguf_cpu._LAUNCHES.find((a, w, out), QMatMulParams(quant_type=QuantType.Q8_0, k=K, n=N)) is None
    same = a.view()
    assert gguf_cpu._LAUNCHES.find((same, w, out), params) is None  # another object over the same memory
    wide = np.zeros((2, K), np.float32)
    row = wide[:1]
    gguf_cpu.qmatmul_kernel([row, w], out, params)
    _check(row, w64, out)
    row.shape = (K, 1)  # in place: the remembered job would read a [1, K] row
    assert gguf_cpu._LAUNCHES.find((row, w, out), params) is None


def test_an_entry_dies_with_its_arrays() -> None:
    table = jobs.JobCache()
    a, b = np.zeros(3), np.zeros(4)
    argv = np.zeros(2, np.int64)
    table.remember((a, b), None, jobs.Job(0, argv, 0, 0.0, 1))
    assert len(table) == 1 and table.find((a, b), None) is not None
    del a
    gc.collect()
    assert len(table) == 0


def test_flash_attn_decode_reuses_its_job_with_each_calls_k_len() -> None:
    """A decode step's FlashAttn: the same q, k, v and out every token, k_len moving; each call's output
    is that of a first call on fresh copies (the same kernel) and agrees with torch over the live keys."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 6, 1, 32)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 40, 32)).astype(np.float32) for _ in range(2))
    out = np.empty_like(q)
    for kl in (5, 17, 40, 0, 9):
        params = FlashAttnParams(0.2, True, None, 0, None, kl)
        flash_attn_kernel([q, k, v], out, params)
        assert attention_cpu._LAUNCHES.find((q, k, v, out), None) is not None
        fresh = np.empty_like(q)
        flash_attn_kernel([q.copy(), k.copy(), v.copy()], fresh, params)
        assert fresh.tobytes() == out.tobytes()
        tk = torch.from_numpy(k[:, :, :kl]).repeat_interleave(3, 1).double()
        tv = torch.from_numpy(v[:, :, :kl]).repeat_interleave(3, 1).double()
        want = (torch.nn.functional.scaled_dot_product_attention(torch.from_numpy(q).double(), tk, tv, scale=0.2)
                if kl else torch.zeros(q.shape, dtype=torch.float64))
        np.testing.assert_allclose(out, want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [np.int32, np.float32, np.uint64, np.complex64, np.bool_, object, "not a dtype"])
def test_a_record_field_a_task_cannot_read_is_refused(kind: object) -> None:
    """A task reads each word as int64 or float64: any other kind, 8 bytes wide or not, is a DTypeError
    naming the field and what came."""
    with pytest.raises(DTypeError, match=r"jobs\.record: field 'rows' must be ADDRESS, INT \(int64\) or REAL "
                                         r"\(float64\), got"):
        jobs.record(x=jobs.ADDRESS, rows=kind)  # type: ignore[arg-type]


def test_a_record_of_no_field_and_an_unknown_word_are_refused() -> None:
    with pytest.raises(ParamError, match=r"jobs\.record: expected at least one field .* got none"):
        jobs.record()
    rec = jobs.record(x=jobs.ADDRESS, k_len=jobs.INT, eps=jobs.REAL)
    assert [jobs.word(rec, f) for f in ("x", "k_len", "eps")] == [0, 1, 2]
    with pytest.raises(ParamError, match=r"jobs\.word: the record has no field 'klen'; its fields are x, k_len, eps"):
        jobs.word(rec, "klen")
