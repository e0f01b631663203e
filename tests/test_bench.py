"""The benchmark harness runs end to end on a tiny case and writes JSON and a PNG (no timing asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib  # noqa: F401  (the harness draws its PNG with it: a broken install fails here)
import numpy as np
import pytest
import torch  # noqa: F401  (the peer every case is timed against)

import fuel as fl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_ops


def test_bench_harness_reports_ratio_and_roofline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = bench_ops.BenchCase("tiny_softmax", "[64, 128]",
                               lambda rng, dt: [rng.standard_normal((64, 128)).astype(dt.np)],
                               lambda t: fl.ops.softmax_last_dim(t[0]),
                               lambda x: x.softmax(-1))
    monkeypatch.setitem(bench_ops.CASES, "tiny_softmax", tiny)
    monkeypatch.setattr(bench_ops, "machine_limits", lambda repeat=5: {"bandwidth_gbs": 10.0, "gemm_gflops": 50.0})
    assert bench_ops.main(["tiny_softmax"], ["f32", "bf16"], str(tmp_path), 2, compile_torch=False) == 0
    data = json.loads((tmp_path / "bench_ops.json").read_text())
    (r32, r16) = data["results"]
    assert r32["impl"] == "SoftmaxLastDim[cpu:f32,f32]" and r16["dtype"] == "bf16"
    assert r32["ratio_vs_eager"] == pytest.approx(r32["fuel_ms"] / r32["torch_eager_ms"])
    assert r32["roofline_fraction"] > 0 and r32["roofline_ms"] == pytest.approx(2 * 64 * 128 * 4 / 10e9 * 1e3)
    assert (tmp_path / "bench_ops.png").stat().st_size > 1000
    assert bench_ops.main(["nope"], ["f32"], str(tmp_path), 1, compile_torch=False) == 2
    assert np.isfinite(r16["fuel_ms"])
