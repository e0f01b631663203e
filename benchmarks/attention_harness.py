"""The measuring side of bench_attention, shared by bench_conv and bench_scans too: interleaved timing,
inputs fuel and torch read alike, correctness against torch, the roofline and one case's record.

Every way of a case runs interleaved (one call of each per round, medians over `repeat` rounds, fewer
when a case's rounds would take over a minute), so drift and other load hit them alike.
The roofline is the larger of the fuel impl's own cost estimate (`impl.cost`): bytes over the measured
copy bandwidth and flops over the measured sgemm peak; without a fused kernel it falls back to the
analytic counts the case passes in. It is reported as floor / fuel's best time.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import fuel as fl
from benchmarks.timing import timed_ms
from fuel.dtype import DType

# torch's OpenMP pool waits passively, as fuel's does (bench_latency says why: spinning, each pool
# starves the other on two cores). Set before torch loads, which is why torch is imported inside the
# functions here and in attention_cases.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

THREADS = 2
FUEL_WAYS = ("fuel", "fuel_jit")
TORCH_WAYS = ("torch_eager", "torch_compile")
WAYS = FUEL_WAYS + TORCH_WAYS


def _torch_dtype(dt: DType) -> Any:
    import torch

    return {DType.F32: torch.float32, DType.F64: torch.float64, DType.BF16: torch.bfloat16,
            DType.F16: torch.float16}[dt]


def randn(rng: np.random.Generator, shape: tuple[int, ...], dt: DType) -> np.ndarray:
    """Standard normal values, rounded once to `dt` (fuel and torch then read the same numbers)."""
    return rng.standard_normal(shape, dtype=np.float32).astype(dt.np)


def to_torch(a: np.ndarray, dt: DType, requires_grad: bool = False) -> Any:
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a.astype(np.float32))).to(_torch_dtype(dt))
    return t.requires_grad_(requires_grad)


def _as_f32(x: Any) -> np.ndarray:
    """A fuel Tensor, a torch tensor or an array, as a float32 array (for comparing)."""
    if hasattr(x, "detach"):
        return np.asarray(x.detach().float().numpy())
    if hasattr(x, "numpy"):
        x = x.numpy()
    return np.asarray(x).astype(np.float32)


def compare(ref: list[Any], got: list[Any], rtol: float, atol: float) -> dict[str, Any]:
    """np.allclose of every output against torch's, with the worst absolute difference."""
    r32, g32 = [_as_f32(r) for r in ref], [_as_f32(g) for g in got]
    if len(r32) != len(g32) or any(r.shape != g.shape for r, g in zip(r32, g32, strict=False)):
        return {"ok": False, "max_abs": float("nan"), "rtol": rtol, "atol": atol,
                "error": f"shapes {[g.shape for g in g32]} != torch's {[r.shape for r in r32]}"}
    ok = all(np.allclose(g, r, rtol=rtol, atol=atol) for r, g in zip(r32, g32, strict=True))
    worst = max(float(np.max(np.abs(g.astype(np.float64) - r), initial=0.0)) for r, g in zip(r32, g32, strict=True))
    return {"ok": bool(ok), "max_abs": worst, "rtol": rtol, "atol": atol}


def tolerance(dt: DType, backward: bool = False) -> tuple[float, float]:
    """(rtol, atol) against torch: f32 accumulation-order noise, or bf16's 8-bit mantissa."""
    if dt is DType.BF16:
        return 2e-2, 2e-2
    return (1e-3, 1e-4) if backward else (1e-4, 2e-5)


def has_impl(op_id: int, dt: DType) -> bool:
    """A CPU kernel for this op whose first input has dtype `dt` is registered."""
    return any(i.backend == "cpu" and i.dtypes[0] is dt for i in fl.kernels().impls(op_id))


def fused_impls(build: Callable[[], list[fl.Tensor]], op_ids: tuple[int, ...],
                env: dict[str, int] | None = None) -> list[Any]:
    """The impls (BackendImpl) of ops `op_ids` that realising `build()` runs, in order, each once (none when
    fuel ran the op's primitive decomposition, whose own fused pieces, a softmax, say, are not the op)."""
    with fl.trace() as t:
        fl.realize(*build(), env=env)
    names: list[str] = []
    for r in t.records:
        # a joint step (the three backward entries in one pass) records "A[..] + B[..] + C[..]"
        for name in r.impl.split(" + "):
            if not name.startswith("prim:") and name not in names:
                names.append(name)
    by_name = {i.name: i for i in fl.kernels()}
    return [by_name[n] for n in names if n in by_name and by_name[n].op_id in op_ids]


