"""Every entry has a live pattern or says why it has none, `fuel inventory` reports both, and the reasons
the backward entries give hold: fl.grad of a forward spelled in primitives runs them (gradients against
torch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import fuel as fl
from fuel.graph.registry import default_registry
from fuel.inventory import inventory, to_markdown


def test_every_entry_has_a_pattern_or_a_reason() -> None:
    missing = [e.name for e in default_registry() if e.pattern is None and not e.no_pattern]
    both = [e.name for e in default_registry() if e.pattern is not None and e.no_pattern]
    assert not missing, f"no pattern and no reason: {missing}"
    assert not both, f"a live pattern and a reason for having none: {both}"


def test_inventory_reports_the_live_count_and_each_reason() -> None:
    records = inventory()
    text = to_markdown(records)
    live = sum(e.pattern is not None for e in default_registry())
    assert f"{live}/{len(default_registry())} have a live pattern" in text
    for e in default_registry():
        rec = next(r for r in records if r["name"] == e.name)
        assert rec["no_pattern"] == e.no_pattern
        if e.no_pattern:
            assert f"Pattern: none ({e.no_pattern})" in text


def _rms(x: Any, w: Any) -> Any:
    return x * (x * x).mean(-1, keepdim=True).add(1e-5).rsqrt() * w


def _layer_norm(x: Any, w: Any) -> Any:
    m = x - x.mean(-1, keepdim=True)
    return m * ((m * m).mean(-1, keepdim=True) + 1e-5).rsqrt() * w


def _max_and_cube(x: Any, w: Any) -> Any:
    top = x.max(-1, keepdim=True)
    return (top if isinstance(top, fl.Tensor) else top.values) * w + x ** 3


Forward = Callable[[Any, Any], Any]  # fuel or torch tensors, the same spelling


@pytest.mark.parametrize(("forward", "entries"), [
    (_rms, {"RmsNormLastDimBackward"}),
    (_layer_norm, {"LayerNormLastDimBackward"}),
    (_max_and_cube, {"ReduceMaxToBackward", "PowIBackward"}),
], ids=["rms_norm", "layer_norm", "max_and_powi"])
def test_backward_entries_run_for_primitive_spellings(forward: Forward, entries: set[str]) -> None:
    rng = np.random.default_rng(3)
    x, w, c = rng.standard_normal((5, 24)), rng.standard_normal(24), rng.standard_normal((5, 24))
    fx, fw = fl.tensor(x.astype(np.float32)), fl.tensor(w.astype(np.float32))
    loss = (forward(fx, fw) * fl.tensor(c.astype(np.float32))).sum()
    gx, gw = fl.grad(loss, [fx, fw])
    with fl.trace() as t:
        got_x, got_w = gx.numpy(), gw.numpy()
    ran = {r.impl.split("[")[0] for r in t.records}
    assert entries <= ran, f"{entries - ran} did not run: {sorted(ran)}"
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    (forward(tx, tw) * torch.tensor(c)).sum().backward()
    assert tx.grad is not None and tw.grad is not None
    for got, want in ((got_x, tx.grad.numpy()), (got_w, tw.grad.numpy())):
        scale = np.maximum(np.abs(want).max(axis=-1, keepdims=True), 1.0)
        assert np.all(np.abs(got - want) <= 1e-4 * scale)
