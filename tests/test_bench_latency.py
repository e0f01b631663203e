"""The latency benchmark's model: NumPy and fuel eager compute what torch computes, on a tiny config;
the harness runs end to end and writes JSON and a PNG (no timing asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib  # noqa: F401  (the harness draws its PNG with it: a broken install fails here)
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_latency
from benchmarks import latency_model as lm

TINY = lm.ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, cache=16, prefill=8)
LIMITS = {"bandwidth_gbs": 30.0, "gemm_gflops": 200.0}  # skip measuring the machine: no timing is asserted



@pytest.mark.parametrize("make_inputs", [lm.decode_inputs, lm.prefill_inputs], ids=["decode", "prefill"])
def test_numpy_and_fuel_eager_agree_with_torch(make_inputs: object) -> None:
    w = lm.make_weights(TINY)
    inputs = make_inputs(TINY)  # type: ignore[operator]
    want = [t.numpy() for t in lm.torch_fn(TINY, w)(*lm.torch_inputs(inputs))]
    assert len(want) == 1 + 2 * TINY.layers
    kv_rows = 1 if make_inputs is lm.decode_inputs else TINY.prefill
    assert want[1].shape == (TINY.kv_heads, kv_rows, TINY.head_dim)
    for got in (lm.numpy_fn(TINY, w)(*inputs), lm.fuel_eager(lm.fuel_fn(TINY, w))(*inputs)):
        assert len(got) == len(want)
        for g, t in zip(got, want, strict=True):
            assert g.dtype == np.float32 and g.shape == t.shape
            np.testing.assert_allclose(g, t, rtol=1e-4, atol=1e-5)


def test_decode_mask_hides_the_dead_cache_rows() -> None:
    """Changing a cache row past the live length must not change the step (the mask is -inf there)."""
    w = lm.make_weights(TINY)
    inputs = lm.decode_inputs(TINY)
    base = lm.numpy_fn(TINY, w)(*inputs)
    inputs[2] = inputs[2].copy()
    inputs[2][:, TINY.decode_pos + 1:] += 100.0
    np.testing.assert_array_equal(lm.numpy_fn(TINY, w)(*inputs)[0], base[0])


def test_harness_writes_json_and_png(tmp_path: Path, one_thread_before: None) -> None:
    assert bench_latency.main(str(tmp_path), 1, TINY, LIMITS) == 0
    data = json.loads((tmp_path / "latency.json").read_text())
    assert data["meta"]["threads"] == bench_latency.THREADS == 2
    assert data["meta"]["engine_threads"] == {"fuel": 2, "torch": 2}
    assert data["meta"]["limits"] == LIMITS
    decode, prefill = data["results"]
    assert (decode["workload"], prefill["workload"]) == ("decode", "prefill")
    for r in (decode, prefill):
        assert all(r["ms"][w] > 0 for w in ("fuel_eager", "fuel_jit", "numpy", "torch"))
        assert r["jit_over_torch"] > 0 and r["eager_overhead_us_per_node"] is not None
        assert r["roofline_ms"] > 0 and r["roofline_fraction"]["fuel_jit"] > 0
        assert r["nodes"] > 0 and r["node_count_source"] == "jit plan steps"
        assert set(r["correctness"]) == {"fuel_eager", "fuel_jit", "torch"}
        assert all(c["ok"] for c in r["correctness"].values())
    assert data["small_op"]["us_per_call"]["torch"] > 0 and data["small_op"]["us_per_call"]["fuel_jit"] > 0
    assert data["replay_overhead"]["jit_us_per_node"] > 0 and data["replay_overhead"]["nodes"] == 400
    assert (tmp_path / "latency.png").stat().st_size > 1000
