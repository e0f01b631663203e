"""Interleaved timing shared by the op benchmarks: each round runs every way once, so a slow patch of the
machine lands on all of them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def timed_ms(fns: dict[str, Callable[[], Any]], repeat: int, budget_s: float = 60.0,
             before: Callable[[str], None] | None = None) -> tuple[dict[str, float], int]:
    """(median ms per call of each fn, rounds timed). Each round runs every fn once, each after an untimed
    `before(name)` when given (a cache flush). One warm-up round first; it also sizes the run: at most
    `repeat` rounds, fewer (but at least 3) when `repeat` rounds would take longer than `budget_s`."""
    start = time.perf_counter()
    for fn in fns.values():
        fn()
    round_s = time.perf_counter() - start
    rounds = max(1, min(repeat, max(3, int(budget_s / max(round_s, 1e-9)))))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if before is not None:
                before(name)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}, rounds
