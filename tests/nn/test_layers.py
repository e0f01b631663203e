"""fuel.nn's layers against torch.nn run in float64 on the same (rounded) values: forward and every gradient,
in each dtype fuel stores floats in, per element with bounds from the dtype's unit roundoff and each element's
own scale (|x|·|w| sums for contractions, the norm's terms for norms)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel import nn
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.testing.check import as64, excess, floor_of
from fuel.testing.oracle import assert_close_rowwise

DTYPES = pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)
EXAMPLES = settings(max_examples=6)
LEAD = st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple)
DIM = st.integers(1, 40)


def unit(dt: DType) -> float:
    """The unit roundoff of dt (half an ulp at 1)."""
    info = ml_dtypes.finfo(ml_dtypes.bfloat16) if dt is fl.bf16 else np.finfo(dt.np)
    return float(info.eps) / 2


def acc_unit(dt: DType) -> float:
    """The unit roundoff of dt's accumulation type (f32 for the half types)."""
    return unit(dt.acc)


def assert_within(out: np.ndarray, ref: np.ndarray, scale: np.ndarray, factor: float, dt: DType) -> None:
    """|out - ref| <= factor·scale + the format's smallest subnormal, per element."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    ratio = excess(out, ref, scale, 0.0, factor, floor_of(dt.np))
    assert np.all(ratio <= 1.0), f"worst |err|/allowed {float(np.max(ratio)):.3g} ({dt.value})"


def t64(a: np.ndarray | fl.Tensor, grad: bool = False) -> torch.Tensor:
    return torch.tensor(as64(a.numpy() if isinstance(a, fl.Tensor) else a), requires_grad=grad)


def grad_of(t: torch.Tensor) -> np.ndarray:
    assert t.grad is not None
    return t.grad.numpy()


def array_of(t: fl.Tensor) -> np.ndarray:
    """A parameter's own (writable) array."""
    assert t.node.value is not None
    return t.node.value


def draw(rng: np.random.Generator, shape: tuple[int, ...], dt: DType) -> np.ndarray:
    return rng.standard_normal(shape).astype(dt.np)


