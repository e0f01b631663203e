"""Mamba scans and fused cross-entropy against PyTorch eager, side by side in one process.

Cases (f32, 2 threads each side):
1. selective_scan: Mamba-1, u/delta [2, 1024, 1536], a [1536, 16], b/c [2, 1024, 16], delta_softplus,
   against the reference recurrence written in torch (mamba's `selective_scan_ref`: one Python step per
   token, which is what runs where the CUDA kernel does not); forward, and forward + backward (the
   gradient of every input; torch through autograd of the loop with each step's tensors made inside
   it, since autograd through the reference's up-front [B, L, dim, N] tensors takes minutes).
2. ssd_chunk_scan: Mamba-2, x [1, 2048, 24, 64], dt [1, 2048, 24], a [24], b/c [1, 2048, 24, 128],
   chunk 64, against `ssd_minimal_discrete` written in torch (the chunked einsum form from mamba_ssm: the
   stronger torch peer; the step-per-token loop is far slower).
3. cross_entropy: logits [4096, 32000], targets with some ignored, mean, against `F.cross_entropy`:
   forward, and forward + backward (the logits' gradient).
Ways: fuel (graph built and realised each call), fuel_jit (`fl.jit`, arrays in), torch_eager. Every way
of a case runs interleaved (medians), and the load average is recorded.
Roofline (forward cases): the larger of the fuel impl's own cost as bytes over the measured copy bandwidth
and flops over the measured sgemm peak, over fuel's best time. Backward cases run a gradient primitive
with no cost model of its own, so they report none.
Target: every fuel / torch ratio <= 1.0. Correctness: each fuel way against torch with f32 tolerances.
Run it through `fuel bench --scans` or, from the checkout, `python -m benchmarks.bench_scans`.
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
from benchmarks.bench_conv import plot
from benchmarks.bench_ops import blas_info, machine_limits
from fuel.graph.node import Op

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

THREADS = 2
FUEL_WAYS = ("fuel", "fuel_jit")
TARGET = 1.0


@dataclass(frozen=True)
class Sizes:
    """Every size the cases use; `Sizes.tiny()` runs the whole harness in seconds."""

    batch: int = 2
    seq: int = 1024
    dim: int = 1536
    state: int = 16
    ssd_batch: int = 1
    ssd_seq: int = 2048
    heads: int = 24
    head_dim: int = 64
    ssd_state: int = 128
    chunk: int = 64
    rows: int = 4096
    vocab: int = 32000

    @staticmethod
    def tiny() -> Sizes:
        return Sizes(batch=2, seq=16, dim=8, state=4, ssd_batch=1, ssd_seq=16, heads=2, head_dim=4, ssd_state=8,
                     chunk=8, rows=8, vocab=50)


# ---- torch peers ----------------------------------------------------------------------------------

def torch_selective_scan(u: Any, delta: Any, a: Any, b: Any, c: Any) -> tuple[Any, Any]:
    """mamba's selective_scan_ref in fuel's layout ([B, L, dim]; b, c [B, L, N]), softplus on delta: the
    decay and drive of every step made up front ([B, L, dim, N] each), then one state update per step."""
    import torch
    import torch.nn.functional as F

    d = F.softplus(delta)
    decay = torch.exp(d.unsqueeze(-1) * a)                       # [B, L, dim, N]
    drive = (d * u).unsqueeze(-1) * b.unsqueeze(2)               # [B, L, dim, N]
    h = u.new_zeros(u.shape[0], u.shape[2], a.shape[1])
    ys = []
    for t in range(u.shape[1]):
        h = decay[:, t] * h + drive[:, t]
        ys.append(torch.einsum("bdn,bn->bd", h, c[:, t]))
    return torch.stack(ys, dim=1), h


def torch_selective_scan_stepwise(u: Any, delta: Any, a: Any, b: Any, c: Any) -> tuple[Any, Any]:
    """The same recurrence with each step's decay and drive made inside the loop. Autograd through the
    up-front form scatters every step's slice gradient into a full [B, L, dim, N] tensor (minutes per
    backward here); this form keeps each step's tensors [B, dim, N], the fairer peer for a backward."""
    import torch
    import torch.nn.functional as F

    d = F.softplus(delta)
    du = d * u
    h = u.new_zeros(u.shape[0], u.shape[2], a.shape[1])
    ys = []
    for t in range(u.shape[1]):
        h = torch.exp(d[:, t].unsqueeze(-1) * a) * h + du[:, t].unsqueeze(-1) * b[:, t].unsqueeze(1)
        ys.append(torch.einsum("bdn,bn->bd", h, c[:, t]))
    return torch.stack(ys, dim=1), h


