"""Per-step latency of a SmolLM2-135M-shaped model: fuel eager, fuel jit replay, NumPy and torch eager.

bench_ops times big kernels, where fuel's per-node Python cost vanishes; a decode step is the opposite
(hundreds of small nodes, one row each), so this benchmark shows what the runtime around the kernels
costs: ms per step, jit's ratio to NumPy and torch doing the same math, and the overhead per node,
(step time - the sum of the traced kernel times) / node count. One small fused op per call
(rms_norm_last_dim on [1, 576]) isolates the fixed cost of one realize.

The ways run interleaved (one call of each per round) in one process, so drift and other load hit them
alike.
Run it through `fuel bench --latency` or, from the checkout, `python -m benchmarks.bench_latency`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

import fuel as fl
from benchmarks import latency_model as lm
from benchmarks import timing
from benchmarks.bench_ops import blas_info, machine_limits

# torch's OpenMP pool waits passively, as fuel's does: spinning, torch's decode took 79 ms instead of
# 45 and starved fuel's interleaved prefill (690 ms instead of 180). Set before torch loads, which is
# why torch is imported inside the functions below.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

WAYS = ("fuel_eager", "fuel_jit", "numpy", "torch")
THREADS = 2  # fuel's and torch's, each set explicitly


def interleaved_ms(fns: dict[str, Callable[[], Any]], repeat: int, warmup: int = 1,
                   calls: int = 1) -> dict[str, float]:
    """Median ms per call of each fn, interleaved (`timing.timed_ms`), the garbage collector run between
    fns and off while one is timed."""
    return timing.timed_ms(fns, repeat, warmup=warmup, calls=calls, collect=True)[0]


def as_arrays(outs: Any) -> list[np.ndarray]:
    """A jitted step's return (a Tensor or a tuple of them), or a list of arrays / torch tensors, as arrays."""
    items = outs if isinstance(outs, (tuple, list)) else (outs,)
    return [o.numpy() if hasattr(o, "numpy") else np.asarray(o) for o in items]


def _plan_steps(step: Any, inputs: Sequence[np.ndarray]) -> int:
    """How many plan steps the jitted step replays for these inputs."""
    capture = step.capture_for(*inputs)
    assert capture is not None, "call the step once first"
    return int(capture.n_steps)


def traced(run: Callable[[], Any], repeat: int) -> tuple[float, int]:
    """(median of the summed per-node seconds, in ms; records per run) over `repeat` traced runs."""
    sums, count = [], 0
    for _ in range(repeat):
        with fl.trace() as t:
            run()
        sums.append(sum(r.seconds for r in t.records))
        count = len(t.records)
    return statistics.median(sums) * 1e3, count


def compare(ref: Sequence[np.ndarray], got: Sequence[np.ndarray], rtol: float = 1e-3,
            atol: float = 1e-3) -> dict[str, Any]:
    """Per-output np.allclose against the NumPy reference, with the worst absolute difference."""
    if len(ref) != len(got):
        return {"ok": False, "bad_outputs": [], "max_abs": float("nan"),
                "error": f"{len(got)} outputs, reference has {len(ref)}"}
    bad = [i for i, (r, g) in enumerate(zip(ref, got, strict=True))
           if r.shape != g.shape or not np.allclose(g, r, rtol=rtol, atol=atol)]
    worst = max((float(np.max(np.abs(g.astype(np.float64) - r))) for r, g in zip(ref, got, strict=True)
                 if r.shape == g.shape), default=float("nan"))
    return {"ok": not bad, "bad_outputs": bad, "max_abs": worst}


