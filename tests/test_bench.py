"""The benchmark harness runs end to end on a tiny case and writes JSON and a PNG (no timing asserted)."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib  # noqa: F401  (the harness draws its PNG with it: a broken install fails here)
import numpy as np
import pytest
import torch

import fuel as fl
from fuel.dtype import DType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_ops, timing


def test_bench_harness_reports_ratio_and_roofline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  one_thread_before: None) -> None:
    """Each case times fuel and torch interleaved, one call of each per round (the log of calls alternates
    from the warm-up round on), both engines on the benchmark's thread count."""
    log: list[tuple[str, int]] = []

    def make(rng: np.random.Generator, dt: DType) -> list[np.ndarray]:
        log.append(("make", 0))
        return [rng.standard_normal((64, 128)).astype(dt.np)]

    def fuel_softmax(t: list[fl.Tensor]) -> fl.Tensor:
        log.append(("fuel", fl.get_num_threads()))
        return fl.ops.softmax_last_dim(t[0])

    def torch_softmax(x: Any) -> Any:
        log.append(("torch", torch.get_num_threads()))
        return x.softmax(-1)

    tiny = bench_ops.BenchCase("tiny_softmax", "[64, 128]", make, fuel_softmax, torch_softmax)
    monkeypatch.setitem(bench_ops.CASES, "tiny_softmax", tiny)
    monkeypatch.setattr(bench_ops, "machine_limits", lambda repeat=5: {"bandwidth_gbs": 10.0, "gemm_gflops": 50.0})
    assert bench_ops.main(["tiny_softmax"], ["f32", "bf16"], str(tmp_path), 2, compile_torch=False) == 0
    data = json.loads((tmp_path / "bench_ops.json").read_text())
    assert data["meta"]["threads"] == bench_ops.THREADS == 2
    (r32, r16) = data["results"]
    assert r32["impl"] == "SoftmaxLastDim[cpu:f32,f32]" and r16["dtype"] == "bf16"
    assert r32["ratio_vs_eager"] == pytest.approx(r32["fuel_ms"] / r32["torch_eager_ms"])
    assert r32["roofline_fraction"] > 0 and r32["roofline_ms"] == pytest.approx(2 * 64 * 128 * 4 / 10e9 * 1e3)
    assert np.isfinite(r16["fuel_ms"])
    starts = [i for i, (what, _) in enumerate(log) if what == "make"]
    assert len(starts) == 2
    for start, r in zip(starts, (r32, r16), strict=True):
        assert r["rounds"] == 2
        timed = [what for what, _ in log[start + 1:start + 1 + 2 * (r["rounds"] + 1)]]
        assert timed == ["fuel", "torch"] * (r["rounds"] + 1), log
    assert {n for what, n in log if what != "make"} == {2}, log
    assert (tmp_path / "bench_ops.png").stat().st_size > 1000
    assert bench_ops.main(["nope"], ["f32"], str(tmp_path), 1, compile_torch=False) == 2


def test_timed_ms_interleaves_and_keeps_the_collector_off_the_clock() -> None:
    """Warm-up rounds, then each round runs every fn `calls` times in a row after its `before`; with
    `collect` the garbage collector is off while a fn is timed and on again afterwards."""
    log: list[tuple[str, bool]] = []
    fns = {"a": lambda: log.append(("a", gc.isenabled())), "b": lambda: log.append(("b", gc.isenabled()))}
    ms, rounds = timing.timed_ms(fns, 2, before=lambda name: log.append((f"before {name}", True)),
                                 warmup=2, calls=3, collect=True)
    assert rounds == 2 and set(ms) == {"a", "b"} and all(v >= 0 for v in ms.values())
    timed_round = ["before a", "a", "a", "a", "before b", "b", "b", "b"]
    assert [name for name, _ in log] == ["a", "b"] * 2 + timed_round * 2
    assert [on for name, on in log[4:] if not name.startswith("before")] == [False] * 12
    assert gc.isenabled()
