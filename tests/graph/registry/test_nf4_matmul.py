"""Nf4Matmul (entry 21) against bitsandbytes and torch float64: kernels, rules, decomposition, gradients."""

from __future__ import annotations

from typing import Any

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_limits

import fuel as fl
from fuel.cpu.quant import nf4_matmul as nf4_kernels
from fuel.cpu.quant.nibble_tables import LUT32
from fuel.dtype import DType
from fuel.graph.registry import FusedOps, default_registry
from fuel.graph.registry.nf4_matmul import Nf4MatmulParams, decompose, dequantize
from fuel.quant.nf4 import NF4, nf4_codes, nf4_quantize
from fuel.testing.contract import fuel_threads, output_for, thread_counts
from fuel.testing.oracle import assert_close_contraction
from fuel.testing.reference.nf4_matmul import dequant64

ACT_DTYPES = [DType.F32, DType.BF16, DType.F16]
ACTS = pytest.mark.parametrize("dt", ACT_DTYPES, ids=lambda d: d.value)
ENTRY = default_registry().entry(FusedOps.NF4_MATMUL)


def _weight(rng: np.random.Generator, n: int, k: int, bs: int) -> tuple[np.ndarray, np.ndarray]:
    return nf4_quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), bs)


def _act(rng: np.random.Generator, shape: tuple[int, ...], dt: DType) -> np.ndarray:
    return rng.standard_normal(shape).astype(dt.np)