def _segsum(x: Any) -> Any:
    """segsum(x)[..., i, j] = Σ_{j < k <= i} x[..., k] below the diagonal, −inf above it."""
    import torch

    t = x.shape[-1]
    x = x.unsqueeze(-1).expand(*x.shape, t)
    x = x.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool), diagonal=-1), 0)
    s = torch.cumsum(x, dim=-2)
    return s.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool), diagonal=0), -torch.inf)


def torch_ssd(x: Any, dt: Any, a: Any, b: Any, c: Any, chunk: int) -> tuple[Any, Any]:
    """mamba_ssm's ssd_minimal_discrete(x·dt, a·dt, b, c, chunk): per-chunk einsums plus state passing."""
    import torch
    import torch.nn.functional as F

    bsz, seq, heads, p = x.shape
    n = b.shape[-1]
    nc = seq // chunk
    xs = (x * dt.unsqueeze(-1)).reshape(bsz, nc, chunk, heads, p)
    bs, cs = b.reshape(bsz, nc, chunk, heads, n), c.reshape(bsz, nc, chunk, heads, n)
    da = (dt * a).reshape(bsz, nc, chunk, heads).permute(0, 3, 1, 2)      # [B, H, nc, chunk]
    cum = torch.cumsum(da, dim=-1)
    decay = torch.exp(_segsum(da))
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", cs, bs, decay, xs)
    to_end = torch.exp(cum[..., -1:] - cum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", bs, to_end, xs)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    chunk_decay = torch.exp(_segsum(F.pad(cum[..., -1], (1, 0))))
    passed = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)
    states, final = passed[:, :-1], passed[:, -1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", cs, states, torch.exp(cum))
    return (y_diag + y_off).reshape(bsz, seq, heads, p), final


# ---- cases ----------------------------------------------------------------------------------------

Case = tuple[str, str, Callable[[np.random.Generator], list[np.ndarray]], Callable[..., Any], Callable[..., Any],
             tuple[float, float], bool]


def _scan_inputs(sz: Sizes, rng: np.random.Generator) -> list[np.ndarray]:
    b, seq, dim, n = sz.batch, sz.seq, sz.dim, sz.state
    f = np.float32
    a = -np.broadcast_to(np.arange(1, n + 1, dtype=f), (dim, n)).copy()   # Mamba-1's init: a = −(1..N)
    delta = np.log(np.expm1(rng.uniform(1e-3, 1e-1, (b, seq, dim)))).astype(f)  # softplus(delta) in [1e-3, 0.1]
    return [rng.standard_normal((b, seq, dim), dtype=f), delta, a, rng.standard_normal((b, seq, n), dtype=f),
            rng.standard_normal((b, seq, n), dtype=f)]


def _ssd_inputs(sz: Sizes, rng: np.random.Generator) -> list[np.ndarray]:
    b, seq, h, p, n = sz.ssd_batch, sz.ssd_seq, sz.heads, sz.head_dim, sz.ssd_state
    f = np.float32
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), (b, seq, h))).astype(f)
    return [rng.standard_normal((b, seq, h, p), dtype=f), dt, -rng.uniform(1, 16, h).astype(f),
            rng.standard_normal((b, seq, h, n), dtype=f), rng.standard_normal((b, seq, h, n), dtype=f)]


def _ce_inputs(sz: Sizes, rng: np.random.Generator) -> list[np.ndarray]:
    targets = rng.integers(0, sz.vocab, sz.rows).astype(np.int64)
    targets[::16] = -100  # padding positions
    return [rng.standard_normal((sz.rows, sz.vocab), dtype=np.float32) * np.float32(2), targets]


def _scan_grads(u: Any, delta: Any, a: Any, b: Any, c: Any) -> tuple[Any, ...]:
    y, state = fl.ops.selective_scan(u, delta, a, b, c, delta_softplus=True)
    loss = y.sum() + state.sum()
    return (y, *fl.grad(loss, [u, delta, a, b, c]))


def _torch_scan_grads(u: Any, delta: Any, a: Any, b: Any, c: Any) -> tuple[Any, ...]:
    import torch

    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (u, delta, a, b, c)]
        y, state = torch_selective_scan_stepwise(*leaves)
        grads = torch.autograd.grad(y.sum() + state.sum(), leaves)
    return (y.detach(), *grads)


