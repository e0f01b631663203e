"""FusedSoftmaxCrossEntropy (17) against torch's cross_entropy, every logits dtype and reduction: loss,
ignore_index (default and a real class id), edge shapes, the fused logits gradient, range errors, the
lowering, bit-stability and `fl.jit` replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fuel as fl
from fuel.cpu.fused_softmax_cross_entropy import cross_entropy, cross_entropy_grad
from fuel.dtype import DType
from fuel.graph.registry import FusedOps, default_registry
from fuel.graph.registry.fused_softmax_cross_entropy import FusedSoftmaxCrossEntropyParams
from fuel.testing.contract import fuel_threads
from fuel.testing.oracle import assert_close_rowwise
from fuel.testing.reference.fused_softmax_cross_entropy import targets_for

ce = fl.ops.fused_softmax_cross_entropy
REDUCTIONS = ["mean", "sum", "none"]
SHAPES = [(7, 33), (2, 3, 64), (3, 1000), (5, 1), (1, 32000)]
# The oracle sees float64 copies of the dtype-rounded logits, so the logits dtype adds no error: what
# is left is the kernel's f32 exps (f64 for f64 logits) and the one rounding of the f32 output. A
# per-row loss also gets an absolute allowance: log-sum-exp's error is absolute (about u_f32 per unit
# of spread of the row), which matters for losses near 0.
SCALAR_RTOL = {DType.F32: 1e-6, DType.F64: 1e-6, DType.F16: 1e-6, DType.BF16: 1e-6}
ROW_ATOL = 1e-6


def _logits(rng: np.random.Generator, shape: tuple[int, ...], dt: DType, scale: float = 3.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dt.np)


def _torch_loss(x: np.ndarray, t: np.ndarray, reduction: str, ii: int) -> np.ndarray:
    """torch on float64 copies: [..., V] flattened to [N, V]; PyTorch's NaN for an all-ignored mean is 0."""
    v = x.shape[-1]
    x64 = torch.from_numpy(x.astype(np.float64).reshape(-1, v))
    out = F.cross_entropy(x64, torch.from_numpy(t.reshape(-1)), ignore_index=ii, reduction=reduction).numpy()
    if reduction == "none":
        return out.reshape(t.shape)
    return np.nan_to_num(out, nan=0.0) if not (t != ii).any() else out


def _lower(x: np.ndarray, t: np.ndarray, params: FusedSoftmaxCrossEntropyParams) -> fl.Tensor:
    """The entry's primitive lowering, realised without fusing it back."""
    decompose = default_registry().entry(FusedOps.FUSED_SOFTMAX_CROSS_ENTROPY).decompose
    assert decompose is not None
    lowered = decompose([fl.tensor(x), fl.tensor(t)], params)
    assert isinstance(lowered, fl.Tensor)
    (out,) = fl.realize(lowered, fuse=False)
    return out


