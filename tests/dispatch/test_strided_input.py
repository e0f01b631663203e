"""Strided inputs without copies: a kernel that declares `strided_input` gets its inputs as they are
(transposed leading axes, slices, reversed or broadcast rows, an offset start), the executor copies only
what the impl's `caps.reads` refuses, and `fuel.trace()` counts the copies it made (`Trace.copies`).

For every kernel that reads such inputs in place (the row kernels, Rope, FusedSoftmaxCrossEntropy): no
copy, the very bytes of the same values laid out contiguously, and torch's float64 result within the
entry's tolerance. Native replay (`fl.jit`) posts the same jobs over views of its staged arguments, so
strided views replay natively with the eager bytes, call after call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.cpu.fused_softmax_cross_entropy import cross_entropy_grad
from fuel.dtype import DType
from fuel.graph.registry.fused_softmax_cross_entropy import FusedSoftmaxCrossEntropyParams
from fuel.testing.oracle import assert_close_rowwise
from tests.torch_rows import EPS, T, grad_of, ln, rms, softmax_backward

# entry name -> (fuel op over (x, g), torch float64 oracle over the same inputs, arity, is a backward)
ROW_KERNELS: dict[str, tuple[Callable[..., fl.Tensor], Callable[..., T], int, bool]] = {
    "SoftmaxLastDim": (lambda x: fl.ops.softmax_last_dim(x), lambda x: torch.softmax(x, -1), 1, False),
    "SoftmaxLastDimBackward": (fl.ops.softmax_last_dim_backward, softmax_backward, 2, True),
    "RmsNormLastDim": (lambda x: fl.ops.rms_norm_last_dim(x, EPS), rms, 1, False),
    "RmsNormLastDimBackward": (lambda x, g: fl.ops.rms_norm_last_dim_backward(x, g, EPS), grad_of(rms), 2, True),
    "LayerNormLastDim": (lambda x: fl.ops.layer_norm_last_dim(x, EPS), ln, 1, False),
    "LayerNormLastDimBackward": (lambda x, g: fl.ops.layer_norm_last_dim_backward(x, g, EPS), grad_of(ln), 2,
                                 True),
}
DTYPES = [DType.F32, DType.F64, DType.BF16, DType.F16]


@st.composite
def layouts(draw: Any, lead: tuple[int, ...], cols: int) -> tuple[Any, ...]:
    """How a [*lead, cols] view lies in a larger array: the order of its leading axes in memory, a step per
    leading axis (2 skips rows, -1 reverses them), one leading axis broadcast (or none), and the slice of
    the last axis (an offset start and a shorter row)."""
    n = len(lead)
    perm = tuple(draw(st.permutations(range(n))))
    steps = tuple(draw(st.sampled_from([1, 2, -1])) for _ in range(n))
    broadcast = draw(st.sampled_from([None, *range(n)]))
    return perm, steps, broadcast, draw(st.integers(0, 3)), draw(st.integers(0, 3))


def _view(rng: np.random.Generator, dt: DType, lead: tuple[int, ...], cols: int, layout: tuple[Any, ...],
          softmax_output: bool = False) -> np.ndarray:
    perm, steps, broadcast, start, pad = layout
    n = len(lead)
    full = [1 if k == broadcast else size * abs(step) for k, (size, step) in enumerate(zip(lead, steps, strict=True))]
    base = rng.standard_normal([full[p] for p in perm] + [start + cols + pad]) * 3 + 0.5
    if softmax_output:  # softmax's backward reads a softmax output
        base[..., start:start + cols] = torch.softmax(torch.from_numpy(base[..., start:start + cols]), -1).numpy()
    v = base.astype(dt.np).transpose([perm.index(k) for k in range(n)] + [n])
    index = tuple(slice(None) if k == broadcast else slice(None, None, s) for k, s in enumerate(steps))
    v = np.broadcast_to(v[(*index, slice(start, start + cols))], (*lead, cols))
    assert v.shape == (*lead, cols)
    return v


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8)


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(ROW_KERNELS)), dt=st.sampled_from(DTYPES),
       lead=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), cols=st.integers(1, 40),
       data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_row_kernels_read_strided_input_without_a_copy(name: str, dt: DType, lead: tuple[int, ...], cols: int,
                                                       data: Any, seed: int) -> None:
    op, oracle, arity, backward = ROW_KERNELS[name]
    rng = np.random.default_rng(seed)
    xs = [_view(rng, dt, lead, cols, data.draw(layouts(lead, cols)), name == "SoftmaxLastDimBackward" and k == 0)
          for k in range(arity)]
    with fl.trace() as t:
        out = op(*map(fl.tensor, xs)).numpy()
    assert [r.impl.split("[")[0] for r in t.records] == [name]
    assert t.copies == 0, str(t)
    dense = op(*(fl.tensor(np.ascontiguousarray(x)) for x in xs)).numpy()
    np.testing.assert_array_equal(_bits(out), _bits(dense))
    want = oracle(*(torch.from_numpy(x.astype(np.float64)) for x in xs)).detach().numpy()
    if name == "SoftmaxLastDimBackward":  # the Jacobian product's terms can cancel: scale per element
        y, g = (x.astype(np.float64) for x in xs)
        scale = np.abs(y) * (np.abs(g) + np.abs(g * y).sum(-1, keepdims=True))
        assert_close_rowwise(out, want, dt, backward=True, scale=scale)
    else:
        assert_close_rowwise(out, want, dt, backward=backward)


def _rotate_half(x: T) -> T:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


@settings(max_examples=25, deadline=None)
@given(dt=st.sampled_from(DTYPES), lead=st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple),
       seq=st.integers(1, 5), half=st.integers(1, 12), data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_rope_reads_strided_x_and_tables_without_a_copy(dt: DType, lead: tuple[int, ...], seq: int, half: int,
                                                        data: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    d = 2 * half
    x = _view(rng, dt, (*lead, seq), d, data.draw(layouts((*lead, seq), d)))
    cos, sin = (_view(rng, dt, (seq,), d, data.draw(layouts((seq,), d))) for _ in range(2))
    with fl.trace() as t:
        out = fl.ops.rope(fl.tensor(x), fl.tensor(cos), fl.tensor(sin)).numpy()
    assert [r.impl.split("[")[0] for r in t.records] == ["Rope"]
    assert t.copies == 0, str(t)
    dense = fl.ops.rope(*(fl.tensor(np.ascontiguousarray(a)) for a in (x, cos, sin))).numpy()
    np.testing.assert_array_equal(_bits(out), _bits(dense))
    x64, c64, s64 = (torch.from_numpy(a.astype(np.float64)) for a in (x, cos, sin))
    want = x64 * c64 + _rotate_half(x64) * s64  # transformers' apply_rotary_pos_emb, in float64
    scale = x64.abs() * c64.abs() + _rotate_half(x64).abs() * s64.abs()  # the two products can cancel
    assert_close_rowwise(out, want.numpy(), dt, scale=scale.numpy())


@settings(max_examples=20, deadline=None)
@given(dt=st.sampled_from(DTYPES), lead=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
       v=st.integers(1, 40), reduction=st.sampled_from(["mean", "sum", "none"]), data=st.data(),
       seed=st.integers(0, 2**32 - 1))
def test_cross_entropy_reads_strided_logits_without_a_copy(dt: DType, lead: tuple[int, ...], v: int, reduction: str,
                                                          data: Any, seed: int) -> None:
    """Shifted logits (`logits[:, :-1]`), a vocabulary slice, heads in another order: the forward impl and
    the gradient primitive read the rows where they lie."""
    rng = np.random.default_rng(seed)
    x = _view(rng, dt, lead, v, data.draw(layouts(lead, v)))
    t = np.where(rng.random(lead) < 0.2, -100, rng.integers(0, v, lead)).astype(np.int64)
    t.flat[0] = 0  # one counted row: torch's mean over none is 0/0, fuel's 0 (documented)
    with fl.trace() as tr:
        loss = fl.ops.fused_softmax_cross_entropy(fl.tensor(x), fl.tensor(t), reduction).numpy()
    assert [r.impl.split("[")[0] for r in tr.records] == ["FusedSoftmaxCrossEntropy"]
    assert tr.copies == 0, str(tr)
    dense = np.ascontiguousarray(x)
    np.testing.assert_array_equal(loss, fl.ops.fused_softmax_cross_entropy(dense, t, reduction).numpy())
    x64 = torch.from_numpy(x.astype(np.float64)).reshape(-1, v).requires_grad_(True)
    want = torch.nn.functional.cross_entropy(x64, torch.from_numpy(t.reshape(-1)), reduction=reduction,
                                             ignore_index=-100)
    np.testing.assert_allclose(loss.reshape(-1), want.detach().numpy().reshape(-1), rtol=1e-6, atol=1e-6)
    g = rng.standard_normal(loss.shape).astype(np.float32)
    params = FusedSoftmaxCrossEntropyParams(reduction, -100)
    grad = cross_entropy_grad([x, t, g], params)
    np.testing.assert_array_equal(_bits(grad), _bits(cross_entropy_grad([dense, t, g], params)))
    leaf = fl.tensor(x)  # through autograd: the gradient primitive hands the kernel the logits as they are
    (through,) = fl.grad(fl.ops.fused_softmax_cross_entropy(leaf, t, reduction), [leaf], g)
    np.testing.assert_array_equal(_bits(through.numpy()), _bits(grad))
    (want_grad,) = torch.autograd.grad(want, [x64], torch.from_numpy(g.astype(np.float64)).reshape(want.shape))
    assert_close_rowwise(grad, want_grad.numpy().reshape(x.shape), dt, backward=True)


def test_a_transposed_last_axis_is_still_copied_and_counted() -> None:
    """A row kernel reads rows with a unit-stride last axis; a transposed matrix is copied (one per input)."""
    x = np.random.default_rng(0).standard_normal((8, 5)).astype(np.float32)
    with fl.trace() as t:
        out = fl.ops.softmax_last_dim_backward(fl.tensor(x.T), fl.tensor(x[:, ::-1].T)).numpy()
    assert t.copies == 2 and [r.copies for r in t.copied] == [2]
    assert "input copies 2" in str(t)
    dense = fl.ops.softmax_last_dim_backward(np.ascontiguousarray(x.T), np.ascontiguousarray(x[:, ::-1].T)).numpy()
    np.testing.assert_array_equal(out, dense)


def test_strided_views_replay_natively_with_the_eager_bytes() -> None:
    """Views of the arguments (heads transposed, a sliced row, every other position) and of captured tables
    go to the kernels' native jobs without a copy (cross-entropy, which has no job, to its Python step), and
    each call's new values come out as eagerly."""
    rng = np.random.default_rng(1)
    cos_big, sin_big = rng.standard_normal((8, 20)).astype(np.float32), rng.standard_normal((12, 8)).astype(np.float32)

    def step(x: fl.Tensor, g: fl.Tensor, t: fl.Tensor) -> tuple[fl.Tensor, ...]:
        xv = x.transpose(1, 2)[:, :, 1:, 2:10]        # [B, H, S-1, 8] of [B, S, H, D]
        gv = g[:, :, ::2]                             # every other row
        cos, sin = fl.tensor(cos_big)[1:7, 4:12], fl.tensor(sin_big)[::2]  # captured tables, sliced
        return (fl.ops.rms_norm_last_dim(xv, EPS), fl.ops.softmax_last_dim(xv),
                fl.ops.layer_norm_last_dim_backward(xv, gv, EPS), fl.ops.rope(xv, cos, sin),
                fl.ops.fused_softmax_cross_entropy(xv, t, "none"))

    def dense(x: np.ndarray, g: np.ndarray, t: np.ndarray) -> list[np.ndarray]:
        xv = np.ascontiguousarray(x.transpose(0, 2, 1, 3)[:, :, 1:, 2:10])
        gv = np.ascontiguousarray(g[:, :, ::2])
        cos, sin = np.ascontiguousarray(cos_big[1:7, 4:12]), np.ascontiguousarray(sin_big[::2])
        return [a.numpy() for a in (fl.ops.rms_norm_last_dim(xv, EPS), fl.ops.softmax_last_dim(xv),
                                    fl.ops.layer_norm_last_dim_backward(xv, gv, EPS), fl.ops.rope(xv, cos, sin),
                                    fl.ops.fused_softmax_cross_entropy(xv, t, "none"))]

    f = fl.jit(step)
    for call in range(3):
        x = rng.standard_normal((2, 7, 3, 12)).astype(np.float32)
        g = rng.standard_normal((2, 3, 12, 8)).astype(np.float32)
        t = rng.integers(0, 8, (2, 3, 6)).astype(np.int64)
        outs = f(x, g, t)
        if call == 0:
            capture = f.capture_for(x, g, t)
            assert capture is not None and capture.native is not None
            jobbed = {s for s, _ in capture.native.fixed}
            fused = {r.step.name.split("[")[0]: r.step.output for r in capture.runs if r.step.prim is None}
            assert len(fused) == 5
            assert [n for n, s in fused.items() if s not in jobbed] == ["FusedSoftmaxCrossEntropy"]
        with fl.trace() as tr:
            eager = step(fl.tensor(x), fl.tensor(g), fl.tensor(t))
            fl.realize(*eager)
        assert tr.copies == 0, str(tr)
        want = dense(x, g, t)
        for got, e, d in zip(outs, eager, want, strict=True):
            np.testing.assert_array_equal(got.numpy(), d)
            np.testing.assert_array_equal(e.numpy(), d)
        xv = torch.from_numpy(x.transpose(0, 2, 1, 3)[:, :, 1:, 2:10].astype(np.float64))
        assert_close_rowwise(outs[1].numpy(), torch.softmax(xv, -1).numpy(), DType.F32)
