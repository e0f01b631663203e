"""Fuel kernels against PyTorch eager and torch.compile, side by side in one process.

Each case times fuel, torch eager and torch.compile interleaved (`timing.timed_ms`: one call of each per
round, so a slow patch of the machine lands on all of them), every engine on THREADS threads, and
reports medians, the ratio fuel/torch (below 1 is faster) and the fraction of the roofline (the impl's
own cost: bytes over measured copy bandwidth, flops over measured BLAS peak; reported, never judged).
Run it through `fuel bench [NAME…]` (or `make bench`, which unsets the OpenBLAS overrides).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit, prange

import fuel as fl
from benchmarks import timing
from fuel.dtype import DType, as_dtype

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

THREADS = 2  # fuel's and torch's, each set explicitly


@dataclass(frozen=True)
class BenchCase:
    name: str
    shape_label: str
    make: Callable[[np.random.Generator, DType], list[np.ndarray]]
    fuel: Callable[[list[fl.Tensor]], fl.Tensor]
    torch: Callable[..., Any]
    # Puts torch's inputs in the layout torch is fastest with (done once, outside the timing).
    torch_layout: Callable[[list[Any]], list[Any]] = lambda ts: ts
    repeat_cap: int = 1000  # torch's bf16 GEMM here takes seconds a call


CASES: dict[str, BenchCase] = {}


def case(c: BenchCase) -> None:
    CASES[c.name] = c


def _randn(rng: np.random.Generator, shape: tuple[int, ...], dt: DType, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(dt.np)


def _rope_tables(rng: np.random.Generator, s: int, d: int, dt: DType) -> list[np.ndarray]:
    inv = 10000.0 ** (-np.arange(0, d // 2) * 2.0 / d)
    ang = np.arange(s)[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], axis=1)
    return [np.cos(ang).astype(dt.np), np.sin(ang).astype(dt.np)]


def _torch_rope(x: Any, cos: Any, sin: Any) -> Any:
    import torch

    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def _torch_rms(x: Any) -> Any:
    import torch.nn.functional as F

    return F.rms_norm(x, (x.shape[-1],), None, 1e-6)


def _torch_ln(x: Any) -> Any:
    import torch.nn.functional as F

    return F.layer_norm(x, (x.shape[-1],), None, None, 1e-5)


def _torch_linear(a: Any, w: Any, bias: Any) -> Any:
    import torch.nn.functional as F

    return F.linear(a, w, bias)


case(BenchCase("softmax_last_dim", "[8192, 4096]",
               lambda rng, dt: [_randn(rng, (8192, 4096), dt, 3.0)],
               lambda t: fl.ops.softmax_last_dim(t[0]),
               lambda x: x.softmax(-1)))
case(BenchCase("rms_norm_last_dim", "[8192, 4096]",
               lambda rng, dt: [_randn(rng, (8192, 4096), dt)],
               lambda t: fl.ops.rms_norm_last_dim(t[0], 1e-6),
               _torch_rms))
case(BenchCase("layer_norm_last_dim", "[8192, 4096]",
               lambda rng, dt: [_randn(rng, (8192, 4096), dt)],
               lambda t: fl.ops.layer_norm_last_dim(t[0], 1e-5),
               _torch_ln))
case(BenchCase("rope", "[8, 32, 1024, 128]",
               lambda rng, dt: [_randn(rng, (8, 32, 1024, 128), dt), *_rope_tables(rng, 1024, 128, dt)],
               lambda t: fl.ops.rope(t[0], t[1], t[2]),
               _torch_rope))
case(BenchCase("fused_linear", "[2048, 4096] x [4096, 4096] + bias",
               lambda rng, dt: [_randn(rng, (2048, 4096), dt), _randn(rng, (4096, 4096), dt, 0.02),
                                _randn(rng, (4096,), dt)],
               lambda t: fl.ops.fused_linear(t[0], t[1], t[2]),
               _torch_linear,
               # nn.Linear's [N, K] weight: torch's bf16 addmm on a [K, N] weight is a single-threaded
               # fallback here (minutes a call), F.linear on [N, K] is its fast path.
               torch_layout=lambda ts: [ts[0], ts[1].t().contiguous(), ts[2]], repeat_cap=3))


def _median_ms(fn: Callable[[], Any], repeat: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@njit(parallel=True, cache=True)
def _parallel_copy(src: np.ndarray, dst: np.ndarray) -> None:
    chunks = 64
    n = src.shape[0]
    for c in prange(chunks):
        for i in range(c * n // chunks, (c + 1) * n // chunks):
            dst[i] = src[i]


def machine_limits(repeat: int = 5) -> dict[str, float]:
    """Measured copy bandwidth (read + write bytes, the faster of NumPy and a two-thread Numba copy)
    and the f32 GEMM peak of NumPy's BLAS on this machine, now."""
    src = np.ones(1 << 26, np.float32)
    dst = np.empty_like(src)
    _parallel_copy(src, dst)
    copy_ms = min(_median_ms(lambda: np.copyto(dst, src), repeat), _median_ms(lambda: _parallel_copy(src, dst), repeat))
    return {"bandwidth_gbs": 2 * src.nbytes / copy_ms / 1e6, "gemm_gflops": sgemm_gflops(min(repeat, 3))}


