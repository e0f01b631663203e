"""The quantized-matmul benchmark on tiny sizes: every case runs, fuel agrees with torch's dequantise +
matmul, the JSON has its fields and the PNG is drawn; `fuel bench --quant` reaches the harness (no
timing asserted)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import bitsandbytes  # noqa: F401  (torch's NF4 side: a broken install fails here)
import gguf  # noqa: F401  (torch's GGUF dequantisation)
import matplotlib  # noqa: F401  (the harness draws its PNG with it)
import numpy as np
import pytest
import torch  # noqa: F401  (the reference every fuel result is checked against)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_quant as bq
from benchmarks import quant_cases as qc

from fuel import cli

TINY = bq.Sizes.tiny()
LIMITS = {"bandwidth_gbs": 30.0, "read_gbs": 20.0, "gemm_gflops": 200.0}  # skip measuring the machine


def test_harness_writes_json_and_png(tmp_path: Path) -> None:
    assert bq.main(str(tmp_path), 1, TINY, LIMITS) == 0
    data = json.loads((tmp_path / "quant.json").read_text())
    meta = data["meta"]
    assert meta["threads"] == 2 and meta["sizes"]["k"] == TINY.k and meta["roofline_bandwidth"] == "read_gbs"
    assert meta["targets"] == {"fuel_over_torch_deq_mm_max": 0.5, "roofline_fraction_min_at_m1": 0.5}
    results = {(r["type"], r["m"]): r for r in data["results"]}
    assert set(results) == {(t, m) for t in bq.TYPES for m in TINY.ms}
    for (qtype, m), r in results.items():
        assert r["skipped"] is None, r
        ms = r["ms"]
        assert all(ms[w] > 0 for w in ("fuel", "fuel_jit", "fuel_jit_warm", "torch_deq_mm", "torch_mm"))
        assert (ms["bnb_4bit"] is not None) == (qtype == "NF4")
        assert r["fuel_ms"] == ms[r["fuel_best_way"]] == min(ms["fuel"], ms["fuel_jit"])
        assert r["fuel_over_torch_deq_mm"] == pytest.approx(r["fuel_ms"] / ms["torch_deq_mm"])
        assert r["fuel_over_torch_mm"] == pytest.approx(r["fuel_ms"] / ms["torch_mm"])
        assert ms["fuel_jit_weight_cold"] > 0
        assert r["roofline_fraction_full_flush"] == pytest.approx(r["roofline_ms"] / r["fuel_ms"])
        roof_ways = ("fuel", "fuel_jit", "fuel_jit_weight_cold") if m == 1 else ("fuel", "fuel_jit")
        assert r["roofline_way"] in roof_ways
        assert r["roofline_fraction"] == pytest.approx(r["roofline_ms"] / min(ms[w] for w in roof_ways))
        assert isinstance(r["meets_ratio_target"], bool)
        assert (r["meets_roofline_target"] is None) == (m != 1)
        assert r["impls"] and not any(i.startswith("prim:") for i in r["impls"]), r["impls"]
        expect = {"fuel", "fuel_jit", "torch_mm"} | ({"bnb_4bit"} if qtype == "NF4" else set())
        assert set(r["correctness"]) == expect
        for way, c in r["correctness"].items():
            assert c["ok"] and c["max_rel_to_scale"] <= c["rtol"], (qtype, m, way, c)
    # The M = 1 floor is the weight's bytes over the read bandwidth.
    q4 = results["Q4_0", 1]
    assert q4["weight_bytes"] == TINY.n * TINY.k // 32 * 18
    assert q4["roofline_ms"] == pytest.approx(q4["weight_bytes"] / (LIMITS["read_gbs"] * 1e6))
    nf4 = results["NF4", 1]
    assert nf4["weight_bytes"] == TINY.n * TINY.k // 2 + 4 * TINY.n * TINY.k // 64
    assert nf4["bnb_bytes_identical"] is True
    assert (tmp_path / "quant.png").stat().st_size > 1000


def test_roofline_takes_the_largest_bandwidth_probed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that measures the machine measures the read bandwidth and the sgemm peak again after each type's
    cases and judges every record by the largest: one slow phase of the host while probing must not flatter
    the fractions."""
    probed, gemm = iter([40.0, 25.0]), iter([150.0, 400.0])
    monkeypatch.setattr(bq, "measure_limits", lambda: dict(LIMITS))
    monkeypatch.setattr(bq, "read_bandwidth", lambda: {"read_gbs": next(probed)})
    monkeypatch.setattr(bq, "sgemm_gflops", lambda: next(gemm))
    sizes = bq.Sizes(k=TINY.k, n=TINY.n, ms=(1, 5), types=("Q4_0", "Q8_0"), one_row_rounds=1)
    assert bq.main(str(tmp_path), 1, sizes) == 0
    data = json.loads((tmp_path / "quant.json").read_text())
    assert data["meta"]["read_gbs_probes"] == [LIMITS["read_gbs"], 40.0, 25.0]
    assert data["meta"]["gemm_gflops_probes"] == [LIMITS["gemm_gflops"], 150.0, 400.0]
    for r in data["results"]:
        floor = max(r["weight_bytes"] / 40e6, r["flops"] / 400e6) if r["m"] > 1 else r["weight_bytes"] / 40e6
        assert r["roofline_ms"] == pytest.approx(floor)
        assert r["roofline_fraction"] == pytest.approx(r["roofline_ms"] / r["ms"][r["roofline_way"]])
        assert r["meets_roofline_target"] == (r["roofline_fraction"] >= 0.5 if r["m"] == 1 else None)


