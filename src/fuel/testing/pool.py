"""Helpers for tests of the spinning pool (`fuel.runtime.pool`): waiting for its workers' state."""

from __future__ import annotations

import time

from fuel.runtime import pool


def awake_when(workers: pool.SpinPool, awake: int, seconds: float = 2.0, worker: int = 0) -> int:
    """The worker's AWAKE flag once it reads `awake` (1 spinning, 0 asleep), or after `seconds`: a parked
    worker goes to sleep when the scheduler next runs it, which a busy host may put off for milliseconds."""
    deadline = time.monotonic() + seconds
    while workers.ctl[pool.AWAKE + worker] != awake and time.monotonic() < deadline:
        time.sleep(1e-4)
    return int(workers.ctl[pool.AWAKE + worker])
