"""`fuel verify --decomposed` (`fuel.testing.decomposed`): a lowering within its kernel's declared bound
passes, a broken one (QMatMul's dequantisation patched wrong, or raising) is reported and exits 1."""

from __future__ import annotations

import numpy as np
import pytest

import fuel.quant.lowering as lowering
from fuel.cli import main
from fuel.errors import ShapeError
from fuel.graph.tensor import Tensor
from fuel.quant import QuantType
from fuel.testing.decomposed import verify_decomposed


def test_lowerings_within_their_bounds_pass(capsys: pytest.CaptureFixture[str]) -> None:
    """QMatMul (every block type, both forms) and PowIBackward (every dtype, the recipe in f64 rounded
    once): all cases run, each within its bound, exit 0."""
    results = verify_decomposed(["PowIBackward"])
    assert len(results) == 4 and all(r.ok and r.cases > 0 and r.worst <= 1.0 for r in results), results
    assert main(["verify", "--decomposed", "qmatmul"]) == 0
    out = capsys.readouterr().out
    assert "QMatMul[cpu:f32,u32,f32]" in out and "1 passed, 0 failed" in out


def test_rms_norm_backward_lowering_of_one_element_rows() -> None:
    """A row of one element: the general form's g·x² − x·(g·x) cancels to rounding noise (2x the f64 kernel's
    bound); the lowering takes the kernel's closed form g·eps/den^1.5 there."""
    results = verify_decomposed(["RmsNormLastDimBackward"])
    assert len(results) == 4 and all(r.ok and r.worst <= 1.0 for r in results), results


def test_a_wrong_lowering_is_reported(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Q4_K's values scaled by 1.001: the kernel disagrees far past the bound, the line says FAIL, exit 1."""
    right = lowering.dequantize

    def wrong(w_q: Tensor, qt: QuantType, n: int, k: int) -> Tensor:
        w = right(w_q, qt, n, k)
        return w * 1.001 if qt is QuantType.Q4K else w

    monkeypatch.setattr(lowering, "dequantize", wrong)
    assert main(["verify", "--decomposed", "QMatMul"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: error" in out and "0 passed, 1 failed" in out


def test_a_lowering_that_raises_names_the_case(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(w_q: Tensor, qt: QuantType, n: int, k: int) -> Tensor:
        raise ShapeError("dequantize: broken on purpose")

    monkeypatch.setattr(lowering, "dequantize", broken)
    (r,) = verify_decomposed(["QMatMul"])
    assert not r.ok and r.error.startswith("Q4_0 a[1, 32] W[1, 32]: ShapeError: dequantize: broken on purpose")


def test_inputs_are_not_written() -> None:
    from fuel.graph.registry import default_registry
    from fuel.testing.decomposed import lowered_output

    entry = next(e for e in default_registry() if e.name == "InplaceAffine")
    x = np.arange(6, dtype=np.float16).reshape(2, 3)
    before = x.copy()
    from fuel.graph.registry.inplace_affine import InplaceAffineParams

    out = lowered_output(entry, [x], InplaceAffineParams(2.0, 1.0))
    assert np.array_equal(x, before) and out.dtype == np.float16
    assert np.array_equal(out, (before.astype(np.float32) * 2 + 1).astype(np.float16))