def step_bytes(w: lm.Weights, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> int:
    """Bytes a step must move at least: every weight and input read once, every output written once."""
    weights = [getattr(lw, k) for lw in w.layers for k in lm.LayerWeights.__dataclass_fields__]
    return sum(a.nbytes for a in (*weights, w.final_norm, *inputs, *outputs))


def step_flops(cfg: lm.ModelConfig, w: lm.Weights, rows: int, keys: int) -> int:
    """Multiply-adds of the step's products, twice: every weight once per row, and per layer the two
    attention products of `rows` queries over `keys` keys in every head."""
    weights = sum(getattr(lw, k).size for lw in w.layers for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    attention = cfg.layers * 2 * cfg.heads * rows * keys * cfg.head_dim
    return 2 * (rows * weights + attention)


def run_workload(name: str, cfg: lm.ModelConfig, w: lm.Weights, inputs: list[np.ndarray],
                 repeat: int, limits: dict[str, float]) -> dict[str, Any]:
    """Time the four ways on one workload and check fuel (eager, jit) and torch against NumPy.
    The roofline is the larger of the step's bytes (`step_bytes`) over the measured copy bandwidth and
    its flops (`step_flops`) over the measured sgemm peak."""
    fn = lm.fuel_fn(cfg, w)
    eager = lm.fuel_eager(fn)
    np_step = lm.numpy_fn(cfg, w)
    torch_step = lm.torch_fn(cfg, w)
    tin = lm.torch_inputs(inputs)
    jit_step = fl.jit(fn)

    ref = [np.asarray(o) for o in np_step(*inputs)]
    outs = {"fuel_eager": eager(*inputs), "torch": as_arrays(torch_step(*tin)),
            "fuel_jit": as_arrays(jit_step(*inputs))}
    checks = {way: compare(ref, got) for way, got in outs.items()}
    for way, c in checks.items():
        if not c["ok"]:
            print(f"WARNING: {name}: {way} disagrees with NumPy (rtol 1e-3, atol 1e-3) on outputs "
                  f"{c['bad_outputs']}; max |diff| {c['max_abs']:.3g} {c.get('error', '')}", flush=True)

    fns: dict[str, Callable[[], Any]] = {"fuel_eager": lambda: eager(*inputs),
                                         "fuel_jit": lambda: as_arrays(jit_step(*inputs))}
    fns["numpy"] = lambda: np_step(*inputs)
    fns["torch"] = lambda: torch_step(*tin)
    ms: dict[str, float | None] = {way: None for way in WAYS}
    ms.update(interleaved_ms(fns, repeat))

    # The replay's own kernel times (it reports every step to fl.trace): eager's time beyond them, per
    # node, is what building, keying and running a graph costs. The replay's own per-node cost is too
    # small to see this way (tracing inflates the kernel sum more than it); `replay_overhead` measures it.
    kernel_ms, _ = traced(lambda: jit_step(*inputs), min(repeat, 3))
    nodes, count_source = _plan_steps(jit_step, inputs), "jit plan steps"

    def per_node_us(way: str) -> float | None:
        t = ms[way]
        return None if t is None or not nodes else (t - kernel_ms) / nodes * 1e3

    def ratio(a: str, b: str) -> float | None:
        ta, tb = ms[a], ms[b]
        return None if ta is None or tb is None else ta / tb

    rows = inputs[0].shape[0]
    keys = inputs[1].shape[-1]  # the mask's width: the cache for decode, the tokens for prefill
    roofline_ms = max(step_bytes(w, inputs, ref) / (limits["bandwidth_gbs"] * 1e6),
                      step_flops(cfg, w, rows, keys) / (limits["gemm_gflops"] * 1e6))
    return {
        "workload": name, "x_shape": list(inputs[0].shape), "ms": ms, "roofline_ms": roofline_ms,
        "roofline_fraction": {way: (roofline_ms / t if t else None) for way, t in ms.items()},
        "jit_over_numpy": ratio("fuel_jit", "numpy"), "jit_over_torch": ratio("fuel_jit", "torch"),
        "eager_over_numpy": ratio("fuel_eager", "numpy"), "eager_over_torch": ratio("fuel_eager", "torch"),
        "nodes": nodes, "node_count_source": count_source, "kernel_ms": kernel_ms,
        "eager_overhead_us_per_node": per_node_us("fuel_eager"),
        "correctness": checks,
    }


def replay_overhead(repeat: int, nodes: int = 400) -> dict[str, Any]:
    """The replay's own cost per node: a chain of `nodes` scalar adds on one element under `fl.jit`,
    against the same adds as NumPy ufunc calls writing into a buffer (what each replayed step runs)."""

    def chain(x: fl.Tensor) -> fl.Tensor:
        for _ in range(nodes):
            x = x + 1.0
        return x

    x = np.zeros(1, np.float32)
    out = np.empty_like(x)
    one = np.float32(1.0)
    jitted = fl.jit(chain)

    def numpy_chain() -> None:
        y = x
        for _ in range(nodes):
            y = np.add(y, one, out=out)

    ms = interleaved_ms({"fuel_jit": lambda: jitted(x), "numpy": numpy_chain}, repeat, warmup=3)
    return {"nodes": nodes, "jit_us_per_node": ms["fuel_jit"] * 1e3 / nodes,
            "numpy_us_per_op": ms["numpy"] * 1e3 / nodes,
            "overhead_us_per_node": (ms["fuel_jit"] - ms["numpy"]) * 1e3 / nodes}


def small_op(cfg: lm.ModelConfig, repeat: int, calls: int = 200) -> dict[str, Any]:
    """One rms_norm_last_dim on [1, hidden] per call: the fixed cost of one realize (or one replay)."""
    import torch
    import torch.nn.functional as F

    x = np.random.default_rng(3).standard_normal((1, cfg.hidden), dtype=np.float32)
    eps = cfg.eps
    rms = fl.ops.rms_norm_last_dim
    xt = fl.tensor(x)
    tx = torch.from_numpy(x)
    jitted = fl.jit(lambda t: rms(t, eps))
    fns: dict[str, Callable[[], Any]] = {"fuel_eager": lambda: fl.realize(rms(xt, eps)),
                                         "fuel_jit": lambda: jitted(x)}
    fns["numpy"] = lambda: x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))

    def torch_rms() -> Any:
        with torch.inference_mode():
            return F.rms_norm(tx, (cfg.hidden,), None, eps)
    fns["torch"] = torch_rms
    # fl.ops.<name> looks the builder up through the registry on each access (the model binds it once).
    fns["fl.ops lookup"] = lambda: fl.ops.rms_norm_last_dim
    ms = interleaved_ms(fns, repeat, warmup=2, calls=calls)
    us: dict[str, float | None] = {way: None for way in WAYS}
    us.update({k: v * 1e3 for k, v in ms.items()})
    return {"op": "rms_norm_last_dim", "shape": [1, cfg.hidden], "us_per_call": us}


