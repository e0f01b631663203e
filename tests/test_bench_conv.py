"""The convolution benchmark on tiny sizes: every case runs, fuel agrees with torch, the JSON has its fields
and the PNG is drawn; `fuel bench --conv` reaches the harness (no timing asserted)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import matplotlib  # noqa: F401  (the harness draws its PNG with it: a broken install fails here)
import pytest
import torch  # noqa: F401  (the reference every fuel result is checked against)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_conv as bc

from fuel import cli

LIMITS = {"bandwidth_gbs": 30.0, "gemm_gflops": 200.0}  # skip measuring the machine: no timing is asserted


def test_harness_writes_json_and_png(tmp_path: Path) -> None:
    assert bc.main(str(tmp_path), 1, bc.Sizes.tiny(), LIMITS) == 0
    data = json.loads((tmp_path / "conv.json").read_text())
    assert data["meta"]["threads"] == 2 and data["meta"]["sizes"]["hw"] == bc.Sizes.tiny().hw
    results = {r["case"]: r for r in data["results"]}
    assert set(results) == {"conv2d", "conv_transpose2d", "causal_conv1d", "causal_conv1d_silu", "conv2d_batch1",
                            "causal_conv1d_one_step"}
    impls = {"conv2d": "Conv2D[", "conv_transpose2d": "ConvTranspose2D[", "causal_conv1d": "CausalConv1d[",
             "causal_conv1d_silu": "CausalConv1d[", "conv2d_batch1": "Conv2D[",
             "causal_conv1d_one_step": "CausalConv1d["}
    for name, r in results.items():
        assert all(r["ms"][w] > 0 for w in bc.WAYS)
        assert r["fuel_ms"] == r["ms"][r["fuel_best_way"]] and r["torch_ms"] == r["ms"]["torch_eager"]
        assert r["fuel_over_torch"] == pytest.approx(r["fuel_ms"] / r["torch_ms"])
        assert r["impl"].startswith(impls[name]) and r["flops"] > 0 and r["bytes"] > 0
        assert r["roofline_ms"] > 0 and r["roofline_fraction"] > 0 and r["target"] == bc.TARGETS[name]
        for way, c in r["correctness"].items():
            assert c["ok"], (name, way, c)
    assert (tmp_path / "conv.png").stat().st_size > 1000


def test_cli_flag_reaches_the_harness(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[Any, ...]] = []

    def fake_main(*a: Any) -> int:
        calls.append(a)
        return 0

    monkeypatch.setattr(bc, "main", fake_main)
    for key in ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE"):  # _bench sets them: restore them afterwards
        monkeypatch.setenv(key, os.environ.get(key, "PASSIVE" if key.startswith("OMP") else "1"))
    assert cli.main(["bench", "--conv", "--out", str(tmp_path), "--repeat", "3"]) == 0
    assert calls == [(str(tmp_path), 3)]
    with pytest.raises(SystemExit):
        cli.main(["bench", "--conv", "--attention"])
