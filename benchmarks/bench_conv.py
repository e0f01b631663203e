"""Convolutions against PyTorch eager, side by side in one process: Conv2D, ConvTranspose2D, CausalConv1d.

Cases (f32, 2 threads each side):
1. conv2d: x [8, 64, 56, 56], w [64, 64, 3, 3], bias, padding 1 (a ResNet stage) against
   `F.conv2d` (torch runs oneDNN here).
2. conv_transpose2d: the matching shape, x [8, 64, 56, 56], w [64, 64, 3, 3], padding 1 (the input
   gradient of case 1) against `F.conv_transpose2d`.
3. causal_conv1d: x [2, 1536, 1024 + 3] (caller-padded), w [1536, 1, 4], bias (a Mamba-1.4B block's
   conv), without and with the fused SiLU, against `F.conv1d(groups=C)` (+ `F.silu`).
Ways: fuel (graph built and realised each call, on prebuilt leaves), fuel_jit (`fl.jit`, arrays in),
torch_eager (under `torch.inference_mode`). Every way of a case runs interleaved (one call of each per
round, medians), so drift and other load hit them alike; the load average is recorded, since two cores
shared with anything else skew every number.
Roofline: the larger of the fuel impl's own cost (`impl.cost`) as bytes over the measured copy bandwidth
and flops over the measured sgemm peak (`bench_ops.machine_limits`), reported as floor / fuel's best time.
Targets printed beside the ratios: causal_conv1d ≤ 1.0x torch, conv2d and conv_transpose2d ≤ 1.5x.
Correctness: each fuel way against torch, `np.allclose` with f32 contraction tolerances.
Run it through `fuel bench --conv` or, from the checkout, `python -m benchmarks.bench_conv`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import fuel as fl
from benchmarks.attention_harness import compare, timed_ms
from benchmarks.bench_ops import blas_info, machine_limits

# torch's OpenMP pool waits passively, as fuel's does (set before torch loads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

THREADS = 2
WAYS = ("fuel", "fuel_jit", "torch_eager")
FUEL_WAYS = ("fuel", "fuel_jit")
TARGETS = {"conv2d": 1.5, "conv_transpose2d": 1.5, "causal_conv1d": 1.0, "causal_conv1d_silu": 1.0,
           "conv2d_batch1": 1.5, "causal_conv1d_one_step": 1.0}


@dataclass(frozen=True)
class Sizes:
    """Every size the cases use; `Sizes.tiny()` runs the whole harness in seconds."""

    batch: int = 8
    channels: int = 64
    hw: int = 56
    kernel: int = 3
    seq_batch: int = 2
    seq_channels: int = 1536
    seq_len: int = 1024
    taps: int = 4

    @staticmethod
    def tiny() -> Sizes:
        return Sizes(batch=2, channels=8, hw=9, kernel=3, seq_batch=2, seq_channels=16, seq_len=33, taps=4)


def _randn(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))


def _impl(build: Callable[[], fl.Tensor]) -> Any:
    """The fused impl (BackendImpl) that realising `build()` runs, or None (a primitive decomposition ran)."""
    with fl.trace() as t:
        fl.realize(build())
    names = [r.impl for r in t.records if not r.impl.startswith("prim:")]
    by_name = {i.name: i for i in fl.kernels()}
    return next((by_name[n] for n in names if n in by_name), None)


def run_case(name: str, label: str, arrays: list[np.ndarray], fuel_fn: Callable[..., fl.Tensor],
             torch_fn: Callable[..., Any], repeat: int, limits: dict[str, float], tol: tuple[float, float]
             ) -> dict[str, Any]:
    """Time fuel (eager), fuel_jit and torch eager interleaved; check both fuel ways against torch."""
    import torch

    leaves = [fl.tensor(a) for a in arrays]
    jitted = fl.jit(fuel_fn)
    tensors = [torch.from_numpy(a) for a in arrays]

    def fuel_eager() -> Any:
        return fuel_fn(*leaves).numpy()

    def fuel_jit() -> Any:
        return jitted(*arrays)

    def torch_eager() -> Any:
        with torch.inference_mode():
            return torch_fn(*tensors)

    want = torch_eager()
    correctness = {"fuel": compare([want], [fuel_eager()], *tol), "fuel_jit": compare([want], [fuel_jit()], *tol)}
    ms, rounds = timed_ms({"fuel": fuel_eager, "fuel_jit": fuel_jit, "torch_eager": torch_eager}, repeat)
    best = min(FUEL_WAYS, key=lambda w: ms[w])
    impl = _impl(lambda: fuel_fn(*leaves))
    node = fuel_fn(*leaves).node
    flops = moved = 0
    roof_ms = None
    if impl is not None:
        cost = impl.cost([*(i.shape for i in node.inputs), node.shape], [*(i.dtype for i in node.inputs), node.dtype],
                         node.arg[1])
        flops, moved = cost.flops, cost.bytes_moved
        roof_ms = max(moved / (limits["bandwidth_gbs"] * 1e6), flops / (limits["gemm_gflops"] * 1e6))
    return {"case": name, "shape": label, "dtype": "f32", "ms": ms, "rounds": rounds, "fuel_best_way": best,
            "fuel_ms": ms[best], "torch_ms": ms["torch_eager"], "fuel_over_torch": ms[best] / ms["torch_eager"],
            "target": TARGETS[name], "meets_target": ms[best] / ms["torch_eager"] <= TARGETS[name],
            "impl": impl.name if impl is not None else None, "flops": flops, "bytes": moved, "roofline_ms": roof_ms,
            "roofline_fraction": None if roof_ms is None else roof_ms / ms[best], "correctness": correctness}


def cases(sz: Sizes) -> list[tuple[str, str, Callable[[np.random.Generator], list[np.ndarray]], Callable[..., Any],
                                   Callable[..., Any], tuple[float, float]]]:
    import torch.nn.functional as F

    n, c, hw, k = sz.batch, sz.channels, sz.hw, sz.kernel
    b, ch, seq, taps = sz.seq_batch, sz.seq_channels, sz.seq_len, sz.taps
    pad = k // 2
    conv_tol = (1e-4, 1e-4 * np.sqrt(c * k * k))  # f32 sums of C·K² unit terms
    seq_tol = (1e-5, 1e-5)
    return [
        ("conv2d", f"x[{n},{c},{hw},{hw}] w[{c},{c},{k},{k}] +bias pad {pad}",
         lambda rng: [_randn(rng, (n, c, hw, hw)), _randn(rng, (c, c, k, k), 0.1), _randn(rng, (c,))],
         lambda x, w, bias: fl.ops.conv2d(x, w, bias, padding=pad),
         lambda x, w, bias: F.conv2d(x, w, bias, padding=pad), conv_tol),
        ("conv_transpose2d", f"x[{n},{c},{hw},{hw}] w[{c},{c},{k},{k}] pad {pad}",
         lambda rng: [_randn(rng, (n, c, hw, hw)), _randn(rng, (c, c, k, k), 0.1)],
         lambda x, w: fl.ops.conv_transpose2d(x, w, padding=pad),
         lambda x, w: F.conv_transpose2d(x, w, None, padding=pad), conv_tol),
        ("causal_conv1d", f"x[{b},{ch},{seq}+{taps - 1}] w[{ch},1,{taps}] +bias",
         lambda rng: [_randn(rng, (b, ch, seq + taps - 1)), _randn(rng, (ch, 1, taps), 0.5), _randn(rng, (ch,))],
         lambda x, w, bias: fl.ops.causal_conv1d(x, w, bias, use_silu=False),
         lambda x, w, bias: F.conv1d(x, w, bias, groups=ch), seq_tol),
        ("causal_conv1d_silu", f"x[{b},{ch},{seq}+{taps - 1}] w[{ch},1,{taps}] +bias, SiLU",
         lambda rng: [_randn(rng, (b, ch, seq + taps - 1)), _randn(rng, (ch, 1, taps), 0.5), _randn(rng, (ch,))],
         lambda x, w, bias: fl.ops.causal_conv1d(x, w, bias, use_silu=True),
         lambda x, w, bias: F.silu(F.conv1d(x, w, bias, groups=ch)), seq_tol),
        # decode sizes: one small image, and one new column of a causal conv (what a Mamba decode step runs)
        ("conv2d_batch1", f"x[1,{c},8,8] w[{c},{c},{k},{k}] +bias pad {pad}",
         lambda rng: [_randn(rng, (1, c, 8, 8)), _randn(rng, (c, c, k, k), 0.1), _randn(rng, (c,))],
         lambda x, w, bias: fl.ops.conv2d(x, w, bias, padding=pad),
         lambda x, w, bias: F.conv2d(x, w, bias, padding=pad), conv_tol),
        ("causal_conv1d_one_step", f"x[1,{ch},1+{taps - 1}] w[{ch},1,{taps}] +bias, SiLU",
         lambda rng: [_randn(rng, (1, ch, taps)), _randn(rng, (ch, 1, taps), 0.5), _randn(rng, (ch,))],
         lambda x, w, bias: fl.ops.causal_conv1d(x, w, bias, use_silu=True),
         lambda x, w, bias: F.silu(F.conv1d(x, w, bias, groups=ch)), seq_tol),
    ]


def plot(results: list[dict[str, Any]], path: Path,
         title: str = "Fuel convolutions vs PyTorch eager, this CPU") -> None:
    """One panel per case: bars fuel / fuel jit / torch with the ratio to torch over each fuel bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(1, len(results)), figsize=(4.2 * max(1, len(results)), 4.2), squeeze=False)
    labels = {"fuel": "fuel", "fuel_jit": "fuel jit", "torch_eager": "torch"}
    for ax, r in zip(axes[0], results, strict=False):
        vals = [r["ms"][w] for w in WAYS]
        bars = ax.bar(range(len(WAYS)), vals, color=["C0", "C1", "C3"])
        for way, bar, v in zip(WAYS, bars, vals, strict=True):
            text = f"{v:.2f}" + (f"\n{v / r['torch_ms']:.2f}x torch" if way in FUEL_WAYS else "")
            ax.text(bar.get_x() + bar.get_width() / 2, v, text, ha="center", va="bottom", fontsize=7)
        if r["roofline_ms"]:
            ax.axhline(r["roofline_ms"], color="black", linestyle=":", linewidth=1, label="roofline")
            ax.legend(fontsize=7, loc="upper left")
        ax.set_xticks(range(len(WAYS)), [labels[w] for w in WAYS], fontsize=8)
        ax.set_ylim(0, max(vals) * 1.3)
        ax.set_ylabel("median ms (lower is better)")
        ax.set_title(f"{r['case']} (target <= {r['target']}x)\n{r['shape']}", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(out_dir: str, repeat: int, sizes: Sizes | None = None, limits: dict[str, float] | None = None) -> int:
    """Run every case, print the table, write conv.json and conv.png in `out_dir`. `sizes` defaults to the
    real sizes; tests pass `Sizes.tiny()` (and `limits`, skipping the measurement)."""
    import torch

    sz = sizes or Sizes()
    torch.set_num_threads(THREADS)
    fl.set_num_threads(THREADS)
    limits = limits or machine_limits()
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "threads": THREADS, "blas": blas_info(),
            "torch": torch.__version__, "repeat": repeat, "limits": limits, "sizes": dataclasses.asdict(sz),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"), "loadavg_start": os.getloadavg()}
    print(f"conv: {THREADS} threads, repeat {repeat}, BLAS {blas_info()}", flush=True)
    results: list[dict[str, Any]] = []
    rng = np.random.default_rng(0)
    for name, label, make, fuel_fn, torch_fn, tol in cases(sz):
        r = run_case(name, label, make(rng), fuel_fn, torch_fn, repeat, limits, tol)
        results.append(r)
        bad = [w for w, c in r["correctness"].items() if not c["ok"]]
        roof = f"{r['roofline_fraction']:.3f}" if r["roofline_fraction"] is not None else "n/a"
        print(f"  {name:19} fuel {r['ms']['fuel']:8.2f} | jit {r['ms']['fuel_jit']:8.2f} | torch "
              f"{r['torch_ms']:8.2f} ms | fuel/torch {r['fuel_over_torch']:.2f} (target <= {r['target']}) | "
              f"roofline {roof}" + (f" | DISAGREES with torch: {bad}" if bad else ""), flush=True)
        (folder / "conv.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    meta["loadavg_end"] = os.getloadavg()
    (folder / "conv.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    plot(results, folder / "conv.png")
    print("\n| case | shape | fuel ms | fuel jit ms | torch ms | fuel/torch | target | roofline |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        roof = f"{r['roofline_fraction']:.3f}" if r["roofline_fraction"] is not None else "n/a"
        print(f"| {r['case']} | {r['shape']} | {r['ms']['fuel']:.2f} | {r['ms']['fuel_jit']:.2f} | {r['torch_ms']:.2f} "
              f"| {r['fuel_over_torch']:.2f} | <= {r['target']} | {roof} |")
    print(f"load average (1, 5, 15 min) at start {meta['loadavg_start']}, at end {meta['loadavg_end']} "
          f"({THREADS} cores: above ~{THREADS} something else competed with these timings)")
    print(f"roofline: max(bytes / {limits['bandwidth_gbs']:.1f} GB/s copy, flops / {limits['gemm_gflops']:.0f} "
          f"GFLOP/s sgemm) from the fuel impl's cost, over fuel's best time")
    print(f"wrote {folder / 'conv.json'} and {folder / 'conv.png'}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results", help="folder for conv.json and conv.png")
    parser.add_argument("--repeat", type=int, default=10, help="timed rounds per way (median reported)")
    args = parser.parse_args()
    raise SystemExit(main(args.out, max(1, args.repeat)))