def _fmt(v: float | None, spec: str = "8.2f") -> str:
    width = int(spec.split(".")[0]) if spec[0].isdigit() else 8
    return f"{v:{spec}}" if v is not None else f"{'n/a':>{width}}"


def print_table(results: list[dict[str, Any]], small: dict[str, Any]) -> None:
    print(f"{'workload':9} {'eager ms':>8} {'jit ms':>8} {'numpy ms':>8} {'torch ms':>8} {'jit/np':>6} "
          f"{'jit/torch':>9} {'roofline':>8} {'nodes':>6} {'kern ms':>8} {'eager us/node':>13}")
    for r in results:
        ms = r["ms"]
        print(f"{r['workload']:9} {_fmt(ms['fuel_eager'])} {_fmt(ms['fuel_jit'])} {_fmt(ms['numpy'])} "
              f"{_fmt(ms['torch'])} {_fmt(r['jit_over_numpy'], '6.2f')} {_fmt(r['jit_over_torch'], '9.2f')} "
              f"{_fmt(r['roofline_fraction']['fuel_jit'], '8.2f')} {r['nodes']:6} {_fmt(r['kernel_ms'])} "
              f"{_fmt(r['eager_overhead_us_per_node'], '13.2f')}")
    us = small["us_per_call"]
    print(f"{small['op']} {small['shape']} per call (us): fuel eager {_fmt(us['fuel_eager'])} | "
          f"jit {_fmt(us['fuel_jit'])} | numpy {_fmt(us['numpy'])} | torch {_fmt(us['torch'])} | "
          f"fl.ops lookup {_fmt(us['fl.ops lookup'])}")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """One panel per workload (their scales differ ~10x), one bar per way; a missing way reads n/a."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"fuel_eager": "fuel eager", "fuel_jit": "fuel jit", "numpy": "NumPy", "torch": "torch eager"}
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.2), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        vals = [r["ms"][w] for w in WAYS]
        top = max((v for v in vals if v is not None), default=1.0)
        bars = ax.bar(range(len(WAYS)), [v or 0.0 for v in vals], color=["C0", "C1", "C2", "C3"])
        for bar, v in zip(bars, vals, strict=True):
            ax.text(bar.get_x() + bar.get_width() / 2, (v or 0.0) + 0.01 * top,
                    "n/a" if v is None else f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(WAYS)), [labels[w] for w in WAYS], fontsize=8)
        ax.set_ylabel("median ms per step (lower is better)")
        ax.set_title(f"{r['workload']} x {r['x_shape']}")
    fig.suptitle("SmolLM2-135M-shaped step, f32, this CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(out: str, repeat: int, cfg: lm.ModelConfig | None = None, limits: dict[str, float] | None = None) -> int:
    """Run both workloads and the small op, print the table, write latency.json and latency.png in `out`.
    `cfg` defaults to SmolLM2-135M's shape; tests pass a tiny one (and `limits`, skipping the measurement)."""
    import torch

    cfg = cfg or lm.ModelConfig()
    torch.set_num_threads(THREADS)
    fl.set_num_threads(THREADS)
    threads = {"fuel": fl.get_num_threads(), "torch": torch.get_num_threads()}
    print(f"latency: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads}/{cfg.kv_heads} heads, "
          f"{THREADS} threads (fuel {threads['fuel']}, torch {threads['torch']}), repeat {repeat}", flush=True)
    w = lm.make_weights(cfg)
    limits = limits or machine_limits()
    results = [run_workload("decode", cfg, w, lm.decode_inputs(cfg), repeat, limits),
               run_workload("prefill", cfg, w, lm.prefill_inputs(cfg), repeat, limits)]
    small = small_op(cfg, repeat)
    overhead = replay_overhead(repeat)
    print_table(results, small)
    print(f"replay overhead: {overhead['overhead_us_per_node']:.2f} us per node ({overhead['nodes']} one-element "
          f"adds: jit {overhead['jit_us_per_node']:.2f} us per node, the NumPy ufunc alone "
          f"{overhead['numpy_us_per_op']:.2f})")
    floors = ", ".join(f"{r['workload']} {r['roofline_ms']:.1f} ms" for r in results)
    print(f"roofline: the larger of the step's bytes over {limits['bandwidth_gbs']:.1f} GB/s measured copy "
          f"bandwidth and its flops over {limits['gemm_gflops']:.0f} GFLOP/s measured sgemm ({floors}); "
          f"the roofline column is that over fuel jit's time")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "threads": THREADS, "engine_threads": threads,
            "blas": blas_info(),
            "torch": torch.__version__, "repeat": repeat, "config": asdict(cfg),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "limits": limits}
    (folder / "latency.json").write_text(json.dumps({"meta": meta, "results": results, "small_op": small,
                                                     "replay_overhead": overhead},
                                                    indent=2))
    plot(results, folder / "latency.png")
    print(f"wrote {folder / 'latency.json'} and {folder / 'latency.png'}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results", help="folder for latency.json and latency.png")
    parser.add_argument("--repeat", type=int, default=10, help="timed rounds per way (median reported)")
    args = parser.parse_args()
    raise SystemExit(main(args.out, max(1, args.repeat)))
