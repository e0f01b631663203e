"""The attention benchmark on tiny sizes: every case runs, fuel agrees with torch's SDPA, the JSON has its
fields and the PNG is drawn; `fuel bench --attention` reaches the harness (no timing asserted)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import matplotlib  # noqa: F401  (the harness draws its PNG with it: a broken install fails here)
import numpy as np
import pytest
import torch  # noqa: F401  (the reference every fuel result is checked against)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import attention_cases as cases
from benchmarks import attention_harness as harness
from benchmarks import bench_attention as ba

import fuel as fl
from fuel import cli
from fuel.dtype import DType
from fuel.graph.registry import FusedOps

TINY = ba.Sizes.tiny()
LIMITS = {"bandwidth_gbs": 30.0, "gemm_gflops": 200.0}  # skip measuring the machine: no timing is asserted


def _check_timed(r: dict[str, Any]) -> None:
    assert r["failed"] is None and r["skipped"] is None, r["notes"]
    assert all(r["ms"][w] > 0 for w in ("fuel", "fuel_jit", "torch_eager"))
    assert r["fuel_best_way"] in ("fuel", "fuel_jit") and r["fuel_ms"] == r["ms"][r["fuel_best_way"]]
    assert r["fuel_over_torch"] == pytest.approx(r["fuel_ms"] / r["ms"]["torch_eager"])
    assert r["roofline_ms"] > 0 and r["roofline_fraction"] > 0
    assert r["roofline_source"] in ("impl cost", "analytic") and r["flops"] > 0 and r["bytes"] > 0
    assert set(r["correctness"]) == {"fuel", "fuel_jit"}
    for way, c in r["correctness"].items():
        assert c["ok"], (r["case"], way, c)


def test_harness_writes_json_and_png(tmp_path: Path) -> None:
    assert ba.main(str(tmp_path), 1, False, TINY, LIMITS) == 0
    data = json.loads((tmp_path / "attention.json").read_text())
    assert data["meta"]["threads"] == 2 and data["meta"]["sizes"]["seq"] == TINY.seq
    results = {(r["case"], r["dtype"]): r for r in data["results"]}
    assert set(results) == {("forward", "f32"), ("forward", "bf16"), ("backward", "f32"), ("decode", "f32"),
                            ("paged", "f32")}
    assert not [r for r in data["results"] if r["failed"]]  # a case that raised: main would also return 1
    for key in [("forward", "f32"), ("backward", "f32"), ("decode", "f32")]:
        _check_timed(results[key])
    # With its kernel registered, each case finds the impl that ran (the backward's is one joint step)
    # and takes the roofline from that impl's own cost.
    for key, op in [(("forward", "f32"), FusedOps.FLASH_ATTN), (("backward", "f32"), FusedOps.FLASH_ATTN_BACKWARD_Q),
                    (("decode", "f32"), FusedOps.FLASH_ATTN), (("paged", "f32"), FusedOps.PAGED_ATTN)]:
        if harness.has_impl(op, DType.F32) and results[key]["skipped"] is None:
            assert results[key]["roofline_source"] == "impl cost" and results[key]["impls"], key
    assert results["forward", "f32"]["shape"] == f"B1 H{TINY.heads} S{TINY.seq} D{TINY.head_dim} causal"
    # these two may skip only when their kernel is missing
    for key, op, dt in [(("forward", "bf16"), FusedOps.FLASH_ATTN, DType.BF16),
                        (("paged", "f32"), FusedOps.PAGED_ATTN, DType.F32)]:
        r = results[key]
        if harness.has_impl(op, dt):
            _check_timed(r)
        else:
            assert r["skipped"] in r["notes"] and r["fuel_ms"] is None
    (mem,) = data["memory"]
    assert mem["seq"] == TINY.long_seq and mem["score_matrix_mib"] == pytest.approx(TINY.long_seq**2 * 4 / 2**20)
    assert mem["skipped"] is None and set(mem["ways"]) == {"fuel", "torch"}
    for w in mem["ways"].values():
        assert "error" not in w, w
        assert w["peak_kib"] >= w["base_kib"] > 0 and w["first_s"] > 0
        assert w["extra_mib"] == pytest.approx((w["peak_kib"] - w["base_kib"]) / 1024)
    assert (tmp_path / "attention.png").stat().st_size > 1000


def test_fuel_agrees_with_torch_on_gqa_decode_and_causal_forward() -> None:
    """The case functions on their own, at other tiny sizes (odd lengths, grouped heads)."""
    fwd = cases.case_forward(LIMITS, 1, False, batch=2, heads=3, seq=19, head_dim=8)
    dec = cases.case_decode(LIMITS, 1, False, hq=6, hkv=2, capacity=33, k_len=17, head_dim=8)
    bwd = cases.case_backward(LIMITS, 1, False, batch=1, heads=2, seq=13, head_dim=8)
    for r in (fwd, dec, bwd):
        _check_timed(r)
    assert fwd["analytic_flops"] == 2 * 2 * 2 * 3 * 19 * 19 * 8 // 2


def test_paged_case_runs() -> None:
    r = cases.case_paged(LIMITS, 1, False, batch=2, hq=4, hkv=2, head_dim=8, block_size=4, context=10)
    _check_timed(r)
    assert r["torch_gather_ms"] > 0


def test_a_raising_kernel_fails_the_case_and_the_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An exception in fuel is a failure, recorded as such (never as a skip), and main returns 1 after
    running the other cases."""
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(fl.ops, "paged_attn", broken)
    with pytest.raises(RuntimeError, match="kernel exploded"):  # the case itself does not swallow it
        cases.case_paged(LIMITS, 1, False, batch=2, hq=4, hkv=2, head_dim=8, block_size=4, context=10)
    monkeypatch.setattr(ba, "case_forward", broken)
    assert ba.main(str(tmp_path), 1, False, TINY, LIMITS) == 1
    data = json.loads((tmp_path / "attention.json").read_text())
    crashed = {(r["case"], r["dtype"]): r for r in data["results"] if r["failed"]}
    assert set(crashed) == {("forward", "f32"), ("forward", "bf16"), ("paged", "f32")}
    for r in crashed.values():
        assert r["skipped"] is None and r["failed"] == "RuntimeError: kernel exploded" and r["fuel_ms"] is None
    _check_timed(next(r for r in data["results"] if r["case"] == "decode"))


