"""SsdChunkScan (entry 20) against a torch float64 sequential loop and a torch float64 port of
mamba_ssm's `ssd_minimal_discrete`: both slots in every dtype, gradients of every input against
torch autograd, parameter/shape/dtype errors, edge shapes, bit-stability and `fl.jit` replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fuel as fl
from fuel.cpu.scans.ssd_chunk_scan import ssd_chunk_scan_f16, ssd_chunk_scan_f32, ssd_chunk_scan_grad
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry.ssd_chunk_scan import SsdChunkScanParams, decompose
from fuel.testing.check import as64, excess, floor_of, nonfinite_mismatch, row_max_scale
from fuel.testing.contract import fuel_threads
from fuel.testing.reference.ssd_chunk_scan import mamba2_inputs

DTYPES = pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)
# One rounding of a float64 result (1 ulp of the output format), plus float64-level error per |term|.
REL = {DType.F64: 4e-15, DType.F32: 1.2e-7, DType.BF16: 7.9e-3, DType.F16: 9.8e-4}
ABS = 1e-14
# (B, L, H, P, N, chunk): a Mamba-2 head (P 64, N 128, chunk 64), small ones, L = chunk, size-1 dims
SHAPES = [(1, 128, 2, 64, 128, 64), (2, 8, 3, 4, 5, 4), (1, 16, 1, 8, 16, 16), (1, 1, 1, 1, 1, 1),
          (3, 6, 2, 1, 7, 3), (1, 4, 2, 5, 1, 2), (2, 0, 2, 3, 4, 4)]


def _t64(a: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def torch_loop(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
               absolute: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequential recurrence, step by step (on the terms' magnitudes when `absolute`)."""
    nb, length, nh, p = x.shape
    h = x.new_zeros(nb, nh, p, b.shape[3]) + 0 * a.sum()
    ys = []
    for t in range(length):
        e = torch.exp(dt[:, t] * a)[..., None, None]
        u, bt, ct = dt[:, t, :, None] * x[:, t], b[:, t], c[:, t]
        if absolute:
            u, bt, ct = u.abs(), bt.abs(), ct.abs()
        h = e * h + u[..., None] * bt[:, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, ct))
    y = torch.stack(ys, 1) if ys else x[:, :0] * 0
    return y, h


def _segsum(x: torch.Tensor) -> torch.Tensor:
    t = x.size(-1)
    x = x[..., None].repeat(*([1] * x.dim()), t)
    x = x.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool), diagonal=-1), 0)
    return torch.cumsum(x, dim=-2).masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), -torch.inf)