def _check_loss(got: np.ndarray, want: np.ndarray, dt: DType, reduction: str) -> None:
    assert got.dtype == np.float32
    if reduction == "none":
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=SCALAR_RTOL[dt], atol=ROW_ATOL)
    else:
        assert got.shape == ()
        np.testing.assert_allclose(got, want, rtol=SCALAR_RTOL[dt], atol=1e-30)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ii", [-100, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_matches_torch(float_dtype: DType, shape: tuple[int, ...], ii: int, reduction: str,
                               rng: np.random.Generator) -> None:
    x = _logits(rng, shape, float_dtype)
    t = targets_for(rng, shape[:-1], shape[-1], ii)
    with fl.trace() as tr:
        got = ce(x, t, reduction, ii).numpy()
    assert [r.impl for r in tr.records] == [f"FusedSoftmaxCrossEntropy[cpu:{float_dtype.value},i64,f32]"]
    _check_loss(got, _torch_loss(x, t, reduction, ii), float_dtype, reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradient_matches_torch_autograd(float_dtype: DType, reduction: str, rng: np.random.Generator) -> None:
    shape, ii = (3, 5, 40), 3
    x = _logits(rng, shape, float_dtype, 2.0)
    t = targets_for(rng, shape[:-1], shape[-1], ii)
    t[0, 0] = ii  # a real class id, ignored
    tx = fl.tensor(x)
    loss = ce(tx, t, reduction, ii)
    w = rng.standard_normal(shape[:-1])
    weighted = (loss * fl.tensor(w.astype(np.float32))).sum() if reduction == "none" else loss * 2.5
    (gx,) = fl.grad(weighted, [tx])
    with fl.trace() as tr:
        got = gx.numpy()
    assert "prim:cross_entropy_grad" in [r.impl for r in tr.records]
    assert got.dtype == float_dtype.np and got.shape == shape
    x64 = torch.tensor(x.astype(np.float64).reshape(-1, shape[-1]), requires_grad=True)
    tl = F.cross_entropy(x64, torch.from_numpy(t.reshape(-1)), ignore_index=ii, reduction=reduction)
    (tl * torch.from_numpy(w.astype(np.float32).astype(np.float64).reshape(-1))).sum().backward() \
        if reduction == "none" else (tl * 2.5).backward()
    assert x64.grad is not None
    want = x64.grad.numpy().reshape(shape)
    assert_close_rowwise(got, want, float_dtype, backward=True)
    assert not got[0, 0].any()  # the ignored row's gradient is exactly zero


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_confident_target_on_a_wide_row_keeps_its_relative_accuracy(reduction: str) -> None:
    """A target holding almost all the probability: the loss (~3e-9) and softmax_t − 1 are formed without
    cancellation. The oracle is the closed form: torch's float64 sums 1 + 31999 terms of e^-30, each
    rounded against the 1, and is itself off by 1.3e-4 relative here."""
    v = 32000
    x = np.zeros((2, v), np.float32)
    x[0, 7], x[1, 5] = 30.0, 1.0
    t = np.array([7, 5])
    params = FusedSoftmaxCrossEntropyParams(reduction, -100)
    tiny = (v - 1) * np.exp(-30.0)  # row 0: Σ_{j≠t} e^{x_j − max}
    rows = np.array([np.log1p(tiny), np.log(np.e + v - 1) - 1.0])
    want_loss = {"none": rows, "sum": rows.sum(), "mean": rows.mean()}[reduction]
    np.testing.assert_allclose(ce(x, t, reduction).numpy(), want_loss, rtol=2.4e-7)
    g = np.ones((2,) if reduction == "none" else (), np.float32)
    got = cross_entropy_grad([x, t, g], params).astype(np.float64)
    k = 0.5 if reduction == "mean" else 1.0
    s0, s1 = 1.0 + tiny, np.e + v - 1
    want = k * np.array([[np.exp(-30.0) / s0, -tiny / s0], [1.0 / s1 - 1.0, 1.0 / s1]])  # columns 5 and 7
    want[1] = k * np.array([np.e / s1 - 1.0, 1.0 / s1])
    np.testing.assert_allclose(got[:, [5, 7]], want, rtol=2.4e-7)
    np.testing.assert_allclose(got[0, :5], k * np.exp(-30.0) / s0, rtol=2.4e-7)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_every_target_ignored_gives_zero(float_dtype: DType, reduction: str, rng: np.random.Generator) -> None:
    x = _logits(rng, (4, 9), float_dtype)
    t = np.full(4, 2, np.int64)
    tx = fl.tensor(x)
    loss = ce(tx, t, reduction, ignore_index=2)
    got = loss.numpy()
    assert not got.any() and got.shape == (() if reduction != "none" else (4,))
    (gx,) = fl.grad(loss.sum() if reduction == "none" else loss, [tx])
    assert not gx.numpy().astype(np.float64).any()
    # PyTorch: NaN for the mean, 0 for the sum and the rows.
    if reduction != "mean":
        _check_loss(got, _torch_loss(x, t, reduction, 2), float_dtype, reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_rank1_logits_are_one_row_with_a_rank0_target(float_dtype: DType, reduction: str,
                                                      rng: np.random.Generator) -> None:
    x = _logits(rng, (50,), float_dtype)
    t = np.array(17, np.int64)
    tx = fl.tensor(x)
    loss = ce(tx, t, reduction)
    got = loss.numpy()
    assert got.shape == ()
    _check_loss(got, _torch_loss(x, t, reduction, -100), float_dtype, reduction)
    (gx,) = fl.grad(loss, [tx])
    x64 = torch.tensor(x.astype(np.float64), requires_grad=True)
    F.cross_entropy(x64[None], torch.tensor([17])).backward()
    assert x64.grad is not None
    assert_close_rowwise(gx.numpy(), x64.grad.numpy(), float_dtype, backward=True)


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 5), (0, 0)], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_zero_rows(shape: tuple[int, ...], reduction: str) -> None:
    x = np.zeros(shape, np.float32)
    t = np.zeros(shape[:-1], np.int64)
    tx = fl.tensor(x)
    loss = ce(tx, t, reduction)
    got = loss.numpy()
    assert got.dtype == np.float32
    if reduction == "none":
        assert got.shape == shape[:-1]
    else:
        assert got.shape == () and got == 0.0
    if t.size == 0:
        (gx,) = fl.grad(loss.sum() if reduction == "none" else loss, [tx])
        assert gx.numpy().shape == shape


