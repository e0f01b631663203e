"""CausalConv1d's live pattern: the left-padded depthwise convolution written as shifted slices times their
taps plus a bias (and SiLU) runs on the fused kernel, by `fuel.trace()`, against torch's grouped conv1d;
sums that are not that convolution stay primitive."""

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

FUSED = "CausalConv1d["


def _tap_weight(w: Tensor, k: int, view: int) -> Tensor:
    c = w.shape[0]
    return [w[:, :, k:k + 1].reshape(1, c, 1), w[:, 0, k:k + 1], w[:, :, k]][view]


def _spelled(x: Tensor, w: Tensor, b: Tensor, order: list[int], view: int, silu: int,
             missing: int | None = None, wrong: int | None = None) -> Tensor:
    """bias + Σ_k xp[..., k:k + L]·w[:, :, k] over the left-padded x, terms in `order`."""
    k_taps = w.shape[2]
    seq = x.shape[2]
    xp = pad(x, ((0, 0), (0, 0), (k_taps - 1, 0)))
    terms = [xp[:, :, k:k + seq] * _tap_weight(w, (k + 1) % k_taps if k == wrong else k, view)
             for k in order if k != missing]
    y = b[:, None] if view else b.reshape(1, -1, 1)
    for t in terms:
        y = t + y if len(terms) % 2 else y + t
    return [y, y.silu(), y * y.sigmoid()][silu]


def _torch(x: np.ndarray, w: np.ndarray, b: np.ndarray, silu: bool) -> np.ndarray:
    k, seq = w.shape[2], x.shape[2]
    y = torch.nn.functional.conv1d(torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64),
                                   torch.tensor(b, dtype=torch.float64), padding=k - 1, groups=x.shape[1])
    y = y[..., :seq]
    return (torch.nn.functional.silu(y) if silu else y).numpy()


def _ran(t: Tensor) -> tuple[np.ndarray, set[str]]:
    with fl.trace() as tr:
        out = t.numpy()
    return out, {r.impl for r in tr.records}


@settings(max_examples=12)
@given(st.integers(1, 2), st.integers(1, 5), st.integers(1, 9), st.integers(1, 5), st.integers(0, 2),
       st.integers(0, 2), st.randoms(use_true_random=False))
def test_spellings_run_fused_and_match_torch(b: int, c: int, seq: int, k: int, view: int, silu: int,
                                             rnd: object) -> None:
    rng = np.random.default_rng(seq * 31 + k)
    x = rng.standard_normal((b, c, seq)).astype(np.float32)
    w, bias = rng.standard_normal((c, 1, k)).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    order = list(range(k))
    rnd.shuffle(order)  # type: ignore[attr-defined]
    out, ran = _ran(_spelled(fl.tensor(x), fl.tensor(w), fl.tensor(bias), order, view, silu))
    assert any(i.startswith(FUSED) for i in ran), sorted(ran)
    want = _torch(x, w, bias, silu > 0)
    assert np.all(np.abs(out - want) <= 1e-5 * np.maximum(np.abs(want), 1.0))


def _case() -> tuple[Tensor, Tensor, Tensor, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(4)
    x, w, b = rng.standard_normal((2, 3, 7)), rng.standard_normal((3, 1, 4)), rng.standard_normal(3)
    return fl.tensor(x), fl.tensor(w), fl.tensor(b), x, w, b


def test_a_missing_or_misplaced_tap_stays_primitive() -> None:
    fx, fw, fb, x, w, b = _case()
    for kw in ({"missing": 2}, {"wrong": 1}):
        y = _spelled(fx, fw, fb, [0, 1, 2, 3], 0, 0, **kw)
        (root,) = fuse([y.node], default_registry())
        assert root.op is not Op.FUSED, kw
    # the missing tap's value, checked against torch with that tap zeroed
    w0 = w.copy()
    w0[:, :, 2] = 0.0
    out, ran = _ran(_spelled(fx, fw, fb, [0, 1, 2, 3], 0, 0, missing=2))
    assert not any(i.startswith(FUSED) for i in ran)
    np.testing.assert_allclose(out, _torch(x, w0, b, False), rtol=1e-12, atol=1e-12)


def test_a_partial_sum_read_elsewhere_stays_primitive() -> None:
    fx, fw, fb, x, w, b = _case()
    xp = pad(fx, ((0, 0), (0, 0), (3, 0)))
    part = fb[:, None] + xp[:, :, 0:7] * fw[:, :, 0] + xp[:, :, 1:8] * fw[:, :, 1]
    y = part + xp[:, :, 2:9] * fw[:, :, 2] + xp[:, :, 3:10] * fw[:, :, 3]
    with fl.trace() as tr:
        got, _ = fl.realize(y, part.sum())
    assert not any(r.impl.startswith(FUSED) for r in tr.records)
    np.testing.assert_allclose(got.numpy(), _torch(x, w, b, False), rtol=1e-12, atol=1e-12)


def test_silu_of_a_conv_read_elsewhere_fuses_only_the_conv() -> None:
    fx, fw, fb, x, w, b = _case()
    y = _spelled(fx, fw, fb, [0, 1, 2, 3], 0, 0)
    z = y.silu()
    (root, _) = fuse([z.node, (y * 2.0).node], default_registry())
    assert root.op is Op.SILU and root.inputs[0].op is Op.FUSED and not root.inputs[0].arg[1].use_silu
    np.testing.assert_allclose(z.numpy(), _torch(x, w, b, True), rtol=1e-12, atol=1e-12)
