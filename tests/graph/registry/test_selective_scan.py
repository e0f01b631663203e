"""SelectiveScan (entry 19) against torch float64 `selective_scan_ref` (mamba_ssm's reference loop,
written out here in torch): y and last_state in every dtype with and without softplus, gradients of
every input against torch autograd, edge shapes, errors, thread-count bit-stability and `fl.jit`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.cpu.scans.selective_scan import selective_scan as scan_kernel
from fuel.cpu.scans.selective_scan import selective_scan_grad
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry import FusedOps, default_registry
from fuel.graph.registry.selective_scan import SelectiveScanParams, decompose
from fuel.testing.check import excess, floor_of, nonfinite_mismatch, row_max_scale
from fuel.testing.contract import fuel_threads
from fuel.testing.reference.selective_scan import mamba_inputs

DTYPES = pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)
SOFTPLUS = pytest.mark.parametrize("sp", [False, True], ids=["dt", "softplus"])
# (B, L, dim, N): Mamba-like, decode (L = 1), empty sequence, B = 1, one channel, one state, more
# channels than a kernel block (64) with a tail, an empty batch and no channels.
SHAPES = [(2, 12, 5, 4), (1, 1, 3, 2), (1, 0, 3, 2), (1, 9, 4, 3), (2, 8, 1, 1), (2, 6, 3, 1),
          (1, 20, 70, 3), (0, 4, 3, 2), (2, 5, 0, 3)]
# Forward: one rounding of the output (1 ulp of |ref| covers it) plus the f64 state's own error, per
# element relative to S, the same recurrence over the |terms|. Gradients: 1 ulp plus f64 error relative
# to the larger of the gradient's row maximum (its last axis) and the gradient of the recurrence over
# |u|, |b|, |c| and |weights| (a sum of |terms|: a one-wide row cancels to anything).
FWD_TOL = {DType.F64: (2.3e-16, 1e-14), DType.F32: (1.2e-7, 1e-13), DType.BF16: (7.9e-3, 1e-13),
           DType.F16: (9.8e-4, 1e-13)}
GRAD_TOL = {DType.F64: (2.3e-16, 1e-13), DType.F32: (1.2e-7, 1e-12), DType.BF16: (7.9e-3, 1e-12),
            DType.F16: (9.8e-4, 1e-12)}


def _t64(a: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def selective_scan_ref(u: torch.Tensor, delta: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                       delta_softplus: bool, absolute: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """mamba_ssm's `selective_scan_ref` (D = z = delta_bias = None, return_last_state=True) on Fuel's
    channels-last layout: u, delta [B, L, dim] and b, c [B, L, N] are transposed to its (B, dim, L) and
    (B, N, L). `absolute` runs the recurrence over |δ·u|, |b|, |c|: the local scale of each result."""
    u, delta, b, c = u.transpose(1, 2), delta.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2)
    if delta_softplus:
        delta = F.softplus(delta)
    batch, dim, dstate = u.shape[0], a.shape[0], a.shape[1]
    x = a.new_zeros((batch, dim, dstate))
    delta_a = torch.exp(torch.einsum("bdl,dn->bdln", delta, a))
    delta_b_u = torch.einsum("bdl,bnl,bdl->bdln", delta, b, u)
    if absolute:
        delta_b_u, c = delta_b_u.abs(), c.abs()
    ys = []
    for i in range(u.shape[2]):
        x = delta_a[:, :, i] * x + delta_b_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, c[:, :, i]))
    # L = 0: no step; `0 · u` keeps every input in the graph (zero gradients).
    y = torch.stack(ys, dim=2) if ys else u * 0 + (delta.sum() + b.sum() + c.sum() + a.sum()) * 0
    return y.transpose(1, 2), x


def _check(out: np.ndarray, ref: np.ndarray, scale: np.ndarray, tol: tuple[float, float], dt: DType) -> None:
    o = np.asarray(out, np.float64)
    assert o.shape == ref.shape
    why = nonfinite_mismatch(o, ref)
    assert why is None, why
    ratio = excess(o, ref, scale, tol[0], tol[1], floor_of(dt.np))
    assert ratio.size == 0 or float(ratio.max()) <= 1.0, f"worst |err|/allowed {float(ratio.max()):.3g} ({dt.value})"


def check_forward(y: np.ndarray, last: np.ndarray, arrays: list[np.ndarray], sp: bool, dt: DType) -> None:
    with torch.no_grad():
        ref = [r.numpy() for r in selective_scan_ref(*(_t64(a) for a in arrays), sp)]
        scale = [s.numpy() for s in selective_scan_ref(*(_t64(a) for a in arrays), sp, absolute=True)]
    for got, r, s in zip((y, last), ref, scale, strict=True):
        _check(got, r, s, FWD_TOL[dt], dt)


def _run(arrays: list[np.ndarray], sp: bool) -> tuple[np.ndarray, np.ndarray]:
    y, last = fl.ops.selective_scan(*arrays, delta_softplus=sp)
    y, last = fl.realize(y, last)
    return y.numpy(), last.numpy()


@DTYPES
@SOFTPLUS
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_matches_torch(dt: DType, sp: bool, shape: tuple[int, int, int, int]) -> None:
    arrays = list(mamba_inputs(np.random.default_rng(1), shape, dt, sp))
    y, last = fl.ops.selective_scan(*arrays, delta_softplus=sp)
    nb, seq, dim, ns = shape
    assert (y.shape, last.shape, y.dtype, last.dtype) == ((nb, seq, dim), (nb, dim, ns), dt, dt)
    with fl.trace() as t:
        y_np, last_np = (r.numpy() for r in fl.realize(y, last))
    if y_np.size or last_np.size:
        assert any(r.impl.startswith("SelectiveScan[") for r in t.records)
    if seq == 0:
        assert not last_np.any()
    check_forward(y_np, last_np, arrays, sp, dt)


@DTYPES
@SOFTPLUS
def test_wide_inputs(dt: DType, sp: bool) -> None:
    """Any a (growing states without softplus), delta across softplus's threshold 20 and far below it."""
    rng = np.random.default_rng(2)
    nb, seq, dim, ns = 2, 14, 9, 6
    a = rng.standard_normal((dim, ns))
    delta = rng.standard_normal((nb, seq, dim)) * (12.0 if sp else 0.3)
    arrays = [rng.standard_normal((nb, seq, dim)) * 3, delta, -np.abs(a) if sp else a,
              rng.standard_normal((nb, seq, ns)), rng.standard_normal((nb, seq, ns))]
    arrays = [x.astype(dt.np) for x in arrays]
    check_forward(*_run(arrays, sp), arrays, sp, dt)