def test_one_class_gives_zero_loss_and_gradient(float_dtype: DType, rng: np.random.Generator) -> None:
    x = _logits(rng, (5, 1), float_dtype)
    tx = fl.tensor(x)
    loss = ce(tx, np.zeros(5, np.int64), "none")
    assert not loss.numpy().any()
    (gx,) = fl.grad(loss.sum(), [tx])
    assert not gx.numpy().astype(np.float64).any()


def test_non_contiguous_logits(float_dtype: DType, rng: np.random.Generator) -> None:
    base = _logits(rng, (40, 12), float_dtype)
    x = np.ascontiguousarray(base.T[:, ::2])  # the [12, 20] view the graph takes, strided both ways
    t = targets_for(rng, (12,), 20, -100)
    for reduction in REDUCTIONS:
        tb = fl.tensor(base)
        loss = ce(tb.T[:, ::2], t, reduction)
        _check_loss(loss.numpy(), _torch_loss(x, t, reduction, -100), float_dtype, reduction)
        (gb,) = fl.grad(loss.sum() if reduction == "none" else loss, [tb])
        b64 = torch.tensor(base.astype(np.float64), requires_grad=True)
        F.cross_entropy(b64.T[:, ::2], torch.from_numpy(t), reduction=reduction).sum().backward()
        assert b64.grad is not None
        assert_close_rowwise(gb.numpy().T, b64.grad.numpy().T, float_dtype, backward=True)


def test_extreme_ignore_index(rng: np.random.Generator) -> None:
    """The `lazy_nn_loss` wrapper's i64::MIN: kernel and lowering agree with torch."""
    ii = -(2**63)
    x = _logits(rng, (6, 7), DType.F32)
    t = targets_for(rng, (6,), 7, ii, frac=0.5)
    for reduction in REDUCTIONS:
        params = FusedSoftmaxCrossEntropyParams(reduction, ii)
        want = _torch_loss(x, t, reduction, ii)
        _check_loss(ce(x, t, reduction, ii).numpy(), want, DType.F32, reduction)
        _check_loss(_lower(x, t, params).numpy(), want, DType.F32, reduction)


@pytest.mark.parametrize("bad", [-1, 5, 2**40, -(2**62)])
def test_out_of_range_target_raises_when_run(bad: int) -> None:
    x = np.zeros((3, 5), np.float32)
    t = np.array([0, bad, 4])
    loss = ce(x, t)  # building is fine: the values are only known when it runs
    with pytest.raises(fl.IndexOutOfRange,
                       match=rf"fused_softmax_cross_entropy: target {bad} at position \[1\] is out of range \[0, 5\)"):
        loss.numpy()
    tx = fl.tensor(x)
    (gx,) = fl.grad(ce(tx, t, "sum"), [tx])
    with pytest.raises(fl.IndexOutOfRange, match=f"target {bad} at position"):
        gx.numpy()
    with pytest.raises(fl.IndexOutOfRange):  # the lowering checks too
        _lower(x, t, FusedSoftmaxCrossEntropyParams("mean", -100))


def test_out_of_range_position_names_the_target_index() -> None:
    t = np.zeros((2, 3), np.int64)
    t[1, 2] = 9
    with pytest.raises(fl.IndexOutOfRange, match=r"target 9 at position \[1, 2\] is out of range \[0, 4\)"):
        ce(np.zeros((2, 3, 4), np.float32), t, "none").numpy()


