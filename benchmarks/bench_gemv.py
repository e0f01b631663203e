"""The row-invariant gemv (`fuel.cpu.prims.gemv`) against OpenBLAS, and against another checkout's gemv.

Products [M, K] @ [K, N] in f32 at M = 1, 2, 4, 8, 16 and weights 576x576, 576x1536, 2048x2048 and
4096x4096, at 1 and 2 threads (`fl.set_num_threads`, which sets OpenBLAS's count too). Ways:
- `fuel`: `gemv.gemv` of this checkout;
- `old`: with `--old SRC`, the `cpu/prims/gemv.py` of another checkout's `src` (`git worktree` or clone at
  an earlier commit), loaded beside this one, so both run in one process;
- `blas`: `np.matmul(a, b, out=out)`, OpenBLAS at the same thread count.
Every round runs each way once (`calls` products, timed together), the ways interleaved and each first in
turn, so a slow patch of the shared machine lands on all of them; after BLAS the round waits until its idle
threads stop spinning (they would take a core from the next way). The table gives each way's median over
the rounds and the spread (lowest-highest round). The weights are cold unless `--warm`: each call takes the
next of enough copies of the weight to pass `COLD_BYTES`, as a decode step's products each stream a weight
the last one evicted.
`old`'s bytes are checked equal to `fuel`'s (the kernel's contract: the same arithmetic at any M).
Run from the checkout: `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m benchmarks.bench_gemv
--old /tmp/gemv_old/src`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

import fuel as fl
from fuel.cpu.prims import gemv as fuel_gemv

ROWS = (1, 2, 4, 8, 16)
SIZES = ((576, 576), (576, 1536), (2048, 2048), (4096, 4096))
COLD_BYTES = 96 << 20  # more than the last-level cache of the machines measured (32 MiB)
ROUND_SECONDS = 0.02  # each way's share of a round, at least
BLAS_SPIN_SECONDS = 0.2  # OpenBLAS's idle threads spin this long after a product, holding the cores


def load_old(src: str) -> ModuleType:
    """The gemv module of the checkout whose `src` directory is `src`, under the name `gemv_old`."""
    path = Path(src) / "fuel" / "cpu" / "prims" / "gemv.py"
    spec = importlib.util.spec_from_file_location("gemv_old", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"bench_gemv: no gemv module at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gemv_old"] = module  # Numba's cache finds its functions' module by name
    spec.loader.exec_module(module)
    return module


def ways(old: ModuleType | None) -> dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray], Any]]:
    found: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray], Any]] = {"fuel": fuel_gemv.gemv}
    if old is not None:
        found["old"] = old.gemv
    found["blas"] = lambda a, b, out: np.matmul(a, b, out=out)
    return found


def measure(m: int, k: int, n: int, fns: dict[str, Callable[..., Any]], rounds: int, warm: bool,
            rng: np.random.Generator) -> dict[str, list[float]]:
    """Per way, the ms per product of each round."""
    a = rng.standard_normal((m, k)).astype(np.float32)
    copies = 1 if warm else max(2, -(-COLD_BYTES // (4 * k * n)))
    weights = [(rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32) for _ in range(copies)]
    outs = {name: np.empty((m, n), np.float32) for name in fns}
    for name, fn in fns.items():  # compile, fault the pages in, check the bytes
        for w in weights:
            fn(a, w, outs[name])
    if "old" in outs and outs["old"].tobytes() != outs["fuel"].tobytes():
        raise SystemExit(f"bench_gemv: [{m}, {k}] @ [{k}, {n}]: old and new gemv differ")
    start = time.perf_counter()
    fns["fuel"](a, weights[0], outs["fuel"])
    once = max(time.perf_counter() - start, 1e-6)
    calls = max(copies, int(ROUND_SECONDS / once))
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each way first in turn
            fn, out = fns[name], outs[name]
            t0 = time.perf_counter()
            for c in range(calls):
                fn(a, weights[c % copies], out)
            times[name].append((time.perf_counter() - t0) / calls * 1e3)
            if name == "blas":
                time.sleep(BLAS_SPIN_SECONDS)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", help="another checkout's src directory: its gemv joins the comparison")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--sizes", nargs="+", default=[f"{k}x{n}" for k, n in SIZES], help="KxN weights")
    p.add_argument("--warm", action="store_true", help="one weight, in cache after the first call")
    p.add_argument("--json", help="write the rounds' times here")
    args = p.parse_args(argv)
    fns = ways(load_old(args.old) if args.old else None)
    rng = np.random.default_rng(0)
    before = fl.get_num_threads()
    results = []
    names = list(fns)
    print("| threads | product | " + " | ".join(f"{n} ms" for n in names) + " | fuel / blas |")
    print("|---|---|" + "---|" * len(names) + "---|")
    try:
        for threads in args.threads:
            fl.set_num_threads(threads)
            for size in args.sizes:
                k, n = (int(x) for x in size.split("x"))
                for m in args.rows:
                    times = measure(m, k, n, fns, args.rounds, args.warm, rng)
                    med = {name: statistics.median(t) for name, t in times.items()}
                    cells = [f"{med[name]:.3f} ({min(t):.3f}-{max(t):.3f})" for name, t in times.items()]
                    print(f"| {threads} | [{m}, {k}] @ [{k}, {n}] | " + " | ".join(cells)
                          + f" | {med['fuel'] / med['blas']:.2f} |", flush=True)
                    results.append({"threads": threads, "m": m, "k": k, "n": n, "ms": times})
    finally:
        fl.set_num_threads(before)
    if args.json:
        Path(args.json).write_text(json.dumps({"warm": args.warm, "results": results}, indent=1))


if __name__ == "__main__":
    main()
