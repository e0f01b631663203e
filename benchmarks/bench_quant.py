"""Quantized matmuls against PyTorch, side by side in one process: GGUF Q4_0, Q4_K, Q6_K, Q8_0 and NF4.

Cases: `y = x @ dequant(W)ᵀ`, W `[N, K]` = `[4096, 4096]`, x f32 `[M, K]` with M 1 (a decode step's
projection) and 64 (a short prefill). The ways, the cold-cache timing, the roofline, the targets and the
correctness check are in quant_cases; this module sizes and runs the cases, prints the markdown table
with the targets met or not, and writes quant.json and quant.png.
Run it through `fuel bench --quant` or, from the checkout, `python -m benchmarks.bench_quant`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import fuel as fl
from benchmarks.bench_ops import blas_info, sgemm_gflops
from benchmarks.quant_cases import (
    EVICT_WAY,
    FUEL_WAYS,
    RTOL,
    TARGET_RATIO,
    WARM_WAY,
    WAYS,
    build_weight,
    llama_cpp_note,
    run_case,
    set_roofline,
    skipped,
)
from benchmarks.quant_machine import FLUSH_BYTES, measure_limits, read_bandwidth

THREADS = 2
TYPES = ("Q4_0", "Q4_K", "Q6_K", "Q8_0", "NF4")


@dataclass(frozen=True)
class Sizes:
    """The weight `[n, k]`, the activation rows `ms` and the types; `Sizes.tiny()` runs in seconds.

    `one_row_rounds`: the fewest timed rounds of an M = 1 case, whatever `repeat` asks. A round there takes
    tens of ms (torch's dequantisation and the cache flushes), so 10 rounds span well under a second,
    shorter than the slow phases of this VM's host (0.1 s to seconds, in which a 0.67 ms two-thread NF4
    call takes 0.83): one phase could make a whole case's median. 40 rounds span seconds, so a short
    phase no longer does."""

    k: int = 4096
    n: int = 4096
    ms: tuple[int, ...] = (1, 64)
    types: tuple[str, ...] = TYPES
    one_row_rounds: int = 40

    @staticmethod
    def tiny() -> Sizes:
        return Sizes(k=256, n=48, ms=(1, 5), one_row_rounds=1)


# ---------------------------------------------------------------------------------------------- output

def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else f"{v:{spec}}"


def _mark(ok: bool | None) -> str:
    return "" if ok is None else (" ✓" if ok else " ✗")


def _agrees(r: dict[str, Any]) -> bool:
    """Every way agrees with torch, and torch's dequantiser with gguf's (NF4: bitsandbytes' own)."""
    return all(c["ok"] for c in r["correctness"].values()) and r["torch_dequant_bit_exact"] is not False


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"\n| type | M | fuel ms | fuel jit ms | jit warm ms | jit weight-cold ms | torch deq+mm ms | torch mm ms "
          f"| bnb 4bit ms | fuel/(deq+mm) (≤ {TARGET_RATIO}) | fuel/mm | roofline ms "
          f"| roofline frac | frac, full flush | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ms = r["ms"]
        if r["skipped"]:
            print(f"| {r['type']} | {r['m']} | skipped: {r['skipped'][:80]} | | | | | | | | | | | | |")
            continue
        ok = "yes" if _agrees(r) else "NO"
        print(f"| {r['type']} | {r['m']} | {_fmt(ms['fuel'], '.3f')} | {_fmt(ms['fuel_jit'], '.3f')} | "
              f"{_fmt(ms[WARM_WAY], '.3f')} | {_fmt(ms[EVICT_WAY], '.3f')} | {_fmt(ms['torch_deq_mm'])} | "
              f"{_fmt(ms['torch_mm'], '.3f')} | {_fmt(ms['bnb_4bit'])} | "
              f"{_fmt(r['fuel_over_torch_deq_mm'], '.3f')}{_mark(r['meets_ratio_target'])} | "
              f"{_fmt(r['fuel_over_torch_mm'])} | {_fmt(r['roofline_ms'], '.3f')} | "
              f"{100 * r['roofline_fraction']:.1f}% | "
              f"{100 * r['roofline_fraction_full_flush']:.1f}% | {ok} |")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """One panel per M: grouped bars (log scale) of every way per type, fuel/(deq+mm) over fuel's bar,
    the roofline as a tick per type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms_values = sorted({r["m"] for r in results})
    fig, axes = plt.subplots(1, max(len(ms_values), 1), figsize=(7.5 * max(len(ms_values), 1), 4.8), squeeze=False)
    labels = {"fuel": "fuel", "fuel_jit": "fuel jit", "torch_deq_mm": "torch deq+mm", "torch_mm": "torch mm (pre-deq)",
              "bnb_4bit": "bnb matmul_4bit"}
    colours = {"fuel": "C0", "fuel_jit": "C1", "torch_deq_mm": "C3", "torch_mm": "C2", "bnb_4bit": "C4"}
    width = 0.16
    for ax, m in zip(axes[0], ms_values, strict=False):
        rows = [r for r in results if r["m"] == m and not r["skipped"]]
        for j, way in enumerate(WAYS):
            xs = [i + (j - 2) * width for i, r in enumerate(rows) if r["ms"][way] is not None]
            vals = [r["ms"][way] for r in rows if r["ms"][way] is not None]
            if vals:
                ax.bar(xs, vals, width, label=labels[way], color=colours[way])
        for i, r in enumerate(rows):
            ax.text(i - 1.5 * width, max(r["ms"][w] for w in FUEL_WAYS) * 1.15, f"{r['fuel_over_torch_deq_mm']:.3f}x",
                    ha="center", fontsize=7, rotation=90, va="bottom")
            ax.plot([i - 2.5 * width, i - 0.5 * width], [r["roofline_ms"]] * 2, color="black", linestyle=":",
                    linewidth=1.2, label="roofline" if i == 0 else None)
        ax.set_xticks(range(len(rows)), [r["type"] for r in rows])
        ax.set_yscale("log")
        tops = [v for r in rows for v in r["ms"].values() if v]
        if tops:  # headroom over the tallest bar for the ratio labels and the legend
            ax.set_ylim(top=max(tops) * 12)
        ax.set_ylabel("median ms, cold cache (log, lower is better)")
        if rows:
            ax.set_title(f"M={m}: {rows[0]['shape']}; label: fuel / torch (deq+mm)", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", ncol=3)
    fig.suptitle("Fuel quantized matmul vs torch (dequantise + matmul), this CPU, 2 threads", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write(out_dir: Path, meta: dict[str, Any], results: list[dict[str, Any]], png: bool) -> None:
    """quant.json (after every case, so a long run keeps what it measured) and, at the end, quant.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "quant.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    if png:
        plot(results, out_dir / "quant.png")


def _report(r: dict[str, Any]) -> None:
    if r["skipped"]:
        return
    ms = r["ms"]
    bad = [w for w, c in r["correctness"].items() if not c["ok"]]
    print(f"  {r['type']:5} M={r['m']:<3} fuel {_fmt(ms['fuel'], '.3f')} | jit {_fmt(ms['fuel_jit'], '.3f')} "
          f"(warm {_fmt(ms[WARM_WAY], '.3f')}, weight-cold {_fmt(ms[EVICT_WAY], '.3f')}) | "
          f"deq+mm {_fmt(ms['torch_deq_mm'])} | mm {_fmt(ms['torch_mm'], '.3f')} ms | fuel/(deq+mm) "
          f"{r['fuel_over_torch_deq_mm']:.3f} | roofline {100 * r['roofline_fraction']:.1f}%"
          + (f" | DISAGREES with torch: {bad}" if bad else ""), flush=True)
    if r["torch_dequant_bit_exact"] is False:
        print(f"    WARNING: torch's {r['type']} dequantiser differs from gguf's: the peer is wrong", flush=True)
    for w in bad:
        c = r["correctness"][w]
        print(f"    WARNING: {w} max |diff| {c['max_abs']:.3g}, {c['max_rel_to_scale']:.3g} of |x|@|W|ᵀ "
              f"(bound {c['rtol']}) {c.get('error', '')}", flush=True)


def main(out_dir: str, repeat: int, sizes: Sizes | None = None, limits: dict[str, float] | None = None) -> int:
    """Run every case, print the markdown table, write quant.json and quant.png in `out_dir`. `sizes`
    defaults to the real sizes; tests pass `Sizes.tiny()` (and `limits`, skipping the measurement)."""
    import torch

    sz = sizes or Sizes()
    torch.set_num_threads(THREADS)
    fl.set_num_threads(THREADS)
    print(f"quant: {THREADS} threads, repeat {repeat} (M = 1: at least {sz.one_row_rounds}), W [{sz.n}, {sz.k}], "
          f"M {list(sz.ms)}, types {list(sz.types)}", flush=True)
    measured = limits is None
    limits = dict(limits or measure_limits())
    print(f"  read bandwidth {limits['read_gbs']:.1f} GB/s (the roofline's), copy {limits['bandwidth_gbs']:.1f} "
          f"GB/s (read + write bytes), sgemm {limits['gemm_gflops']:.0f} GFLOP/s", flush=True)
    folder = Path(out_dir)
    import bitsandbytes
    import gguf

    meta = {"machine": platform.processor() or platform.machine(), "threads": THREADS, "blas": blas_info(),
            "torch": torch.__version__, "gguf": getattr(gguf, "__version__", None),
            "bitsandbytes": bitsandbytes.__version__, "repeat": repeat, "limits": limits,
            "roofline_bandwidth": "read_gbs", "sizes": dataclasses.asdict(sz), "cold_cache_bytes": FLUSH_BYTES,
            "targets": {"fuel_over_torch_deq_mm_max": TARGET_RATIO}, "llama_cpp": llama_cpp_note(),
            "tolerance": f"|fuel - torch| <= {RTOL} * (|x| @ |W|^T) per element",
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"), "loadavg_start": os.getloadavg()}
    results: list[dict[str, Any]] = []
    probes = [limits["read_gbs"]]  # read bandwidth at the start and after each type's cases
    gemm_probes = [limits["gemm_gflops"]]  # the sgemm peak, likewise
    for i, qtype in enumerate(sz.types):
        try:
            wt = build_weight(qtype, sz.n, sz.k, np.random.default_rng(100 + i))
        except Exception as e:  # one type failing to build must not stop the others
            for m in sz.ms:
                results.append(skipped(qtype, m, sz.k, sz.n, f"weight: {type(e).__name__}: {str(e)[:300]}"))
            continue
        for m in sz.ms:
            try:
                rounds = max(repeat, sz.one_row_rounds) if m == 1 else repeat
                results.append(run_case(qtype, m, wt, rounds, limits, sz.k, sz.n))
            except Exception as e:  # a kernel still landing, say: report and go on
                results.append(skipped(qtype, m, sz.k, sz.n, f"failed: {type(e).__name__}: {str(e)[:300]}"))
            _report(results[-1])
            _write(folder, meta, results, png=False)
        del wt
        if measured:
            probes.append(read_bandwidth()["read_gbs"])
            if max(sz.ms) > 1:  # only an M > 1 floor reads the sgemm peak
                gemm_probes.append(sgemm_gflops())
    meta["loadavg_end"] = os.getloadavg()
    if measured:  # the host's memory speed drifts: one slow probe would understate the roofline
        meta["read_gbs_probes"], meta["gemm_gflops_probes"] = probes, gemm_probes
        limits["read_gbs"], limits["gemm_gflops"] = max(probes), max(gemm_probes)
        for r in results:
            if not r["skipped"]:
                set_roofline(r, limits)
        print(f"  read bandwidth at the start and after each type {', '.join(f'{p:.1f}' for p in probes)} GB/s: "
              f"the roofline takes {limits['read_gbs']:.1f}, the largest; sgemm "
              f"{', '.join(f'{p:.0f}' for p in gemm_probes)} GFLOP/s: it takes {limits['gemm_gflops']:.0f}", flush=True)
    _write(folder, meta, results, png=True)
    print_table(results)
    print(f"\nload average (1, 5, 15 min) at start {meta['loadavg_start']}, at end {meta['loadavg_end']} "
          f"({THREADS} cores: above ~{THREADS} something else competed with these timings)")
    print(f"roofline: weight bytes (+ NF4 absmax) / {limits['read_gbs']:.1f} GB/s read bandwidth (measured: "
          f"the fastest of a two-thread vector read, a two-thread scalar sum and a NumPy sum over 256 MiB, at the "
          f"start and after each type's cases, the largest taken; at the start "
          f"{limits.get('read_vector_gbs', float('nan')):.1f}, {limits.get('read_numba_gbs', float('nan')):.1f} and "
          f"{limits.get('read_numpy_gbs', float('nan')):.1f} GB/s; copy bandwidth {limits['bandwidth_gbs']:.1f} GB/s "
          f"read + write, not used); at M > 1 "
          f"the larger of that and flops / {limits['gemm_gflops']:.0f} GFLOP/s sgemm (the largest probed); over "
          f"fuel's best way, at M = 1 counting jit weight-cold (the full-flush fraction beside it). Cold cache: "
          f"each timed call follows an untimed {FLUSH_BYTES >> 20} MiB read (jit warm: none, the weight in L3 from "
          f"the jit call before it; jit weight-cold: only the weight's and x's cache lines flushed, the code and "
          f"the replay kept cached, the pool's workers woken, as in a decode loop). The roofline fractions are "
          f"reported, not judged; the target is fuel/(deq+mm) ≤ {TARGET_RATIO}, torch dequantising with torch ops "
          f"(bit-exact with gguf's dequantiser) and timed interleaved with fuel (✓ met, ✗ not). BLAS {blas_info()}")
    print(meta["llama_cpp"])
    print(f"wrote {folder / 'quant.json'} and {folder / 'quant.png'}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="bench-results", help="folder for quant.json and quant.png")
    parser.add_argument("--repeat", type=int, default=10, help="timed rounds per way (median reported)")
    args = parser.parse_args()
    raise SystemExit(main(args.out, max(1, args.repeat)))
