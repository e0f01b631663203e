"""Real models end to end: Fuel against transformers (float32 eager) and llama.cpp, in one run.

- SmolLM2-135M-Instruct (Q4_1/Q8_0) and Gemma-3-270M (Q4_K_M): prefill tokens/s over a 128-token
  prompt, decode tokens/s over 128 greedy tokens, and the peak RSS. All three engines get the same
  token ids. Fuel and transformers run the same GGUF file (transformers dequantises it to float32);
  llama.cpp (llama-cpp-python, built by `make bench-env`) runs it quantized, as Fuel does.
- all-MiniLM-L6-v2: sentences/s at batch 32 and batch 1, Fuel against sentence-transformers.

Each (engine, model) runs in its own child process, one after another, `Sizes.rounds` times round-robin
(each throughput is the best of the rounds: every engine gets the same chances), so each peak RSS is that
engine's alone (interpreter and imports included: NumPy and Numba for Fuel, torch for transformers).
Every engine gets THREADS threads, each set explicitly (`fl.set_num_threads`, `torch.set_num_threads`,
llama.cpp's n_threads and n_threads_batch) and recorded with its result. Every prefill computes the
logits of the prompt's last token only (Fuel's and llama.cpp's do; transformers is called with
`logits_to_keep=1`). Fuel's rows also give the executor's own cost per decoded token: the step's wall
time minus the kernel times `fl.trace()` records, over the replayed steps.

Targets printed beside the numbers (issue "real models"): SmolLM2 and Gemma-3 decode ≥ 0.6× llama.cpp;
prefill ≥ 2× llama.cpp and ≥ transformers; peak RSS ≤ 2× llama.cpp; MiniLM ≥ 1.2× sentence-transformers.
Run it through `fuel bench --models` or `python -m benchmarks.bench_models`; JSON and PNG go to --out.
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

THREADS = 2  # every engine's, each set explicitly
LLMS = ("smollm2", "gemma3")
LLM_ENGINES = ("fuel", "transformers", "llama_cpp")
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


def prompt_ids(model: str, n: int) -> list[int]:
    """n token ids of TEXT (repeated as needed) after the model's BOS, from the file's own tokenizer."""
    from fuel.io.gguf import bundled_gguf, open_gguf
    from fuel.models.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_metadata(open_gguf(bundled_gguf(model)).metadata)
    body = tok.encode(TEXT * (1 + n // 40), add_bos=False)
    head = [] if tok.bos_id is None else [tok.bos_id]
    return (head + body)[:n]


# ---- one engine, one model: run in a child process ----------------------------------------------------


def _fuel_llm(model: str, ids: list[int], n_decode: int) -> dict[str, Any]:
    import fuel as fl
    from fuel.io.gguf import bundled_gguf
    from fuel.models.llama import LlamaModel

    fl.set_num_threads(THREADS)
    m = LlamaModel.load(bundled_gguf(model), capacity=len(ids) + n_decode + 8)
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


def _transformers_llm(model: str, ids: list[int], n_decode: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from fuel.io.gguf import bundled_gguf

    torch.set_num_threads(THREADS)
    path = bundled_gguf(model)
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


def _llama_cpp_llm(model: str, ids: list[int], n_decode: int) -> dict[str, Any]:
    from llama_cpp import Llama

    from fuel.io.gguf import bundled_gguf

    llm = Llama(model_path=str(bundled_gguf(model)), n_ctx=len(ids) + n_decode + 8, n_batch=512,
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


def worker(engine: str, model: str, sizes: Sizes) -> dict[str, Any]:
    if model == "minilm":
        result = _embed(engine, sizes.sentences, sizes.embed_repeat)
    else:
        ids = prompt_ids(model, sizes.prompt)
        run = {"fuel": _fuel_llm, "transformers": _transformers_llm, "llama_cpp": _llama_cpp_llm}[engine]
        result = run(model, ids, sizes.decode)
        result["prefill_tok_s"] = len(ids) / result["prefill_s"]
        result["decode_tok_s"] = sizes.decode / result["decode_s"] if result["decode_s"] else None
    result["peak_rss_mib"] = _rss_mib()
    return result


def run_child(engine: str, model: str, sizes: Sizes) -> dict[str, Any]:
    """`worker` in a fresh interpreter; an engine that is not installed or fails gives its error."""
    cmd = [sys.executable, "-m", "benchmarks.bench_models", "--worker", engine, model, json.dumps(asdict(sizes))]
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


# ---- the report ---------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def summarise(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Fuel's ratios to the others and whether each target holds (None where a peer is missing)."""
    out: dict[str, Any] = {}
    for model in LLMS:
        r = results.get(model)
        if not r:
            continue
        f, lc, hf = r.get("fuel", {}), r.get("llama_cpp", {}), r.get("transformers", {})
        dec = _ratio(f.get("decode_tok_s"), lc.get("decode_tok_s"))
        pre_lc = _ratio(f.get("prefill_tok_s"), lc.get("prefill_tok_s"))
        pre_hf = _ratio(f.get("prefill_tok_s"), hf.get("prefill_tok_s"))
        rss = _ratio(f.get("peak_rss_mib"), lc.get("peak_rss_mib"))
        out[model] = {
            "decode_over_llama_cpp": dec, "prefill_over_llama_cpp": pre_lc, "prefill_over_transformers": pre_hf,
            "rss_over_llama_cpp": rss, "greedy_tokens_equal_transformers": f.get("tokens") == hf.get("tokens")
            if "tokens" in hf else None, "threads": {engine: e.get("threads") for engine, e in r.items()},
            "targets": {"decode>=0.6x llama.cpp": None if dec is None else dec >= 0.6,
                        "prefill>=2x llama.cpp": None if pre_lc is None else pre_lc >= 2.0,
                        "prefill>=1x transformers": None if pre_hf is None else pre_hf >= 1.0,
                        "rss<=2x llama.cpp": None if rss is None else rss <= 2.0}}
    e = results.get("minilm")
    if e:
        ratio = _ratio(e.get("fuel", {}).get("sentences_per_s_batch32"),
                       e.get("sentence_transformers", {}).get("sentences_per_s_batch32"))
        out["minilm"] = {"batch32_over_sentence_transformers": ratio,
                         "threads": {engine: x.get("threads") for engine, x in e.items()},
                         "targets": {"batch32>=1.2x sentence-transformers": None if ratio is None else ratio >= 1.2}}
    return out


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def print_table(results: dict[str, dict[str, dict[str, Any]]], summary: dict[str, Any]) -> None:
    print(f"{'model':9s} {'engine':22s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'peak RSS MiB':>13s}")
    for model in LLMS:
        for engine, r in results.get(model, {}).items():
            if "error" in r:
                print(f"{model:9s} {engine:22s} unavailable: {r['error']}")
                continue
            print(f"{model:9s} {engine:22s} {_fmt(r.get('prefill_tok_s')):>14s} {_fmt(r.get('decode_tok_s')):>13s} "
                  f"{_fmt(r.get('peak_rss_mib'), '.0f'):>13s}")
        f = results.get(model, {}).get("fuel", {})
        if "overhead_ms_per_token" in f:
            print(f"{'':9s} fuel executor overhead, traced (every step in Python): "
                  f"{f['overhead_ms_per_token']:.2f} ms per token ({f['overhead_us_per_step']:.2f} us per step, "
                  f"{f['steps_per_token']} steps); untraced, {f.get('native_steps_per_token', 0)} of them run "
                  "natively, without it")
    for engine, r in results.get("minilm", {}).items():
        if "error" in r:
            print(f"{'minilm':9s} {engine:22s} unavailable: {r['error']}")
        else:
            print(f"{'minilm':9s} {engine:22s} batch 32: {_fmt(r['sentences_per_s_batch32'])} sentences/s, "
                  f"batch 1: {_fmt(r['sentences_per_s_batch1'])}; peak RSS {_fmt(r['peak_rss_mib'], '.0f')} MiB")
    for model, s in summary.items():
        marks = ", ".join(f"{k}: {'-' if v is None else 'met' if v else 'MISSED'}" for k, v in s["targets"].items())
        print(f"{model}: {marks}")


