"""Real models end to end: Fuel against transformers (float32 eager) and llama.cpp, in one run.

- SmolLM2-135M-Instruct (Q4_1/Q8_0) and Gemma-3-270M (Q4_K_M): prefill tokens/s over a 128-token
  prompt, decode tokens/s over 128 greedy tokens, and the peak RSS. All three engines get the same
  token ids. Fuel and transformers run the same GGUF file (transformers dequantises it to float32);
  llama.cpp (llama-cpp-python, built by `make bench-env`) runs it quantized, as Fuel does.
- Qwen2 and Phi-3 at about 0.5B parameters (benchmarks/synthetic_models.py): random weights of the real
  shapes in llama.cpp's Q4_K_M block types, written once into a cache folder (~/.cache/fuel-bench, or
  `cache`), against llama.cpp only, the same way as above. transformers is left out of these two: it
  dequantises the whole file to float32 through gguf-py's NumPy decoders before it runs, and a float32
  eager peer is already measured on the packaged models; the targets here are llama.cpp's.
- all-MiniLM-L6-v2: sentences/s at batch 32 and batch 1, Fuel against sentence-transformers.

Each (engine, model) runs in its own child process, one after another, `Sizes.rounds` times round-robin
(each throughput is the best of the rounds: every engine gets the same chances), so each peak RSS is that
engine's alone (interpreter and imports included: NumPy and Numba for Fuel, torch for transformers).
Every engine gets THREADS threads, each set explicitly (`fl.set_num_threads`, `torch.set_num_threads`,
llama.cpp's n_threads and n_threads_batch) and recorded with its result. Every prefill computes the
logits of the prompt's last token only (Fuel's and llama.cpp's do; transformers is called with
`logits_to_keep=1`). Fuel's rows also give the executor's own cost per decoded token: the step's wall
time minus the kernel times `fl.trace()` records, over the replayed steps.

The targets printed beside the numbers are benchmarks/models_report.py's. Run it through
`fuel bench --models` or `python -m benchmarks.bench_models [--models ...] [--cache DIR]`; JSON and PNG go
to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import synthetic_models
from benchmarks.models_report import LLMS, SYNTHETIC, plot, print_table, summarise

THREADS = 2  # every engine's, each set explicitly
LLM_ENGINES = ("fuel", "transformers", "llama_cpp")
SYNTHETIC_ENGINES = ("fuel", "llama_cpp")
MODELS = (*LLMS, *SYNTHETIC, "minilm")
EMBED_ENGINES = ("fuel", "sentence_transformers")
TEXT = ("The history of the printing press begins in the fifteenth century, when movable metal type made "
        "books cheap enough for ordinary readers. Within fifty years presses ran in hundreds of towns, and "
        "the spread of pamphlets, maps and scientific tables changed how ideas travelled across Europe. ")
SENTENCES = ("A man is eating food.", "The new movie is awesome, I would see it again tomorrow night.",
             "Two dogs play in the snow.", "Quantized matrix multiplication reads four bits per weight, "
             "so decoding a small language model is bound by memory bandwidth on most CPUs.", "Hello!",
             "It rained all day and the river rose above its banks by the evening.")


@dataclass(frozen=True)
class Sizes:
    prompt: int = 128
    decode: int = 128
    sentences: int = 64
    rounds: int = 2  # runs of every engine, interleaved; each throughput is the best of them
    embed_repeat: int = 5  # timed passes per batch size; the median is reported

    @classmethod
    def tiny(cls) -> Sizes:
        return cls(prompt=12, decode=4, sentences=4, rounds=1, embed_repeat=1)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def engines_of(model: str) -> tuple[str, ...]:
    return EMBED_ENGINES if model == "minilm" else SYNTHETIC_ENGINES if model in SYNTHETIC else LLM_ENGINES


def model_path(model: str, cache: Path | None = None) -> Path:
    """The GGUF file of an LLM: a packaged one, or a synthetic one in `cache` (written on first use)."""
    if model in SYNTHETIC:
        return synthetic_models.ensure(synthetic_models.SPECS[model], cache)
    from fuel.io.gguf import bundled_gguf

    return Path(bundled_gguf(model))


def prompt_ids(model: str, n: int, cache: Path | None = None) -> list[int]:
    """n token ids of TEXT (repeated as needed) after the model's BOS, from the file's own tokenizer."""
    from fuel.io.gguf import open_gguf
    from fuel.models.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_metadata(open_gguf(model_path(model, cache)).metadata)
    body = tok.encode(TEXT * (1 + n // 40), add_bos=False)
    head = [] if tok.bos_id is None else [tok.bos_id]
    return (head + body)[:n]


# ---- one engine, one model: run in a child process ----------------------------------------------------


def _fuel_llm(path: Path, ids: list[int], n_decode: int) -> dict[str, Any]:
    import fuel as fl
    from fuel.models.llama import LlamaModel

    fl.set_num_threads(THREADS)
    m = LlamaModel.load(path, capacity=len(ids) + n_decode + 8)
    m.prefill(ids)  # capture the steps this prompt uses (and load Numba's kernels), and the decode step
    m.decode(0)
    m.reset()
    start = time.perf_counter()
    logits = m.prefill(ids)
    prefill_s = time.perf_counter() - start
    tokens, start = [], time.perf_counter()
    for _ in range(n_decode):
        tokens.append(int(np.argmax(logits)))
        logits = m.decode(tokens[-1])
    decode_s = time.perf_counter() - start
    # The replayed decode step runs natively (`fuel.runtime.replay`): its task-backed steps posted from
    # jitted code, the rest in Python. A traced call runs every step in Python and times each; wall time
    # minus the kernels' time is the Python executor's own cost, which the native steps do not pay.
    capture = next(iter(m._decode._captures.values()))
    native = capture.native
    native_steps = 0 if native is None else native.step_count  # steps, not jobs: a table QMatMul posts two
    traced = min(8, max(1, m.capacity - m.pos))
    kernel_s, steps, start = 0.0, 0, time.perf_counter()
    for _ in range(traced):
        with fl.trace() as t:
            logits = m.decode(int(np.argmax(logits)))
        kernel_s += sum(r.seconds for r in t.records)
        steps = len(t.records)
    wall = (time.perf_counter() - start) / traced
    overhead = wall - kernel_s / traced
    return {"prefill_s": prefill_s, "decode_s": decode_s, "tokens": tokens,
            "overhead_ms_per_token": overhead * 1e3, "steps_per_token": steps,
            "overhead_us_per_step": overhead * 1e6 / max(steps, 1), "native_steps_per_token": native_steps,
            "threads": fl.get_num_threads()}


def _transformers_llm(path: Path, ids: list[int], n_decode: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(THREADS)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.inference_mode():
        hf(x, logits_to_keep=1)  # warm-up
        start = time.perf_counter()
        out = hf(x, use_cache=True, logits_to_keep=1)  # the last token's logits only, as the other engines
        prefill_s = time.perf_counter() - start
        prefill_rows = int(out.logits.shape[1])
        tokens, start = [], time.perf_counter()
        for _ in range(n_decode):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        decode_s = time.perf_counter() - start
    return {"prefill_s": prefill_s, "decode_s": decode_s, "tokens": tokens, "prefill_logits_rows": prefill_rows,
            "threads": torch.get_num_threads()}


def _llama_cpp_llm(path: Path, ids: list[int], n_decode: int) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=len(ids) + n_decode + 8, n_batch=512,
                n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    llm.eval(ids)  # warm-up
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - start
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:  # the last evaluated token's row (Llama.scores is filled only with logits_all)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))

    tokens, start = [], time.perf_counter()
    for _ in range(n_decode):
        tokens.append(int(np.argmax(last_logits())))
        llm.eval([tokens[-1]])
    decode_s = time.perf_counter() - start
    return {"prefill_s": prefill_s, "decode_s": decode_s, "tokens": tokens, "threads": THREADS}


def _embed(engine: str, n: int, repeat: int) -> dict[str, Any]:
    sentences = [SENTENCES[i % len(SENTENCES)] + f" ({i})" for i in range(n)]
    if engine == "fuel":
        import fuel as fl
        from fuel.models import bert

        fl.set_num_threads(THREADS)
        threads = fl.get_num_threads()

        def run(batch: int) -> Any:
            return bert.embed(sentences, batch_size=batch)
    else:
        import torch
        from sentence_transformers import SentenceTransformer

        from fuel.models.bert import model_dir

        torch.set_num_threads(THREADS)
        threads = torch.get_num_threads()
        st = SentenceTransformer(str(model_dir()), device="cpu")

        def run(batch: int) -> Any:
            return st.encode(sentences, batch_size=batch, normalize_embeddings=True)
    result: dict[str, Any] = {"threads": threads}
    for batch in (32, 1):
        run(batch)  # warm-up (and Fuel's captures of these shapes)
        seconds = []
        for _ in range(repeat):  # one pass over 64 sentences varied by ±30% run to run on this VM
            start = time.perf_counter()
            run(batch)
            seconds.append(time.perf_counter() - start)
        result[f"sentences_per_s_batch{batch}"] = n / statistics.median(seconds)
    return result


def worker(engine: str, model: str, sizes: Sizes, cache: Path | None = None) -> dict[str, Any]:
    if model == "minilm":
        result = _embed(engine, sizes.sentences, sizes.embed_repeat)
    else:
        ids = prompt_ids(model, sizes.prompt, cache)
        run = {"fuel": _fuel_llm, "transformers": _transformers_llm, "llama_cpp": _llama_cpp_llm}[engine]
        result = run(model_path(model, cache), ids, sizes.decode)
        result["prefill_tok_s"] = len(ids) / result["prefill_s"]
        result["decode_tok_s"] = sizes.decode / result["decode_s"] if result["decode_s"] else None
    result["peak_rss_mib"] = _rss_mib()
    return result


def run_child(engine: str, model: str, sizes: Sizes, cache: Path | None = None) -> dict[str, Any]:
    """`worker` in a fresh interpreter; an engine that is not installed or fails gives its error."""
    cmd = [sys.executable, "-m", "benchmarks.bench_models", "--worker", engine, model, json.dumps(asdict(sizes)),
           "" if cache is None else str(cache)]
    # Each engine runs with its own defaults and gets its thread count through its API: a passive OpenMP
    # wait (which `fuel bench` sets for the benchmarks that share one process with torch) cut llama.cpp's
    # decode from 98 to 34 tokens/s, its threads sleeping at every barrier.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], env=env)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        hint = " (build it with `make bench-env`)" if engine == "llama_cpp" and "llama_cpp" in proc.stderr else ""
        return {"error": tail[0] + hint}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def best_of(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Two runs of one engine as one: each throughput the higher (this VM's neighbours slowed whole runs of
    an engine by 20-40%, and the rounds give every engine the same chances), the peak RSS the higher,
    everything else from the first run; an error only where both failed."""
    if a is None or "error" in a:
        return b
    if "error" in b:
        return a
    out = dict(a)
    for key, value in b.items():
        if value is None or out.get(key) is None:
            continue
        higher = key.endswith(("_tok_s", "_per_s_batch32", "_per_s_batch1")) or key == "peak_rss_mib"
        if (higher and value > out[key]) or (key in ("prefill_s", "decode_s") and value < out[key]):
            out[key] = value
    return out


