"""Nf4Matmul's AMX path (`nf4_amx`) against float64 dequantise-then-matmul of bitsandbytes' weights.

On a host without AMX (or where Linux refuses the tile state) `nf4_amx.forward` must decline and leave
its output untouched; these tests assert that there, and the numbers where the path runs.
"""

from __future__ import annotations

import bitsandbytes.functional as bnbf
import numpy as np
import pytest
import torch

import fuel as fl
from fuel.dispatch.cpu import amx, nf4_amx
from fuel.dispatch.cpu import nf4 as nf4_kernels
from fuel.dtype import DType
from fuel.quant.nf4 import nf4_quantize
from fuel.testing.contract import numba_threads, thread_counts
from fuel.testing.oracle import assert_close_contraction
from fuel.testing.reference.nf4_matmul import dequant64

RAN = amx.available()  # what `forward` must return wherever its inputs qualify


def _weight(rng: np.random.Generator, n: int, k: int, bs: int) -> tuple[np.ndarray, np.ndarray]:
    return nf4_quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), bs)


def _forward(x: np.ndarray, packed: np.ndarray, absmax: np.ndarray, bs: int,
             pieces: int = 3) -> tuple[bool, np.ndarray]:
    out = np.full((x.shape[0], packed.shape[0]), 7.0, np.float32)
    return nf4_amx.forward(np.ascontiguousarray(x, np.float32), packed, absmax, bs, out, pieces), out


def _check(out: np.ndarray, x: np.ndarray, packed: np.ndarray, absmax: np.ndarray, bs: int, dt: DType) -> None:
    w = dequant64(packed, absmax, bs).T
    x64 = np.asarray(x, np.float64)
    assert_close_contraction(out, x64 @ w, np.abs(x64) @ np.abs(w), dt)


def test_three_bf16_pieces_sum_to_every_f32_exactly() -> None:
    rng = np.random.default_rng(0)
    v = np.concatenate([rng.standard_normal(10000), rng.standard_normal(1000) * 1e-19, rng.standard_normal(1000) * 1e29,
                        [0.0, -0.0, 1.0, float(nf4_amx.TINY), float(nf4_amx.HUGE)]]).astype(np.float32)
    pieces = nf4_amx.split3(v)
    total = sum(((p << np.uint32(16)).view(np.float32)).astype(np.float64) for p in pieces)
    np.testing.assert_array_equal(total, v.astype(np.float64))
    assert all(int(p.max()) < 1 << 16 for p in pieces)


@pytest.mark.parametrize(("m", "k", "n", "bs"), [(1, 64, 1, 64), (5, 64, 7, 64), (16, 128, 32, 64), (17, 256, 40, 128),
                                                 (37, 512, 33, 256), (64, 256, 96, 64), (33, 192, 65, 64)], ids=str)
def test_matches_float64_on_tile_edges(m: int, k: int, n: int, bs: int) -> None:
    """Rows and columns that fill no whole tile (the padding rows are zero and dropped), one block and many."""
    rng = np.random.default_rng(m * 1000 + n)
    packed, absmax = _weight(rng, n, k, bs)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ran, out = _forward(x, packed, absmax, bs)
    assert ran is RAN
    if not ran:
        assert (out == 7.0).all()
        return
    _check(out, x, packed, absmax, bs, DType.F32)


@pytest.mark.parametrize(("dt", "pieces"), [(DType.F16, 2), (DType.BF16, 1)], ids=["f16", "bf16"])
def test_half_activations_need_fewer_pieces(dt: DType, pieces: int) -> None:
    """Widened f16 is two pieces and bf16 one: the products of the pieces they do not have are skipped."""
    rng = np.random.default_rng(3)
    packed, absmax = _weight(rng, 70, 512, 64)
    x = rng.standard_normal((20, 512)).astype(dt.np).astype(np.float32)
    ran, out = _forward(x, packed, absmax, 64, pieces)
    assert ran is RAN
    if ran:
        _check(out, x, packed, absmax, 64, DType.F32)


def test_identity_rows_give_bitsandbytes_weights() -> None:
    """A unit activation picks one dequantised weight: absmax · NF4[code], rounded once as bitsandbytes does."""
    rng = np.random.default_rng(4)
    n, k, bs = 40, 256, 64
    w = torch.from_numpy((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
    q, state = bnbf.quantize_4bit(w, blocksize=bs, quant_type="nf4")
    packed, absmax = q.numpy().reshape(n, k // 2), state.absmax.numpy().reshape(n, k // bs)
    want = bnbf.dequantize_4bit(q, state).numpy()
    ran, out = _forward(np.eye(k, dtype=np.float32)[[0, 1, 63, 64, 127, 200, 255]], packed, absmax, bs)
    assert ran is RAN
    if ran:
        np.testing.assert_array_equal(out, want[:, [0, 1, 63, 64, 127, 200, 255]].T)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e-25, 2e30], ids=str)
def test_values_the_tiles_would_flush_or_overflow_are_declined(bad: float) -> None:
    rng = np.random.default_rng(5)
    packed, absmax = _weight(rng, 8, 128, 64)
    x = rng.standard_normal((6, 128)).astype(np.float32)
    x[4, 77] = bad
    ran, out = _forward(x, packed, absmax, 64)
    assert not ran and (out == 7.0).all()


def test_non_finite_absmax_and_blocks_of_32_are_declined() -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((6, 128)).astype(np.float32)
    packed, absmax = _weight(rng, 8, 128, 64)
    absmax[3, 1] = np.inf
    assert _forward(x, packed, absmax, 64)[0] is False
    packed, absmax = _weight(rng, 8, 128, 32)
    assert _forward(x, packed, absmax, 32)[0] is False


def test_same_bytes_at_every_thread_count() -> None:
    rng = np.random.default_rng(7)
    packed, absmax = _weight(rng, 300, 1024, 64)
    x = rng.standard_normal((40, 1024)).astype(np.float32)
    outs = []
    for threads in thread_counts():
        with numba_threads(threads):
            outs.append(_forward(x, packed, absmax, 64)[1].tobytes())
    assert len(set(outs)) == 1


@pytest.mark.parametrize("dt", [DType.F32, DType.BF16, DType.F16], ids=lambda d: d.value)
def test_the_op_takes_the_path_for_large_products(dt: DType, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fl.ops.nf4_matmul` with K·N at the threshold runs on the tiles where the host has them (else on the
    f32 tiles), in every activation dtype, and matches float64 at the dtype's tolerance either way."""
    taken = []
    forward = nf4_amx.forward
    monkeypatch.setattr(nf4_amx, "forward", lambda *a: taken.append(forward(*a)) or taken[-1])
    rng = np.random.default_rng(8)
    k = nf4_kernels.AMX_MIN_K
    n = nf4_kernels.AMX_MIN_WEIGHTS // k
    packed, absmax = _weight(rng, n, k, 64)
    x = rng.standard_normal((2, 3, k)).astype(dt.np)
    y = fl.ops.nf4_matmul(x, packed, absmax, block_size=64)
    assert y.dtype is dt
    out = y.numpy()
    assert taken == [RAN]
    _check(out.reshape(6, n), x.reshape(6, k), packed, absmax, 64, dt)


def test_the_config_and_aligned_buffers() -> None:
    cfg = amx.config()
    assert cfg[0] == 1 and (cfg[16:32].view(np.uint16) == 64).all() and (cfg[48:56] == 16).all()
    for count in (1, 17, 4096):
        assert amx.aligned_empty(count, np.uint16).ctypes.data % 64 == 0
