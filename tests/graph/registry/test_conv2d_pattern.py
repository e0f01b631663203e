"""Conv2D's live pattern: a convolution written as im2col (pad, an unfold by a constant tap table, a grouped
matmul, a bias) runs on the fused kernel, by `fuel.trace()`, against torch's conv2d; a table of no
convolution's geometry, a nonzero pad and an unfold read elsewhere stay primitive."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.graph.functions import pad
from fuel.graph.node import Op
from fuel.graph.passes.fuse import fuse
from fuel.graph.registry import default_registry
from fuel.graph.tensor import Tensor

FUSED = "Conv2D["


def _unfold_table(kernel: tuple[int, int], out: tuple[int, int], width: int, stride: tuple[int, int],
                  dilation: tuple[int, int]) -> np.ndarray:
    """Flat positions in the padded plane of tap (a, b) for output (i, j), in (a, b, i, j) order."""
    rows = []
    for a in range(kernel[0]):
        for b in range(kernel[1]):
            for i in range(out[0]):
                for j in range(out[1]):
                    rows.append((a * dilation[0] + i * stride[0]) * width + b * dilation[1] + j * stride[1])
    return np.array(rows, np.int64)


def _im2col(x: Tensor, w: Tensor, b: Tensor | None, stride: tuple[int, int], padding: tuple[int, int],
            dilation: tuple[int, int], groups: int, table: np.ndarray | None = None, value: float = 0.0,
            ) -> tuple[Tensor, Tensor]:
    n, cin, h, wd = x.shape
    cout, cg, kh, kw = w.shape
    ph, pw = padding
    hp, wp = h + 2 * ph, wd + 2 * pw
    ho = (hp - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (wp - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    xp = pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), value) if ph or pw or value else x
    idx = _unfold_table((kh, kw), (ho, wo), wp, stride, dilation) if table is None else table
    cols = xp.reshape(n, cin, hp * wp).index_select(2, fl.tensor(idx)).reshape(n, groups, cg * kh * kw, ho * wo)
    out = (w.reshape(groups, cout // groups, cg * kh * kw) @ cols).reshape(n, cout, ho, wo)
    return (out if b is None else out + b.reshape(1, cout, 1, 1)), cols


def _torch(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, stride: tuple[int, int], padding: tuple[int, int],
           dilation: tuple[int, int], groups: int) -> np.ndarray:
    return torch.nn.functional.conv2d(torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64),
                                      None if b is None else torch.tensor(b, dtype=torch.float64),
                                      stride, padding, dilation, groups).numpy()


@settings(max_examples=15)
@given(st.integers(1, 2), st.sampled_from([1, 2]), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3),
       st.integers(1, 3), st.integers(1, 2), st.integers(1, 2), st.integers(0, 1), st.integers(0, 1),
       st.integers(1, 2), st.booleans())
def test_im2col_runs_fused_and_matches_torch(n: int, groups: int, cg: int, kh: int, kw: int, sh: int, sw: int,
                                             dh: int, ph: int, pw: int, dw: int, bias: bool) -> None:
    rng = np.random.default_rng(kh * 100 + kw * 10 + sh)
    cin, cout = groups * cg, groups * 2
    x = rng.standard_normal((n, cin, 7, 6)).astype(np.float32)
    w = rng.standard_normal((cout, cg, kh, kw)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32) if bias else None
    y, _ = _im2col(fl.tensor(x), fl.tensor(w), None if b is None else fl.tensor(b), (sh, sw), (ph, pw), (dh, dw),
                   groups)
    with fl.trace() as tr:
        got = y.numpy()
    assert any(r.impl.startswith(FUSED) for r in tr.records), [r.impl for r in tr.records]
    want = _torch(x, w, b, (sh, sw), (ph, pw), (dh, dw), groups)
    assert np.all(np.abs(got - want) <= 1e-5 * np.maximum(np.abs(want).max(axis=(-2, -1), keepdims=True), 1.0))


def _case() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(9)
    return rng.standard_normal((1, 2, 6, 5)), rng.standard_normal((4, 2, 3, 2)), rng.standard_normal(4)


def test_a_table_of_no_geometry_stays_primitive() -> None:
    x, w, b = _case()
    table = _unfold_table((3, 2), (4, 4), 5, (1, 1), (1, 1))
    table[[3, 7]] = table[[7, 3]]  # two windows' taps swapped
    y, _ = _im2col(fl.tensor(x), fl.tensor(w), fl.tensor(b), (1, 1), (0, 0), (1, 1), 1, table)
    (root,) = fuse([y.node], default_registry())
    assert root.op is not Op.FUSED
    cols = x.reshape(1, 2, 30)[:, :, table].reshape(1, 1, 12, 16)
    want = (w.reshape(1, 4, 12) @ cols).reshape(1, 4, 4, 4) + b.reshape(1, 4, 1, 1)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-12, atol=1e-12)


def test_a_nonzero_pad_or_an_unfold_read_elsewhere_stays_primitive() -> None:
    x, w, b = _case()
    y, _ = _im2col(fl.tensor(x), fl.tensor(w), fl.tensor(b), (1, 1), (1, 1), (1, 1), 1, value=1.0)
    (root,) = fuse([y.node], default_registry())
    assert root.op is not Op.FUSED
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=1.0)
    np.testing.assert_allclose(y.numpy(), _torch(xp, w, b, (1, 1), (0, 0), (1, 1), 1), rtol=1e-12, atol=1e-12)
    y, cols = _im2col(fl.tensor(x), fl.tensor(w), fl.tensor(b), (1, 1), (0, 0), (1, 1), 1)
    with fl.trace() as tr:
        got = fl.realize(y, cols.sum())[0].numpy()
    assert not any(r.impl.startswith(FUSED) for r in tr.records)
    np.testing.assert_allclose(got, _torch(x, w, b, (1, 1), (0, 0), (1, 1), 1), rtol=1e-12, atol=1e-12)
