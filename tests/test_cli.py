from __future__ import annotations

import json

import pytest

from fuel.cli import main
from fuel.graph.registry import default_registry


def test_inventory_lists_every_id(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inventory", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in records] == list(range(1, 25))
    complete = {r["name"] for r in records if r["status"] == "complete"}
    assert complete == {e.name for e in default_registry()}
    assert {"SoftmaxLastDim", "SoftmaxLastDimBackward"} <= complete
    softmax = next(r for r in records if r["id"] == 1)
    assert softmax["pattern"] == "live" and softmax["decomposition"].endswith("nodes")
    assert softmax["backward"] == "Fused(SoftmaxLastDimBackward)"
    assert softmax["source"].startswith("fuel/graph/registry/softmax_last_dim.py:")
    assert ["bf16", "bf16"] in softmax["dtypes"]
    assert main(["inventory"]) == 0
    md = capsys.readouterr().out
    assert "## 1. SoftmaxLastDim" in md and "reserved" in md


def test_inventory_points_each_kernel_at_its_kernel_module(capsys: pytest.CaptureFixture[str]) -> None:
    """A kernel's source is its own module under fuel/cpu/, not a runtime wrapper that runs its jobs."""
    assert main(["inventory", "--json"]) == 0
    records = [r for r in json.loads(capsys.readouterr().out) if r["status"] == "complete"]
    assert len(records) == 24
    for r in records:
        assert r["kernel_source"] and all(s.startswith("fuel/cpu/") for s in r["kernel_source"]), r["name"]
    rope = next(r for r in records if r["name"] == "Rope")
    assert all(s.startswith("fuel/cpu/rope.py:") for s in rope["kernel_source"])


def test_inventory_keeps_backward_metadata_apart_from_whether_a_gradient_exists(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inventory", "--json"]) == 0
    by_name = {r["name"]: r for r in json.loads(capsys.readouterr().out) if r["status"] == "complete"}
    assert by_name["FusedLinear"]["backward"] == "NotDifferentiable" and by_name["FusedLinear"]["differentiable"]
    assert main(["inventory"]) == 0
    md = capsys.readouterr().out
    linear = md[md.index("## 2. FusedLinear"):md.index("## 3.")]
    assert "- Backward (inventory metadata): NotDifferentiable\n" in linear
    assert "- Gradient: yes (vjp)\n" in linear
    assert "vjp wired" not in md


def test_verify_passes_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "SoftmaxLastDim"]) == 0
    out = capsys.readouterr().out
    assert "SoftmaxLastDim[cpu:bf16,bf16]" in out and "4 passed, 0 failed" in out
    assert main(["verify", "NoSuchOp"]) == 2
