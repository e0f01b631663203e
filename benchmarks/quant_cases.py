"""The measuring side of bench_quant: the machine's read bandwidth, cold-cache interleaved timing, the
quantized weights in fuel's and torch's forms, and one case's timed and checked record.

Ways, each timed interleaved (one call of each per round, medians):
- fuel: `fl.ops.qmatmul` / `fl.ops.nf4_matmul` on prebuilt input tensors, graph built and realised
  each call; fuel_jit: the same through `fl.jit` (the weight captured, x the argument).
- fuel_jit_warm (reported only): fuel_jit again right after it with no flush (the weight in L3).
- torch_deq_mm (the base of the fuel/torch ratio): what torch needs to do the same from the same bytes,
  dequantise then matmul, timed together: GGUF `torch.from_numpy(gguf.quants.dequantize(raw, type))`
  then `x @ W.T`; NF4 `bitsandbytes.functional.dequantize_4bit` then `x @ W.T`.
- torch_mm (reported, not a ratio base of the targets): `x @ W.T` with W dequantised beforehand (f32,
  4x-8x the bytes of the quantized weight).
- bnb_4bit (NF4 only): `bitsandbytes.matmul_4bit(x, q.t(), quant_state)`.
- fuel_jit_weight_cold (M = 1's roofline): fuel_jit with only its weight and x evicted from every cache
  level (clflush of their lines), not the whole cache, and the spinning pool's workers woken after the
  eviction (`spin.wake`), as a decode loop's are from step to step: posted to sleeping workers, a
  4096² one-row QMatMul ran 0.1 ms (about 12%) longer on this 2-core Xeon VM, waiting for them.
Every other timed call starts from a cold cache: a 64 MiB read (twice the L3 here), untimed, runs before
it, so a 9-18 MB weight is read from memory as in a real model's decode, not from the L3 the previous
way left it in. That read also evicts the interpreter, the replay plan and the kernels' code, which a
decode loop keeps cached: after it, the jitted call spends 0.15-0.25 ms more than after evicting the
weight and x alone (measured on Q4_0/Q4_K/NF4 4096², a 0.6-0.8 ms call), misses that are no part of
streaming the weight. So the M = 1 roofline fraction, which judges the kernel against the weight's
memory time, takes the faster of fuel's best way and fuel_jit_weight_cold; the fraction over the
full-flush time is reported beside it.

Roofline: floor = weight bytes (+ NF4's absmax) / read bandwidth, the read bandwidth measured here (the
fastest of a two-thread vector read, a two-thread scalar sum and a NumPy sum over 256 MiB: `read_bandwidth`;
bytes read / time). Copy bandwidth
(read + write bytes, `bench_ops.machine_limits`) is reported beside it; at M = 64 the floor is the
larger of that and 2·M·N·K flops over the measured sgemm peak. Reported as floor / fuel's best time
(at M = 1 counting fuel_jit_weight_cold among fuel's ways, see above).
Targets each record is judged by: fuel ≤ 0.5x torch_deq_mm, and ≥ 50% of the roofline at M = 1.
Correctness: fuel's output (both ways) against torch_deq_mm's, per element
|fuel - torch| ≤ 1e-5·(|x| @ |W|ᵀ) (f32 contraction noise over K terms), recorded in the JSON.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

import fuel as fl
from benchmarks import timing
from benchmarks.bench_ops import machine_limits
from fuel.dispatch import spin
from fuel.dispatch.cpu.simd16 import hsum, vadd, vload, vzero
from fuel.quant import QuantType
from fuel.quant.nf4 import nf4_quantize
from fuel.testing.reference.qmatmul import as_words, random_weight

# As in attention_harness: torch's OpenMP pool waits passively (set before torch loads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

WAYS = ("fuel", "fuel_jit", "torch_deq_mm", "torch_mm", "bnb_4bit")
# Reported beside them, never a ratio base nor fuel's best: fuel_jit again straight after fuel_jit, no
# flush, so the weight is in L3 (how much of the cold time is memory and how much compute/overhead).
WARM_WAY = "fuel_jit_warm"
FUEL_WAYS = ("fuel", "fuel_jit")
# Reported, and fuel's time for the M = 1 roofline: fuel_jit after evicting only its weight and x.
EVICT_WAY = "fuel_jit_weight_cold"
NF4_BLOCK = 64
RTOL = 1e-5  # per element, relative to |x| @ |W|ᵀ
TARGET_RATIO = 0.5  # fuel / torch_deq_mm at most
TARGET_ROOF = 0.5  # floor / fuel at M = 1 at least
FLUSH_BYTES = 64 << 20


# ---------------------------------------------------------------------------------------------- machine

@njit(parallel=True, cache=True)
def _parallel_sum(a: np.ndarray) -> float:  # pragma: no cover (compiled)
    chunks = 64
    step = a.size // chunks
    part = np.zeros(chunks)
    for c in prange(chunks):
        s = 0.0
        for i in range(c * step, (c + 1) * step):
            s += a[i]
        part[c] = s
    return float(part.sum())


STREAM_THREADS = 2


@njit(nogil=True, cache=True)
def _stream_sum(a: np.ndarray, lo: int, hi: int) -> float:  # pragma: no cover (compiled)
    """Σ a[lo:hi] (f32, hi - lo a multiple of 128) as two sequential streams, 16-float vector loads into
    four independent accumulators per stream: a read that memory, not the adds, limits."""
    half = (hi - lo) // 2
    s0, s1, s2, s3 = vzero(), vzero(), vzero(), vzero()
    for i in range(lo, lo + half, 64):
        j = i + half
        s0 = vadd(s0, vadd(vload(a, i), vload(a, j)))
        s1 = vadd(s1, vadd(vload(a, i + 16), vload(a, j + 16)))
        s2 = vadd(s2, vadd(vload(a, i + 32), vload(a, j + 32)))
        s3 = vadd(s3, vadd(vload(a, i + 48), vload(a, j + 48)))
    return hsum(vadd(vadd(s0, s1), vadd(s2, s3)))


def _threaded_stream_sum(a: np.ndarray, pool: ThreadPoolExecutor) -> float:
    step = a.size // STREAM_THREADS
    return sum(f.result() for f in [pool.submit(_stream_sum, a, t * step, (t + 1) * step)
                                    for t in range(STREAM_THREADS)])


def _median_s(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(repeat: int = 5, nbytes: int = 256 << 20) -> dict[str, float]:
    """Read-only bandwidth (bytes read / time) over `nbytes` (8 times this machine's L3, so from memory),
    the fastest of three reads: `_stream_sum` on two threads (vector loads, two streams a thread), a
    two-thread Numba scalar sum and a NumPy sum. The scalar sum's chain of dependent adds, and NumPy's
    single thread, reach about half of what the vector read does here (15-19 against 31-33 GB/s on a
    Zen 3), and memory-bound kernels such as Q8_0's one-row product stream faster than that; a roofline
    taken from them alone would credit a kernel with twice its real fraction."""
    a = np.ones(nbytes // 8, np.float64)
    f32 = a.view(np.float32)[: a.size * 2 // (128 * STREAM_THREADS) * 128 * STREAM_THREADS]
    with ThreadPoolExecutor(STREAM_THREADS) as pool:
        vector_s = _median_s(lambda: _threaded_stream_sum(f32, pool), repeat)
    numba_s = _median_s(lambda: _parallel_sum(a), repeat)
    numpy_s = _median_s(lambda: np.add.reduce(a), repeat)
    return {"read_vector_gbs": f32.nbytes / vector_s / 1e9, "read_numba_gbs": a.nbytes / numba_s / 1e9,
            "read_numpy_gbs": a.nbytes / numpy_s / 1e9,
            "read_gbs": max(f32.nbytes / vector_s, a.nbytes / numba_s, a.nbytes / numpy_s) / 1e9}


def measure_limits() -> dict[str, float]:
    """read_gbs (the roofline's), copy bandwidth_gbs (read + write bytes) and the sgemm peak."""
    limits = dict(machine_limits())
    limits.update(read_bandwidth())
    return limits


_FLUSH: list[np.ndarray] = []


def flush_cache() -> None:
    """Read FLUSH_BYTES (twice this machine's L3) so the next call finds its weight in memory, not cache."""
    if not _FLUSH:
        _FLUSH.append(np.ones(FLUSH_BYTES // 4, np.float32))
    np.add.reduce(_FLUSH[0])


_I8P = ir.IntType(8).as_pointer()


def _x86_call(builder: Any, name: str, args: list[Any]) -> None:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [a.type for a in args]),
                                        f"llvm.x86.sse2.{name}")
    builder.call(fn, args)


@intrinsic
def _clflush_intrinsic(typingctx: Any, address: Any) -> Any:
    """Write back and drop the cache line holding the byte at `address`, from every level."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        _x86_call(builder, "clflush", [builder.inttoptr(args[0], _I8P)])
        return context.get_dummy_value()

    return types.void(address), codegen


@intrinsic
def _mfence_intrinsic(typingctx: Any) -> Any:
    """Order the flushes before what follows."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        _x86_call(builder, "mfence", [])
        return context.get_dummy_value()

    return types.void(), codegen


_clflush: Any = _clflush_intrinsic  # Numba intrinsics, typed for their jitted callers only
_mfence: Any = _mfence_intrinsic
_CLFLUSH = platform.machine().lower() in ("x86_64", "amd64")


@njit(cache=True)
def _evict_lines(address: int, nbytes: int) -> None:  # pragma: no cover (compiled)
    for i in range(0, nbytes, 64):
        _clflush(address + i)
    if nbytes:
        _clflush(address + nbytes - 1)
    _mfence()


def evict(*arrays: np.ndarray) -> None:
    """Write back and drop these (contiguous) arrays' cache lines from every level (clflush), nothing
    else; where the host is not x86, the whole-cache flush instead."""
    if not _CLFLUSH:
        flush_cache()
        return
    for a in arrays:
        if not a.flags.c_contiguous:
            raise ValueError("evict: a contiguous array is needed (a copy would be evicted instead)")
        _evict_lines(a.ctypes.data, a.nbytes)


def weight_cold(weight_arrays: tuple[np.ndarray, ...], x: np.ndarray) -> None:
    """EVICT_WAY's preparation: the weight and x evicted, then the pool's workers woken (see the module
    docstring)."""
    evict(*weight_arrays, x)
    spin.wake()


def timed_ms(fns: dict[str, Callable[[], Any]], repeat: int, budget_s: float = 60.0,
             cold: bool = True, warm: frozenset[str] = frozenset(),
             before: dict[str, Callable[[], None]] | None = None) -> tuple[dict[str, float], int]:
    """`timing.timed_ms` with each call after an untimed cache flush (`cold`, except the names in `warm`,
    and those in `before`, which run their own preparation instead)."""
    def flush(name: str) -> None:
        if before and name in before:
            before[name]()
        elif cold and name not in warm:
            flush_cache()
    return timing.timed_ms(fns, repeat, budget_s, flush)


# ---------------------------------------------------------------------------------------------- cases

def check(got: Any, want: np.ndarray, scale: np.ndarray, rtol: float = RTOL) -> dict[str, Any]:
    """Per element |got - want| ≤ rtol·scale (scale = |x| @ |W|ᵀ), with the worst |diff| / scale."""
    g = np.asarray(got.numpy() if hasattr(got, "numpy") else got, np.float64)
    if g.shape != want.shape:
        return {"ok": False, "max_abs": float("nan"), "max_rel_to_scale": float("nan"), "rtol": rtol,
                "error": f"shape {list(g.shape)} != torch's {list(want.shape)}"}
    diff = np.abs(g - want)
    rel = diff / np.maximum(scale, np.finfo(np.float32).tiny)
    ok = bool(np.all(diff <= rtol * scale)) and bool(np.all(np.isfinite(g)))
    return {"ok": ok, "max_abs": float(diff.max(initial=0.0)), "max_rel_to_scale": float(rel.max(initial=0.0)),
            "rtol": rtol}


def _ggml(name: str) -> Any:
    import gguf

    return gguf.GGMLQuantizationType[QuantType.of(name, "bench_quant").ggml_name]


def build_weight(qtype: str, n: int, k: int, rng: np.random.Generator) -> dict[str, Any]:
    """The quantized weight in fuel's and torch's forms, its dequantised f32 W and its byte count.

    Q4_0/Q8_0: `gguf.quants.quantize` of normal values; Q4_K/Q6_K: random valid blocks (random bytes,
    finite f16 scales: `fuel.testing.reference.qmatmul.random_weight`); NF4: `nf4_quantize` of normal
    values (byte for byte bitsandbytes' `quantize_4bit`), given to bitsandbytes through its own call."""
    import gguf
    import torch

    if qtype == "NF4":
        import bitsandbytes.functional as bnbf

        w = rng.standard_normal((n, k), dtype=np.float32)
        packed, absmax = nf4_quantize(w, NF4_BLOCK)
        q, state = bnbf.quantize_4bit(torch.from_numpy(w), blocksize=NF4_BLOCK, quant_type="nf4")
        same = bool(np.array_equal(q.numpy().reshape(-1), packed.reshape(-1))
                    and np.array_equal(state.absmax.numpy().reshape(-1), absmax.reshape(-1)))
        deq = bnbf.dequantize_4bit(q, state).numpy()
        return {"fuel": (fl.tensor(packed), fl.tensor(absmax)), "bnb": (q, state), "w": deq,
                "bytes": packed.nbytes + absmax.nbytes, "bnb_bytes_identical": same}
    qt = QuantType.of(qtype, "bench_quant")
    raw = random_weight(rng, qt, n, k)
    deq = np.asarray(gguf.quants.dequantize(raw, _ggml(qtype)), np.float32).reshape(n, k)
    return {"fuel": (fl.tensor(as_words(raw)),), "raw": raw, "w": deq, "bytes": raw.nbytes}


def floor_ms(nbytes: int, flops: int, limits: dict[str, float]) -> float:
    return max(nbytes / (limits["read_gbs"] * 1e6), flops / (limits["gemm_gflops"] * 1e6))


def run_case(qtype: str, m: int, wt: dict[str, Any], repeat: int, limits: dict[str, float],
             k: int, n: int, seed: int = 0) -> dict[str, Any]:
    """Time every way of `x[m, k] @ dequant(W)ᵀ` for one weight, check fuel against torch, assemble the record."""
    import gguf
    import torch

    rng = np.random.default_rng(seed + m)
    x = rng.standard_normal((m, k), dtype=np.float32)
    tx = torch.from_numpy(x)
    xt = fl.tensor(x)
    tw = torch.from_numpy(wt["w"])
    fns: dict[str, Callable[[], Any]] = {}
    if qtype == "NF4":
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbf

        packed, absmax = wt["fuel"]
        weight_arrays: tuple[np.ndarray, ...] = (packed.numpy(), absmax.numpy())
        q, state = wt["bnb"]

        def build() -> fl.Tensor:
            return fl.ops.nf4_matmul(xt, packed, absmax, block_size=NF4_BLOCK)

        jitted = fl.jit(lambda a: fl.ops.nf4_matmul(a, packed, absmax, block_size=NF4_BLOCK))

        def torch_deq_mm() -> Any:
            return tx @ bnbf.dequantize_4bit(q, state).T

        fns["bnb_4bit"] = lambda: bnb.matmul_4bit(tx, q.t(), state)
    else:
        (words,) = wt["fuel"]
        weight_arrays = (words.numpy(),)
        raw, ggml = wt["raw"], _ggml(qtype)

        def build() -> fl.Tensor:
            return fl.ops.qmatmul(xt, words, qtype, k, n)

        jitted = fl.jit(lambda a: fl.ops.qmatmul(a, words, qtype, k, n))

        def torch_deq_mm() -> Any:
            return tx @ torch.from_numpy(gguf.quants.dequantize(raw, ggml)).T

    with torch.inference_mode():
        want = torch_deq_mm().numpy().astype(np.float64)
        mm_out = (tx @ tw.T).numpy()
        extra = {w: fns[w]().numpy() for w in fns}
    scale = np.abs(x).astype(np.float64) @ np.abs(wt["w"]).astype(np.float64).T
    correctness = {"fuel": check(fl.realize(build())[0], want, scale),
                   "fuel_jit": check(jitted(x), want, scale),
                   "torch_mm": check(mm_out, want, scale)}
    correctness.update({w: check(v, want, scale) for w, v in extra.items()})

    def torch_mm() -> Any:
        with torch.inference_mode():
            return tx @ tw.T

    def deq_mm() -> Any:
        with torch.inference_mode():
            return torch_deq_mm()

    timed: dict[str, Callable[[], Any]] = {"fuel": lambda: fl.realize(build()), "fuel_jit": lambda: jitted(x),
                                           WARM_WAY: lambda: jitted(x), EVICT_WAY: lambda: jitted(x),
                                           "torch_deq_mm": deq_mm, "torch_mm": torch_mm}
    for w, fn in fns.items():
        timed[w] = _in_inference_mode(fn)
    medians, rounds = timed_ms(timed, repeat, warm=frozenset({WARM_WAY}),
                               before={EVICT_WAY: lambda: weight_cold(weight_arrays, x)})
    ms: dict[str, float | None] = {w: medians.get(w) for w in (*WAYS, WARM_WAY, EVICT_WAY)}
    best_way = min(FUEL_WAYS, key=lambda w: medians[w])
    fuel_ms = medians[best_way]
    impls = _impls(build)
    record = {
        "type": qtype, "m": m, "k": k, "n": n, "shape": f"x[{m}, {k}] W[{n}, {k}]", "ms": ms, "rounds": rounds,
        "fuel_best_way": best_way, "fuel_ms": fuel_ms,
        "fuel_over_torch_deq_mm": fuel_ms / medians["torch_deq_mm"],
        "fuel_over_torch_mm": fuel_ms / medians["torch_mm"],
        "fuel_over_bnb_4bit": fuel_ms / medians["bnb_4bit"] if "bnb_4bit" in medians else None,
        "weight_bytes": wt["bytes"], "dequantised_bytes": 4 * n * k, "flops": 2 * m * n * k,
        "roofline_way": min((best_way, EVICT_WAY) if m == 1 else (best_way,), key=lambda w: medians[w]),
        "roofline_basis": "weight bytes / read bandwidth" + (" or flops / sgemm peak, the larger" if m > 1 else ""),
        "meets_ratio_target": fuel_ms / medians["torch_deq_mm"] <= TARGET_RATIO,
        "impls": impls, "correctness": correctness,
        "bnb_bytes_identical": wt.get("bnb_bytes_identical"), "skipped": None,
    }
    judge_roofline(record, limits)
    return record


def judge_roofline(record: dict[str, Any], limits: dict[str, float]) -> None:
    """Set a timed record's roofline floor, its fractions and whether it meets the M = 1 target, for the
    machine's `limits` (the harness judges again at the end with the largest bandwidth it probed)."""
    m, ms = record["m"], record["ms"]
    roof_ms = floor_ms(record["weight_bytes"], record["flops"] if m > 1 else 0, limits)
    fraction = roof_ms / ms[record["roofline_way"]]
    record.update({"roofline_ms": roof_ms, "roofline_fraction": fraction,
                   "roofline_fraction_full_flush": roof_ms / record["fuel_ms"],
                   "meets_roofline_target": fraction >= TARGET_ROOF if m == 1 else None})


def _in_inference_mode(fn: Callable[[], Any]) -> Callable[[], Any]:
    import torch

    def call() -> Any:
        with torch.inference_mode():
            return fn()

    return call


def _impls(build: Callable[[], fl.Tensor]) -> list[str]:
    """The kernels realising `build()` runs (prim: entries when fuel fell back to a decomposition)."""
    with fl.trace() as t:
        fl.realize(build())
    names: list[str] = []
    for r in t.records:
        if r.impl not in names:
            names.append(r.impl)
    return names


def skipped(qtype: str, m: int, k: int, n: int, reason: str) -> dict[str, Any]:
    print(f"  {qtype} M={m}: skipped: {reason}", flush=True)
    return {"type": qtype, "m": m, "k": k, "n": n, "shape": f"x[{m}, {k}] W[{n}, {k}]",
            "ms": {w: None for w in (*WAYS, WARM_WAY, EVICT_WAY)}, "fuel_best_way": None, "fuel_ms": None,
            "fuel_over_torch_deq_mm": None,
            "fuel_over_torch_mm": None, "fuel_over_bnb_4bit": None, "roofline_ms": None,
            "roofline_way": None, "roofline_fraction": None, "roofline_fraction_full_flush": None,
            "meets_ratio_target": None, "meets_roofline_target": None, "impls": [],
            "correctness": None, "skipped": reason}