def sgemm_gflops(repeat: int = 3) -> float:
    """NumPy's BLAS f32 GEMM rate now. BLAS is most efficient on large squares: 4096³ is the size of the
    largest GEMM benchmarked here."""
    a = np.ones((4096, 4096), np.float32)
    return 2 * 4096**3 / _median_ms(lambda: a @ a, repeat) / 1e6


def _fuel_impl(c: BenchCase, tensors: list[fl.Tensor]) -> Any:
    with fl.trace() as t:
        fl.realize(c.fuel(tensors))
    fused = [r for r in t.records if not r.impl.startswith("prim:")]
    name = fused[0].impl if fused else ""
    for impl in fl.kernels():
        if impl.name == name:
            return impl
    return None


def run_case(c: BenchCase, dtype: DType, repeat: int, limits: dict[str, float], compile_torch: bool) -> dict[str, Any]:
    import torch

    torch.set_num_threads(THREADS)
    fl.set_num_threads(THREADS)
    repeat = min(repeat, c.repeat_cap)
    rng = np.random.default_rng(0)
    arrays = c.make(rng, dtype)
    tensors = [fl.tensor(a) for a in arrays]
    torch_dt = {DType.F32: torch.float32, DType.F64: torch.float64,
                DType.BF16: torch.bfloat16, DType.F16: torch.float16}[dtype]
    targs = c.torch_layout([torch.from_numpy(a.astype(np.float32)).to(torch_dt) for a in arrays])

    def no_grad(fn: Callable[..., Any]) -> Callable[[], Any]:
        def call() -> Any:
            with torch.no_grad():
                return fn(*targs)
        return call

    fns: dict[str, Callable[[], Any]] = {"fuel": lambda: fl.realize(c.fuel(tensors)), "torch_eager": no_grad(c.torch)}
    compile_error = ""
    if compile_torch:
        try:
            compiled = no_grad(torch.compile(c.torch))
            compiled()  # compiles, untimed (timed_ms's warm-up round then runs the compiled code once more)
            fns["torch_compile"] = compiled
        except Exception as e:  # report why torch.compile could not run; eager still counts
            compile_error = f"{type(e).__name__}: {str(e)[:200]}"
    ms, rounds = timing.timed_ms(fns, repeat)
    fuel_ms, eager_ms, compiled_ms = ms["fuel"], ms["torch_eager"], ms.get("torch_compile")
    impl = _fuel_impl(c, tensors)
    roofline_ms = None
    if impl is not None:
        shapes = [a.shape for a in arrays] + [c.fuel(tensors).shape]
        cost = impl.cost(shapes, impl.dtypes, c.fuel(tensors).node.arg[1])
        roofline_ms = max(cost.bytes_moved / (limits["bandwidth_gbs"] * 1e6),
                          cost.flops / (limits["gemm_gflops"] * 1e6))
    best_torch = min(x for x in (eager_ms, compiled_ms) if x is not None)
    return {
        "op": c.name, "shape": c.shape_label, "dtype": dtype.value,
        "impl": impl.name if impl is not None else None, "rounds": rounds,
        "fuel_ms": fuel_ms, "torch_eager_ms": eager_ms, "torch_compile_ms": compiled_ms,
        "torch_compile_error": compile_error,
        "ratio_vs_eager": fuel_ms / eager_ms,
        "ratio_vs_best_torch": fuel_ms / best_torch,
        "roofline_ms": roofline_ms,
        "roofline_fraction": (roofline_ms / fuel_ms) if roofline_ms else None,
    }