def _t64(a: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(np.asarray(a, np.float64), requires_grad=grad)


def check(out: np.ndarray, act: np.ndarray, packed: np.ndarray, absmax: np.ndarray, bs: int, dt: DType,
          transpose: bool = False) -> None:
    """out against float64 dequant-then-matmul, at the contraction tolerance S = |act| @ |W|."""
    w = dequant64(packed, absmax, bs)
    w = w if transpose else w.T
    a64 = np.asarray(act, np.float64)
    assert_close_contraction(out, a64 @ w, np.abs(a64) @ np.abs(w), dt)


def _impls(y: fl.Tensor) -> list[str]:
    with fl.trace() as t:
        fl.realize(y)
    return [r.impl for r in t.records]


@ACTS
@pytest.mark.parametrize(("shape", "n", "bs"), [((1, 256), 48, 64), ((3, 256), 20, 128), ((64, 128), 40, 64),
                                                ((2, 3, 384), 24, 128), ((4, 96), 8, 32), ((5, 72), 7, 24),
                                                ((2, 20, 128), 1040, 64)],
                         ids=str)
def test_forward_matches_float64(dt: DType, shape: tuple[int, ...], n: int, bs: int) -> None:
    rng = np.random.default_rng(1)
    packed, absmax = _weight(rng, n, shape[-1], bs)
    x = _act(rng, shape, dt)
    y = fl.ops.nf4_matmul(x, packed, absmax, bs)
    assert y.shape == shape[:-1] + (n,) and y.dtype is dt
    assert any(i.startswith("Nf4Matmul[") for i in _impls(y))
    check(y.numpy(), x, packed, absmax, bs, dt)


def _bnb(w: np.ndarray, bs: int) -> tuple[np.ndarray, np.ndarray, torch.Tensor, Any]:
    q, st = bnbf.quantize_4bit(torch.tensor(w), blocksize=bs, quant_type="nf4")
    n, k = w.shape
    return q.numpy().reshape(n, k // 2), st.absmax.numpy().reshape(n, k // bs), q, st


TORCH = {DType.F32: torch.float32, DType.BF16: torch.bfloat16, DType.F16: torch.float16}


@ACTS
@pytest.mark.parametrize("m", [1, 3, 64])
@pytest.mark.parametrize("bs", [64, 128])
def test_forward_matches_bitsandbytes_matmul_4bit(dt: DType, m: int, bs: int) -> None:
    """bitsandbytes' weights loaded unchanged; bnb.matmul_4bit on the CPU is `x @ dequantize_4bit(W).T`
    in the activation dtype (for bf16/f16 it rounds each weight to that type first), so the bound is
    two roundings of the activation dtype on the scale S plus one on the value."""
    rng = np.random.default_rng(m + bs)
    w = (rng.standard_normal((40, 4 * bs)) * 0.05).astype(np.float32)
    packed, absmax, q, st = _bnb(w, bs)
    x = _act(rng, (m, 4 * bs), dt)
    xt = torch.tensor(x.astype(np.float32)).to(TORCH[dt])
    want = bnb.matmul_4bit(xt, q.t(), quant_state=st).float().numpy().astype(np.float64)
    got = fl.ops.nf4_matmul(x, packed, absmax, bs).numpy().astype(np.float64)
    scale = np.abs(x.astype(np.float64)) @ np.abs(dequant64(packed, absmax, bs)).T
    if dt is DType.F32:
        assert_close_contraction(got, want, scale, dt)
    else:
        u = 2.0**-8 if dt is DType.BF16 else 2.0**-11
        assert (np.abs(got - want) <= 2 * u * scale + 2 * u * np.abs(want) + 1e-30).all()


@pytest.mark.parametrize("bs", [64, 128])
def test_dequantisation_is_bitsandbytes_bit_for_bit(bs: int) -> None:
    """The decomposition's f32 weights (nibbles by float arithmetic, index_select on the table) are
    bitsandbytes' dequantize_4bit exactly."""
    rng = np.random.default_rng(bs)
    w = (rng.standard_normal((24, 3 * bs)) * 0.05).astype(np.float32)
    w[3, :bs] = 0.0
    packed, absmax, q, st = _bnb(w, bs)
    want = bnbf.dequantize_4bit(q, st).numpy()
    got = dequantize(fl.tensor(packed), fl.tensor(absmax), bs, DType.F32).numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("shape", "n", "bs", "transpose"),
                         [((3, 256), 16, 64, False), ((70, 512), 12, 128, False), ((2, 2, 24), 24, 64, True)], ids=str)
def test_decomposition_matches_kernel_in_f32(shape: tuple[int, ...], n: int, bs: int, transpose: bool) -> None:
    rng = np.random.default_rng(2)
    k = 4 * bs
    packed, absmax = _weight(rng, n, k, bs)
    x = _act(rng, shape, DType.F32)
    fused = fl.ops.nf4_matmul(x, packed, absmax, bs, transpose=transpose)
    lowered = decompose([fl.tensor(x), fl.tensor(packed), fl.tensor(absmax)], Nf4MatmulParams(bs, transpose))
    assert (lowered.shape, lowered.dtype) == (fused.shape, fused.dtype)
    got, want = fused.numpy(), fl.realize(lowered, fuse=False)[0].numpy()
    # The same f32 weights and products, summed in another order.
    w = np.abs(dequant64(packed, absmax, bs))
    scale = np.abs(x.astype(np.float64)) @ (w if transpose else w.T)
    assert (np.abs(got.astype(np.float64) - want) <= 2e-6 * scale).all()


def test_f64_activations_run_through_the_decomposition() -> None:
    rng = np.random.default_rng(3)
    packed, absmax = _weight(rng, 10, 128, 64)
    x = _act(rng, (3, 128), DType.F64)
    y = fl.ops.nf4_matmul(x, packed, absmax)
    assert y.dtype is DType.F64 and not any(i.startswith("Nf4Matmul[") for i in _impls(y))
    np.testing.assert_allclose(y.numpy(), x @ dequant64(packed, absmax, 64).T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("shape", "n", "k"), [((0, 64), 5, 64), ((3, 64), 0, 64), ((2, 0, 64), 4, 64),
                                               ((3, 0), 4, 0), ((1, 64), 1, 64), ((1, 1, 64), 3, 64)], ids=str)
def test_empty_and_size_one_dims(shape: tuple[int, ...], n: int, k: int) -> None:
    rng = np.random.default_rng(4)
    packed, absmax = _weight(rng, n, k, 64)
    x = _act(rng, shape, DType.F32)
    for transpose in (False, True):
        a = x if not transpose else _act(rng, shape[:-1] + (n,), DType.F32)
        y = fl.ops.nf4_matmul(a, packed, absmax, transpose=transpose).numpy()
        assert y.shape == shape[:-1] + ((k if transpose else n),)
        check(y, a, packed, absmax, 64, DType.F32, transpose)


@ACTS
def test_non_contiguous_activations(dt: DType) -> None:
    rng = np.random.default_rng(5)
    packed, absmax = _weight(rng, 12, 128, 64)
    xt = _act(rng, (2, 128, 3), dt)
    x = fl.tensor(xt).transpose(-2, -1)  # [2, 3, 128], k strided
    check(fl.ops.nf4_matmul(x, packed, absmax).numpy(), xt.transpose(0, 2, 1), packed, absmax, 64, dt)
    wide = _act(rng, (5, 256), dt)
    check(fl.ops.nf4_matmul(fl.tensor(wide)[:, ::2], packed, absmax).numpy(), wide[:, ::2], packed, absmax, 64, dt)
    row = _act(rng, (1, 128), dt)
    y = fl.ops.nf4_matmul(fl.tensor(row).broadcast_to(4, 128), packed, absmax).numpy()
    check(y, np.broadcast_to(row, (4, 128)), packed, absmax, 64, dt)


@pytest.mark.parametrize("dt", [DType.F32, DType.BF16], ids=lambda d: d.value)
@pytest.mark.parametrize(("shape", "n", "bs"), [((1, 128), 24, 64), ((2, 5, 256), 16, 128), ((70, 64), 9, 32)],
                         ids=str)
def test_gradients_match_torch(dt: DType, shape: tuple[int, ...], n: int, bs: int) -> None:
    """d act = g @ W (a transposed Nf4Matmul) and d absmax, against torch autograd of act @ W.T in float64."""
    rng = np.random.default_rng(6)
    packed, absmax = _weight(rng, n, shape[-1], bs)
    x_np, g_np = _act(rng, shape, dt), _act(rng, shape[:-1] + (n,), dt)
    x, am = fl.tensor(x_np), fl.tensor(absmax)
    y = fl.ops.nf4_matmul(x, packed, am, bs)
    gx, gam = fl.grad(y, [x, am], fl.tensor(g_np))
    assert any(i.startswith("Nf4Matmul[") for i in _impls(gx))

    def torch_grads(absolute: bool) -> list[np.ndarray]:
        fix = np.abs if absolute else np.asarray
        xt, amt = _t64(fix(x_np), True), _t64(absmax, True)
        values = torch.tensor(fix(NF4.astype(np.float64)[nf4_codes(packed)]))
        w = values * amt.repeat_interleave(bs, dim=1)
        return [t.numpy() for t in torch.autograd.grad(xt @ w.T, [xt, amt], _t64(fix(g_np)))]

    (want_x, want_am), (scale_x, scale_am) = torch_grads(False), torch_grads(True)
    assert gx.dtype is dt and gam.dtype is DType.F32
    assert_close_contraction(gx.numpy(), want_x, scale_x, dt)
    assert_close_contraction(gam.numpy(), want_am, scale_am, DType.F32)


def test_gradient_of_the_transposed_product() -> None:
    """The transposed node's own VJP (second order): d g = dy @ W.T, a forward Nf4Matmul."""
    rng = np.random.default_rng(7)
    packed, absmax = _weight(rng, 8, 128, 64)
    g_np, dy = _act(rng, (3, 8), DType.F32), _act(rng, (3, 128), DType.F32)
    g = fl.tensor(g_np)
    (dg,) = fl.grad(fl.ops.nf4_matmul(g, packed, absmax, transpose=True), [g], fl.tensor(dy))
    check(dg.numpy(), dy, packed, absmax, 64, DType.F32)


def test_packed_weights_get_no_gradient() -> None:
    rng = np.random.default_rng(8)
    packed, absmax = _weight(rng, 4, 64, 64)
    w = fl.tensor(packed)
    y = fl.ops.nf4_matmul(_act(rng, (2, 64), DType.F32), w, absmax)
    with pytest.raises(fl.DTypeError, match="u8"):
        fl.grad(y.sum(), [w])


@pytest.mark.parametrize(
    ("act", "w", "am", "bs", "err", "words"),
    [
        ((64,), (4, 32), (4, 1), 64, fl.ShapeError, "rank >= 2"),
        ((2, 5), (4, 2), (4, 2), 2, fl.ShapeError, "K must be even"),
        ((2, 96), (4, 48), (4, 1), 64, fl.ShapeError, "K=96 (w_packed [4, 48]) is not a multiple of block_size 64"),
        ((2, 64), (4, 32), (4, 2), 64, fl.ShapeError, "absmax must be [N, K/block_size] = [4, 1], got [4, 2]"),
        ((2, 64), (4, 32, 1), (4, 1), 64, fl.ShapeError, "w_packed must be [N, K/2]"),
        ((2, 128), (4, 32), (4, 1), 64, fl.ShapeError, "act has K=128 but w_packed [4, 32] holds K=64"),
        ((2, 64), (4, 32), (4, 1), 0, fl.ParamError, "positive even int, got 0"),
        ((2, 64), (4, 32), (4, 2), 31, fl.ParamError, "positive even int, got 31"),
        ((2, 64), (4, 32), (4, 1), True, fl.ParamError, "positive even int"),
    ],
)
def test_build_errors(act: tuple[int, ...], w: tuple[int, ...], am: tuple[int, ...], bs: int,
                      err: type[Exception], words: str) -> None:
    with pytest.raises(err, match="nf4_matmul") as info:
        fl.ops.nf4_matmul(np.zeros(act, np.float32), np.zeros(w, np.uint8), np.zeros(am, np.float32), bs)
    assert words in str(info.value)


def test_transposed_shape_error_and_dtype_errors() -> None:
    x, w, am = np.zeros((2, 64), np.float32), np.zeros((4, 32), np.uint8), np.zeros((4, 1), np.float32)
    with pytest.raises(fl.ShapeError, match="nf4_matmul: act has N=64 but w_packed"):
        fl.ops.nf4_matmul(x, w, am, transpose=True)
    with pytest.raises(fl.DTypeError, match="nf4_matmul: w_packed must be u8"):
        fl.ops.nf4_matmul(x, w.astype(np.float32), am)
    with pytest.raises(fl.DTypeError, match="nf4_matmul: absmax must be f32, got f16"):
        fl.ops.nf4_matmul(x, w, am.astype(np.float16))
    with pytest.raises(fl.DTypeError, match="nf4_matmul: absmax must be f32, got f64"):
        fl.ops.nf4_matmul(x, w, am.astype(np.float64))
    with pytest.raises(fl.DTypeError, match="nf4_matmul: act must be f32, bf16 or f16, got u8"):
        fl.ops.nf4_matmul(x.astype(np.uint8), w, am)
    with pytest.raises(fl.ParamError, match="nf4_matmul: transpose must be a bool"):
        fl.ops.nf4_matmul(x, w, am, transpose=1)


@pytest.mark.parametrize(("rows", "bs", "transpose"), [(1, 64, False), (3, 128, False), (20, 64, False),
                                                       (2, 64, True), (1, 24, False)], ids=str)
def test_same_bytes_with_one_and_two_threads(rows: int, bs: int, transpose: bool) -> None:
    """Decode (parallel over output columns), tile (BLAS) and transposed paths, Numba and BLAS threads."""
    rng = np.random.default_rng(9)
    n, k = 300, 8 * bs
    packed, absmax = _weight(rng, n, k, bs)
    x = _act(rng, (rows, n if transpose else k), DType.F32)
    impl = fl.kernels().lookup(FusedOps.NF4_MATMUL, "cpu", (DType.F32, DType.U8, DType.F32, DType.F32))
    assert impl is not None
    outs = []
    for threads in thread_counts():
        with fuel_threads(threads), threadpool_limits(threads, "blas"):
            outs.append(output_for(ENTRY, impl, [x, packed, absmax], Nf4MatmulParams(bs, transpose)).tobytes())
    assert len(set(outs)) == 1


@pytest.mark.parametrize("bs", [32, 64, 128])
@pytest.mark.parametrize("table", [False, True] if LUT32 else [False])
def test_one_row_by_table_and_portable_both_match(bs: int, table: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One activation row by table (AVX-512 and AVX2 hosts: codes looked up 8 or 16 bytes at a time, the
    activations permuted to the lanes' order, each block's absmax applied to its sum) and by the portable path: both
    match float64, give bitsandbytes' values on identity rows, and the same bytes on any thread count."""
    monkeypatch.setattr(nf4_kernels, "USE_TABLE", table)
    rng = np.random.default_rng(31)
    n, k = 37, 4096 + bs
    packed, absmax = _weight(rng, n, k, bs)
    x = _act(rng, (1, k), DType.F32)
    outs = []
    for threads in thread_counts():
        with fuel_threads(threads):
            out = np.empty((1, n), np.float32)
            nf4_kernels._forward(x, packed, absmax, bs, out)
            outs.append(out.tobytes())
    assert len(set(outs)) == 1
    check(out, x, packed, absmax, bs, DType.F32)
    deq = np.asarray(NF4, np.float32)[nf4_codes(packed)] * np.repeat(absmax, bs, axis=1)  # bnb: one rounding
    for i in (0, 1, 14, 15, 16, 17, bs - 1, bs, k - 2, k - 1):
        unit = np.zeros((1, k), np.float32)
        unit[0, i] = 1
        nf4_kernels._forward(unit, packed, absmax, bs, out)
        np.testing.assert_array_equal(out[0], deq[:, i])


def test_jit_decode_step_replays_without_a_dequantised_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """An M=1 step is the fused decode kernel: no dequantised tile and no scratch buffer, so the
    replay runs with both taken away."""
    rng = np.random.default_rng(10)
    packed, absmax = _weight(rng, 64, 256, 64)
    f = fl.jit(lambda x: fl.ops.nf4_matmul(x, packed, absmax))
    x1, x2 = _act(rng, (1, 256), DType.F32), _act(rng, (1, 256), DType.F32)
    first = f(x1).numpy().copy()

    def refuse(*args: object) -> None:
        raise AssertionError("the decode path allocated or dequantised a tile")

    class NoPool:
        empty = staticmethod(refuse)

    monkeypatch.setattr(nf4_kernels, "_dequant_tile", refuse)
    monkeypatch.setattr(nf4_kernels, "POOL", NoPool())
    second = f(x2).numpy()
    again = f(x1).numpy()
    monkeypatch.undo()
    np.testing.assert_array_equal(first, fl.ops.nf4_matmul(x1, packed, absmax).numpy())
    np.testing.assert_array_equal(again, first)
    np.testing.assert_array_equal(second, fl.ops.nf4_matmul(x2, packed, absmax).numpy())


@pytest.mark.parametrize(("rows", "bs", "table"), [(2, 64, True), (3, 32, True), (4, 128, True), (1, 64, False)],
                         ids=str)
def test_few_row_decode_steps_replay_natively(rows: int, bs: int, table: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode-sized f32 step (up to DECODE_MAX_ROWS rows, one row without the table too) replays as the
    two jobs the eager kernel runs (the activations split by k's parity into the jobs' scratch, then the
    fused dots): the Python replay's bytes, and float64 dequantise-then-matmul's values for new
    activations at every call."""
    from fuel.runtime import replay

    monkeypatch.setattr(nf4_kernels, "USE_TABLE", table and LUT32)
    rng = np.random.default_rng(rows)
    n, k = 40, 256
    packed, absmax = _weight(rng, n, k, bs)
    xs = [_act(rng, (rows, k), DType.F32) for _ in range(3)]

    def fn(x: fl.Tensor) -> fl.Tensor:
        return fl.ops.nf4_matmul(x, fl.tensor(packed), fl.tensor(absmax), bs)

    with monkeypatch.context() as m:
        m.setattr(replay, "prepare", lambda *a, **kw: None)
        python = fl.jit(fn)
        want = [python(x).numpy() for x in xs]
    f = fl.jit(fn)
    got = [f(x).numpy() for x in xs]
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]
    cap = f.capture_for(xs[0])
    assert cap is not None and cap.native is not None and len(cap.native.program.jobs) == 2
    for x, g in zip(xs, got, strict=True):
        check(g, x, packed, absmax, bs, DType.F32)


def test_cost_counts_real_bytes() -> None:
    impl = fl.kernels().lookup(FusedOps.NF4_MATMUL, "cpu", (DType.BF16, DType.U8, DType.F32, DType.BF16))
    assert impl is not None and impl.precision.bit_stable_on_same_hardware
    c = impl.cost([(1, 4096), (4096, 2048), (4096, 64), (1, 4096)], impl.dtypes, Nf4MatmulParams(64))
    assert c.bytes_moved == 4096 * 2048 + 4096 * 64 * 4 + 4096 * 2 + 4096 * 2
    assert c.flops == 2 * 4096 * 4096 + 4096 * 4096