def impl_cost(impl: Any, shapes: Sequence[tuple[int, ...]], params: Any, k_len: int | None = None) -> tuple[int, int]:
    """(flops, bytes) from the impl's own cost estimate; a DynScalar k_len is bound to `k_len` first."""
    if k_len is not None and dataclasses.is_dataclass(params) and hasattr(params, "k_len"):
        params = dataclasses.replace(params, k_len=k_len)  # type: ignore[type-var]
    c = impl.cost(shapes, impl.dtypes, params)
    return int(c.flops), int(c.bytes_moved)


def floor_ms(flops: int, nbytes: int, limits: dict[str, float]) -> float:
    return max(nbytes / (limits["bandwidth_gbs"] * 1e6), flops / (limits["gemm_gflops"] * 1e6))


def torch_compiled(fn: Callable[..., Any], args: tuple[Any, ...], notes: list[str]) -> Callable[[], Any] | None:
    """torch.compile(fn) called once on `args` (compiling), or None with the reason in `notes`."""
    import torch

    try:
        compiled = torch.compile(fn)
        start = time.perf_counter()
        with torch.inference_mode():
            compiled(*args)
        notes.append(f"torch.compile took {time.perf_counter() - start:.1f} s to compile")
    except Exception as e:  # torch.compile is optional: report why, eager still counts
        notes.append(f"torch.compile failed: {type(e).__name__}: {str(e)[:200]}")
        return None

    def call() -> Any:
        with torch.inference_mode():
            return compiled(*args)

    return call


def case_record(case: str, label: str, dt: DType, fns: dict[str, Callable[[], Any]], repeat: int,
                limits: dict[str, float], analytic: tuple[int, int], cost: tuple[int, int] | None,
                impls: list[Any], correctness: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """Time `fns` interleaved and assemble one case's record."""
    ms: dict[str, float | None] = {w: None for w in WAYS}
    medians, rounds = timed_ms(fns, repeat)
    ms.update(medians)
    fuel_times: dict[str, float] = {w: t for w in FUEL_WAYS if (t := ms[w]) is not None}
    best_way = min(fuel_times, key=lambda w: fuel_times[w]) if fuel_times else None
    fuel_ms = fuel_times[best_way] if best_way else None

    def ratio(torch_way: str) -> float | None:
        t = ms[torch_way]
        return None if fuel_ms is None or t is None else fuel_ms / t

    analytic_ms = floor_ms(*analytic, limits)
    roof_ms, source = (floor_ms(*cost, limits), "impl cost") if cost else (analytic_ms, "analytic")
    if fuel_ms and roof_ms > fuel_ms:
        notes.append(f"the floor ({roof_ms:.3f} ms) is above fuel's time: the cost estimate over-counts "
                     f"({source}: {(cost or analytic)[1]} bytes, {(cost or analytic)[0]} flops; the analytic "
                     f"minimum is {analytic[1]} bytes, {analytic[0]} flops) or the measured limits are low")
    return {
        "case": case, "shape": label, "dtype": dt.value, "ms": ms, "rounds": rounds,
        "fuel_best_way": best_way, "fuel_ms": fuel_ms,
        "fuel_over_torch": ratio("torch_eager"), "fuel_over_compile": ratio("torch_compile"),
        "impls": [i.name for i in impls],
        "flops": (cost or analytic)[0], "bytes": (cost or analytic)[1],
        "analytic_flops": analytic[0], "analytic_bytes": analytic[1],
        "roofline_ms": roof_ms, "roofline_source": source, "analytic_floor_ms": analytic_ms,
        "roofline_fraction": roof_ms / fuel_ms if fuel_ms else None,
        "correctness": correctness, "notes": notes, "skipped": None, "failed": None,
    }


def _untimed(case: str, label: str, dt: DType, reason: str, skip: str | None, fail: str | None) -> dict[str, Any]:
    return {"case": case, "shape": label, "dtype": dt.value, "ms": {w: None for w in WAYS}, "fuel_best_way": None,
            "fuel_ms": None, "fuel_over_torch": None, "fuel_over_compile": None, "impls": [],
            "roofline_ms": None, "roofline_fraction": None, "correctness": None, "notes": [reason],
            "skipped": skip, "failed": fail}


def skipped(case: str, label: str, dt: DType, reason: str) -> dict[str, Any]:
    """The record of a case that cannot run here (no kernel for it): no timings, `skipped` says why."""
    print(f"  {case} {dt.value}: skipped: {reason}", flush=True)
    return _untimed(case, label, dt, reason, reason, None)


def failed(case: str, label: str, dt: DType, error: BaseException) -> dict[str, Any]:
    """The record of a case that raised: no timings, `failed` holds the exception. A crash is never a
    skip: the run reports it and exits non-zero."""
    reason = f"{type(error).__name__}: {str(error)[:300]}"
    print(f"  {case} {dt.value}: FAILED: {reason}", flush=True)
    return _untimed(case, label, dt, reason, None, reason)