def test_nan_stays_in_its_channel() -> None:
    rng = np.random.default_rng(3)
    arrays = list(mamba_inputs(rng, (2, 10, 4, 3), DType.F32, False))
    arrays[0][1, 4, 2] = np.nan
    y, last = _run(arrays, False)
    assert np.isnan(y[1, 4:, 2]).all() and np.isnan(last[1, 2]).all()
    mask = np.ones(y.shape, bool)
    mask[1, 4:, 2] = False
    assert np.isfinite(y[mask]).all()
    check_forward(y, last, arrays, False, DType.F32)


def test_prefix_of_a_sequence_is_bit_identical() -> None:
    """Causality: the scan of the first k steps gives the first k outputs (and the state after step k)
    byte for byte; L = 1 is the decode step of a fresh sequence."""
    arrays = list(mamba_inputs(np.random.default_rng(4), (2, 16, 70, 4), DType.F32, True))
    y, _ = _run(arrays, True)
    for k in (1, 7):
        yk, _ = _run([x if x.ndim == 2 else np.ascontiguousarray(x[:, :k]) for x in arrays], True)
        np.testing.assert_array_equal(yk, y[:, :k])


@pytest.mark.parametrize("dt", [DType.F64, DType.F32], ids=lambda d: d.value)
@SOFTPLUS
def test_lowering_agrees_with_torch(dt: DType, sp: bool) -> None:
    rng = np.random.default_rng(5)
    for shape in [(2, 6, 3, 4), (1, 1, 2, 1), (1, 0, 2, 3)]:
        arrays = list(mamba_inputs(rng, shape, dt, sp))
        lowered = decompose([fl.tensor(a) for a in arrays], SelectiveScanParams(sp))
        y, last = fl.realize(*lowered, fuse=False)
        check_forward(y.numpy(), last.numpy(), arrays, sp, dt)


def _torch_grads(arrays: list[np.ndarray], wy: np.ndarray | None, wl: np.ndarray | None,
                 sp: bool) -> list[np.ndarray]:
    ts = [_t64(a, grad=True) for a in arrays]
    y, last = selective_scan_ref(*ts, sp)
    loss = (y * _t64(wy)).sum() if wy is not None else y.sum() * 0
    if wl is not None:
        loss = loss + (last * _t64(wl)).sum()
    return [g.numpy() for g in torch.autograd.grad(loss, ts)]


