"""The report of `fuel bench --models` (benchmarks/bench_models.py): Fuel's ratios to its peers, the
targets each model is held to, the printed table and the PNG.

Targets (issue "real models"): SmolLM2 and Gemma-3 decode ≥ 0.6× llama.cpp, prefill ≥ 2× llama.cpp and
≥ transformers; the synthetic 0.5B Qwen2 and Phi-3 (issue 45) decode ≥ 1.0× llama.cpp and prefill ≥ 1.5×;
every LLM's peak RSS ≤ 2× llama.cpp's; MiniLM ≥ 1.2× sentence-transformers. A target whose peer did not
run is None ("-" in the table), never met or missed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.synthetic_models import SPECS

LLMS = ("smollm2", "gemma3")  # the packaged models: Fuel, transformers and llama.cpp
SYNTHETIC = tuple(SPECS)  # random-weight 0.5B files: Fuel and llama.cpp (module doc of bench_models)
# (decode over llama.cpp, prefill over llama.cpp, prefill over transformers or None) each model must reach.
TARGETS: dict[str, tuple[float, float, float | None]] = {
    **{m: (0.6, 2.0, 1.0) for m in LLMS}, **{m: (1.0, 1.5, None) for m in SYNTHETIC}}
RSS_OVER_LLAMA_CPP = 2.0

Results = dict[str, dict[str, dict[str, Any]]]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def _at_least(value: float | None, target: float) -> bool | None:
    return None if value is None else value >= target


def _llm_summary(model: str, r: dict[str, dict[str, Any]]) -> dict[str, Any]:
    f, lc, hf = r.get("fuel", {}), r.get("llama_cpp", {}), r.get("transformers", {})
    decode_target, prefill_target, hf_target = TARGETS[model]
    dec = _ratio(f.get("decode_tok_s"), lc.get("decode_tok_s"))
    pre_lc = _ratio(f.get("prefill_tok_s"), lc.get("prefill_tok_s"))
    rss = _ratio(f.get("peak_rss_mib"), lc.get("peak_rss_mib"))
    targets: dict[str, bool | None] = {f"decode>={decode_target:g}x llama.cpp": _at_least(dec, decode_target),
                                       f"prefill>={prefill_target:g}x llama.cpp": _at_least(pre_lc, prefill_target)}
    out: dict[str, Any] = {"decode_over_llama_cpp": dec, "prefill_over_llama_cpp": pre_lc}
    if hf_target is not None:
        pre_hf = _ratio(f.get("prefill_tok_s"), hf.get("prefill_tok_s"))
        out["prefill_over_transformers"] = pre_hf
        out["greedy_tokens_equal_transformers"] = f.get("tokens") == hf.get("tokens") if "tokens" in hf else None
        targets[f"prefill>={hf_target:g}x transformers"] = _at_least(pre_hf, hf_target)
    out["rss_over_llama_cpp"] = rss
    targets[f"rss<={RSS_OVER_LLAMA_CPP:g}x llama.cpp"] = None if rss is None else rss <= RSS_OVER_LLAMA_CPP
    out["threads"] = {engine: e.get("threads") for engine, e in r.items()}
    out["targets"] = targets
    return out


def summarise(results: Results) -> dict[str, Any]:
    """Fuel's ratios to the others and whether each target holds (None where a peer is missing)."""
    out: dict[str, Any] = {}
    for model in (*LLMS, *SYNTHETIC):
        if results.get(model):
            out[model] = _llm_summary(model, results[model])
    e = results.get("minilm")
    if e:
        ratio = _ratio(e.get("fuel", {}).get("sentences_per_s_batch32"),
                       e.get("sentence_transformers", {}).get("sentences_per_s_batch32"))
        out["minilm"] = {"batch32_over_sentence_transformers": ratio,
                         "threads": {engine: x.get("threads") for engine, x in e.items()},
                         "targets": {"batch32>=1.2x sentence-transformers": _at_least(ratio, 1.2)}}
    return out


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def print_table(results: Results, summary: dict[str, Any]) -> None:
    print(f"{'model':10s} {'engine':22s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'peak RSS MiB':>13s}")
    for model in (*LLMS, *SYNTHETIC):
        for engine, r in results.get(model, {}).items():
            if "error" in r:
                print(f"{model:10s} {engine:22s} unavailable: {r['error']}")
                continue
            print(f"{model:10s} {engine:22s} {_fmt(r.get('prefill_tok_s')):>14s} {_fmt(r.get('decode_tok_s')):>13s} "
                  f"{_fmt(r.get('peak_rss_mib'), '.0f'):>13s}")
        f = results.get(model, {}).get("fuel", {})
        if "overhead_ms_per_token" in f:
            print(f"{'':10s} fuel executor overhead, traced (every step in Python): "
                  f"{f['overhead_ms_per_token']:.2f} ms per token ({f['overhead_us_per_step']:.2f} us per step, "
                  f"{f['steps_per_token']} steps); untraced, {f.get('native_steps_per_token', 0)} of them run "
                  "natively, without it")
    for engine, r in results.get("minilm", {}).items():
        if "error" in r:
            print(f"{'minilm':10s} {engine:22s} unavailable: {r['error']}")
        else:
            print(f"{'minilm':10s} {engine:22s} batch 32: {_fmt(r['sentences_per_s_batch32'])} sentences/s, "
                  f"batch 1: {_fmt(r['sentences_per_s_batch1'])}; peak RSS {_fmt(r['peak_rss_mib'], '.0f')} MiB")
    for model, s in summary.items():
        marks = ", ".join(f"{k}: {'-' if v is None else 'met' if v else 'MISSED'}" for k, v in s["targets"].items())
        print(f"{model}: {marks}")


def plot(results: Results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    llms = (*LLMS, *SYNTHETIC)
    panels = [("prefill_tok_s", "prefill tokens/s", llms), ("decode_tok_s", "decode tokens/s", llms),
              ("sentences_per_s_batch32", "MiniLM sentences/s (batch 32)", ("minilm",))]
    for ax, (key, title, models) in zip(axes, panels, strict=True):
        labels, values = [], []
        for model in models:
            for engine, r in results.get(model, {}).items():
                if r.get(key):
                    labels.append(f"{model}\n{engine}")
                    values.append(r[key])
        ax.bar(range(len(values)), values, color=["C0" if "fuel" in lb else "C7" for lb in labels])
        ax.set_xticks(range(len(values)), labels, fontsize=6)
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