def _ce_grad(logits: Any, targets: Any) -> tuple[Any, Any]:
    loss = fl.ops.fused_softmax_cross_entropy(logits, targets)
    return loss, fl.grad(loss, [logits])[0]


def _torch_ce_grad(logits: Any, targets: Any) -> tuple[Any, Any]:
    import torch
    import torch.nn.functional as F

    with torch.enable_grad():
        leaf = logits.detach().requires_grad_()
        loss = F.cross_entropy(leaf, targets)
        (g,) = torch.autograd.grad(loss, [leaf])
    return loss.detach(), g


def cases(sz: Sizes) -> list[Case]:
    import torch.nn.functional as F

    scan_shape = f"u[{sz.batch},{sz.seq},{sz.dim}] N {sz.state}"
    ssd_shape = f"x[{sz.ssd_batch},{sz.ssd_seq},{sz.heads},{sz.head_dim}] N {sz.ssd_state} chunk {sz.chunk}"
    ce_shape = f"logits[{sz.rows},{sz.vocab}]"
    scan_tol = (1e-4, 1e-4)  # torch's f32 state against fuel's f64 one
    return [
        ("selective_scan", scan_shape, lambda rng: _scan_inputs(sz, rng),
         lambda u, d, a, b, c: fl.ops.selective_scan(u, d, a, b, c, delta_softplus=True),
         torch_selective_scan, scan_tol, False),
        ("selective_scan_backward", scan_shape, lambda rng: _scan_inputs(sz, rng), _scan_grads, _torch_scan_grads,
         (1e-3, 1e-3), True),
        ("ssd_chunk_scan", ssd_shape, lambda rng: _ssd_inputs(sz, rng),
         lambda x, dt, a, b, c: fl.ops.ssd_chunk_scan(x, dt, a, b, c, sz.chunk),
         lambda x, dt, a, b, c: torch_ssd(x, dt, a, b, c, sz.chunk), (1e-3, 1e-3), False),
        # decode sizes: one token through the scan, one row of a vocabulary
        ("selective_scan_one_token", f"u[1,1,{sz.dim}] N {sz.state}",
         lambda rng: _scan_inputs(dataclasses.replace(sz, batch=1, seq=1), rng),
         lambda u, d, a, b, c: fl.ops.selective_scan(u, d, a, b, c, delta_softplus=True),
         torch_selective_scan, scan_tol, False),
        ("cross_entropy_one_row", f"logits[1,{sz.vocab}]",
         lambda rng: _ce_inputs(dataclasses.replace(sz, rows=1), rng)[:1] + [np.array([3], np.int64)],
         lambda lg, t: fl.ops.fused_softmax_cross_entropy(lg, t), lambda lg, t: F.cross_entropy(lg, t),
         (1e-5, 1e-6), False),
        ("cross_entropy", ce_shape, lambda rng: _ce_inputs(sz, rng),
         lambda lg, t: fl.ops.fused_softmax_cross_entropy(lg, t), lambda lg, t: F.cross_entropy(lg, t),
         (1e-5, 1e-6), False),
        ("cross_entropy_backward", ce_shape, lambda rng: _ce_inputs(sz, rng), _ce_grad, _torch_ce_grad,
         (1e-5, 1e-9), True),
    ]


def _outputs(result: Any) -> list[Any]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _impl_cost(build: Callable[[], Any], limits: dict[str, float]) -> tuple[str | None, int, int, float | None]:
    """(impl name, flops, bytes, roofline ms) of the fused step realising `build()` runs."""
    with fl.trace() as t:
        fl.realize(*_outputs(build()))
    by_name = {i.name: i for i in fl.kernels()}
    rec = next((r for r in t.records if r.impl in by_name), None)
    if rec is None:
        return None, 0, 0, None
    impl = by_name[rec.impl]
    node = _outputs(build())[0].node
    fused = node.inputs[0] if node.op is Op.VIEW else node
    cost = impl.cost([*(i.shape for i in fused.inputs), fused.shape], [*(i.dtype for i in fused.inputs), fused.dtype],
                     fused.arg[1])
    roof = max(cost.bytes_moved / (limits["bandwidth_gbs"] * 1e6), cost.flops / (limits["gemm_gflops"] * 1e6))
    return impl.name, cost.flops, cost.bytes_moved, roof


