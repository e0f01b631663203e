"""The quantized-matmul benchmark on tiny sizes: every case runs, fuel agrees with torch's dequantise +
matmul, torch's dequantiser (torch ops) is gguf's bit for bit, the JSON has its fields and the PNG is drawn;
`fuel bench --quant` reaches the harness (no timing asserted)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import bitsandbytes  # noqa: F401  (torch's NF4 side: a broken install fails here)
import gguf  # (the oracle torch's GGUF dequantiser is checked against)
import matplotlib  # noqa: F401  (the harness draws its PNG with it)
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_quant as bq
from benchmarks import quant_cases as qc
from benchmarks import quant_machine as qm
from benchmarks import torch_dequant as td

from fuel import cli
from fuel.errors import ParamError, ShapeError

TINY = bq.Sizes.tiny()
LIMITS = {"bandwidth_gbs": 30.0, "read_gbs": 20.0, "gemm_gflops": 200.0}  # skip measuring the machine
GGUF_TYPES = ("Q4_0", "Q4_K", "Q6_K", "Q8_0")


def test_harness_writes_json_and_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One tiny run of every type and M. The machine's limits are stubbed: the read bandwidth and the sgemm
    peak are probed again after each type's cases and every record's floor takes the largest (one slow
    phase of the host while probing must not flatter the fractions). The fractions are reported, never
    judged; the only target is the ratio to torch's dequantise + matmul, and that peer dequantises with
    torch ops, not gguf's NumPy dequantiser (called once per GGUF weight, for the reference W only)."""
    reads, gemms = [25.0, 40.0, 22.0, 30.0, 28.0], [150.0, 400.0, 120.0, 100.0, 90.0]
    probed, gemm = iter(reads), iter(gemms)
    monkeypatch.setattr(bq, "measure_limits", lambda: dict(LIMITS))
    monkeypatch.setattr(bq, "read_bandwidth", lambda: {"read_gbs": next(probed)})
    monkeypatch.setattr(bq, "sgemm_gflops", lambda: next(gemm))
    gguf_calls: list[Any] = []
    real_dequantize = gguf.quants.dequantize

    def counted(*a: Any) -> Any:
        gguf_calls.append(a[1])
        return real_dequantize(*a)

    monkeypatch.setattr(gguf.quants, "dequantize", counted)
    assert bq.main(str(tmp_path), 1, TINY) == 0
    assert len(gguf_calls) == len(GGUF_TYPES)
    data = json.loads((tmp_path / "quant.json").read_text())
    meta = data["meta"]
    assert meta["threads"] == 2 and meta["sizes"]["k"] == TINY.k and meta["roofline_bandwidth"] == "read_gbs"
    assert meta["targets"] == {"fuel_over_torch_deq_mm_max": 0.5}
    assert "no matmul time" in meta["llama_cpp"]
    assert meta["read_gbs_probes"] == [LIMITS["read_gbs"], *reads]
    assert meta["gemm_gflops_probes"] == [LIMITS["gemm_gflops"], *gemms]
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
        assert isinstance(r["meets_ratio_target"], bool)
        assert r["torch_dequant_bit_exact"] is (True if qtype in GGUF_TYPES else None)
        assert ms["fuel_jit_weight_cold"] > 0
        floor = max(r["weight_bytes"] / 40e6, r["flops"] / 400e6) if m > 1 else r["weight_bytes"] / 40e6
        assert r["roofline_ms"] == pytest.approx(floor)
        assert r["roofline_fraction_full_flush"] == pytest.approx(r["roofline_ms"] / r["fuel_ms"])
        roof_ways = ("fuel", "fuel_jit", "fuel_jit_weight_cold") if m == 1 else ("fuel", "fuel_jit")
        assert r["roofline_way"] in roof_ways
        assert r["roofline_fraction"] == pytest.approx(r["roofline_ms"] / min(ms[w] for w in roof_ways))
        assert not any(key.startswith("meets_roof") for key in r), r.keys()
        assert r["impls"] and not any(i.startswith("prim:") for i in r["impls"]), r["impls"]
        expect = {"fuel", "fuel_jit", "torch_mm"} | ({"bnb_4bit"} if qtype == "NF4" else set())
        assert set(r["correctness"]) == expect
        for way, c in r["correctness"].items():
            assert c["ok"] and c["max_rel_to_scale"] <= c["rtol"], (qtype, m, way, c)
    q4 = results["Q4_0", 1]
    assert q4["weight_bytes"] == TINY.n * TINY.k // 32 * 18
    nf4 = results["NF4", 1]
    assert nf4["weight_bytes"] == TINY.n * TINY.k // 2 + 4 * TINY.n * TINY.k // 64
    assert nf4["bnb_bytes_identical"] is True
    assert (tmp_path / "quant.png").stat().st_size > 1000