def test_one_row_runs_do_not_probe_the_sgemm_peak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only an M > 1 floor reads the sgemm peak, so a run of M = 1 cases spends no time measuring it again."""
    monkeypatch.setattr(bq, "measure_limits", lambda: dict(LIMITS))
    monkeypatch.setattr(bq, "read_bandwidth", lambda: {"read_gbs": 30.0})

    def no_gemm() -> float:
        raise AssertionError("sgemm probed for M = 1 cases")

    monkeypatch.setattr(bq, "sgemm_gflops", no_gemm)
    sizes = bq.Sizes(k=TINY.k, n=TINY.n, ms=(1,), types=("Q4_0",), one_row_rounds=1)
    assert bq.main(str(tmp_path), 1, sizes) == 0
    data = json.loads((tmp_path / "quant.json").read_text())
    assert data["meta"]["gemm_gflops_probes"] == [LIMITS["gemm_gflops"]]
    assert data["meta"]["read_gbs_probes"] == [LIMITS["read_gbs"], 30.0]


def test_check_flags_a_mismatch() -> None:
    want = np.ones((2, 3))
    scale = np.full((2, 3), 100.0)
    assert qc.check(want + 1e-4, want, scale)["ok"]
    bad = qc.check(want + 1e-2, want, scale)
    assert not bad["ok"] and bad["max_abs"] == pytest.approx(1e-2)
    assert not qc.check(want[:1], want, scale)["ok"]
    assert not qc.check(want * np.nan, want, scale)["ok"]


def test_evict_leaves_values_alone() -> None:
    a = np.arange(1000, dtype=np.float32)
    b = np.arange(7, dtype=np.uint8)
    before = a.copy(), b.copy()
    qc.evict(a, b, np.empty(0, np.float32))
    assert np.array_equal(a, before[0]) and np.array_equal(b, before[1])


def test_read_bandwidth_is_measured() -> None:
    bw = qc.read_bandwidth(repeat=1, nbytes=8 << 20)
    assert bw["read_gbs"] == pytest.approx(max(bw["read_vector_gbs"], bw["read_numba_gbs"], bw["read_numpy_gbs"]))
    assert bw["read_gbs"] > 0


def test_stream_sum_reads_every_element() -> None:
    a = np.arange(4096, dtype=np.float32)
    assert qc._stream_sum(a, 0, a.size) == a.sum(dtype=np.float64)
    assert qc._stream_sum(a, 1024, 2048) == a[1024:2048].sum(dtype=np.float64)


def test_cli_flag_reaches_the_harness(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[Any, ...]] = []

    def fake_main(*a: Any) -> int:
        calls.append(a)
        return 0

    monkeypatch.setattr(bq, "main", fake_main)
    for key in ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE"):  # _bench sets them: restore them afterwards
        monkeypatch.setenv(key, os.environ.get(key, "PASSIVE" if key.startswith("OMP") else "1"))
    assert cli.main(["bench", "--quant", "--out", str(tmp_path), "--repeat", "3"]) == 0
    assert calls == [(str(tmp_path), 3)]
    for other in ("--attention", "--latency"):
        with pytest.raises(SystemExit):
            cli.main(["bench", "--quant", other])