def _synthetic_meta(model: str, cache: Path | None) -> dict[str, Any]:
    spec = synthetic_models.SPECS[model]
    return {**asdict(spec), "file": model_path(model, cache).name, "parameters": synthetic_models.parameter_count(spec),
            "block_types": synthetic_models.type_counts(spec)}


def main(out_dir: str, sizes: Sizes | None = None, models: tuple[str, ...] = MODELS,
         engines: tuple[str, ...] | None = None, cache: Path | None = None) -> int:
    """Run every (engine, model) `sizes.rounds` times, the engines of a model round-robin; write the JSON and
    PNG into out_dir. A synthetic model's file is written here, once, before any engine runs it."""
    sizes = sizes or Sizes()
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"bench_models: unknown model {unknown[0]!r}; expected one of {', '.join(MODELS)}")
    for model in models:
        if model in SYNTHETIC:
            model_path(model, cache)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for model in models:
        for r in range(sizes.rounds):
            for engine in engines_of(model):
                if engines is not None and engine not in engines:
                    continue
                print(f"running {engine} on {model} (round {r + 1} of {sizes.rounds}) ...", flush=True)
                got = results.setdefault(model, {})
                got[engine] = best_of(got.get(engine), run_child(engine, model, sizes, cache))
    summary = summarise(results)
    print_table(results, summary)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
            "threads": THREADS, "sizes": asdict(sizes),
            "synthetic": {m: _synthetic_meta(m, cache) for m in models if m in SYNTHETIC}}
    (out / "models.json").write_text(json.dumps({"meta": meta, "results": results, "summary": summary}, indent=1))
    plot(results, out / "models.png")
    print(f"wrote {out / 'models.json'} and {out / 'models.png'}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, eng, mdl, size_json, cache_dir = sys.argv
        print(json.dumps(worker(eng, mdl, Sizes(**json.loads(size_json)), Path(cache_dir) if cache_dir else None)))
        raise SystemExit(0)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    ap.add_argument("--cache", type=Path, default=None,
                    help=f"the synthetic models' folder (default {synthetic_models.DEFAULT_FOLDER})")
    ap.add_argument("--rounds", type=int, default=Sizes.rounds, help="runs of every engine, interleaved")
    a = ap.parse_args()
    raise SystemExit(main(a.out, Sizes(rounds=a.rounds), models=tuple(a.models), cache=a.cache))
