"""The scans and cross-entropy benchmark on tiny sizes: every case runs, fuel agrees with torch, the JSON
has its fields and the PNG is drawn; `fuel bench --scans` reaches the harness (no timing asserted)."""

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
from benchmarks import bench_scans as bs

from fuel import cli

LIMITS = {"bandwidth_gbs": 30.0, "gemm_gflops": 200.0}  # skip measuring the machine: no timing is asserted


def test_harness_writes_json_and_png(tmp_path: Path) -> None:
    assert bs.main(str(tmp_path), 1, bs.Sizes.tiny(), LIMITS) == 0
    data = json.loads((tmp_path / "scans.json").read_text())
    assert data["meta"]["threads"] == 2 and data["meta"]["sizes"]["seq"] == bs.Sizes.tiny().seq
    results = {r["case"]: r for r in data["results"]}
    assert set(results) == {"selective_scan", "selective_scan_backward", "ssd_chunk_scan", "cross_entropy",
                            "cross_entropy_backward", "selective_scan_one_token", "cross_entropy_one_row"}
    impls = {"selective_scan": "SelectiveScan[", "ssd_chunk_scan": "SsdChunkScan[",
             "cross_entropy": "FusedSoftmaxCrossEntropy[", "selective_scan_one_token": "SelectiveScan[",
             "cross_entropy_one_row": "FusedSoftmaxCrossEntropy["}
    for name, r in results.items():
        assert all(r["ms"][w] > 0 for w in ("fuel", "fuel_jit", "torch_eager"))
        assert r["fuel_over_torch"] == pytest.approx(r["fuel_ms"] / r["torch_ms"])
        if name in impls:
            assert r["impl"].startswith(impls[name]) and r["flops"] > 0 and r["bytes"] > 0
            assert r["roofline_fraction"] > 0
        else:
            assert r["impl"] is None and r["roofline_ms"] is None
        for way, c in r["correctness"].items():
            assert c["ok"], (name, way, c)
    assert (tmp_path / "scans.png").stat().st_size > 1000


def test_cli_flag_reaches_the_harness(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[Any, ...]] = []

    def fake_main(*a: Any) -> int:
        calls.append(a)
        return 0

    monkeypatch.setattr(bs, "main", fake_main)
    for key in ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE"):  # _bench sets them: restore them afterwards
        monkeypatch.setenv(key, os.environ.get(key, "PASSIVE" if key.startswith("OMP") else "1"))
    assert cli.main(["bench", "--scans", "--out", str(tmp_path), "--repeat", "3"]) == 0
    assert calls == [(str(tmp_path), 3)]
