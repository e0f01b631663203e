"""The training benchmark's harness on synthetic rounds: medians, spread and ratios (checked against the
standard library's median), a failed engine reported with its error, the PNG written, and an unknown shape
refused. No engine trains here: `fuel bench --train` runs them (docs/benchmarks.md)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_train as bt


def _run(tok_s: float, rss: float = 100.0) -> dict[str, Any]:
    return {"tok_s": tok_s, "first_step_s": 1.0, "step_s": 1 / tok_s, "peak_rss_mib": rss}


def test_summary_takes_medians_spread_and_ratios_of_medians(tmp_path: Path) -> None:
    runs = {"stories15m": {"fuel": [_run(900), _run(1200), _run(1000, 300)],
                           "torch_eager": [_run(400), _run(650), _run(500)],
                           "torch_compile": [{"error": "RuntimeError: no compiler"}]},
            "qlora": {"fuel": [_run(180)], "peft": [_run(90), _run(80)]}}
    summary = bt.summarise(runs)
    fuel = summary["stories15m"]["fuel"]
    assert fuel["tok_s"] == statistics.median([900, 1200, 1000]) == 1000  # not the mean
    assert (fuel["tok_s_min"], fuel["tok_s_max"], fuel["rounds"], fuel["peak_rss_mib"]) == (900, 1200, 3, 300)
    assert summary["stories15m"]["fuel_vs_torch_eager"] == 1000 / 500
    assert summary["stories15m"]["torch_compile"] == {"error": "RuntimeError: no compiler"}
    assert summary["stories15m"]["fuel_vs_torch_compile"] is None
    assert summary["qlora"]["fuel_vs_peft"] == 180 / 85
    assert "fuel_vs_torch_eager" not in summary["qlora"]  # QLoRA's peer is peft only
    bt.print_table(summary)
    bt.plot(summary, tmp_path / "train.png")
    assert (tmp_path / "train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unknown_shape_is_refused(tmp_path: Path, capsys: Any) -> None:
    assert bt.main(str(tmp_path), rounds=1, shapes=("stories1b",)) == 2
    assert "unknown shape 'stories1b'" in capsys.readouterr().out