@DTYPES
@EXAMPLES
@given(lead=LEAD, n_in=DIM, n_out=DIM, bias=st.booleans())
def test_linear_matches_torch(dt: DType, lead: tuple[int, ...], n_in: int, n_out: int, bias: bool) -> None:
    rng = np.random.default_rng(n_in * 41 + n_out)
    layer = nn.Linear(n_in, n_out, bias=bias, dtype=dt, seed=3)
    x, r = draw(rng, (*lead, n_in), dt), draw(rng, (*lead, n_out), dt)
    tx = fl.tensor(x)
    y = layer(tx)
    params = [layer.weight] + ([layer.bias] if layer.bias is not None else [])
    grads = fl.grad((y * fl.tensor(r)).sum(), [tx, *params])
    fl.realize(y, *grads)

    ref = torch.nn.Linear(n_in, n_out, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(t64(layer.weight))
        if layer.bias is not None:
            ref.bias.copy_(t64(layer.bias))
    rx = t64(x, grad=True)
    ry = ref(rx)
    ry.backward(t64(r))

    w, ax, ar = np.abs(as64(layer.weight.numpy())), np.abs(as64(x)), np.abs(as64(r))
    b = np.abs(as64(layer.bias.numpy())) if layer.bias is not None else 0.0
    u, ua, rows = unit(dt), acc_unit(dt), int(np.prod(lead))
    # y: the product rounded to dt, the bias added and rounded again, n_in terms accumulated
    assert_within(y.numpy(), ry.detach().numpy(), ax @ w.T + b, 2 * u + n_in * ua, dt)
    assert_within(grads[0].numpy(), grad_of(rx), ar @ w, u + n_out * ua, dt)
    ar2, ax2 = ar.reshape(rows, n_out), ax.reshape(rows, n_in)
    assert_within(grads[1].numpy(), grad_of(ref.weight), ar2.T @ ax2, u + rows * ua, dt)
    if layer.bias is not None:
        assert_within(grads[2].numpy(), grad_of(ref.bias), ar2.sum(0), u + rows * ua, dt)


@DTYPES
@EXAMPLES
@given(lead=LEAD, num=st.integers(1, 12), dim=DIM)
def test_embedding_matches_torch(dt: DType, lead: tuple[int, ...], num: int, dim: int) -> None:
    rng = np.random.default_rng(num * 53 + dim)
    layer = nn.Embedding(num, dim, dtype=dt, seed=5)
    ids = rng.integers(0, num, lead).astype(np.int64)  # repeats: their gradients add
    r = draw(rng, (*lead, dim), dt)
    y = layer(fl.tensor(ids))
    (gw,) = fl.grad((y * fl.tensor(r)).sum(), [layer.weight])
    fl.realize(y, gw)

    ref = torch.nn.Embedding(num, dim, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(t64(layer.weight))
    ry = ref(torch.from_numpy(ids))
    ry.backward(t64(r))
    np.testing.assert_array_equal(as64(y.numpy()), ry.detach().numpy())  # a lookup is exact
    count = np.bincount(ids.reshape(-1), minlength=num)[:, None]
    scale = np.zeros((num, dim))
    np.add.at(scale, ids.reshape(-1), np.abs(as64(r)).reshape(-1, dim))
    assert_within(gw.numpy(), grad_of(ref.weight), scale, float(np.max(count)) * unit(dt), dt)


def _norm_case(rng: np.random.Generator, lead: tuple[int, ...], dim: int, dt: DType, layer: nn.RMSNorm | nn.LayerNorm
               ) -> tuple[np.ndarray, np.ndarray]:
    array_of(layer.weight)[...] = draw(rng, (dim,), dt)  # not all ones, so the weight's role is seen
    bias = getattr(layer, "bias", None)
    if bias is not None:
        array_of(bias)[...] = draw(rng, (dim,), dt)
    return draw(rng, (*lead, dim), dt), draw(rng, (*lead, dim), dt)


@DTYPES
@EXAMPLES
@given(lead=LEAD, dim=DIM)
def test_rms_norm_matches_torch(dt: DType, lead: tuple[int, ...], dim: int) -> None:
    rng = np.random.default_rng(dim)
    layer = nn.RMSNorm(dim, eps=1e-5, dtype=dt)
    x, r = _norm_case(rng, lead, dim, dt, layer)
    tx = fl.tensor(x)
    y = layer(tx)
    gx, gw = fl.grad((y * fl.tensor(r)).sum(), [tx, layer.weight])
    fl.realize(y, gx, gw)

    ref = torch.nn.RMSNorm(dim, eps=1e-5, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(t64(layer.weight))
    rx = t64(x, grad=True)
    ry = ref(rx)
    ry.backward(t64(r))

    x64, w, g = as64(x), np.abs(as64(layer.weight.numpy())), as64(r)
    rms = np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5)
    xhat = np.abs(x64) / rms
    wg = w * np.abs(g)
    # per element: the sizes of the terms each result sums (dx = w·g/rms − x̂·mean(w·g·x̂)/rms)
    assert_close_rowwise(y.numpy(), ry.detach().numpy(), dt, scale=xhat * w)
    assert_close_rowwise(gx.numpy(), grad_of(rx), dt, backward=True,
                         scale=(wg + xhat * (wg * xhat).mean(-1, keepdims=True)) / rms)
    n = int(np.prod(lead))
    assert_within(gw.numpy(), grad_of(ref.weight), (np.abs(g) * xhat).reshape(n, dim).sum(0),
                  (4 + dim) * unit(dt) + n * acc_unit(dt), dt)


@DTYPES
@EXAMPLES
@given(lead=LEAD, dim=st.integers(2, 40), bias=st.booleans())
def test_layer_norm_matches_torch(dt: DType, lead: tuple[int, ...], dim: int, bias: bool) -> None:
    rng = np.random.default_rng(dim + 100)
    layer = nn.LayerNorm(dim, eps=1e-5, bias=bias, dtype=dt)
    x, r = _norm_case(rng, lead, dim, dt, layer)
    tx = fl.tensor(x)
    y = layer(tx)
    params = [layer.weight] + ([layer.bias] if layer.bias is not None else [])
    grads = fl.grad((y * fl.tensor(r)).sum(), [tx, *params])
    fl.realize(y, *grads)

    ref = torch.nn.LayerNorm(dim, eps=1e-5, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(t64(layer.weight))
        if layer.bias is not None:
            ref.bias.copy_(t64(layer.bias))
    rx = t64(x, grad=True)
    ry = ref(rx)
    ry.backward(t64(r))

    x64, w, g = as64(x), np.abs(as64(layer.weight.numpy())), as64(r)
    b = np.abs(as64(layer.bias.numpy())) if layer.bias is not None else 0.0
    std = np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    xhat = (np.abs(x64) + np.abs(x64.mean(-1, keepdims=True))) / std  # x − mean cancels: its terms' sizes
    wg = w * np.abs(g)
    assert_close_rowwise(y.numpy(), ry.detach().numpy(), dt, scale=xhat * w + b)
    # dx = (w·g − mean(w·g) − x̂·mean(w·g·x̂)) / std, per element its terms' sizes
    assert_close_rowwise(grads[0].numpy(), grad_of(rx), dt, backward=True,
                         scale=(wg + wg.mean(-1, keepdims=True) + xhat * (wg * xhat).mean(-1, keepdims=True)) / std)
    n = int(np.prod(lead))
    assert_within(grads[1].numpy(), grad_of(ref.weight), (np.abs(g) * xhat).reshape(n, dim).sum(0),
                  (4 + dim) * unit(dt) + n * acc_unit(dt), dt)
    if layer.bias is not None:
        assert_within(grads[2].numpy(), grad_of(ref.bias), np.abs(g).reshape(n, dim).sum(0),
                      unit(dt) + n * acc_unit(dt), dt)


def test_default_initialisation_follows_torch() -> None:
    """torch.nn's default distributions: Linear U(±1/√in), Embedding N(0, 1), norms 1 and 0."""
    lin = nn.Linear(400, 300, seed=0)
    w, b = lin.weight.numpy(), lin.bias.numpy()  # type: ignore[union-attr]
    assert np.abs(w).max() <= 1 / 20 and np.abs(w).max() > 0.049 and np.abs(b).max() <= 1 / 20
    assert abs(float(w.std()) - (1 / 20) / np.sqrt(3)) < 1e-3  # a uniform's std is bound/√3
    emb = nn.Embedding(300, 400, seed=0).weight.numpy()
    assert abs(float(emb.std()) - 1.0) < 1e-2 and abs(float(emb.mean())) < 1e-2
    ln = nn.LayerNorm(7)
    np.testing.assert_array_equal(ln.weight.numpy(), np.ones(7, np.float32))
    np.testing.assert_array_equal(ln.bias.numpy(), np.zeros(7, np.float32))  # type: ignore[union-attr]
    np.testing.assert_array_equal(nn.Linear(3, 2, seed=7).weight.numpy(), nn.Linear(3, 2, seed=7).weight.numpy())


@pytest.mark.parametrize(("make", "message"), [
    (lambda: nn.Linear(0, 3), "Linear: in_features must be a positive int, got 0"),
    (lambda: nn.Linear(3, 2.5),  # type: ignore[arg-type]
     "Linear: out_features must be a positive int, got 2.5"),
    (lambda: nn.Linear(3, 2, dtype=fl.i64), "Linear: parameters need a float dtype, got i64"),
    (lambda: nn.Embedding(-1, 3), "Embedding: num_embeddings must be a positive int, got -1"),
    (lambda: nn.RMSNorm(4, eps=-1.0), "RMSNorm: eps must be a finite number >= 0, got -1.0"),
    (lambda: nn.LayerNorm(4, eps=float("nan")), "LayerNorm: eps must be a finite number >= 0, got nan"),
])
def test_bad_construction_is_a_param_error(make: object, message: str) -> None:
    with pytest.raises(fl.FuelError, match=message.replace("(", r"\(").replace(".", r"\.")):
        make()  # type: ignore[operator]


def test_bad_inputs_name_the_layer() -> None:
    with pytest.raises(fl.ShapeError, match=r"Linear: input's last dim must be in_features = 3, got shape \[2, 4\]"):
        nn.Linear(3, 2)(np.zeros((2, 4), np.float32))
    with pytest.raises(fl.DTypeError, match="Embedding: ids must be i64, got f32"):
        nn.Embedding(5, 2)(np.zeros(3, np.float32))
    with pytest.raises(fl.ShapeError, match=r"RMSNorm: input's last dim must be dim = 4, got shape \[3\]"):
        nn.RMSNorm(4)(np.zeros(3, np.float32))
    with pytest.raises(fl.IndexOutOfRange):
        nn.Embedding(5, 2)(np.array([1, 5])).numpy()
