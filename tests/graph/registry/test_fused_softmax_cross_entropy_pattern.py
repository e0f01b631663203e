"""FusedSoftmaxCrossEntropy's live pattern: cross-entropy spelled with log_softmax, gather and a mean or sum
runs on the fused kernel (by `fuel.trace()`), with torch's `cross_entropy` as the oracle; spellings that
are not that loss stay primitive."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.graph.functions import where
from fuel.graph.node import Op
from fuel.graph.passes.fuse import fuse
from fuel.graph.registry import default_registry
from fuel.graph.registry.fused_softmax_cross_entropy import PLAIN, FusedSoftmaxCrossEntropyParams
from fuel.graph.tensor import Tensor

FUSED = "FusedSoftmaxCrossEntropy["


def _lsm(kind: int, x: Tensor) -> Tensor:
    if kind == 0:
        s = x - x.max(-1, keepdim=True)
        return s - s.exp().sum(-1, keepdim=True).log()
    if kind == 1:
        return x - x.exp().sum(-1, keepdim=True).log()
    return x.softmax(-1).log()


def _picked(lp: Tensor, idx: Tensor) -> Tensor:
    return lp.gather(-1, idx.unsqueeze(-1)).squeeze(-1)


def _spelled(x: Tensor, t: Tensor, kind: int, neg: str, reduction: str, ignore: int | None) -> Tensor:
    """The loss as a user writes it: no fused op named anywhere."""
    lp = -_lsm(kind, x) if neg == "lsm" else _lsm(kind, x)
    if ignore is not None:
        valid = t != ignore
        nll = where(valid, -_picked(lp, where(valid, t, 0)), 0.0)
        if reduction == "mean":
            return nll.sum() / valid.cast("f32").sum().maximum(1.0)
    else:
        nll = -_picked(lp, t) if neg == "row" else _picked(lp, t)
    if reduction == "none":
        return nll
    total = nll.sum() if reduction == "sum" else nll.mean()
    return -total if neg == "total" else total


def _torch(x: np.ndarray, t: np.ndarray, reduction: str, ignore: int | None) -> np.ndarray:
    v = x.shape[-1]
    out = torch.nn.functional.cross_entropy(torch.tensor(x, dtype=torch.float64).reshape(-1, v),
                                            torch.tensor(t).reshape(-1), reduction=reduction,
                                            ignore_index=-100 if ignore is None else ignore)
    return (out.reshape(t.shape) if reduction == "none" else out).numpy()


def _run(loss: Tensor, *others: Tensor) -> tuple[np.ndarray, set[str]]:
    with fl.trace() as tr:
        got = fl.realize(loss, *others)[0].numpy()
    return got, {r.impl for r in tr.records}


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= 2e-6 * np.maximum(np.abs(want), 1.0)), (got, want)


@settings(max_examples=15)
@given(st.lists(st.integers(1, 4), min_size=0, max_size=3), st.integers(1, 40), st.integers(0, 2),
       st.sampled_from(["lsm", "row", "total"]), st.sampled_from(["mean", "sum", "none"]),
       st.sampled_from([None, -100, 2]), st.integers(0, 2**31))
def test_spellings_run_fused_and_match_torch(rows: list[int], v: int, kind: int, neg: str, reduction: str,
                                             ignore: int | None, seed: int) -> None:
    if ignore is not None:
        neg = "row"
    if reduction == "none" and neg == "total":
        neg = "lsm"
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((*rows, v)) * 3).astype(np.float32)
    t = rng.integers(0, v, tuple(rows), dtype=np.int64)
    if ignore is not None:
        t[rng.random(tuple(rows)) < 0.3] = ignore
        t.reshape(-1)[0] = 0 if ignore != 0 else 1  # a row that counts, so torch's mean is not NaN
    got, ran = _run(_spelled(fl.tensor(x), fl.tensor(t), kind, neg, reduction, ignore))
    assert any(i.startswith(FUSED) for i in ran), sorted(ran)
    _close(got, _torch(x, t, reduction, ignore))


def test_gradient_of_the_spelling_is_the_fused_gradient_and_matches_torch() -> None:
    rng = np.random.default_rng(5)
    x, t = rng.standard_normal((6, 11)).astype(np.float32), rng.integers(0, 11, 6)
    t[2] = -100
    fx = fl.tensor(x)
    (g,) = fl.grad(_spelled(fx, fl.tensor(t), 0, "row", "mean", -100), [fx])
    got, ran = _run(g)
    assert "prim:cross_entropy_grad" in ran, sorted(ran)
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    torch.nn.functional.cross_entropy(tx, torch.tensor(t), ignore_index=-100).backward()
    assert tx.grad is not None
    want = tx.grad.numpy()
    assert np.all(np.abs(got - want) <= 1e-6 * np.maximum(np.abs(want).max(-1, keepdims=True), 1e-3))


def _inputs(seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((4, 9)) * 2).astype(np.float32), rng.integers(0, 9, 4)


def test_log_probs_read_elsewhere_stay_primitive() -> None:
    x, t = _inputs()
    fx = fl.tensor(x)
    lp = _lsm(0, fx)
    loss = -_picked(lp, fl.tensor(t)).mean()
    got, ran = _run(loss, lp.exp())
    assert not any(i.startswith(FUSED) for i in ran), sorted(ran)
    _close(got, _torch(x, t, "mean", None))


def test_other_axes_stay_primitive() -> None:
    """log_softmax over the rows (axis 0), then the same gather: not a cross-entropy."""
    x, t = _inputs()
    lp0 = torch.log_softmax(torch.tensor(x, dtype=torch.float64), 0)
    want = -lp0.gather(-1, torch.tensor(t).unsqueeze(-1)).squeeze(-1).mean()
    fx = fl.tensor(x)
    s = fx - fx.max(0, keepdim=True)
    got, ran = _run(-_picked(s - s.exp().sum(0, keepdim=True).log(), fl.tensor(t)).mean())
    assert not any(i.startswith(FUSED) for i in ran), sorted(ran)
    _close(got, want.numpy())


def test_a_divisor_that_is_not_the_row_count_is_no_mean() -> None:
    """Σ·0.5 over 4 rows: the sum fuses and the scale stays a primitive after it."""
    x, t = _inputs()
    loss = -_picked(_lsm(0, fl.tensor(x)), fl.tensor(t)).sum() * 0.5
    (root,) = fuse([loss.node], default_registry())
    assert root.op is Op.MUL_SCALAR and root.arg == 0.5
    inner = root.inputs[0]
    assert inner.op is Op.FUSED and inner.arg[1] == FusedSoftmaxCrossEntropyParams("sum", PLAIN)
    want = torch.nn.functional.cross_entropy(torch.tensor(x, dtype=torch.float64), torch.tensor(t),
                                             reduction="sum").numpy() * 0.5
    _close(loss.numpy(), want)


def test_mismatched_ignore_index_and_fill_are_no_ignore_index() -> None:
    """A mask and a gather around different ids, or ignored rows reading column 1: the root stays a
    primitive (at most the per-row loss of the rewritten targets fuses) and the value is torch's."""
    x, t = _inputs()
    t[1], t[2] = 5, 4
    lp = torch.log_softmax(torch.tensor(x, dtype=torch.float64), -1)
    tt = torch.tensor(t)

    def two_ids(fx: Tensor, ft: Tensor) -> Tensor:  # gathers around id 5, masks id 4
        return where(ft != 4, -_picked(_lsm(0, fx), where(ft != 5, ft, 0)), 0.0).sum()

    def fill_one(fx: Tensor, ft: Tensor) -> Tensor:  # ignored rows read column 1, not 0
        valid = ft != 5
        return where(valid, -_picked(_lsm(0, fx), where(valid, ft, 1)), 0.0).sum()

    def torch_loss(mask: int, gather_at: int, fill: int) -> np.ndarray:
        picked = lp.gather(-1, torch.where(tt != gather_at, tt, fill).unsqueeze(-1)).squeeze(-1)
        return torch.where(tt != mask, -picked, 0.0).sum().numpy()

    for build, want in ((two_ids, torch_loss(4, 5, 0)), (fill_one, torch_loss(5, 5, 1))):
        loss = build(fl.tensor(x), fl.tensor(t))
        (root,) = fuse([loss.node], default_registry())
        assert root.op is not Op.FUSED
        _close(loss.numpy(), want)