def _blocks(rng: np.random.Generator, qtype: str, n: int, k: int, finite: bool) -> np.ndarray:
    """Random block bytes of a `[n, k]` weight; with `finite`, every f16 field a finite value (any sign,
    subnormals included), otherwise the raw random bits (infinities and NaNs too)."""
    per_block, nbytes = td.BLOCKS[qtype]
    blocks = rng.integers(0, 256, (n * k // per_block, nbytes), dtype=np.uint8)
    if finite:
        fields = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}[qtype]
        for off in fields:
            bits = blocks[:, off:off + 2].copy().view(np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # an all-ones exponent (inf, NaN) loses its top bit
            blocks[:, off:off + 2] = bits.view(np.uint8)
    return blocks.reshape(n, -1)


@settings(max_examples=60)
@given(qtype=st.sampled_from(GGUF_TYPES), n=st.integers(1, 5), blocks=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1), finite=st.booleans())
def test_torch_dequantiser_is_gguf_bit_for_bit(qtype: str, n: int, blocks: int, seed: int, finite: bool) -> None:
    k = blocks * td.BLOCKS[qtype][0]
    raw = _blocks(np.random.default_rng(seed), qtype, n, k, finite)
    kept = raw.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        want = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]), np.float32).reshape(n, k)
    deq = td.TorchDequantiser(qtype, n, k)
    got = deq(torch.from_numpy(raw)).numpy()
    assert got.shape == (n, k) and got.dtype == np.float32
    if finite:
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    else:
        assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(raw, kept)
    again = deq(torch.from_numpy(raw[::-1].copy())).numpy()  # the reused buffer holds the new weight only
    assert np.array_equal(again, want[::-1], equal_nan=True)


def test_torch_dequantiser_refuses_bad_input() -> None:
    with pytest.raises(ParamError, match="Q5_0"):
        td.TorchDequantiser("Q5_0", 2, 32)
    with pytest.raises(ShapeError, match="multiple of 256"):
        td.TorchDequantiser("Q4_K", 2, 32)
    with pytest.raises(ShapeError, match="72 uint8 bytes, got 71"):
        td.TorchDequantiser("Q4_0", 2, 64)(torch.zeros(71, dtype=torch.uint8))
    with pytest.raises(ShapeError, match=r"torch\.int8"):
        td.TorchDequantiser("Q4_0", 2, 64)(torch.zeros(72, dtype=torch.int8))


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
    qm.evict(a, b, np.empty(0, np.float32))
    assert np.array_equal(a, before[0]) and np.array_equal(b, before[1])


def test_read_bandwidth_is_measured() -> None:
    bw = qm.read_bandwidth(repeat=1, nbytes=8 << 20)
    assert bw["read_gbs"] == pytest.approx(max(bw["read_vector_gbs"], bw["read_numba_gbs"], bw["read_numpy_gbs"]))
    assert bw["read_gbs"] > 0


def test_stream_sum_reads_every_element() -> None:
    a = np.arange(4096, dtype=np.float32)
    assert qm._stream_sum(a, 0, a.size) == a.sum(dtype=np.float64)
    assert qm._stream_sum(a, 1024, 2048) == a[1024:2048].sum(dtype=np.float64)


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
