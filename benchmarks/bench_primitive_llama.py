"""The primitive-written Llama's training step against the hand-fused `fuel.nn.Llama`'s.

tests/models/primitive_llama.py spells every op from primitives (matmul attention with a `where` mask and an
exp/sum softmax, `x·rsqrt(mean(x²)+eps)`, rotate-half by slicing, log-softmax + gather); the fuse pass is meant to
turn them into the same fused kernels the hand-fused model calls, so its step should cost the same. Both models
start from one state dict and each trains with its own AdamW (`opt.compile(model.loss)`: forward, backward and
update as one replay) on the same batches; the rounds interleave the two steps, and each model's median over the
rounds is reported with the ratio primitive / hand-fused, as JSON. The kernel counts of each model's eager plan
(`fuel.trace()` over a realised loss and gradient) are reported with them, to show what ran.

    python -m benchmarks.bench_primitive_llama [--out DIR] [--rounds 30] [--shapes stories260k nanogpt]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_train import SHAPES
from benchmarks.timing import timed_ms

THREADS = 2
DEFAULT_SHAPES = ("stories260k", "nanogpt")
WARMUP = 2  # untimed steps: the capture and the first replay


def kernel_counts(model: Any, x: np.ndarray, y: np.ndarray) -> dict[str, int]:
    """How often each fused entry, MATMUL and CROSS_ENTROPY_GRAD ran in the eager loss-and-gradient plan."""
    import fuel as fl
    from fuel.nn import get_parameters

    grads = fl.grad(model.loss(x, y), get_parameters(model))
    with fl.trace() as t:
        fl.realize(*grads)
    out: Counter[str] = Counter()
    for r in t.records:
        for impl in r.impl.split(" + "):
            name = impl.split("[")[0]
            if not name.startswith("prim:") or name in ("prim:matmul", "prim:cross_entropy_grad"):
                out[name] += 1
    return dict(sorted(out.items()))


def measure(shape: str, rounds: int) -> dict[str, Any]:
    from tests.models.primitive_llama import PrimitiveLlama

    import fuel as fl
    from fuel.nn import get_parameters, get_state_dict, load_state_dict
    from fuel.nn.llama import Llama, LlamaConfig
    from fuel.optim import AdamW

    fields, b, t, _ = SHAPES[shape]
    cfg = LlamaConfig(max_seq_len=max(t, 256), **fields)
    prim = PrimitiveLlama(cfg, seed=0)
    fused = Llama(cfg, seed=1)
    load_state_dict(fused, {k: v.numpy() for k, v in get_state_dict(prim).items()})
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(b, t + 1), dtype=np.int64)
    x, y = np.ascontiguousarray(ids[:, :-1]), np.ascontiguousarray(ids[:, 1:])
    kernels = {"primitive": kernel_counts(prim, x, y), "hand_fused": kernel_counts(fused, x, y)}

    fl.set_num_threads(THREADS)
    steps = {name: AdamW(get_parameters(m), lr=1e-4, weight_decay=0.1).compile(m.loss)
             for name, m in (("primitive", prim), ("hand_fused", fused))}
    first = {name: step(x, y) for name, step in steps.items()}
    ms, timed = timed_ms({name: partial(step, x, y) for name, step in steps.items()}, rounds,
                         budget_s=120.0, warmup=WARMUP, collect=True)
    return {"config": {**fields, "batch": b, "seq": t}, "threads": THREADS, "rounds": timed,
            "step_ms": ms, "primitive_over_hand_fused": ms["primitive"] / ms["hand_fused"],
            "first_loss": first, "kernels": kernels, "same_kernels": kernels["primitive"] == kernels["hand_fused"]}


def main(out_dir: str, rounds: int = 30, shapes: tuple[str, ...] = DEFAULT_SHAPES) -> int:
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        print(f"bench_primitive_llama: unknown shape(s) {unknown}; known: {sorted(SHAPES)}")
        return 2
    report: dict[str, Any] = {"machine": platform.machine(), "python": platform.python_version(),
                              "shapes": {s: measure(s, rounds) for s in shapes}}
    for s, r in report["shapes"].items():
        ms = r["step_ms"]
        print(f"{s:12} primitive {ms['primitive']:9.2f} ms  hand-fused {ms['hand_fused']:9.2f} ms  "
              f"ratio {r['primitive_over_hand_fused']:.3f}  same kernels {r['same_kernels']}  ({r['rounds']} rounds)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "primitive_llama.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
    args = ap.parse_args()
    sys.exit(main(args.out, args.rounds, tuple(args.shapes)))
