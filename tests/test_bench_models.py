"""The models benchmark at tiny sizes: each engine's worker gives its record (throughputs, peak RSS, thread
count; Fuel's executor overhead), transformers' prefill computes one row of logits, a worker runs in its own
process and a failing one is reported, and the harness writes its JSON and PNG. Whether Fuel's greedy tokens
equal transformers' is tests/models/test_llama.py's to check, not repeated here. (llama.cpp is a
benchmark-only peer built by `make bench-env`.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib  # noqa: F401  (the harness draws its PNG with it)
import pytest
import sentence_transformers  # noqa: F401  (MiniLM's peer)
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_models as bm

TINY = bm.Sizes.tiny()



def _canned(engine: str, model: str) -> dict[str, Any]:
    if engine == "llama_cpp":
        return {"error": "ModuleNotFoundError: No module named 'llama_cpp' (build it with `make bench-env`)"}
    if model == "minilm":
        rate = {"fuel": 300.0, "sentence_transformers": 200.0}[engine]
        return {"sentences_per_s_batch32": rate, "sentences_per_s_batch1": rate / 4, "peak_rss_mib": 400.0,
                "threads": 2}
    prefill = {"fuel": 300.0, "transformers": 150.0}[engine]
    return {"prefill_s": TINY.prompt / prefill, "decode_s": TINY.decode / 50.0, "prefill_tok_s": prefill,
            "decode_tok_s": 50.0, "peak_rss_mib": 500.0, "tokens": [1, 2, 3, 4], "threads": 2}


def test_harness_runs_every_engine_round_robin_and_writes_json_and_png(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []

    def fake_child(engine: str, model: str, sizes: bm.Sizes) -> dict[str, Any]:
        calls.append((engine, model))
        return _canned(engine, model)

    monkeypatch.setattr(bm, "run_child", fake_child)
    sizes = bm.Sizes(prompt=TINY.prompt, decode=TINY.decode, sentences=TINY.sentences, rounds=2)
    assert bm.main(str(tmp_path), sizes, models=("smollm2", "minilm")) == 0
    llm_round = [(e, "smollm2") for e in bm.LLM_ENGINES]
    assert calls == llm_round * 2 + [(e, "minilm") for e in bm.EMBED_ENGINES] * 2
    data = json.loads((tmp_path / "models.json").read_text())
    assert data["meta"]["threads"] == 2 and data["meta"]["sizes"]["rounds"] == 2
    smol = data["summary"]["smollm2"]
    assert smol["prefill_over_transformers"] == pytest.approx(2.0)
    assert smol["targets"]["prefill>=1x transformers"] is True
    assert smol["decode_over_llama_cpp"] is None and smol["targets"]["decode>=0.6x llama.cpp"] is None
    assert smol["threads"] == {"fuel": 2, "transformers": 2, "llama_cpp": None}
    assert "make bench-env" in data["results"]["smollm2"]["llama_cpp"]["error"]
    minilm = data["summary"]["minilm"]
    assert minilm["batch32_over_sentence_transformers"] == pytest.approx(1.5)
    assert minilm["targets"]["batch32>=1.2x sentence-transformers"] is True
    assert (tmp_path / "models.png").stat().st_size > 1000


def test_fuel_llm_record(one_thread_before: None) -> None:
    r = bm.worker("fuel", "smollm2", TINY)
    assert r["threads"] == bm.THREADS == 2
    assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["peak_rss_mib"] > 50
    assert len(r["tokens"]) == TINY.decode
    assert r["steps_per_token"] > 0 and "overhead_ms_per_token" in r
    assert 0 < r["native_steps_per_token"] <= r["steps_per_token"]


def test_transformers_prefill_computes_the_last_rows_logits_only(monkeypatch: pytest.MonkeyPatch,
                                                                 one_thread_before: None) -> None:
    """The same call the benchmark makes of SmolLM2's GGUF, made of a tiny random Llama (loading the real
    file is tests/models/test_llama.py's): one row of logits comes back from the 12-token prefill."""
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    tiny = transformers.LlamaForCausalLM(config)
    loaded: list[tuple[Any, ...]] = []

    def from_pretrained(*a: Any, **kw: Any) -> Any:
        loaded.append((*a, kw))
        return tiny

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    r = bm.worker("transformers", "smollm2", TINY)
    assert len(loaded) == 1 and loaded[0][-1]["gguf_file"].endswith(".gguf")
    assert r["prefill_logits_rows"] == 1
    assert r["threads"] == 2 and len(r["tokens"]) == TINY.decode
    assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0


def test_sentence_transformers_record(one_thread_before: None) -> None:
    r = bm.worker("sentence_transformers", "minilm", TINY)
    assert r["threads"] == 2 and r["sentences_per_s_batch32"] > 0 and r["sentences_per_s_batch1"] > 0


def test_a_worker_runs_in_its_own_process() -> None:
    r = bm.run_child("fuel", "minilm", TINY)
    assert "error" not in r, r
    assert r["threads"] == 2 and r["sentences_per_s_batch32"] > 0 and r["sentences_per_s_batch1"] > 0
    assert r["peak_rss_mib"] > 50


def test_a_failing_engine_is_reported() -> None:
    r = bm.run_child("no_such_engine", "smollm2", TINY)
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
