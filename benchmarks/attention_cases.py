"""The attention cases, each fuel against PyTorch: forward, backward, decode, paged decode, and the peak
memory of a long causal forward.

Cases (f32; the forward in bf16 too when a bf16 FlashAttn kernel is registered):
1. forward: B1 H16 S1024 D64 causal. fuel (build + realize each call, and through `fl.jit`) against
   `F.scaled_dot_product_attention(is_causal=True)` eager and torch.compile'd (for Sq == Sk top-left
   and bottom-right causal agree).
2. backward of the same: fuel's dq, dk, dv in one realize against torch autograd of SDPA, torch's
   backward alone (`torch.autograd.grad(out, (q, k, v), g, retain_graph=True)` on a kept forward).
3. decode: Sq 1, Hq 32 over Hkv 8 (GQA), D 64, k_len 2048 live of a [1, 8, 4096, 64] capacity cache:
   fuel with `k_len=fl.dyn("k_len")` against torch SDPA on `k[:, :, :2048]` with `enable_gqa=True`.
4. paged decode: B4, Hq 32, Hkv 8, D 64, block_size 16, 2048 tokens each through a shuffled block
   table: fuel's paged_attn against torch SDPA on the dense cache gathered beforehand (the gather is
   excluded from torch's time; it is reported on its own).
5. long-sequence memory: S 16384, D 64, B1, H1 and H2, causal, f32, each in a fresh subprocess: peak
   RSS (VmHWM after a reset, see `memory_child`) minus the RSS once the inputs are allocated, next to
   the score matrix one head would need (S^2 * 4 bytes = 1 GiB). Only run when a FlashAttn CPU kernel
   for f32 is registered (the primitive decomposition materialises the score matrix).
Each timed case hands attention_harness its analytic counts, the roofline's fallback without a fused
kernel (the causal forward's flops: 2*2*B*H*S^2*D/2).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import fuel as fl
from benchmarks.attention_harness import (
    THREADS,
    case_record,
    compare,
    fused_impls,
    has_impl,
    impl_cost,
    randn,
    skipped,
    timed_ms,
    to_torch,
    tolerance,
    torch_compiled,
)
from fuel.dtype import DType, as_dtype
from fuel.graph.registry import FusedOps

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- timed

def case_forward(limits: dict[str, float], repeat: int, compile_torch: bool = True, *, batch: int = 1,
                 heads: int = 16, seq: int = 1024, head_dim: int = 64, dtype: str = "f32") -> dict[str, Any]:
    """Causal self-attention forward: fuel (build + realize, and jit) vs torch SDPA eager and compiled."""
    import torch
    import torch.nn.functional as F

    dt = as_dtype(dtype)
    label = f"B{batch} H{heads} S{seq} D{head_dim} causal"
    if dt is not DType.F32 and not has_impl(FusedOps.FLASH_ATTN, dt):
        return skipped("forward", label, dt, f"no FlashAttn CPU kernel for {dt.value} (the decomposition would "
                                             f"only time primitives in {dt.value})")
    rng = np.random.default_rng(0)
    shape = (batch, heads, seq, head_dim)
    arrays = [randn(rng, shape, dt) for _ in range(3)]
    tensors = [fl.tensor(a) for a in arrays]
    tq = [to_torch(a, dt) for a in arrays]
    notes: list[str] = []

    def build() -> list[fl.Tensor]:
        return [fl.ops.flash_attn(tensors[0], tensors[1], tensors[2], causal=True)]

    jitted = fl.jit(lambda q, k, v: fl.ops.flash_attn(q, k, v, causal=True))

    def sdpa(q: Any, k: Any, v: Any) -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def torch_eager() -> Any:
        with torch.inference_mode():
            return sdpa(*tq)

    want = torch_eager()
    correctness = {"fuel": compare([want], build(), *tolerance(dt)),
                   "fuel_jit": compare([want], [jitted(*arrays)], *tolerance(dt))}
    fns: dict[str, Callable[[], Any]] = {"fuel": lambda: fl.realize(*build()), "fuel_jit": lambda: jitted(*arrays),
                                         "torch_eager": torch_eager}
    if compile_torch:
        call = torch_compiled(sdpa, tuple(tq), notes)
        if call is not None:
            fns["torch_compile"] = call
    impls = fused_impls(build, (FusedOps.FLASH_ATTN,))
    out = build()[0]
    cost = impl_cost(impls[0], [shape, shape, shape, shape], out.node.arg[1]) if impls else None
    n = batch * heads * seq * seq * head_dim
    analytic = (2 * 2 * n // 2, dt.np.itemsize * 4 * batch * heads * seq * head_dim)
    if not impls:
        notes.append("no fused kernel ran: fuel timed its primitive decomposition")
    return case_record("forward", label, dt, fns, repeat, limits, analytic, cost, impls, correctness, notes)


def case_backward(limits: dict[str, float], repeat: int, compile_torch: bool = True, *, batch: int = 1,
                  heads: int = 16, seq: int = 1024, head_dim: int = 64) -> dict[str, Any]:
    """dq, dk, dv of causal attention: fuel's three grads in one realize vs torch autograd's backward."""
    import torch
    import torch.nn.functional as F

    dt = DType.F32
    label = f"B{batch} H{heads} S{seq} D{head_dim} causal"
    rng = np.random.default_rng(1)
    shape = (batch, heads, seq, head_dim)
    arrays = [randn(rng, shape, dt) for _ in range(4)]  # q, k, v and the upstream gradient
    tensors = [fl.tensor(a) for a in arrays]
    notes = ["torch: the backward alone (autograd.grad on a kept forward, retain_graph=True); "
             "fuel: dq, dk, dv realised together from q, k, v, dO (fuel recomputes the softmax)"]

    def grads(q: fl.Tensor, k: fl.Tensor, v: fl.Tensor, g: fl.Tensor) -> list[fl.Tensor]:
        return fl.grad(fl.ops.flash_attn(q, k, v, causal=True), [q, k, v], grad_out=g)

    def build() -> list[fl.Tensor]:
        return grads(*tensors)

    jitted = fl.jit(grads)
    tq, tk, tv = (to_torch(a, dt, requires_grad=True) for a in arrays[:3])
    tg = to_torch(arrays[3], dt)
    out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

    def torch_backward() -> Any:
        return torch.autograd.grad(out, (tq, tk, tv), tg, retain_graph=True)

    want = list(torch_backward())
    tol = tolerance(dt, backward=True)
    correctness = {"fuel": compare(want, list(fl.realize(*build())), *tol),
                   "fuel_jit": compare(want, list(jitted(*arrays)), *tol)}
    fns: dict[str, Callable[[], Any]] = {"fuel": lambda: fl.realize(*build()), "fuel_jit": lambda: jitted(*arrays),
                                         "torch_eager": torch_backward}
    if compile_torch:
        notes.append("torch.compile not timed for the backward")
    impls = fused_impls(build, (FusedOps.FLASH_ATTN_BACKWARD_Q, FusedOps.FLASH_ATTN_BACKWARD_K,
                                FusedOps.FLASH_ATTN_BACKWARD_V))
    cost = None
    if impls:
        node = build()[0].node
        shapes = [shape] * 5  # q, k, v, dO, then the output (each grad has q's shape here)
        costs = [impl_cost(i, shapes, node.arg[1]) for i in impls]
        # The CPU kernel computes dq, dk and dv in one pass for the three entries: one impl's estimate is
        # the pass when they agree; take the largest so a per-entry estimate is not counted three times.
        cost = max(costs)
        notes.append(f"impl cost: the largest of {len(costs)} backward impl estimates {costs}")
    n = batch * heads * seq * seq * head_dim
    # Five S x S x D products (s, dP, dV, dQ, dK), half of each masked: 5 * 2 * n / 2.
    analytic = (5 * n, dt.np.itemsize * 7 * batch * heads * seq * head_dim)
    if not impls:
        notes.append("no fused kernel ran: fuel timed its primitive decomposition")
    return case_record("backward", label, dt, fns, repeat, limits, analytic, cost, impls, correctness, notes)


def case_decode(limits: dict[str, float], repeat: int, compile_torch: bool = True, *, hq: int = 32, hkv: int = 8,
                capacity: int = 4096, k_len: int = 2048, head_dim: int = 64) -> dict[str, Any]:
    """One query over the first k_len rows of a capacity cache, k_len a DynScalar bound per call."""
    import torch
    import torch.nn.functional as F

    dt = DType.F32
    label = f"Sq1 Hq{hq} Hkv{hkv} D{head_dim} k_len {k_len} of {capacity}"
    rng = np.random.default_rng(2)
    q = randn(rng, (1, hq, 1, head_dim), dt)
    k, v = (randn(rng, (1, hkv, capacity, head_dim), dt) for _ in range(2))
    tensors = [fl.tensor(a) for a in (q, k, v)]
    notes = ["fuel causal=True (bottom-right: the one query sees all k_len keys); torch without a mask "
             "(its is_causal aligns top-left)"]
    kl: Any = fl.dyn("k_len")
    env: dict[str, int] | None = {"k_len": k_len}
    if not has_impl(FusedOps.FLASH_ATTN, dt):
        kl, env = k_len, None
        notes.append("no FlashAttn CPU kernel: a DynScalar k_len has no decomposition, so fuel ran with a "
                     "static k_len (its primitive decomposition)")

    def build() -> list[fl.Tensor]:
        return [fl.ops.flash_attn(tensors[0], tensors[1], tensors[2], causal=True, k_len=kl)]

    jitted = fl.jit(lambda a, b, c: fl.ops.flash_attn(a, b, c, causal=True, k_len=kl))
    env_kw = env or {}
    tq, tk, tv = (to_torch(a, dt) for a in (q, k, v))

    def sdpa(a: Any, b: Any, c: Any) -> Any:
        return F.scaled_dot_product_attention(a, b[:, :, :k_len], c[:, :, :k_len], enable_gqa=True)

    def torch_eager() -> Any:
        with torch.inference_mode():
            return sdpa(tq, tk, tv)

    want = torch_eager()
    tol = tolerance(dt)
    correctness = {"fuel": compare([want], list(fl.realize(*build(), env=env)), *tol),
                   "fuel_jit": compare([want], [jitted(q, k, v, **env_kw)], *tol)}
    fns: dict[str, Callable[[], Any]] = {"fuel": lambda: fl.realize(*build(), env=env),
                                         "fuel_jit": lambda: jitted(q, k, v, **env_kw), "torch_eager": torch_eager}
    if compile_torch:
        call = torch_compiled(sdpa, (tq, tk, tv), notes)
        if call is not None:
            fns["torch_compile"] = call
    impls = fused_impls(build, (FusedOps.FLASH_ATTN,), env)
    node = build()[0].node
    cost = impl_cost(impls[0], [q.shape, k.shape, v.shape, q.shape], node.arg[1], k_len) if impls else None
    analytic = (4 * hq * k_len * head_dim, dt.np.itemsize * (2 * hkv * k_len * head_dim + 2 * hq * head_dim))
    return case_record("decode", label, dt, fns, repeat, limits, analytic, cost, impls, correctness, notes)


def case_paged(limits: dict[str, float], repeat: int, compile_torch: bool = True, *, batch: int = 4, hq: int = 32,
               hkv: int = 8, head_dim: int = 64, block_size: int = 16, context: int = 2048) -> dict[str, Any]:
    """Paged decode through a shuffled block table vs torch SDPA on the dense cache gathered beforehand."""
    import torch
    import torch.nn.functional as F

    dt = DType.F32
    label = f"B{batch} Hq{hq} Hkv{hkv} D{head_dim} bs{block_size} ctx {context}"
    paged = getattr(fl.ops, "paged_attn", None)
    if paged is None:
        return skipped("paged", label, dt, "fl.ops.paged_attn is not available yet")
    rng = np.random.default_rng(3)
    per_seq = -(-context // block_size)
    n_blocks = batch * per_seq
    q = randn(rng, (batch, hq, 1, head_dim), dt)
    k_cache, v_cache = (randn(rng, (n_blocks, block_size, hkv, head_dim), dt) for _ in range(2))
    table = rng.permutation(n_blocks).astype(np.uint32).reshape(batch, per_seq)
    lens = np.full(batch, context, np.uint32)
    inputs = [q, k_cache, v_cache, table, lens]
    tensors = [fl.tensor(a) for a in inputs]
    notes = [f"torch runs on the dense cache gathered beforehand (gather excluded from its time), "
             f"{n_blocks} blocks shuffled"]

    def build() -> list[fl.Tensor]:
        return [paged(*tensors)]

    jitted = fl.jit(lambda *a: paged(*a))

    def gather(cache: Any) -> Any:  # [NB, bs, Hkv, D] -> [B, Hkv, context, D], contiguous
        idx = torch.from_numpy(table.astype(np.int64))
        return cache[idx].reshape(batch, per_seq * block_size, hkv, head_dim)[:, :context].permute(0, 2, 1, 3) \
            .contiguous()

    tq, tkc, tvc = (to_torch(a, dt) for a in (q, k_cache, v_cache))
    with torch.inference_mode():
        dense_k, dense_v = gather(tkc), gather(tvc)

    def sdpa(a: Any, b: Any, c: Any) -> Any:
        return F.scaled_dot_product_attention(a, b, c, enable_gqa=True)

    def torch_eager() -> Any:
        with torch.inference_mode():
            return sdpa(tq, dense_k, dense_v)

    want = torch_eager()
    tol = tolerance(dt)
    correctness = {"fuel": compare([want], build(), *tol), "fuel_jit": compare([want], [jitted(*inputs)], *tol)}
    fns: dict[str, Callable[[], Any]] = {"fuel": lambda: fl.realize(*build()), "fuel_jit": lambda: jitted(*inputs),
                                         "torch_eager": torch_eager}
    if compile_torch:
        call = torch_compiled(sdpa, (tq, dense_k, dense_v), notes)
        if call is not None:
            fns["torch_compile"] = call
    impls = fused_impls(build, (FusedOps.PAGED_ATTN,))
    node = build()[0].node
    shapes = [a.shape for a in inputs] + [q.shape]
    cost = impl_cost(impls[0], shapes, node.arg[1]) if impls else None
    kv_bytes = dt.np.itemsize * batch * (2 * hkv * context * head_dim + 2 * hq * head_dim)
    analytic = (4 * batch * hq * context * head_dim, kv_bytes + table.nbytes + lens.nbytes)
    if not impls:
        notes.append("no fused kernel ran: fuel timed its primitive decomposition")
    r = case_record("paged", label, dt, fns, repeat, limits, analytic, cost, impls, correctness, notes)
    with torch.inference_mode():
        r["torch_gather_ms"] = timed_ms({"gather": lambda: (gather(tkc), gather(tvc))}, repeat)[0]["gather"]
    return r


# ---------------------------------------------------------------------------------------------- memory

def _status_kib(field: str) -> int:
    """A /proc/self/status memory field (VmRSS: resident now, VmHWM: its peak), KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def memory_child(spec: str) -> None:
    """Run in a fresh process: one causal forward of [1, H, S, D] f32 by `way`; prints a JSON line.
    The kernels are loaded (compiled) on a smaller problem first, the inputs allocated, then the peak RSS
    reset to the current RSS (/proc/self/clear_refs); the peak is then VmHWM after the run (the counter
    ru_maxrss reads for this process). ru_maxrss itself is kept in the record but not used when the
    reset worked: a forked child's ru_maxrss starts at its parent's RSS at the fork (the kernel carries
    the old mm's peak across exec), here the whole benchmark process, and clear_refs does not lower it."""
    args = json.loads(spec)
    s, h, d, way = args["seq"], args["heads"], args["head_dim"], args["way"]
    rng = np.random.default_rng(4)
    if way == "fuel":
        def run(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> Any:
            return fl.ops.flash_attn(fl.tensor(q), fl.tensor(k), fl.tensor(v), causal=True).numpy()
    else:
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(THREADS)

        def run(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> Any:
            with torch.inference_mode():
                tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    # Big enough to take the kernel's parallel path too (a tiny problem runs a serial variant), small
    # enough that its score matrix would not matter (4 MiB per head).
    small = rng.standard_normal((1, h, min(s, 1024), d), dtype=np.float32)
    run(small, small, small)
    q, k, v = (rng.standard_normal((1, h, s, d), dtype=np.float32) for _ in range(3))
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
        reset = True
    except OSError:
        reset = False
    base_kib = _status_kib("VmRSS")
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    out = run(q, k, v)
    first_s = time.perf_counter() - start
    maxrss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    hwm_kib = _status_kib("VmHWM")
    peak_kib = hwm_kib if reset else maxrss_kib
    del out
    start = time.perf_counter()
    run(q, k, v)
    second_s = time.perf_counter() - start
    print(json.dumps({"base_kib": base_kib, "maxrss_before_kib": before_kib, "maxrss_kib": maxrss_kib,
                      "hwm_kib": hwm_kib, "peak_kib": peak_kib, "hwm_reset": reset, "first_s": first_s,
                      "second_s": second_s}))


def case_memory(seq: int = 16384, heads: int = 1, head_dim: int = 64, require_kernel: bool = True,
                ways: tuple[str, ...] = ("fuel", "torch"), timeout: float = 600) -> dict[str, Any]:
    """Peak RSS over the RSS with the inputs allocated, for one causal forward per way, each in a fresh
    subprocess, next to the score matrix the decomposition would materialise (S^2 * 4 bytes per head)."""
    label = f"B1 H{heads} S{seq} D{head_dim} causal"
    score_mib = heads * seq * seq * 4 / 2**20
    record: dict[str, Any] = {"case": "memory", "shape": label, "dtype": "f32", "seq": seq, "heads": heads,
                              "score_matrix_mib": score_mib, "output_mib": heads * seq * head_dim * 4 / 2**20,
                              "ways": {}, "skipped": None}
    if require_kernel and not has_impl(FusedOps.FLASH_ATTN, DType.F32):
        record["skipped"] = ("no FlashAttn CPU kernel for f32: the decomposition would materialise the "
                             f"{score_mib:.0f} MiB score matrix")
        print(f"  memory {label}: skipped: {record['skipped']}", flush=True)
        return record
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
            "from benchmarks.attention_cases import memory_child; memory_child(sys.argv[1])")
    for way in ways:
        spec = json.dumps({"seq": seq, "heads": heads, "head_dim": head_dim, "way": way})
        try:
            proc = subprocess.run([sys.executable, "-c", code, spec], capture_output=True, text=True,
                                  timeout=timeout, env=os.environ.copy())
        except subprocess.TimeoutExpired:
            record["ways"][way] = {"error": f"timed out after {timeout:.0f} s"}
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            record["ways"][way] = {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
            continue
        m = json.loads(lines[-1])
        extra_mib = (m["peak_kib"] - m["base_kib"]) / 1024
        m.update({"extra_mib": extra_mib, "extra_over_score_matrix": extra_mib / score_mib,
                  # without a reset, a peak under an earlier high-water mark hides behind it: an upper bound
                  "extra_is_upper_bound": (not m["hwm_reset"]) and m["maxrss_kib"] == m["maxrss_before_kib"]})
        record["ways"][way] = m
    return record
