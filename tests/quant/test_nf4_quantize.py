"""fuel.quant.nf4 against bitsandbytes 0.50.2 on the CPU: the same bytes, absmax and dequantised values."""

from __future__ import annotations

from typing import Any

import bitsandbytes.functional as bnbf
import numpy as np
import pytest
import torch

from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.quant.nf4 import _MIDPOINTS, NF4, nf4_codes, nf4_dequantize, nf4_quantize


def bnb_quantize(w: np.ndarray, bs: int) -> tuple[np.ndarray, np.ndarray, torch.Tensor, Any]:
    """bitsandbytes' packed bytes and absmax, reshaped to [N, K/2] and [N, K/bs], and its own (q, state)."""
    tw = torch.tensor(w.astype(np.float32)) if w.dtype.name == "bfloat16" else torch.tensor(w)
    if w.dtype.name == "bfloat16":
        tw = tw.to(torch.bfloat16)
    q, st = bnbf.quantize_4bit(tw, blocksize=bs, quant_type="nf4")
    n, k = w.shape
    return q.numpy().reshape(n, k // 2), st.absmax.numpy().reshape(n, k // bs), q, st


def _weights(kind: str, rng: np.random.Generator, n: int, k: int, bs: int) -> np.ndarray:
    if kind == "normal":
        return (rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
    if kind == "midpoints":  # every value exactly on a table entry or a midpoint between two (times absmax)
        am = np.float32(rng.uniform(0.1, 4.0))
        w = (rng.choice(np.concatenate([_MIDPOINTS, NF4]), (n, k)) * am).astype(np.float32)
        w[:, ::bs] = am  # so each block's absmax is exactly am
        return w
    if kind == "zeros":  # zero elements, and a block (and a row) of zeros: absmax 0
        w = rng.standard_normal((n, k)).astype(np.float32)
        w[rng.random((n, k)) < 0.3] = 0.0
        w[0, :bs] = 0.0
        w[-1] = 0.0
        return w
    if kind == "tiny":  # absmax below bitsandbytes' 1e-38 clamp
        return (rng.standard_normal((n, k)) * 1e-39).astype(np.float32)
    if kind == "f16":
        return rng.standard_normal((n, k)).astype(np.float16)
    return rng.standard_normal((n, k)).astype(np.dtype("bfloat16"))  # bf16 through ml_dtypes


KINDS = ["normal", "midpoints", "zeros", "tiny", "f16", "bf16"]


@pytest.mark.parametrize("bs", [64, 128, 32])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n", "blocks"), [(1, 1), (7, 3), (33, 2)])
def test_quantize_matches_bitsandbytes_byte_for_byte(bs: int, kind: str, n: int, blocks: int) -> None:
    rng = np.random.default_rng(bs * 1000 + n * 10 + blocks)
    w = _weights(kind, rng, n, blocks * bs, bs)
    packed, absmax = nf4_quantize(w, bs)
    want_p, want_a, _, _ = bnb_quantize(w, bs)
    assert packed.dtype == np.uint8 and absmax.dtype == np.float32
    np.testing.assert_array_equal(packed, want_p)
    np.testing.assert_array_equal(absmax, want_a)


def test_quantize_many_random_weights() -> None:
    """100 random weights of random shape, scale and block size: no byte differs."""
    rng = np.random.default_rng(0)
    for trial in range(100):
        bs = [32, 64, 128, 256][trial % 4]
        n, k = int(rng.integers(1, 12)), bs * int(rng.integers(1, 4))
        w = _weights(KINDS[trial % 4], rng, n, k, bs)
        packed, absmax = nf4_quantize(w, bs)
        want_p, want_a, _, _ = bnb_quantize(w, bs)
        assert np.array_equal(packed, want_p) and np.array_equal(absmax, want_a), trial


def test_byte_order_even_element_in_high_nibble() -> None:
    w = np.zeros((1, 64), np.float32)
    w[0, :3] = [-1.0, 1.0, 0.0]
    packed, absmax = nf4_quantize(w, 64)
    assert packed[0, 0] == 0x0F and packed[0, 1] == 0x77 and absmax[0, 0] == 1.0
    np.testing.assert_array_equal(nf4_codes(packed)[0, :4], [0, 15, 7, 7])


def test_table_is_bitsandbytes() -> None:
    np.testing.assert_array_equal(bnbf.get_4bit_type("nf4", device="cpu").numpy(), NF4)


@pytest.mark.parametrize("bs", [64, 128])
@pytest.mark.parametrize("kind", ["normal", "zeros", "midpoints"])
def test_dequantize_matches_bitsandbytes_bit_for_bit(bs: int, kind: str) -> None:
    rng = np.random.default_rng(bs)
    w = _weights(kind, rng, 9, 4 * bs, bs)
    packed, absmax = nf4_quantize(w, bs)
    _, _, q, st = bnb_quantize(w, bs)
    want = bnbf.dequantize_4bit(q, st).numpy()
    got = nf4_dequantize(packed, absmax, bs)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_quantize_errors() -> None:
    with pytest.raises(ShapeError, match="nf4_quantize: w must be"):
        nf4_quantize(np.zeros(64, np.float32))
    with pytest.raises(ShapeError, match="not a multiple of block_size 64"):
        nf4_quantize(np.zeros((2, 96), np.float32), 64)
    with pytest.raises(ShapeError, match="K must be even"):
        nf4_quantize(np.zeros((2, 3), np.float32), 2)
    with pytest.raises(ParamError, match="positive even"):
        nf4_quantize(np.zeros((2, 64), np.float32), 0)
    with pytest.raises(ParamError, match="must be an int"):
        nf4_quantize(np.zeros((2, 64), np.float32), 64.0)  # type: ignore[arg-type]
    with pytest.raises(DTypeError, match="float array"):
        nf4_quantize(np.zeros((2, 64), np.int32))
    with pytest.raises(ShapeError, match=r"absmax must be \[2, 1\]"):
        nf4_dequantize(np.zeros((2, 32), np.uint8), np.zeros((2, 2), np.float32), 64)


def test_helpers_are_reachable_as_fuel_quant() -> None:
    import fuel.quant
    import fuel.quant.nf4

    assert fuel.quant.nf4_quantize is fuel.quant.nf4.nf4_quantize
    assert fuel.quant.nf4_dequantize is fuel.quant.nf4.nf4_dequantize