def _grad_scales(arrays: list[np.ndarray], wy: np.ndarray, wl: np.ndarray, sp: bool) -> list[np.ndarray]:
    u, delta, a, b, c = arrays
    absolute = [np.abs(u), delta, a, np.abs(b), np.abs(c)]
    terms = _torch_grads(absolute, np.abs(wy), np.abs(wl), sp)
    return [np.maximum(np.abs(t), row_max_scale(r))
            for t, r in zip(terms, _torch_grads(arrays, wy, wl, sp), strict=True)]


def _fuel_grads(arrays: list[np.ndarray], wy: np.ndarray | None, wl: np.ndarray | None,
                sp: bool) -> list[np.ndarray]:
    leaves = [fl.tensor(a) for a in arrays]
    y, last = fl.ops.selective_scan(*leaves, delta_softplus=sp)
    if wl is None:
        grads = fl.grad(y, leaves, wy)
    elif wy is None:
        grads = fl.grad(last, leaves, wl)
    else:
        grads = fl.grad((y * fl.tensor(wy)).sum() + (last * fl.tensor(wl)).sum(), leaves)
    return [g.numpy() for g in fl.realize(*grads)]


@DTYPES
@SOFTPLUS
@pytest.mark.parametrize("which", ["both", "dy", "dlast"])
@pytest.mark.parametrize("shape", [(2, 12, 5, 4), (1, 1, 3, 2), (1, 40, 70, 3), (2, 0, 3, 2)], ids=str)
def test_grad_matches_torch(dt: DType, sp: bool, which: str, shape: tuple[int, int, int, int]) -> None:
    rng = np.random.default_rng(6)
    arrays = list(mamba_inputs(rng, shape, dt, sp))
    nb, seq, dim, ns = shape
    wy = rng.standard_normal((nb, seq, dim)).astype(dt.np) if which != "dlast" else None
    wl = rng.standard_normal((nb, dim, ns)).astype(dt.np) if which != "dy" else None
    got = _fuel_grads(arrays, wy, wl, sp)
    refs = _torch_grads(arrays, wy, wl, sp)
    for g, r, x in zip(got, refs, arrays, strict=True):
        assert g.shape == x.shape and g.dtype == dt.np
        _check(g, r, row_max_scale(r), GRAD_TOL[dt], dt)


def test_grad_kernel_with_wide_inputs() -> None:
    rng = np.random.default_rng(7)
    nb, seq, dim, ns = 2, 70, 66, 5
    for sp in (False, True):
        a = rng.standard_normal((dim, ns))
        arrays = [rng.standard_normal((nb, seq, dim)), rng.standard_normal((nb, seq, dim)) * (6.0 if sp else 0.1),
                  -np.abs(a) if sp else a * 0.3, rng.standard_normal((nb, seq, ns)), rng.standard_normal((nb, seq, ns))]
        wy, wl = rng.standard_normal((nb, seq, dim)), rng.standard_normal((nb, dim, ns))
        got = selective_scan_grad([*arrays, wy, wl], SelectiveScanParams(sp))
        refs, scales = _torch_grads(arrays, wy, wl, sp), _grad_scales(arrays, wy, wl, sp)
        for g, r, s in zip(got, refs, scales, strict=True):
            _check(g, r, s, GRAD_TOL[DType.F64], DType.F64)


def test_non_contiguous_inputs() -> None:
    """A u built with permute, a transposed a and strided b/c give the contiguous inputs' bytes."""
    rng = np.random.default_rng(8)
    arrays = list(mamba_inputs(rng, (2, 9, 6, 4), DType.F32, True))
    want = _run(arrays, True)
    u = fl.tensor(np.ascontiguousarray(arrays[0].transpose(0, 2, 1))).permute(0, 2, 1)
    a = fl.tensor(np.ascontiguousarray(arrays[2].T)).transpose(0, 1)
    b = np.repeat(arrays[3], 2, axis=0)[::2]
    got = fl.realize(*fl.ops.selective_scan(u, arrays[1], a, b, arrays[4], True))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.numpy(), w)
    strided = [np.repeat(x, 2, axis=-1)[..., ::2] for x in arrays]
    assert not strided[0].flags.c_contiguous
    for g, w in zip(_run(strided, True), want, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)
def test_same_bytes_with_one_and_two_threads(dt: DType) -> None:
    rng = np.random.default_rng(9)
    arrays = list(mamba_inputs(rng, (2, 40, 150, 5), dt, True))
    cot = [rng.standard_normal((2, 40, 150)).astype(dt.np), rng.standard_normal((2, 150, 5)).astype(dt.np)]
    p = SelectiveScanParams(True)
    results = []
    for threads in (1, 2):
        with fuel_threads(threads):
            out = (np.empty((2, 40, 150), dt.np), np.empty((2, 150, 5), dt.np))
            scan_kernel(arrays, out, p)
            results.append([o.tobytes() for o in out] + [g.tobytes() for g in selective_scan_grad(arrays + cot, p)])
    assert results[0] == results[1]


