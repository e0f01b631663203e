"""`fuel bench --train`: training tokens/s and peak RSS of fuel against torch eager and torch.compile.

Each engine trains the same Llama shape (transformers' `LlamaForCausalLM` for torch, `fuel.nn.Llama` for
fuel; the same config, random weights, AdamW, f32) on random token batches, in its own child process (so
each peak RSS is its own), every engine once per round and the rounds interleaved, at the same thread
count. A step is forward, backward and the AdamW update; the first steps (fuel's capture, torch.compile's
compile) are reported apart and not timed. Results: each engine's median tokens/s over the rounds, the
spread (min-max), and fuel's ratio to each torch engine; JSON and a PNG.

Before the rounds, a model `fuel train` would export (the nanoGPT shape, trained a few steps) is written as
an F32 GGUF and loaded by llama.cpp (the benchmark environment's llama-cpp-python, `make bench-env`), and the
report says whether llama.cpp's logits agree with fuel's on the same tokens (per row, relative to the row's
largest logit; llama.cpp with an f32 KV cache).

The `qlora` shape fine-tunes LoRA adapters (r 8, alpha 16, q/k/v/o/gate/up/down) on the bundled SmolLM2:
fuel over the GGUF's quantized blocks (QMatMul) against peft on transformers' float model of the same file.

    python -m benchmarks.bench_train [--out DIR] [--rounds 3] [--shapes stories15m smollm2]
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
from pathlib import Path
from typing import Any

THREADS = 2  # every engine's, each set explicitly
ENGINES = ("fuel", "torch_eager", "torch_compile", "peft")
LLAMA_ENGINES = ENGINES[:3]
# name: (LlamaConfig fields, batch, sequence length, timed steps)
SHAPES: dict[str, tuple[dict[str, Any], int, int, int]] = {
    "stories260k": (dict(dim=64, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512, hidden_dim=172), 8, 256, 8),
    "nanogpt": (dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=258, hidden_dim=352), 12, 64, 10),
    "stories15m": (dict(dim=288, n_layers=6, n_heads=6, n_kv_heads=6, vocab_size=32000, hidden_dim=768), 4, 256, 5),
    "smollm2": (dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152, hidden_dim=1536,
                     rope_theta=100000.0, tie_embeddings=True), 1, 128, 3),
}
QLORA = ("qlora", 1, 128, 3)  # batch, sequence length, timed steps on the bundled SmolLM2
DEFAULT_SHAPES = ("nanogpt", "stories15m", "smollm2", "qlora")
WARMUP = 2  # untimed steps: fuel's capture and first replay, torch.compile's compile


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _batches(vocab: int, b: int, t: int, n: int) -> list[tuple[Any, Any]]:
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        ids = rng.integers(0, vocab, size=(b, t + 1), dtype=np.int64)
        out.append((ids[:, :-1].copy(), ids[:, 1:].copy()))
    return out


def _fuel(fields: dict[str, Any], batches: list[tuple[Any, Any]]) -> list[float]:
    import fuel as fl
    from fuel.nn.llama import Llama, LlamaConfig
    from fuel.nn.state import get_parameters
    from fuel.optim import AdamW

    fl.set_num_threads(THREADS)
    t = batches[0][0].shape[1]
    model = Llama(LlamaConfig(max_seq_len=max(t, 256), **fields))
    step = AdamW(get_parameters(model), lr=1e-4, weight_decay=0.1).compile(model.loss)
    seconds = []
    for x, y in batches:
        start = time.perf_counter()
        step(x, y)
        seconds.append(time.perf_counter() - start)
    return seconds


def _torch(fields: dict[str, Any], batches: list[tuple[Any, Any]], compiled: bool) -> list[float]:
    import torch
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    from fuel.nn.llama import LlamaConfig

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    t = batches[0][0].shape[1]
    cfg = HFConfig(**LlamaConfig(max_seq_len=max(t, 256), **fields).to_hf())
    model = LlamaForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def loss_of(x: Any, y: Any) -> Any:
        logits = model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    run = torch.compile(loss_of) if compiled else loss_of
    seconds = []
    for x, y in batches:
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        run(tx, ty).backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
    return seconds


def _fuel_lora(batches: list[tuple[Any, Any]]) -> list[float]:
    import fuel as fl
    from fuel.lora import LoraAdapter, LoraConfig, load_model
    from fuel.lora.train import LoraTrainer

    fl.set_num_threads(THREADS)
    model, _ = load_model("smollm2", capacity=batches[0][0].shape[1])
    adapter = LoraAdapter.create(model.cfg, LoraConfig(r=8, lora_alpha=16), seed=0)
    adapter.attach(model)
    trainer = LoraTrainer(model, adapter, batch=batches[0][0].shape[0], lr=1e-3)
    seconds = []
    for x, y in batches:
        start = time.perf_counter()
        trainer.step(x, y)
        seconds.append(time.perf_counter() - start)
    return seconds


def _peft(batches: list[tuple[Any, Any]]) -> list[float]:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from fuel.io.gguf import bundled_gguf

    torch.set_num_threads(THREADS)
    path = bundled_gguf("smollm2")
    base = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                      target_modules=targets)).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    seconds = []
    for x, y in batches:
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=tx).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ty.reshape(-1)).backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
    return seconds


def engines_of(shape: str) -> tuple[str, ...]:
    return ("fuel", "peft") if shape == QLORA[0] else LLAMA_ENGINES


def worker(engine: str, shape: str) -> dict[str, Any]:
    if shape == QLORA[0]:
        _, b, t, steps = QLORA
        batches = _batches(49152, b, t, WARMUP + steps)
        seconds = _fuel_lora(batches) if engine == "fuel" else _peft(batches)
    else:
        fields, b, t, steps = SHAPES[shape]
        batches = _batches(fields["vocab_size"], b, t, WARMUP + steps)
        seconds = _fuel(fields, batches) if engine == "fuel" else _torch(fields, batches, engine == "torch_compile")
    timed = seconds[WARMUP:]
    return {"tok_s": b * t / statistics.median(timed), "first_step_s": seconds[0],
            "step_s": statistics.median(timed), "peak_rss_mib": _rss_mib()}


def export_check(tmp: Path, steps: int = 3, tol: float = 1e-5) -> dict[str, Any]:
    """Train the nanoGPT shape `steps` steps, export it to an F32 GGUF, and compare llama.cpp's logits of
    one sequence with fuel's, per row."""
    import numpy as np

    from fuel.nn.llama import Llama, LlamaConfig
    from fuel.nn.state import get_parameters, get_state_dict
    from fuel.optim import AdamW
    from fuel.train.export import export_gguf

    fields, b, t, _ = SHAPES["nanogpt"]
    cfg = LlamaConfig(max_seq_len=t, **fields)
    model = Llama(cfg)
    step = AdamW(get_parameters(model), lr=1e-3).compile(model.loss)
    for x, y in _batches(cfg.vocab_size, b, t, steps):
        step(x, y)
    ids = _batches(256, 1, t, 1)[0][0]  # bytes
    ours = np.asarray(model(ids).numpy(), np.float64)[0]
    path = tmp / "export-f32.gguf"
    state = {k: np.asarray(v.numpy()) for k, v in get_state_dict(model).items()}
    hp = {**fields, "context_length": t, "rope_theta": cfg.rope_theta, "norm_eps": cfg.norm_eps}
    export_gguf(state, hp, "byte", path, "f32")
    try:
        import llama_cpp
    except ImportError as e:
        return {"error": f"llama-cpp-python is not installed ({e}); build it with `make bench-env`"}
    # an f32 KV cache (llama.cpp keeps f16 by default, which alone moves its logits by ~1e-4 of a row)
    llm = llama_cpp.Llama(str(path), n_ctx=t, n_threads=THREADS, logits_all=True, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval([int(i) for i in ids[0]])
    theirs = np.asarray(llm.scores[:t], np.float64)
    err = np.abs(ours - theirs).max(axis=1) / np.abs(ours).max(axis=1)
    return {"rows": t, "max_row_rel_err": float(err.max()), "tolerance": tol, "agree": bool(err.max() <= tol)}


def run_child(engine: str, shape: str) -> dict[str, Any]:
    """`worker` in a fresh interpreter; a failure gives its error's last line."""
    cmd = [sys.executable, "-m", "benchmarks.bench_train", "--worker", engine, shape]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], env=env)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        return {"error": tail[0]}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def summarise(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """Per shape and engine: median tokens/s and its spread over the rounds, the highest peak RSS, and
    fuel's ratio of medians to each torch engine."""
    out: dict[str, dict[str, Any]] = {}
    for shape, by_engine in runs.items():
        row: dict[str, Any] = {}
        for engine, rs in by_engine.items():
            ok = [r for r in rs if "error" not in r]
            if not ok:
                row[engine] = {"error": rs[-1]["error"] if rs else "not run"}
                continue
            toks = [r["tok_s"] for r in ok]
            row[engine] = {"tok_s": statistics.median(toks), "tok_s_min": min(toks), "tok_s_max": max(toks),
                           "rounds": len(ok), "peak_rss_mib": max(r["peak_rss_mib"] for r in ok),
                           "first_step_s": statistics.median(r["first_step_s"] for r in ok)}
        fuel = row.get("fuel", {}).get("tok_s")
        for peer in engines_of(shape)[1:]:
            theirs = row.get(peer, {}).get("tok_s")
            row[f"fuel_vs_{peer}"] = fuel / theirs if fuel and theirs else None
        out[shape] = row
    return out


def print_table(summary: dict[str, dict[str, Any]]) -> None:
    print(f"{'shape':12} {'engine':14} {'tok/s (min-max)':>24} {'peak RSS MiB':>13} {'first step s':>13}")
    for shape, row in summary.items():
        for engine in engines_of(shape):
            r = row.get(engine, {})
            if "error" in r:
                print(f"{shape:12} {engine:14} error: {r['error']}")
            elif r:
                spread = f"{r['tok_s']:.0f} ({r['tok_s_min']:.0f}-{r['tok_s_max']:.0f})"
                print(f"{shape:12} {engine:14} {spread:>24} {r['peak_rss_mib']:13.0f} {r['first_step_s']:13.1f}")
        ratios = "  ".join(f"vs {p}: {row[f'fuel_vs_{p}']:.2f}x" for p in engines_of(shape)[1:]
                           if row.get(f"fuel_vs_{p}"))
        print(f"{'':12} fuel {ratios}")


def plot(summary: dict[str, dict[str, Any]], path: Path) -> None:
    """Left: each engine's tokens/s relative to the shape's reference peer (torch eager; peft for QLoRA), its
    tokens/s written on the bar, so shapes of very different speeds share one axis. Right: peak RSS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(ENGINES)
    for j, engine in enumerate(ENGINES):
        xs = [i + j * width for i in range(len(shapes))]
        toks = [summary[s].get(engine, {}).get("tok_s", 0.0) for s in shapes]
        refs = [summary[s].get(engines_of(s)[1], {}).get("tok_s") or 0.0 for s in shapes]
        rel = [t / r if r else 0.0 for t, r in zip(toks, refs, strict=True)]
        rss = [summary[s].get(engine, {}).get("peak_rss_mib", 0.0) for s in shapes]
        bars = axes[0].bar(xs, rel, width, label=engine)
        for bar, t in zip(bars, toks, strict=True):
            if t:
                axes[0].annotate(f"{t:,.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                 ha="center", va="bottom", fontsize=7)
        axes[1].bar(xs, rss, width, label=engine)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_ylim(0, max(1.6, axes[0].get_ylim()[1] * 1.3))  # room for the legend above the bars
    titles = ("tokens/s relative to torch eager (QLoRA: peft); tokens/s on the bars", "peak RSS (MiB)")
    for ax, title, corner in zip(axes, titles, ("upper right", "upper left"), strict=True):
        ax.set_xticks([i + 1.5 * width for i in range(len(shapes))], shapes)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, ncol=2, loc=corner)
    fig.suptitle(f"fuel bench --train: AdamW f32, {THREADS} threads, median of the rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(out_dir: str, rounds: int = 3, shapes: tuple[str, ...] = DEFAULT_SHAPES,
         engines: tuple[str, ...] = ENGINES) -> int:
    unknown = [s for s in shapes if s not in SHAPES and s != QLORA[0]]
    if unknown:
        print(f"bench --train: unknown shape {unknown[0]!r}; shapes: {', '.join([*SHAPES, QLORA[0]])}")
        return 2
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        export = export_check(Path(tmp))
    print(f"llama.cpp on fuel train's F32 GGUF export: {export}", flush=True)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {e: [] for e in engines_of(s) if e in engines} for s in shapes}
    for r in range(rounds):
        for shape in shapes:
            for engine in runs[shape]:
                print(f"training {shape} with {engine} (round {r + 1} of {rounds}) ...", flush=True)
                runs[shape][engine].append(run_child(engine, shape))
    summary = summarise(runs)
    print_table(summary)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
            "threads": THREADS, "rounds": rounds,
            "shapes": {s: {"config": SHAPES[s][0], "batch": SHAPES[s][1], "seq": SHAPES[s][2]} if s in SHAPES
                       else {"model": "bundled smollm2 GGUF", "lora_r": 8, "batch": QLORA[1], "seq": QLORA[2]}
                       for s in shapes}}
    (out / "train.json").write_text(json.dumps({"meta": meta, "llama_cpp_export": export, "runs": runs,
                                                "summary": summary}, indent=1))
    plot(summary, out / "train.png")
    print(f"wrote {out / 'train.json'} and {out / 'train.png'}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], sys.argv[3])))
        raise SystemExit(0)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", nargs="*", default=list(DEFAULT_SHAPES))
    ap.add_argument("--engines", nargs="*", default=list(ENGINES))
    a = ap.parse_args()
    raise SystemExit(main(a.out, a.rounds, tuple(a.shapes), tuple(a.engines)))
