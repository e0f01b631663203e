"""The models benchmark at tiny sizes: each engine's worker gives its record (throughputs, peak RSS, thread
count; Fuel's executor overhead), transformers' prefill computes one row of logits, a worker runs in its own
process and a failing one is reported, and the harness writes its JSON and PNG. The synthetic Qwen2 and
Phi-3 files, written at tiny shapes under the real models' names: gguf-py reads every tensor in the type
llama.cpp's Q4_K_M recipe gives it (the recipe's choices written out by hand below), with finite, bounded
values; Fuel runs them through the benchmark's worker; the harness runs them against llama.cpp only and
writes each file once. Whether Fuel's greedy tokens
equal transformers' is tests/models/test_llama.py's to check, not repeated here. (llama.cpp is a
benchmark-only peer built by `make bench-env`.)"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import gguf
import matplotlib  # noqa: F401  (the harness draws its PNG with it)
import numpy as np
import pytest
import sentence_transformers  # noqa: F401  (MiniLM's peer)
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_models as bm
from benchmarks import synthetic_models as sm

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

    def fake_child(engine: str, model: str, sizes: bm.Sizes, cache: Path | None = None) -> dict[str, Any]:
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


# ---- the synthetic 0.5B models, at tiny shapes --------------------------------------------------------

TINY_SPECS = {  # rows of 128 in Qwen2 (every K-quant falls back) and of 256 in Phi-3 (none does)
    "qwen2_0.5b": sm.Spec("tiny-qwen2", "qwen2", hidden=128, layers=2, heads=4, kv_heads=2, ffn=256, vocab=49408,
                          tied=True, context=64, rope_base=1e6, eps=1e-6),
    "phi3_0.5b": sm.Spec("tiny-phi3", "phi3", hidden=256, layers=2, heads=4, kv_heads=4, ffn=256, vocab=32064,
                         tied=False, context=64, rope_base=1e4, eps=1e-5, window=2047),
}


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fuel-bench")
    for spec in TINY_SPECS.values():
        sm.ensure(spec, folder)
    return folder


@pytest.fixture
def tiny_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    for model, spec in TINY_SPECS.items():
        monkeypatch.setitem(sm.SPECS, model, spec)


def _more_bits(layers: int) -> set[int]:
    """llama.cpp's use_more_bits, spelled out for the two real depths."""
    return {24: {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23}, 14: {0, 3, 6, 9, 12, 13}}[layers]


def test_the_real_specs_follow_llama_cpps_q4_k_m_recipe() -> None:
    """Qwen2.5-0.5B's rows of 896 are no multiple of 256, so its K-quants fall back as llama.cpp's do
    (Q4_K -> Q5_0, Q6_K -> Q8_0) except ffn_down's rows of 4864; Phi-3's fused qkv is Q5_K."""
    def types(spec: sm.Spec) -> dict[str, str]:
        return {name: sm.block_type(name, shape[1], int(name.split(".")[1]) if name.startswith("blk.") else 0,
                                    spec).ggml_name
                for name, shape in sm.tensor_shapes(spec).items() if len(shape) == 2}

    q = types(sm.QWEN2)
    assert q.pop("token_embd.weight") == "Q8_0" and "output.weight" not in q
    for i in range(24):
        more = i in _more_bits(24)
        assert q.pop(f"blk.{i}.attn_v.weight") == ("Q8_0" if more else "Q5_0")
        assert q.pop(f"blk.{i}.ffn_down.weight") == ("Q6_K" if more else "Q4_K")
    assert set(q.values()) == {"Q5_0"} and len(q) == 24 * 5
    p = types(sm.PHI3)
    assert p.pop("token_embd.weight") == "Q4_K" and p.pop("output.weight") == "Q6_K"
    for i in range(14):
        assert p.pop(f"blk.{i}.ffn_down.weight") == ("Q6_K" if i in _more_bits(14) else "Q4_K")
        assert p.pop(f"blk.{i}.attn_qkv.weight") == "Q5_K"
    assert set(p.values()) == {"Q4_K"} and len(p) == 14 * 2
    assert sm.type_counts(sm.QWEN2) == {"Q8_0": 13, "Q5_0": 132, "Q4_K": 12, "Q6_K": 12, "F32": 24 * 5 + 1}
    assert 0.45e9 < sm.parameter_count(sm.QWEN2) < 0.55e9 and 0.45e9 < sm.parameter_count(sm.PHI3) < 0.55e9


@pytest.mark.parametrize("model", sorted(TINY_SPECS))
def test_a_synthetic_file_reads_back_with_valid_blocks(model: str, tiny_cache: Path) -> None:
    spec = TINY_SPECS[model]
    reader = gguf.GGUFReader(sm.file_path(spec, tiny_cache))

    def field(key: str) -> Any:
        return reader.fields[key].contents()

    assert field("general.architecture") == spec.arch and field(f"{spec.arch}.block_count") == spec.layers
    assert field(f"{spec.arch}.attention.head_count_kv") == spec.kv_heads
    window = reader.fields.get(f"{spec.arch}.attention.sliding_window")
    assert (window.contents() if window else 0) == spec.window
    tokens, merges = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.merges")
    assert len(tokens) == spec.vocab == len(set(tokens)) and field("tokenizer.ggml.eos_token_id") == 2
    known = set(tokens)
    assert all(part in known for m in merges for part in m.split(" "))  # every merge joins two tokens it has
    expected = sm.tensor_shapes(spec)
    assert sorted(t.name for t in reader.tensors) == sorted(expected)
    for t in reader.tensors:
        shape = expected[t.name]
        assert tuple(int(d) for d in t.shape[::-1]) == shape, t.name  # gguf-py gives ggml's order
        if len(shape) == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            continue
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else 0
        assert t.tensor_type.name == sm.block_type(t.name, shape[1], layer, spec).ggml_name, t.name
        rows = t.data[:512]  # the vocabulary-sized tensors in part: gguf-py decodes them slowly
        w = np.asarray(gguf.quants.dequantize(rows, t.tensor_type), np.float64)
        assert np.isfinite(w).all(), t.name
        mean = np.abs(w).mean(axis=1)  # per row: weights of the size the module doc promises
        assert (mean > 0.002).all() and (mean < 0.2).all() and np.abs(w).max() < 1.0, t.name