def run_case(case: Case, rng: np.random.Generator, repeat: int, limits: dict[str, float]) -> dict[str, Any]:
    import torch

    name, label, make, fuel_fn, torch_fn, tol, backward = case
    arrays = make(rng)
    leaves = [fl.tensor(a) for a in arrays]
    jitted = fl.jit(fuel_fn)
    tensors = [torch.from_numpy(a) for a in arrays]

    def fuel_eager() -> list[Any]:
        return [t.numpy() for t in fl.realize(*_outputs(fuel_fn(*leaves)))]

    def fuel_jit() -> list[Any]:
        return [t.numpy() for t in _outputs(jitted(*arrays))]

    def torch_eager() -> list[Any]:
        with torch.inference_mode(not backward):
            return [t.detach().numpy() for t in _outputs(torch_fn(*tensors))]

    want = torch_eager()
    correctness = {"fuel": compare(want, fuel_eager(), *tol), "fuel_jit": compare(want, fuel_jit(), *tol)}
    ms, rounds = timed_ms({"fuel": fuel_eager, "fuel_jit": fuel_jit, "torch_eager": torch_eager}, repeat)
    best = min(FUEL_WAYS, key=lambda w: ms[w])
    impl, flops, moved, roof = (None, 0, 0, None) if backward else _impl_cost(lambda: fuel_fn(*leaves), limits)
    ratio = ms[best] / ms["torch_eager"]
    return {"case": name, "shape": label, "dtype": "f32", "ms": ms, "rounds": rounds, "fuel_best_way": best,
            "fuel_ms": ms[best], "torch_ms": ms["torch_eager"], "fuel_over_torch": ratio, "target": TARGET,
            "meets_target": ratio <= TARGET, "impl": impl, "flops": flops, "bytes": moved, "roofline_ms": roof,
            "roofline_fraction": None if roof is None else roof / ms[best], "correctness": correctness}


def main(out_dir: str, repeat: int, sizes: Sizes | None = None, limits: dict[str, float] | None = None) -> int:
    """Run every case, print the table, write scans.json and scans.png in `out_dir`."""
    import torch

    sz = sizes or Sizes()
    torch.set_num_threads(THREADS)
    fl.set_num_threads(THREADS)
    limits = limits or machine_limits()
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "threads": THREADS, "blas": blas_info(),
            "torch": torch.__version__, "repeat": repeat, "limits": limits, "sizes": dataclasses.asdict(sz),
            "loadavg_start": os.getloadavg()}
    print(f"scans: {THREADS} threads, repeat {repeat}, BLAS {blas_info()}", flush=True)
    results: list[dict[str, Any]] = []
    rng = np.random.default_rng(0)
    for case in cases(sz):
        r = run_case(case, rng, repeat, limits)
        results.append(r)
        bad = [w for w, c in r["correctness"].items() if not c["ok"]]
        roof = f"{r['roofline_fraction']:.3f}" if r["roofline_fraction"] is not None else "n/a"
        print(f"  {r['case']:24} fuel {r['ms']['fuel']:9.2f} | jit {r['ms']['fuel_jit']:9.2f} | torch "
              f"{r['torch_ms']:9.2f} ms | fuel/torch {r['fuel_over_torch']:.3f} (target <= {TARGET}) | roofline {roof}"
              + (f" | DISAGREES with torch: {bad}" if bad else ""), flush=True)
        (folder / "scans.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    meta["loadavg_end"] = os.getloadavg()
    (folder / "scans.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    plot(results, folder / "scans.png", "Fuel scans and cross-entropy vs PyTorch eager, this CPU")
    print("\n| case | shape | fuel ms | fuel jit ms | torch ms | fuel/torch | roofline |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        roof = f"{r['roofline_fraction']:.3f}" if r["roofline_fraction"] is not None else "n/a"
        print(f"| {r['case']} | {r['shape']} | {r['ms']['fuel']:.2f} | {r['ms']['fuel_jit']:.2f} | "
              f"{r['torch_ms']:.2f} | {r['fuel_over_torch']:.3f} | {roof} |")
    print(f"load average at start {meta['loadavg_start']}, at end {meta['loadavg_end']}")
    print(f"wrote {folder / 'scans.json'} and {folder / 'scans.png'}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results", help="folder for scans.json and scans.png")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per way (median reported)")
    args = parser.parse_args()
    raise SystemExit(main(args.out, max(1, args.repeat)))