def test_jit_replay_gives_the_realized_bytes() -> None:
    rng = np.random.default_rng(10)
    a = mamba_inputs(rng, (1, 1, 8, 4), DType.F32, True)[2]
    step = fl.jit(lambda u, d, b, c: fl.ops.selective_scan(u, d, a, b, c, delta_softplus=True))
    with fl.trace() as t:
        for _ in range(4):
            u, d, _, b, c = mamba_inputs(rng, (2, 3, 8, 4), DType.F32, True)
            got = step(u, d, b, c)
            want = _run([u, d, a, b, c], True)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(np.asarray(g), w)
    assert t.plans_built <= 2  # the jitted step's plan once, realize's once


@pytest.mark.parametrize(
    ("shapes", "words"),
    [
        (((2, 8), (2, 8), (8, 4), (2, 8, 4), (2, 8, 4)), "u must be [B, L, dim], got [2, 8]"),
        (((2, 8, 16), (2, 8, 15), (16, 4), (2, 8, 4), (2, 8, 4)), "delta must be [B, L, dim] = [2, 8, 16]"),
        (((2, 8, 16), (2, 8, 16), (15, 4), (2, 8, 4), (2, 8, 4)), "a must be [dim, dstate] = [16, dstate]"),
        (((2, 8, 16), (2, 8, 16), (16,), (2, 8, 4), (2, 8, 4)), "a must be [dim, dstate]"),
        (((2, 8, 16), (2, 8, 16), (16, 16), (2, 8, 4), (2, 8, 16)),
         "b must be [B, L, dstate] = [2, 8, 16], got [2, 8, 4]"),
        (((2, 8, 16), (2, 8, 16), (16, 4), (2, 8, 4), (2, 7, 4)), "c must be [B, L, dstate] = [2, 8, 4]"),
        (((2, 8, 16), (2, 8, 16), (16, 4), (8, 4), (2, 8, 4)), "b must be [B, L, dstate]"),
    ],
)
def test_shape_errors(shapes: tuple[tuple[int, ...], ...], words: str) -> None:
    with pytest.raises(fl.ShapeError) as info:
        fl.ops.selective_scan(*(np.zeros(s, np.float32) for s in shapes))
    assert words in str(info.value) and str(info.value).startswith("selective_scan")


def test_dtype_and_param_errors() -> None:
    u, a, b = np.zeros((1, 3, 2), np.float32), np.zeros((2, 4), np.float32), np.zeros((1, 3, 4), np.float32)
    with pytest.raises(fl.DTypeError, match="selective_scan: a must have u's dtype f32, got f64"):
        fl.ops.selective_scan(u, u, a.astype(np.float64), b, b)
    with pytest.raises(fl.DTypeError, match="selective_scan: c must have u's dtype f32, got bf16"):
        fl.ops.selective_scan(u, u, a, b, fl.tensor(b).cast(DType.BF16))
    with pytest.raises(fl.DTypeError, match="u must be a float tensor"):
        fl.ops.selective_scan(*(x.astype(np.int64) for x in (u, u, a, b, b)))
    with pytest.raises(fl.ParamError, match="delta_softplus must be a bool"):
        fl.ops.selective_scan(u, u, a, b, b, delta_softplus=1)  # type: ignore[arg-type]
    entry = default_registry().entry(FusedOps.SELECTIVE_SCAN)
    assert entry.name == "SelectiveScan" and entry.arity == (5,) and entry.vjp is not None
    assert entry.output_views is not None


@settings(max_examples=20, deadline=None)
@given(nb=st.integers(1, 2), seq=st.integers(0, 12), dim=st.integers(1, 70), ns=st.integers(1, 5), sp=st.booleans(),
       grad=st.booleans(), seed=st.integers(0, 2**16))
def test_property(nb: int, seq: int, dim: int, ns: int, sp: bool, grad: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    dt = DType.F64 if grad else DType.F32
    arrays = list(mamba_inputs(rng, (nb, seq, dim, ns), dt, sp))
    check_forward(*_run(arrays, sp), arrays, sp, dt)
    if grad:
        wy, wl = rng.standard_normal((nb, seq, dim)), rng.standard_normal((nb, dim, ns))
        refs, scales = _torch_grads(arrays, wy, wl, sp), _grad_scales(arrays, wy, wl, sp)
        for g, r, s in zip(_fuel_grads(arrays, wy, wl, sp), refs, scales, strict=True):
            _check(g, r, s, GRAD_TOL[dt], dt)
