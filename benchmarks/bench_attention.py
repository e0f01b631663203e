"""Attention against PyTorch, side by side in one process: forward, backward, decode, paged decode,
and the peak memory of a long causal forward.

The cases are in attention_cases, the timing, correctness and roofline they share in attention_harness;
this module sizes and runs them, prints the markdown table and writes attention.json and attention.png.
The load average is recorded, since two cores shared with anything else skew every number.
Run it through `fuel bench --attention` or, from the checkout, `python -m benchmarks.bench_attention`.
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

import fuel as fl
from benchmarks.attention_cases import case_backward, case_decode, case_forward, case_memory, case_paged
from benchmarks.attention_harness import FUEL_WAYS, THREADS, WAYS, failed
from benchmarks.bench_ops import blas_info, machine_limits
from fuel.dtype import as_dtype


@dataclass(frozen=True)
class Sizes:
    """Every size the cases use; `Sizes.tiny()` runs the whole harness in seconds."""

    batch: int = 1
    heads: int = 16
    seq: int = 1024
    head_dim: int = 64
    decode_hq: int = 32
    decode_hkv: int = 8
    decode_capacity: int = 4096
    decode_len: int = 2048
    paged_batch: int = 4
    block_size: int = 16
    paged_context: int = 2048
    long_seq: int = 16384
    long_heads: tuple[int, ...] = (1, 2)

    @staticmethod
    def tiny() -> Sizes:
        return Sizes(batch=1, heads=2, seq=32, head_dim=16, decode_hq=4, decode_hkv=2, decode_capacity=64,
                     decode_len=40, paged_batch=2, block_size=4, paged_context=24, long_seq=256, long_heads=(1,))


# ---------------------------------------------------------------------------------------------- output

def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else f"{v:{spec}}"


def print_table(results: list[dict[str, Any]], memory: list[dict[str, Any]]) -> None:
    print("\n| case | shape | dtype | fuel ms | fuel jit ms | torch ms | torch.compile ms | fuel/torch "
          "| fuel/compile | roofline ms | roofline frac | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ms = r["ms"]
        ok = "FAILED" if r["failed"] else "skipped" if r["skipped"] else (
            "yes" if all(c["ok"] for c in r["correctness"].values()) else "NO")
        frac = r["roofline_fraction"]
        print(f"| {r['case']} | {r['shape']} | {r['dtype']} | {_fmt(ms['fuel'])} | {_fmt(ms['fuel_jit'])} | "
              f"{_fmt(ms['torch_eager'])} | {_fmt(ms['torch_compile'])} | {_fmt(r['fuel_over_torch'])} | "
              f"{_fmt(r['fuel_over_compile'])} | {_fmt(r['roofline_ms'], '.3f')} | "
              f"{'n/a' if frac is None else f'{100 * frac:.1f}%'} | {ok} |")
    if memory:
        print("\n| memory | score matrix MiB | way | extra peak RSS MiB | / score matrix | first s | second s |")
        print("|---|---|---|---|---|---|---|")
        for m in memory:
            if m["skipped"]:
                print(f"| {m['shape']} | {m['score_matrix_mib']:.0f} | - | skipped | | | |")
            for way, w in m["ways"].items():
                if "error" in w:
                    print(f"| {m['shape']} | {m['score_matrix_mib']:.0f} | {way} | error: {w['error'][:80]} | | | |")
                    continue
                bound = " (upper bound)" if w["extra_is_upper_bound"] else ""
                print(f"| {m['shape']} | {m['score_matrix_mib']:.0f} | {way} | {w['extra_mib']:.1f}{bound} | "
                      f"{w['extra_over_score_matrix']:.3f} | {w['first_s']:.2f} | {w['second_s']:.2f} |")


def plot(results: list[dict[str, Any]], memory: list[dict[str, Any]], path: Path) -> None:
    """One panel per timed case (their scales differ), bars fuel / fuel jit / torch / torch.compile with
    the ratio to torch eager over each fuel bar; one panel of peak memory against the score matrix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in results if not r["skipped"] and not r["failed"]]
    mem = [m for m in memory if not m["skipped"] and m["ways"]]
    panels = max(len(timed) + (1 if mem else 0), 1)
    cols = min(panels, 3)
    rows = -(-panels // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(4.6 * cols, 4.2 * rows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[panels:]:
        ax.axis("off")
    labels = {"fuel": "fuel", "fuel_jit": "fuel jit", "torch_eager": "torch", "torch_compile": "torch\ncompile"}
    for ax, r in zip(axes, timed, strict=False):
        vals = [r["ms"][w] for w in WAYS]
        top = max((v for v in vals if v is not None), default=1.0)
        bars = ax.bar(range(len(WAYS)), [v or 0.0 for v in vals], color=["C0", "C1", "C3", "C2"])
        torch_ms = r["ms"]["torch_eager"]
        for way, bar, v in zip(WAYS, bars, vals, strict=True):
            text = "n/a" if v is None else f"{v:.2f}"
            if v is not None and way in FUEL_WAYS and torch_ms:
                text += f"\n{v / torch_ms:.2f}x torch"
            ax.text(bar.get_x() + bar.get_width() / 2, (v or 0.0) + 0.01 * top, text, ha="center", va="bottom",
                    fontsize=7)
        if r["roofline_ms"]:
            ax.axhline(r["roofline_ms"], color="black", linestyle=":", linewidth=1, label="roofline")
            ax.legend(fontsize=7, loc="upper left")
        ax.set_xticks(range(len(WAYS)), [labels[w] for w in WAYS], fontsize=8)
        ax.set_ylim(0, top * 1.3)
        ax.set_ylabel("median ms (lower is better)")
        ax.set_title(f"{r['case']} {r['dtype']}\n{r['shape']}", fontsize=8)
    if mem:
        ax = axes[len(timed)]
        names, vals = [], []
        for m in mem:
            names.append(f"score matrix\nH{m['heads']}")
            vals.append(m["score_matrix_mib"])
            for way, w in m["ways"].items():
                if "extra_mib" in w:
                    names.append(f"{way}\nH{m['heads']}")
                    vals.append(w["extra_mib"])
        colours = {"score": "C7", "fuel": "C0", "torch": "C3"}
        bars = ax.bar(range(len(vals)), vals, color=[colours[n.split()[0]] for n in names])
        for bar, v in zip(bars, vals, strict=True):
            ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(vals)), names, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("MiB above the inputs (peak RSS, log scale)")
        ax.set_title(f"causal forward S{mem[0]['seq']}: peak memory", fontsize=8)
    fig.suptitle("Fuel attention vs PyTorch, this CPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write(out_dir: Path, meta: dict[str, Any], results: list[dict[str, Any]], memory: list[dict[str, Any]]) -> None:
    """JSON and PNG of the results so far (rewritten after each case, so a long run keeps its results)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attention.json").write_text(json.dumps({"meta": meta, "results": results, "memory": memory},
                                                       indent=2))
    plot(results, memory, out_dir / "attention.png")


def _report(r: dict[str, Any]) -> None:
    if r["skipped"] or r["failed"]:
        return
    ms = r["ms"]
    bad = [w for w, c in r["correctness"].items() if not c["ok"]]
    print(f"  {r['case']:8} {r['dtype']:4} fuel {_fmt(ms['fuel'])} | jit {_fmt(ms['fuel_jit'])} | torch "
          f"{_fmt(ms['torch_eager'])} | compile {_fmt(ms['torch_compile'])} ms | fuel/torch "
          f"{_fmt(r['fuel_over_torch'])} | roofline {_fmt(r['roofline_fraction'], '.3f')} ({r['roofline_source']})"
          + (f" | DISAGREES with torch: {bad}" if bad else ""), flush=True)
    for w in bad:
        c = r["correctness"][w]
        print(f"    WARNING: {w} max |diff| {c['max_abs']:.3g} (rtol {c['rtol']}, atol {c['atol']}) "
              f"{c.get('error', '')}", flush=True)


def main(out_dir: str, repeat: int, compile_torch: bool = True, sizes: Sizes | None = None,
         limits: dict[str, float] | None = None) -> int:
    """Run every case, print the markdown table, write attention.json and attention.png in `out_dir`;
    returns 1 when a case raised (its record says `failed`; the other cases still run), else 0.
    `sizes` defaults to the real sizes; tests pass `Sizes.tiny()` (and `limits`, skipping the measurement)."""
    import torch

    sz = sizes or Sizes()
    torch.set_num_threads(THREADS)
    fl.set_num_threads(THREADS)
    attn = [i.name for i in fl.kernels() if "Attn" in i.name]
    print(f"attention: {THREADS} threads, repeat {repeat}; attention kernels registered: {attn or 'none'}",
          flush=True)
    limits = limits or machine_limits()
    folder = Path(out_dir)
    meta = {"machine": platform.processor() or platform.machine(), "threads": THREADS, "blas": blas_info(),
            "torch": torch.__version__, "repeat": repeat, "limits": limits, "sizes": dataclasses.asdict(sz),
            "attention_kernels": attn, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
            # two cores: a load average above ~2 means something else competed with the timings
            "loadavg_start": os.getloadavg()}
    results: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    base: dict[str, Any] = {"batch": sz.batch, "heads": sz.heads, "seq": sz.seq, "head_dim": sz.head_dim}
    fwd_label = f"B{sz.batch} H{sz.heads} S{sz.seq} D{sz.head_dim} causal"
    runs: list[Callable[[], dict[str, Any]]] = [
        lambda: case_forward(limits, repeat, compile_torch, **base),
        lambda: case_forward(limits, repeat, compile_torch, **base, dtype="bf16"),
        lambda: case_backward(limits, repeat, compile_torch, **base),
        lambda: case_decode(limits, repeat, compile_torch, hq=sz.decode_hq, hkv=sz.decode_hkv,
                            capacity=sz.decode_capacity, k_len=sz.decode_len, head_dim=sz.head_dim),
        lambda: case_paged(limits, repeat, compile_torch, batch=sz.paged_batch, hq=sz.decode_hq, hkv=sz.decode_hkv,
                           head_dim=sz.head_dim, block_size=sz.block_size, context=sz.paged_context),
    ]
    labels = [("forward", "f32", fwd_label), ("forward", "bf16", fwd_label), ("backward", "f32", fwd_label),
              ("decode", "f32", "decode"), ("paged", "f32", "paged")]
    for run, (case, dtype, label) in zip(runs, labels, strict=True):
        try:
            results.append(run())
        except Exception as e:  # one broken case must not stop the others; the run still fails
            results.append(failed(case, label, as_dtype(dtype), e))
        _report(results[-1])
        _write(folder, meta, results, memory)
    for h in sz.long_heads:
        memory.append(case_memory(sz.long_seq, h, sz.head_dim, require_kernel=sizes is None))
        _write(folder, meta, results, memory)
    meta["loadavg_end"] = os.getloadavg()
    _write(folder, meta, results, memory)
    print_table(results, memory)
    print(f"load average (1, 5, 15 min) at start {meta['loadavg_start']}, at end {meta['loadavg_end']} "
          f"({THREADS} cores: above ~{THREADS} something else competed with these timings)")
    print(f"\nroofline: max(bytes / {limits['bandwidth_gbs']:.1f} GB/s copy, flops / {limits['gemm_gflops']:.0f} "
          f"GFLOP/s sgemm) from the fuel impl's cost (analytic counts without a kernel), over fuel's best time; "
          f"ratios use fuel's best way. BLAS {blas_info()}")
    for r in results:
        for n in r["notes"]:
            print(f"note ({r['case']} {r['dtype']}): {n}")
    print(f"wrote {folder / 'attention.json'} and {folder / 'attention.png'}")
    crashed = [f"{r['case']} {r['dtype']}" for r in results if r["failed"]]
    if crashed:
        print(f"FAILED (raised): {', '.join(crashed)}")
    return 1 if crashed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results", help="folder for attention.json and attention.png")
    parser.add_argument("--repeat", type=int, default=10, help="timed rounds per way (median reported)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    args = parser.parse_args()
    raise SystemExit(main(args.out, max(1, args.repeat), not args.no_compile))