def plot(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = [("prefill_tok_s", "prefill tokens/s", LLMS), ("decode_tok_s", "decode tokens/s", LLMS),
              ("sentences_per_s_batch32", "MiniLM sentences/s (batch 32)", ("minilm",))]
    for ax, (key, title, models) in zip(axes, panels, strict=True):
        labels, values = [], []
        for model in models:
            for engine, r in results.get(model, {}).items():
                if r.get(key):
                    labels.append(f"{model}\n{engine}")
                    values.append(r[key])
        ax.bar(range(len(values)), values, color=["C0" if "fuel" in lb else "C7" for lb in labels])
        ax.set_xticks(range(len(values)), labels, fontsize=7)
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(out_dir: str, sizes: Sizes | None = None, models: tuple[str, ...] = (*LLMS, "minilm"),
         engines: tuple[str, ...] | None = None) -> int:
    sizes = sizes or Sizes()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for model in models:
        for r in range(sizes.rounds):
            for engine in (EMBED_ENGINES if model == "minilm" else LLM_ENGINES):
                if engines is not None and engine not in engines:
                    continue
                print(f"running {engine} on {model} (round {r + 1} of {sizes.rounds}) ...", flush=True)
                got = results.setdefault(model, {})
                got[engine] = best_of(got.get(engine), run_child(engine, model, sizes))
    summary = summarise(results)
    print_table(results, summary)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
            "threads": THREADS, "sizes": asdict(sizes)}
    (out / "models.json").write_text(json.dumps({"meta": meta, "results": results, "summary": summary}, indent=1))
    plot(results, out / "models.png")
    print(f"wrote {out / 'models.json'} and {out / 'models.png'}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, eng, mdl, size_json = sys.argv
        print(json.dumps(worker(eng, mdl, Sizes(**json.loads(size_json)))))
        raise SystemExit(0)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--models", nargs="*", default=[*LLMS, "minilm"])
    a = ap.parse_args()
    raise SystemExit(main(a.out, models=tuple(a.models)))