def test_no_classes_is_out_of_range_unless_every_target_is_ignored() -> None:
    x = np.zeros((3, 0), np.float32)
    with pytest.raises(fl.IndexOutOfRange, match=r"target 0 at position \[0\] is out of range \[0, 0\)"):
        ce(x, np.zeros(3, np.int64)).numpy()
    for reduction in REDUCTIONS:
        assert not ce(x, np.full(3, -100, np.int64), reduction).numpy().any()
    p = FusedSoftmaxCrossEntropyParams("sum", -100)
    assert _lower(x, np.full(3, -100, np.int64), p).numpy() == 0.0
    with pytest.raises(fl.IndexOutOfRange):
        _lower(x, np.array([-100, 0, -100]), p)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ii", [-100, 3])
def test_lowering_honours_ignore_index(float_dtype: DType, reduction: str, ii: int,
                                       rng: np.random.Generator) -> None:
    x = _logits(rng, (2, 6, 10), float_dtype)
    t = targets_for(rng, (2, 6), 10, ii, frac=0.4)
    got = _lower(x, t, FusedSoftmaxCrossEntropyParams(reduction, ii))
    _check_loss(got.numpy(), _torch_loss(x, t, reduction, ii), float_dtype, reduction)
    np.testing.assert_allclose(got.numpy(), ce(x, t, reduction, ii).numpy(), rtol=2.4e-7, atol=1e-7)


@pytest.mark.parametrize(("build", "error", "message"), [
    (lambda: ce(np.zeros((2, 3), np.float32), np.zeros(2, np.uint32)), fl.DTypeError,
     "fused_softmax_cross_entropy: targets must be i64, got u32"),
    (lambda: ce(np.zeros((2, 3), np.float32), np.zeros(3, np.int64)), fl.ShapeError,
     r"targets must have logits' shape without its last axis, \[2\], got \[3\]"),
    (lambda: ce(np.float32(1.0), np.int64(0)), fl.ShapeError, "logits must have rank >= 1"),
    (lambda: ce(np.zeros((2, 3), np.int64), np.zeros(2, np.int64)), fl.DTypeError,
     "logits must be a float tensor .*, got i64"),
    (lambda: ce(np.zeros((2, 3), np.float32), np.zeros(2, np.int64), "avg"), fl.ParamError,
     "reduction must be one of 'mean', 'sum', 'none', got 'avg'"),
    (lambda: ce(np.zeros((2, 3), np.float32), np.zeros(2, np.int64), "mean", 1.5), fl.ParamError,
     "ignore_index must be an int, got 1.5"),
    (lambda: ce(np.zeros((2, 3), np.float32), np.zeros(2, np.int64), "mean", 2**63), fl.ParamError,
     "ignore_index must fit in i64"),
])
def test_bad_inputs_raise_at_build_time(build, error, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=message):
        build()


def test_same_bytes_with_one_and_two_threads(float_dtype: DType, rng: np.random.Generator) -> None:
    """The kernels themselves (the executor would reset Numba's thread count to fuel's)."""
    x = _logits(rng, (300, 1000), float_dtype)
    t = targets_for(rng, (300,), 1000, -100)
    g = rng.standard_normal(300).astype(np.float32)

    def run() -> list[bytes]:
        outs = []
        for r in REDUCTIONS:
            params = FusedSoftmaxCrossEntropyParams(r, -100)
            out = np.zeros(t.shape if r == "none" else (), np.float32)
            cross_entropy([x, t], out, params)
            outs.append(out.tobytes())
            outs.append(cross_entropy_grad([x, t, g if r == "none" else g[:1].reshape(())], params).tobytes())
        return outs

    with fuel_threads(1):
        one = run()
    with fuel_threads(2):
        two = run()
    assert one == two


def test_jit_replay_equals_realize(rng: np.random.Generator) -> None:
    def step(x: fl.Tensor, t: fl.Tensor) -> tuple[fl.Tensor, fl.Tensor]:
        loss = ce(x, t)
        (gx,) = fl.grad(loss, [x])
        return loss, gx

    f = fl.jit(step)
    for seed in range(3):
        r = np.random.default_rng(seed)
        x = _logits(r, (6, 50), DType.F32)
        t = targets_for(r, (6,), 50, -100)
        loss, gx = f(x, t)
        want_loss, want_gx = fl.realize(*step(fl.tensor(x), fl.tensor(t)))
        np.testing.assert_array_equal(np.asarray(loss), want_loss.numpy())
        np.testing.assert_array_equal(np.asarray(gx), want_gx.numpy())
