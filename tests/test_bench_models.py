"""The models benchmark at tiny sizes: each engine runs in its own process, Fuel's greedy tokens equal
transformers', the JSON has its fields and the PNG is drawn; a missing engine is reported, not fatal.
(llama.cpp is a benchmark-only peer built by `make bench-env`; the harness around it is the same.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib  # noqa: F401  (the harness draws its PNG with it)
import sentence_transformers  # noqa: F401  (MiniLM's peer)
import transformers  # noqa: F401  (the LLMs' peer)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_models as bm


def test_harness_runs_engines_in_children_and_writes_json_and_png(tmp_path: Path) -> None:
    engines = ("fuel", "transformers", "sentence_transformers")
    assert bm.main(str(tmp_path), bm.Sizes.tiny(), models=("smollm2", "minilm"), engines=engines) == 0
    data = json.loads((tmp_path / "models.json").read_text())
    assert (tmp_path / "models.png").stat().st_size > 0
    smol = data["results"]["smollm2"]
    assert set(smol) == {"fuel", "transformers"}
    for r in smol.values():
        assert "error" not in r, r
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["peak_rss_mib"] > 50
        assert len(r["tokens"]) == bm.Sizes.tiny().decode
    assert smol["fuel"]["steps_per_token"] > 0 and "overhead_ms_per_token" in smol["fuel"]
    assert 0 < smol["fuel"]["native_steps_per_token"] <= smol["fuel"]["steps_per_token"]
    assert data["summary"]["smollm2"]["greedy_tokens_equal_transformers"] is True
    minilm = data["results"]["minilm"]
    for r in minilm.values():
        assert r["sentences_per_s_batch32"] > 0 and r["sentences_per_s_batch1"] > 0
    assert data["summary"]["minilm"]["batch32_over_sentence_transformers"] > 0


def test_a_failing_engine_is_reported() -> None:
    r = bm.run_child("no_such_engine", "smollm2", bm.Sizes.tiny())
    assert "KeyError" in r["error"]


def test_prompt_ids_are_the_files_tokens() -> None:
    ids = bm.prompt_ids("smollm2", 20)
    assert len(ids) == 20 and ids[0] == 1  # SmolLM2's bos <|im_start|>, then TEXT's tokens


def test_rounds_keep_each_throughput_at_its_best() -> None:
    a = {"prefill_tok_s": 400.0, "decode_tok_s": 60.0, "prefill_s": 0.32, "decode_s": 2.13, "peak_rss_mib": 350.0,
         "tokens": [1, 2]}
    b = {"prefill_tok_s": 380.0, "decode_tok_s": 66.0, "prefill_s": 0.34, "decode_s": 1.94, "peak_rss_mib": 352.0,
         "tokens": [1, 3]}
    got = bm.best_of(a, b)
    assert got == {"prefill_tok_s": 400.0, "decode_tok_s": 66.0, "prefill_s": 0.32, "decode_s": 1.94,
                   "peak_rss_mib": 352.0, "tokens": [1, 2]}
    assert bm.best_of(None, b) is b and bm.best_of({"error": "x"}, b) is b and bm.best_of(a, {"error": "x"}) is a