def blas_info() -> str:
    try:
        from threadpoolctl import threadpool_info

        return "; ".join(f"{i.get('internal_api')} {i.get('architecture')} x{i.get('num_threads')}"
                         for i in threadpool_info() if i.get("user_api") == "blas")
    except ImportError:
        return "threadpoolctl not installed"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['op']}\n{r['dtype']}" for r in results]
    x = np.arange(len(results))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(results)), 4.5))
    series = [("fuel", "fuel_ms"), ("torch eager", "torch_eager_ms"), ("torch.compile", "torch_compile_ms")]
    for k, (label, key) in enumerate(series):
        vals = [r[key] or 0.0 for r in results]
        ax.bar(x + (k - 1) * 0.27, vals, 0.27, label=label)
    roof = [r["roofline_ms"] or 0.0 for r in results]
    ax.scatter(x - 0.27, roof, marker="_", s=400, color="black", label="roofline (impl cost)", zorder=3)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("median ms (lower is better)")
    ax.set_title("Fuel vs PyTorch on this CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write(out_dir: str, limits: dict[str, float], repeat: int, results: list[dict[str, Any]], png: bool) -> None:
    """The JSON of the results so far (rewritten after each case, so a long run keeps its results) and, at
    the end, the PNG."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "limits": limits, "blas": blas_info(),
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"), "threads": THREADS,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "repeat": repeat}
    (out / "bench_ops.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    if png:
        plot(results, out / "bench_ops.png")


def main(names: list[str], dtypes: list[str], out_dir: str, repeat: int, compile_torch: bool) -> int:
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"bench: unknown case(s) {unknown}; known: {', '.join(CASES)}")
        return 2
    limits = machine_limits()
    results = []
    for name in names or list(CASES):
        for dt in dtypes:
            r = run_case(CASES[name], as_dtype(dt), repeat, limits, compile_torch)
            results.append(r)
            comp = f"{r['torch_compile_ms']:8.2f}" if r["torch_compile_ms"] is not None else "     n/a"
            roof = f"{100 * r['roofline_fraction']:5.1f}%" if r["roofline_fraction"] else "   n/a"
            print(f"{r['op']:22} {r['dtype']:5} fuel {r['fuel_ms']:8.2f} ms | eager {r['torch_eager_ms']:8.2f} | "
                  f"compile {comp} | ratio vs best torch {r['ratio_vs_best_torch']:5.2f} | roofline {roof}",
                  flush=True)
            if r["torch_compile_error"]:
                print(f"{'':28} torch.compile: {r['torch_compile_error']}", flush=True)
            _write(out_dir, limits, repeat, results, png=False)
    _write(out_dir, limits, repeat, results, png=True)
    out = Path(out_dir)
    print(f"limits: {limits['bandwidth_gbs']:.1f} GB/s copy, {limits['gemm_gflops']:.0f} GFLOP/s sgemm; "
          f"BLAS {blas_info()}; wrote {out / 'bench_ops.json'} and {out / 'bench_ops.png'}")
    return 0