def ssd_minimal_discrete(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                         block_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """mamba_ssm.modules.ssd_minimal.ssd_minimal_discrete (einops spelled out): x (b,l,h,p), a (b,l,h),
    b and c (b,l,h,n) -> (y, final_state (b,h,p,n))."""
    x, a, b, c = (v.reshape(v.shape[0], -1, block_len, *v.shape[2:]) for v in (x, a, b, c))
    a = a.permute(0, 3, 1, 2)
    a_cumsum = torch.cumsum(a, dim=-1)
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", c, b, torch.exp(_segsum(a)), x)
    decay_states = torch.exp(a_cumsum[:, :, :, -1:] - a_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b, decay_states, x)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = torch.exp(_segsum(F.pad(a_cumsum[:, :, :, -1], (1, 0))))
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", c, states, torch.exp(a_cumsum))
    y = y_diag + y_off
    return y.reshape(y.shape[0], -1, *y.shape[3:]), final_state


def check(out: np.ndarray, ref: np.ndarray, scale: np.ndarray, dt: DType, rel: float | None = None) -> None:
    o, r = as64(out), as64(ref)
    assert o.shape == r.shape
    assert nonfinite_mismatch(o, r) is None
    ratio = excess(o, r, scale, REL[dt] if rel is None else rel, ABS, floor_of(dt.np))
    assert not (ratio > 1).any(), f"worst |err|/allowed {float(ratio.max()):.3e} ({dt.value})"


def _forward_refs(arrays: tuple[np.ndarray, ...]) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    ts = [_t64(v) for v in arrays]
    refs = tuple(r.numpy() for r in torch_loop(*ts))
    scales = tuple(s.numpy() for s in torch_loop(*ts, absolute=True))
    return refs, scales


@DTYPES
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_matches_the_float64_loop(dt: DType, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    arrays = mamba2_inputs(rng, shape[:5], dt)
    with fl.trace() as t:
        y, last = fl.realize(*fl.ops.ssd_chunk_scan(*arrays, chunk_size=shape[5]))
    if y.size:
        assert any(r.impl.startswith("SsdChunkScan[") for r in t.records)
    nb, length, nh, p, n = shape[:5]
    assert y.shape == (nb, length, nh, p) and last.shape == (nb, nh, p, n) and y.dtype is dt and last.dtype is dt
    refs, scales = _forward_refs(arrays)
    for got, ref, s in zip((y.numpy(), last.numpy()), refs, scales, strict=True):
        check(got, ref, s, dt)


@pytest.mark.parametrize("shape", [(1, 128, 2, 64, 128, 64), (2, 12, 3, 4, 5, 4), (1, 6, 1, 1, 1, 6)], ids=str)
def test_matches_ssd_minimal_discrete(shape: tuple[int, ...]) -> None:
    """The chunked SSD form, an independent oracle: ssd_minimal_discrete(x·dt, a·dt, b, c, chunk)."""
    rng = np.random.default_rng(2)
    x, dt, a, b, c = mamba2_inputs(rng, shape[:5], DType.F64)
    y, last = fl.realize(*fl.ops.ssd_chunk_scan(x, dt, a, b, c, shape[5]))
    xt, dtt, at, bt, ct = (_t64(v) for v in (x, dt, a, b, c))
    ry, rlast = ssd_minimal_discrete(xt * dtt[..., None], at * dtt, bt, ct, shape[5])
    _, scales = _forward_refs((x, dt, a, b, c))
    for got, ref, s in zip((y.numpy(), last.numpy()), (ry.numpy(), rlast.numpy()), scales, strict=True):
        check(got, ref, s, DType.F64, rel=1e-13)  # the oracle's own cumsum-differences error


def test_large_steps_and_positive_decay() -> None:
    """Decays that underflow to 0 (dt·a = −800), e^-16 per step and growth (a > 0) all follow the loop."""
    rng = np.random.default_rng(3)
    x, dt, a, b, c = mamba2_inputs(rng, (2, 40, 3, 4, 6), DType.F64)
    dt[0, 5, 0], a[2] = 50.0, 0.5
    dt[1, :, 1] = 1.0
    y, last = fl.realize(*fl.ops.ssd_chunk_scan(x, dt, a, b, c, 8))
    refs, scales = _forward_refs((x, dt, a, b, c))
    for got, ref, s in zip((y.numpy(), last.numpy()), refs, scales, strict=True):
        check(got, ref, s, DType.F64)


def test_long_sequence_renormalises_the_state() -> None:
    """1500 steps of e^-0.8: the kernel's decay product passes 2^-300 and is folded back several times."""
    rng = np.random.default_rng(4)
    x, dt, a, b, c = mamba2_inputs(rng, (1, 1500, 2, 3, 4), DType.F32)
    dt[...] = np.float32(0.1)
    a[:] = np.float32(-8.0)
    y, last = fl.realize(*fl.ops.ssd_chunk_scan(x, dt, a, b, c, 100))
    refs, scales = _forward_refs((x, dt, a, b, c))
    for got, ref, s in zip((y.numpy(), last.numpy()), refs, scales, strict=True):
        check(got, ref, s, DType.F32)


def test_non_contiguous_inputs() -> None:
    rng = np.random.default_rng(5)
    x, dt, a, b, c = mamba2_inputs(rng, (2, 8, 3, 4, 5), DType.F32)
    xs = np.ascontiguousarray(x.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    bs = np.ascontiguousarray(b.transpose(3, 0, 1, 2)).transpose(1, 2, 3, 0)
    cs = np.repeat(c, 2, axis=3)[..., ::2]
    dts = np.ascontiguousarray(dt.T).T
    assert not (xs.flags.c_contiguous or bs.flags.c_contiguous or cs.flags.c_contiguous)
    y, last = fl.realize(*fl.ops.ssd_chunk_scan(xs, dts, a, bs, cs, 4))
    y0, last0 = fl.realize(*fl.ops.ssd_chunk_scan(x, dt, a, b, c, 4))
    np.testing.assert_array_equal(y.numpy(), y0.numpy())
    np.testing.assert_array_equal(last.numpy(), last0.numpy())


@pytest.mark.parametrize("dt", [DType.F64, DType.F32], ids=lambda d: d.value)
def test_lowering_agrees_with_the_loop(dt: DType) -> None:
    rng = np.random.default_rng(6)
    for shape in [(2, 5, 3, 4, 5), (1, 1, 1, 1, 1), (1, 0, 2, 2, 3)]:
        arrays = mamba2_inputs(rng, shape, dt)
        outs = decompose([fl.tensor(v) for v in arrays], SsdChunkScanParams(1))
        refs, scales = _forward_refs(arrays)
        for got, ref, s in zip(fl.realize(*outs, fuse=False), refs, scales, strict=True):
            assert got.dtype is dt
            check(got.numpy(), ref, s, dt)


def _grad_refs(arrays: tuple[np.ndarray, ...], dy: np.ndarray | None,
               dlast: np.ndarray | None) -> list[np.ndarray]:
    ts = [_t64(v, grad=True) for v in arrays]
    y, last = torch_loop(*ts)
    loss = (y * _t64(dy)).sum() if dy is not None else 0 * y.sum()
    if dlast is not None:
        loss = loss + (last * _t64(dlast)).sum()
    return [g.numpy() for g in torch.autograd.grad(loss, ts)]


MAMBA_SIZE = (1, 128, 2, 64, 128, 64)
SMALL_SHAPES = [(2, 8, 3, 4, 5, 4), (1, 1, 1, 1, 1, 1), (1, 70, 1, 2, 3, 7)]
# Every dtype, cotangent mix and small shape; the Mamba-size case once per dtype family (it is slow in f64).
GRAD_CASES = [(dt, which, shape) for dt in FLOAT_DTYPES for which in ("both", "dy", "dlast") for shape in SMALL_SHAPES]
GRAD_CASES += [(dt, "both", MAMBA_SIZE) for dt in FLOAT_DTYPES if dt is not DType.F16]


@pytest.mark.parametrize(("dt", "which", "shape"), GRAD_CASES, ids=str)
def test_gradients_match_torch_autograd(dt: DType, which: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(7)
    arrays = mamba2_inputs(rng, shape[:5], dt)
    nb, _, nh, p, n = shape[:5]
    leaves = [fl.tensor(v) for v in arrays]
    y, last = fl.ops.ssd_chunk_scan(*leaves, chunk_size=shape[5])
    dy = rng.standard_normal(y.shape).astype(dt.np) if which != "dlast" else None
    dlast = rng.standard_normal((nb, nh, p, n)).astype(dt.np) if which != "dy" else None
    loss = y.mul(fl.tensor(dy)).sum() if dy is not None else y.mul(0.0).sum()
    if dlast is not None:
        loss = loss + last.mul(fl.tensor(dlast)).sum()
    grads = fl.realize(*fl.grad(loss, leaves))
    refs = _grad_refs(arrays, dy, dlast)
    for got, ref, v in zip(grads, refs, arrays, strict=True):
        assert got.shape == v.shape and got.dtype is dt
        # float64 throughout, one rounding: 1 ulp of the output plus float64 error of the row's scale
        o, r = as64(got.numpy()), ref
        ratio = excess(o, r, row_max_scale(r), REL[dt], 1e-11, floor_of(dt.np))
        assert not (ratio > 1).any(), f"worst {float(ratio.max()):.3e}"


def test_gradient_with_empty_sequence_is_zero() -> None:
    x, dt, a, b, c = mamba2_inputs(np.random.default_rng(8), (2, 0, 3, 4, 5), DType.F32)
    dlast = np.ones((2, 3, 4, 5), np.float32)
    grads = ssd_chunk_scan_grad([x, dt, a, b, c, np.zeros_like(x), dlast], SsdChunkScanParams(4))
    assert [g.shape for g in grads] == [v.shape for v in (x, dt, a, b, c)]
    assert all(g.dtype == np.float32 for g in grads) and not grads[2].any()


def _case(seed: int, dt: DType) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = list(mamba2_inputs(rng, (2, 96, 3, 40, 24), dt))
    return arrays, rng.standard_normal((2, 96, 3, 40)).astype(dt.np), rng.standard_normal((2, 3, 40, 24)).astype(
        dt.np)


@DTYPES
def test_bit_stable_with_one_and_two_threads(dt: DType) -> None:
    arrays, dy, dlast = _case(9, dt)
    runs = []
    for threads in (1, 2):
        with fuel_threads(threads):
            out = (np.empty((2, 96, 3, 40), dt.np), np.empty((2, 3, 40, 24), dt.np))
            (ssd_chunk_scan_f16 if dt is DType.F16 else ssd_chunk_scan_f32)(arrays, out, SsdChunkScanParams(8))
            grads = ssd_chunk_scan_grad(arrays + [dy, dlast], SsdChunkScanParams(8))
            runs.append(b"".join(v.tobytes() for v in out + grads))
    assert runs[0] == runs[1]


def test_jit_replay_equals_realize() -> None:
    step = fl.jit(lambda x, dt, a, b, c: fl.ops.ssd_chunk_scan(x, dt, a, b, c, 4))
    rng = np.random.default_rng(10)
    for _ in range(3):
        arrays = mamba2_inputs(rng, (2, 8, 3, 4, 5), DType.F32)
        y, last = step(*arrays)
        ry, rlast = fl.realize(*fl.ops.ssd_chunk_scan(*arrays, chunk_size=4))
        np.testing.assert_array_equal(np.asarray(y), ry.numpy())
        np.testing.assert_array_equal(np.asarray(last), rlast.numpy())


def _zeros(shape: tuple[int, ...]) -> np.ndarray:
    return np.zeros(shape, np.float32)


@pytest.mark.parametrize(("chunk", "words"), [
    (0, "chunk_size must be positive, got 0"), (-4, "chunk_size must be positive, got -4"),
    (48, "chunk_size 48 does not divide the sequence length 128"), (3.0, "chunk_size must be an int"),
    (True, "chunk_size must be an int"),
])
def test_chunk_size_errors(chunk: object, words: str) -> None:
    x, dt, a, b, c = mamba2_inputs(np.random.default_rng(0), (1, 128, 2, 3, 4), DType.F32)
    with pytest.raises(fl.ParamError) as info:
        fl.ops.ssd_chunk_scan(x, dt, a, b, c, chunk)  # type: ignore[arg-type]
    assert words in str(info.value) and str(info.value).startswith("ssd_chunk_scan")


def test_empty_sequence_takes_any_chunk_size() -> None:
    y, last = fl.realize(*fl.ops.ssd_chunk_scan(*mamba2_inputs(np.random.default_rng(0), (1, 0, 2, 3, 4),
                                                                DType.F32), chunk_size=7))
    assert y.shape == (1, 0, 2, 3) and not last.numpy().any()


@pytest.mark.parametrize(("shapes", "words"), [
    (((2, 8, 3), (2, 8, 3), (3,), (2, 8, 3, 5), (2, 8, 3, 5)), "x must be [B, L, H, P]"),
    (((2, 8, 3, 4), (2, 8, 2), (3,), (2, 8, 3, 5), (2, 8, 3, 5)), "dt must be [B, L, H] = [2, 8, 3]"),
    (((2, 8, 3, 4), (2, 8, 3), (3, 1), (2, 8, 3, 5), (2, 8, 3, 5)), "a must be [H] = [3]"),
    (((2, 8, 3, 4), (2, 8, 3), (3,), (2, 8, 1, 5), (2, 8, 3, 5)), "b must be [B, L, H, N]"),
    (((2, 8, 3, 4), (2, 8, 3), (3,), (2, 8, 3, 5), (2, 8, 3, 6)), "c must have b's shape [2, 8, 3, 5]"),
])
def test_shape_errors(shapes: tuple[tuple[int, ...], ...], words: str) -> None:
    with pytest.raises(fl.ShapeError) as info:
        fl.ops.ssd_chunk_scan(*(_zeros(s) for s in shapes), chunk_size=4)
    assert words in str(info.value) and str(info.value).startswith("ssd_chunk_scan")


def test_dtype_errors() -> None:
    x, dt, a, b, c = mamba2_inputs(np.random.default_rng(0), (1, 4, 2, 3, 4), DType.F32)
    with pytest.raises(fl.DTypeError, match="ssd_chunk_scan: dt, a, b and c must have x's dtype f32"):
        fl.ops.ssd_chunk_scan(x, dt.astype(np.float64), a, b, c, 4)
    with pytest.raises(fl.DTypeError, match="x must be a float tensor"):
        fl.ops.ssd_chunk_scan(*(v.astype(np.int64) for v in (x, dt, a, b, c)), chunk_size=4)
