"""Interleaved timing shared by the benchmarks: each round runs every way once, so a slow patch of the
machine lands on all of them."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any


def timed_ms(fns: dict[str, Callable[[], Any]], repeat: int, budget_s: float = 60.0,
             before: Callable[[str], None] | None = None, *, warmup: int = 1, calls: int = 1,
             collect: bool = False) -> tuple[dict[str, float], int]:
    """(median ms per call of each fn, rounds timed). Each round runs every fn once (`calls` times in a
    row, timed together and divided), each after an untimed `before(name)` when given (a cache flush).
    `warmup` untimed rounds first; the last one also sizes the run: at most `repeat` rounds, fewer (but at
    least 3) when `repeat` rounds would take longer than `budget_s`. With `collect`, as `timeit` does, the
    cyclic garbage collector runs before each fn and is off while it is timed, so one fn's garbage (fuel
    eager's graph of hundreds of nodes) is not collected on the next fn's clock."""
    round_s = 0.0
    for _ in range(max(1, warmup)):
        start = time.perf_counter()
        for fn in fns.values():
            fn()
        round_s = time.perf_counter() - start
    rounds = max(1, min(repeat, max(3, int(budget_s / max(round_s * calls, 1e-9)))))
    times: dict[str, list[float]] = {k: [] for k in fns}
    enabled = gc.isenabled()
    try:
        for _ in range(rounds):
            for name, fn in fns.items():
                if before is not None:
                    before(name)
                if collect:
                    gc.collect()
                    gc.disable()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[name].append((time.perf_counter() - t0) / calls)
                if collect and enabled:
                    gc.enable()
    finally:
        if enabled:
            gc.enable()
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}, rounds
