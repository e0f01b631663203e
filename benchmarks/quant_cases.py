"""The cases of bench_quant: the quantized weights in fuel's and torch's forms and one case's timed and
checked record (the machine's read bandwidth and the cold-cache timing are quant_machine's).

Ways, each timed interleaved (one call of each per round, medians):
- fuel: `fl.ops.qmatmul` / `fl.ops.nf4_matmul` on prebuilt input tensors, graph built and realised
  each call; fuel_jit: the same through `fl.jit` (the weight captured, x the argument).
- fuel_jit_warm (reported only): fuel_jit again right after it with no flush (the weight in L3).
- torch_deq_mm (the base of the fuel/torch ratio): what torch needs to do the same from the same bytes,
  dequantise then matmul, timed together: GGUF through `torch_dequant.TorchDequantiser` (torch ops,
  bit-exact with the `gguf` package's dequantiser, into a reused buffer) then `x @ W.T`; NF4
  `bitsandbytes.functional.dequantize_4bit` then `x @ W.T`.
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
(at M = 1 counting fuel_jit_weight_cold among fuel's ways, see above), never judged.
The target each record is judged by, a ratio to the peer timed interleaved with fuel: fuel ≤ 0.5x
torch_deq_mm.
llama.cpp: llama-cpp-python (`make bench-env`) binds llama.h's model API only (its `_ggml` module loads
libggml but binds none of its functions), so it has no matmul entry point to time here; `llama_cpp_note`
says so in the JSON and the output, and `fuel bench --models` times its quantized matmuls inside whole
models.
Correctness: fuel's output (both ways) against torch_deq_mm's, per element
|fuel - torch| ≤ 1e-5·(|x| @ |W|ᵀ) (f32 contraction noise over K terms), recorded in the JSON.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

import fuel as fl
from benchmarks.quant_machine import timed_ms, weight_cold
from benchmarks.torch_dequant import TorchDequantiser
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


def llama_cpp_note() -> str:
    """Why there is no llama.cpp column: whether llama-cpp-python is installed, and that it has no matmul
    entry point (see the module docstring)."""
    try:
        import llama_cpp
    except ImportError:
        return "llama.cpp: no matmul time (llama-cpp-python is not installed: `make bench-env`)"
    return (f"llama.cpp: no matmul time (llama-cpp-python {getattr(llama_cpp, '__version__', '?')} binds llama.h's "
            "model API only, no ggml matmul entry point); `fuel bench --models` times its quantized matmuls "
            "inside whole models")


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
    dequantiser = TorchDequantiser(qtype, n, k)
    traw = torch.from_numpy(raw)
    ours = dequantiser(traw).numpy()
    return {"fuel": (fl.tensor(as_words(raw)),), "torch": (dequantiser, traw), "w": deq, "bytes": raw.nbytes,
            "torch_dequant_bit_exact": bool(np.array_equal(ours.view(np.uint32), deq.view(np.uint32)))}


def floor_ms(nbytes: int, flops: int, limits: dict[str, float]) -> float:
    return max(nbytes / (limits["read_gbs"] * 1e6), flops / (limits["gemm_gflops"] * 1e6))


def run_case(qtype: str, m: int, wt: dict[str, Any], repeat: int, limits: dict[str, float],
             k: int, n: int, seed: int = 0) -> dict[str, Any]:
    """Time every way of `x[m, k] @ dequant(W)ᵀ` for one weight, check fuel against torch, assemble the record."""
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
        dequantiser, traw = wt["torch"]

        def build() -> fl.Tensor:
            return fl.ops.qmatmul(xt, words, qtype, k, n)

        jitted = fl.jit(lambda a: fl.ops.qmatmul(a, words, qtype, k, n))

        def torch_deq_mm() -> Any:
            return tx @ dequantiser(traw).T

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
        "bnb_bytes_identical": wt.get("bnb_bytes_identical"),
        "torch_dequant_bit_exact": wt.get("torch_dequant_bit_exact"), "skipped": None,
    }
    set_roofline(record, limits)
    return record


def set_roofline(record: dict[str, Any], limits: dict[str, float]) -> None:
    """Set a timed record's roofline floor and fractions (reported, never judged) for the machine's `limits`
    (the harness sets them again at the end with the largest bandwidth it probed)."""
    m, ms = record["m"], record["ms"]
    roof_ms = floor_ms(record["weight_bytes"], record["flops"] if m > 1 else 0, limits)
    record.update({"roofline_ms": roof_ms, "roofline_fraction": roof_ms / ms[record["roofline_way"]],
                   "roofline_fraction_full_flush": roof_ms / record["fuel_ms"]})


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
            "meets_ratio_target": None, "impls": [], "torch_dequant_bit_exact": None,
            "correctness": None, "skipped": reason}
