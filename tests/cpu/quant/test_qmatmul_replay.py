"""QMatMul's decode path in native replay (`fuel.cpu.quant.qmatmul.qmatmul_form`): a captured product of
1..ROW_INVARIANT_ROWS activation rows runs as the very job the eager kernel posts (the server's batched step,
issue 43), on every host kernel (table, words, portable), so replay gives the eager bytes; values against
torch float64 of gguf-py's dequantised weight."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.cpu.quant import gguf_decode
from fuel.cpu.quant import qmatmul as kernel_module
from fuel.cpu.quant.qmatmul import ROW_INVARIANT_ROWS
from fuel.dtype import DType
from fuel.graph.registry.qmatmul import QMatMulParams
from fuel.quant import QuantType
from fuel.testing.oracle import assert_close_contraction
from fuel.testing.reference.qmatmul import as_words, random_weight

# (host of `gguf_decode.HOST_WAYS`, type), each host's decode kernels forced on any host: every kernel family
# (table, words, portable; 32-element blocks and super-blocks).
WAYS = [("avx512", QuantType.Q4_0), ("avx512", QuantType.Q4_1), ("avx512", QuantType.Q4K), ("avx512", QuantType.Q6K),
        ("avx2", QuantType.Q4_0), ("avx2", QuantType.Q4K), ("portable", QuantType.Q5_1), ("portable", QuantType.Q8_0),
        ("portable", QuantType.Q2K), ("portable", QuantType.Q3K), ("portable", QuantType.Q4K),
        ("portable", QuantType.Q5K)]
N = 37  # W rows: an odd count, so the last chunk's row pair holds one row twice


def _weight(qt: QuantType, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(u32 words, gguf-py's dequantised float64 [N, k])."""
    raw = random_weight(np.random.default_rng(7), qt, N, k)
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qt.ggml_name])
    return as_words(raw), np.asarray(deq, np.float64).reshape(N, k)


def _check(out: np.ndarray, a: np.ndarray, w64: np.ndarray) -> None:
    """Per-element contraction bound against torch float64, S = |a| @ |W|ᵀ."""
    a64 = torch.from_numpy(a.reshape(-1, a.shape[-1]).astype(np.float64))
    ref, scale = (a64 @ torch.from_numpy(w64).T).numpy(), (a64.abs() @ torch.from_numpy(np.abs(w64)).T).numpy()
    assert_close_contraction(out.reshape(ref.shape), ref, scale, DType.F32)


def _k(qt: QuantType) -> int:
    return 512 + (64 if qt.block_elements == 32 else 256)


@pytest.mark.parametrize(("way", "qt"), WAYS, ids=lambda v: getattr(v, "ggml_name", v))
@settings(max_examples=1)
@given(seed=st.integers(0, 2**32 - 1))
def test_captured_rows_replay_as_one_native_stretch(way: str, qt: QuantType, seed: int) -> None:
    """A captured `qmatmul` at every row count 1..16 (batch dims folded at odd counts) is one native
    stretch, the eager kernel's job (two at one row by table: the permute, then the kernel), and each call
    gives the eager bytes for its new activations."""
    with gguf_decode.host_way(way):
        k = _k(qt)
        w, w64 = _weight(qt, k)
        f = fl.jit(lambda a: fl.ops.qmatmul(a, fl.tensor(w), qt, k, N))
        rng = np.random.default_rng(seed)
        for rows in range(1, ROW_INVARIANT_ROWS + 1):
            shape = (1, rows, k) if rows % 2 else (rows, k)
            for _ in range(3):
                a = rng.standard_normal(shape).astype(np.float32)
                got = f(a).numpy()
                want = fl.ops.qmatmul(a, w, qt, k, N).numpy()
                assert got.shape == want.shape == (*shape[:-1], N)
                assert got.tobytes() == want.tobytes()
                _check(got, a, w64)
            cap = f.capture_for(a)
            assert cap is not None and cap.native is not None
            assert [len(item) for item in cap.native.items] == [2]
            assert len(cap.native.program.jobs) == (2 if rows == 1 and qt in gguf_decode.TABLE_KERNELS else 1)


@pytest.mark.parametrize(("way", "qt"), WAYS, ids=lambda v: getattr(v, "ggml_name", v))
def test_eager_kernel_reposts_its_many_row_job_with_new_values(way: str, qt: QuantType) -> None:
    """The eager kernel remembers a 2..16-row job for the same arrays (as a replayed Python step calls it)
    and the job reposted reads their current values: the bytes of a call on fresh copies."""
    with gguf_decode.host_way(way):
        _reposts_its_many_row_job(qt)


def _reposts_its_many_row_job(qt: QuantType) -> None:
    k = _k(qt)
    w, w64 = _weight(qt, k)
    params = QMatMulParams(quant_type=qt, k=k, n=N)
    rng = np.random.default_rng(11)
    for rows in (2, 5, ROW_INVARIANT_ROWS):
        a, out = rng.standard_normal((rows, k)).astype(np.float32), np.empty((rows, N), np.float32)
        kernel_module.qmatmul_kernel([a, w], out, params)
        launch = kernel_module._LAUNCHES.find((a, w, out), params)
        assert launch is not None
        a[:] = rng.standard_normal((rows, k)) * 1e-3
        kernel_module.qmatmul_kernel([a, w], out, params)
        assert kernel_module._LAUNCHES.find((a, w, out), params) is launch
        fresh = np.empty_like(out)
        kernel_module.qmatmul_kernel([a.copy(), w.copy()], fresh, params)
        assert out.tobytes() == fresh.tobytes()
        _check(out, a, w64)


def _form(a: np.ndarray, w: np.ndarray, out: np.ndarray, params: QMatMulParams) -> Any:
    return kernel_module.qmatmul_form([a, w], out, params)


def test_forms_it_does_not_serve() -> None:
    """Past ROW_INVARIANT_ROWS rows (the tiled path), transposed, or activations other than f32 contiguous:
    no job, the step stays in Python."""
    qt, k = QuantType.Q8_0, 64
    w, _ = _weight(qt, k)
    params = QMatMulParams(quant_type=qt, k=k, n=N)
    rows = ROW_INVARIANT_ROWS
    assert _form(np.zeros((rows, k), np.float32), w, np.zeros((rows, N), np.float32), params) is not None
    assert _form(np.zeros((rows + 1, k), np.float32), w, np.zeros((rows + 1, N), np.float32), params) is None
    wide = np.zeros((rows, 2 * k), np.float32)[:, :k]
    assert _form(wide, w, np.zeros((rows, N), np.float32), params) is None
    assert _form(np.zeros((rows, k), np.float64), w, np.zeros((rows, N), np.float32), params) is None
    grad = QMatMulParams(quant_type=qt, k=k, n=N, transpose=True)
    assert _form(np.zeros((rows, N), np.float32), w, np.zeros((rows, k), np.float32), grad) is None