@pytest.mark.parametrize("model", sorted(TINY_SPECS))
def test_fuel_runs_a_synthetic_model_through_the_worker(model: str, tiny_cache: Path, tiny_specs: None,
                                                       one_thread_before: None) -> None:
    r = bm.worker("fuel", model, TINY, tiny_cache)
    assert r["threads"] == 2 and r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
    assert len(r["tokens"]) == TINY.decode and all(0 <= t < TINY_SPECS[model].vocab for t in r["tokens"])


def test_synthetic_prompts_come_from_the_files_tokenizer(tiny_cache: Path, tiny_specs: None) -> None:
    """Qwen2's padding is unreachable, so its ids are SmolLM2's; Phi-3's cut vocabulary spells the same
    text with its own (fewer, shorter) tokens."""
    assert bm.prompt_ids("qwen2_0.5b", 40, tiny_cache) == bm.prompt_ids("smollm2", 40)
    from fuel.models.tokenizer import GGUFTokenizer

    ids = bm.prompt_ids("phi3_0.5b", 40, tiny_cache)
    tok = GGUFTokenizer.from_gguf(sm.file_path(TINY_SPECS["phi3_0.5b"], tiny_cache))
    assert len(ids) == 40 and ids[0] == 1 and max(ids) < 32064
    assert bm.TEXT.startswith(tok.decode(ids[1:]))


def test_a_synthetic_file_is_written_once_under_its_content_key(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    spec = TINY_SPECS["qwen2_0.5b"]
    written: list[Path] = []
    real_write = sm.write

    def write(s: sm.Spec, path: Path) -> Path:
        written.append(path)
        return real_write(s, path)

    monkeypatch.setattr(sm, "write", write)
    first = sm.ensure(spec, tmp_path)
    assert sm.ensure(spec, tmp_path) == first and written == [first]
    keep = sm.ensure(TINY_SPECS["phi3_0.5b"], tmp_path)
    other = sm.ensure(dataclasses.replace(spec, seed=1), tmp_path)  # a new key replaces the old file of its name
    assert other != first and written == [first, keep, other]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([keep.name, other.name])  # no temporary left


def _canned_synthetic(engine: str) -> dict[str, Any]:
    prefill, decode = {"fuel": (300.0, 50.0), "llama_cpp": (250.0, 40.0)}[engine]
    return {"prefill_tok_s": prefill, "decode_tok_s": decode, "peak_rss_mib": 600.0, "tokens": [1], "threads": 2}


def test_the_synthetic_models_run_against_llama_cpp_only(tmp_path: Path, tiny_specs: None,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Each file exists before the first engine runs; fuel and llama.cpp alternate; the summary holds the
    issue's targets (decode >= 1x, prefill >= 1.5x llama.cpp) and no transformers ratio."""
    calls: list[tuple[str, str]] = []
    cache = tmp_path / "cache"

    def fake_child(engine: str, model: str, sizes: bm.Sizes, folder: Path | None = None) -> dict[str, Any]:
        assert folder == cache and sm.file_path(sm.SPECS[model], cache).exists()
        calls.append((engine, model))
        return _canned_synthetic(engine)

    monkeypatch.setattr(bm, "run_child", fake_child)
    sizes = bm.Sizes(prompt=TINY.prompt, decode=TINY.decode, rounds=2)
    assert bm.main(str(tmp_path / "out"), sizes, models=("qwen2_0.5b", "phi3_0.5b"), cache=cache) == 0
    assert calls == [(e, m) for m in ("qwen2_0.5b", "phi3_0.5b") for e in ("fuel", "llama_cpp") * 2]
    data = json.loads((tmp_path / "out" / "models.json").read_text())
    for model, spec in TINY_SPECS.items():
        s = data["summary"][model]
        assert s["decode_over_llama_cpp"] == pytest.approx(1.25) and s["prefill_over_llama_cpp"] == pytest.approx(1.2)
        assert s["targets"] == {"decode>=1x llama.cpp": True, "prefill>=1.5x llama.cpp": False,
                                "rss<=2x llama.cpp": True}
        assert "prefill_over_transformers" not in s and set(data["results"][model]) == {"fuel", "llama_cpp"}
        meta = data["meta"]["synthetic"][model]
        assert meta["parameters"] == sm.parameter_count(spec) and meta["file"] == sm.file_path(spec, cache).name
        assert sum(meta["block_types"].values()) == len(sm.tensor_shapes(spec))
    assert (tmp_path / "out" / "models.png").stat().st_size > 1000
    with pytest.raises(SystemExit, match="unknown model 'qwen9'"):
        bm.main(str(tmp_path / "out"), sizes, models=("qwen9",))