def test_memory_case_skips_without_a_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cases, "has_impl", lambda op_id, dt: False)
    r = cases.case_memory(seq=16384, heads=1)
    assert r["skipped"] and "score matrix" in r["skipped"] and r["ways"] == {}
    assert r["score_matrix_mib"] == pytest.approx(1024.0)


def test_compare_flags_a_mismatch() -> None:
    a = np.ones((2, 3), np.float32)
    assert harness.compare([a], [a + 1e-6], 1e-4, 2e-5)["ok"]
    bad = harness.compare([a], [a + 1.0], 1e-4, 2e-5)
    assert not bad["ok"] and bad["max_abs"] == pytest.approx(1.0)
    assert not harness.compare([a], [a[:1]], 1e-4, 2e-5)["ok"]


def test_cli_flag_reaches_the_harness(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[Any, ...]] = []
    def fake_main(*a: Any) -> int:
        calls.append(a)
        return 0

    monkeypatch.setattr(ba, "main", fake_main)
    for key in ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE"):  # _bench sets them: restore them afterwards
        monkeypatch.setenv(key, os.environ.get(key, "PASSIVE" if key.startswith("OMP") else "1"))
    assert cli.main(["bench", "--attention", "--out", str(tmp_path), "--repeat", "3", "--no-compile"]) == 0
    assert calls == [(str(tmp_path), 3, False)]
    with pytest.raises(SystemExit):
        cli.main(["bench", "--attention", "--latency"])
