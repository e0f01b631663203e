"""fuel's spinning pool: every kernel's parts on every core for a few microseconds of synchronisation.

A decode step runs hundreds of kernels of 20-200 µs each, too small for a pool that must be woken through
the operating system or that hands the GIL over (docs/performance/runtime.md, "pool"). Here the workers
wait in GIL-free jitted code, spinning on one shared word, and run a task by calling its compiled address:
a posted job starts on the other cores within a microsecond or so, with no Python on the workers' side.
Every kernel runs this way (`fuel.runtime.jobs`); docs/runtime.md describes the whole runtime.

- A *task* is a Numba C callback `task(part, parts, argv)` (`@pool.task`): it does part `part` of
  `parts` of a job whose arguments it reads from `argv`, the address of its typed record
  (`jobs.record`). Parts are claimed one at a time by whoever is free (the posting thread too) with a
  compare-and-swap, so a busy or sleeping core only means the others take more parts; which thread runs
  a part never changes its bytes, because a part is a fixed slice of the work.
- Workers spin for `SPIN_SECONDS` after their last part and then sleep on an event. The posting
  thread never waits for a sleeping worker: it wakes it and takes parts meanwhile; the worker joins
  when it is up. `park()` sends spinning workers to sleep at once.
- Each worker is pinned to its own core (`worker_cores`), none of them the first allowed one: unpinned, a
  worker woken from sleep was often placed on its waker's core and shared it with the posting thread,
  which spins in its join (docs/performance/runtime.md, "pool"). A posting thread found on a worker's core
  is moved off it (its affinity narrowed for an instant, then restored: no thread's affinity changes).
  `FUEL_SPIN_PIN=0` leaves the workers unpinned.
- One job at a time: a second Python thread that finds the pool busy runs its parts itself, in order.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import carray, cfunc, njit, types

from fuel.runtime import threads
from fuel.runtime.atomics import (
    TASK_ARGS,
    call_task,
    compare_exchange,
    cycles,
    fetch_add,
    load_acquire,
    pause,
    pointer,
    store,
)

SPIN_SECONDS = 0.5e-3  # how long an idle worker spins before it sleeps (a decode step's gaps are shorter)
SPIN_MIN_SECONDS = 12e-6  # work below this (one core's estimate) runs in the calling thread
PARTS_PER_THREAD = 4  # parts of a job per thread: claimed dynamically, so a slow core takes fewer

# The control words. CLAIM holds the job's generation above PART_BITS and the next unclaimed part below.
CLAIM, FN, ARGV, PARTS, DONE, PARK = 0, 1, 2, 3, 4, 5
AWAKE = 8  # AWAKE + w: worker w is spinning (1) or asleep (0)
PART_BITS = 20
UNCLAIMABLE = (1 << PART_BITS) - 1


class Task:
    """`fn(part, parts, argv)` as a GIL-free C callback the pool calls by address, compiled (or loaded from
    Numba's cache) on first use, as `njit` functions are: a module of tasks imports without compiling."""

    def __init__(self, fn: Callable[[int, int, int], None], options: dict[str, Any]) -> None:
        self.fn = fn
        self.options = options
        self._address = 0
        self._lock = threading.Lock()
        self.__name__ = self.__qualname__ = fn.__name__
        self.__doc__ = fn.__doc__

    @property
    def address(self) -> int:
        if not self._address:
            with self._lock:
                if not self._address:
                    self._compiled = cfunc(types.void(*TASK_ARGS), cache=True, **self.options)(self.fn)
                    address = self._compiled.address
                    assert address is not None
                    self._address = address
        return self._address


def task(**options: Any) -> Callable[[Callable[[int, int, int], None]], Task]:
    """Decorate a task `fn(part, parts, argv)`: jitted code (Numba options as for `cfunc`, e.g.
    `fastmath`) that runs with no Python around it."""
    return lambda fn: Task(fn, options)


@njit(nogil=True, cache=True)
def _take_parts(ctl: Any) -> None:
    """Claim and run parts of the posted job until none is left."""
    while True:
        c = load_acquire(ctl, CLAIM)
        parts = load_acquire(ctl, PARTS)
        part = c & UNCLAIMABLE
        if part >= parts:
            return
        fn, argv = load_acquire(ctl, FN), load_acquire(ctl, ARGV)
        if compare_exchange(ctl, CLAIM, c, c + 1):
            call_task(fn, part, parts, argv)
            fetch_add(ctl, DONE, 1)


@njit(nogil=True, cache=True)
def _serve(ctl: Any, me: int, limit: int) -> None:
    """A worker's loop: take parts whenever a job is posted; return (to sleep) after `limit` cycles idle,
    or at once when parked."""
    start = cycles()
    while True:
        c = load_acquire(ctl, CLAIM)
        if (c & UNCLAIMABLE) < load_acquire(ctl, PARTS):
            _take_parts(ctl)
            start = cycles()
        elif load_acquire(ctl, PARK) == 0 and cycles() - start < limit:
            pause()
        else:
            store(ctl, AWAKE + me, 0)
            # A job posted between the check above and this store saw us awake and woke no one: look
            # again (the poster stores the job, then loads AWAKE; we store AWAKE, then load the job).
            if (load_acquire(ctl, CLAIM) & UNCLAIMABLE) < load_acquire(ctl, PARTS):
                store(ctl, AWAKE + me, 1)
                start = cycles()
                continue
            return


@njit(nogil=True, cache=True)
def _post(ctl: Any, fn: int, argv: int, parts: int, workers: int) -> int:
    """Publish a job (the previous one is finished); returns the bit mask of the sleeping workers."""
    gen = (load_acquire(ctl, CLAIM) >> PART_BITS) + 1
    store(ctl, CLAIM, ((gen - 1) << PART_BITS) | UNCLAIMABLE)  # no claim while the fields change
    store(ctl, FN, fn)
    store(ctl, ARGV, argv)
    store(ctl, PARTS, parts)
    store(ctl, DONE, 0)
    store(ctl, PARK, 0)
    store(ctl, CLAIM, gen << PART_BITS)
    sleeping = 0
    for w in range(workers):
        if load_acquire(ctl, AWAKE + w) == 0:
            sleeping |= 1 << w
    return sleeping


@njit(nogil=True, cache=True)
def _join(ctl: Any) -> None:
    """Take parts of the posted job alongside the workers, then wait until every part is done."""
    _take_parts(ctl)
    parts = load_acquire(ctl, PARTS)
    while load_acquire(ctl, DONE) < parts:
        pause()


@njit(nogil=True, cache=True)
def _run_here(fn: int, argv: int, parts: int) -> None:
    for part in range(parts):
        call_task(fn, part, parts, argv)


@njit(nogil=True, cache=True)
def _run_steps(ctl: Any, workers: int, threads_now: int, steps: Any, seconds: Any, patches: Any, env: Any,
               start: int, stop: int) -> tuple[int, int]:
    """Run prepared jobs start..stop-1 in order (`fuel.runtime.replay`): each step's DynScalar values
    stored into its argv, its part count chosen as `parts_for` would, then run here or posted and joined.
    A job that finds workers asleep is left posted and not joined: returns (its step, the mask of the
    sleeping workers), for Python to wake them and then join it (joined first, the job would run on this
    thread alone: docs/performance/runtime.md, "pool"). Else (stop, 0)."""
    for k in range(start, stop):
        fn, argv, most, unit, p0, p1 = steps[k, 0], steps[k, 1], steps[k, 2], steps[k, 3], steps[k, 4], steps[k, 5]
        for p in range(p0, p1):
            carray(pointer(patches[p, 0], np.int64), (patches[p, 1] + 1,))[patches[p, 1]] = env[patches[p, 2]]
        sec = seconds[k]
        if unit >= 0:
            sec *= carray(pointer(argv, np.int64), (unit + 1,))[unit]
        parts = 1 if sec < SPIN_MIN_SECONDS or threads_now <= 1 else min(most, PARTS_PER_THREAD * threads_now)
        if parts <= 1 or workers == 0:
            _run_here(fn, argv, 1)  # a task's bytes never depend on its part count
            continue
        sleeping = _post(ctl, fn, argv, parts, workers)
        if sleeping:
            return k, sleeping
        _join(ctl)
    return stop, 0


@njit(nogil=True, cache=True)
def _set(ctl: Any, i: int, v: int) -> None:
    store(ctl, i, v)


@njit(cache=True)
def address_of(a: Any) -> int:
    """a's data address, jitted: `a.ctypes.data` builds a ctypes object per call (docs/performance/runtime.md,
    "pool")."""
    return a.ctypes.data


@njit(cache=True)
def _now() -> int:
    return cycles()


def _cycles_per_second() -> float:
    c0, t0 = _now(), time.perf_counter()
    time.sleep(0.002)
    return (_now() - c0) / (time.perf_counter() - t0)


def worker_cores(workers: int) -> list[int]:
    """The core each worker is pinned to: the 2nd, 3rd, ... core this process may use; none (no pinning)
    where there are fewer cores than threads, the platform cannot pin, or FUEL_SPIN_PIN=0."""
    if os.environ.get("FUEL_SPIN_PIN", "1") == "0" or not hasattr(os, "sched_setaffinity"):
        return []
    cores = sorted(os.sched_getaffinity(0))
    return cores[1:workers + 1] if workers < len(cores) else []


def _cpu_reader() -> Callable[[], int] | None:
    """libc's sched_getcpu (the caller's current core, through ctypes) where it exists."""
    try:
        fn = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, []
    return fn


class SpinPool:
    """`workers` threads spinning on one control array; `run` posts a job and takes part in it."""

    def __init__(self, workers: int) -> None:
        self.ctl = np.zeros(AWAKE + max(workers, 1), np.int64)
        self.workers = workers
        self.limit = int(SPIN_SECONDS * _cycles_per_second())
        self.lock = threading.Lock()
        self.closed = False
        self.events = [threading.Event() for _ in range(workers)]
        self.cores = worker_cores(workers)
        self.current_cpu = _cpu_reader() if self.cores else None
        # Compile (or load) the workers' jitted loop here: a worker that compiled it itself would wait for
        # the GIL between the caller's Python steps, and miss jobs for up to a second on first use.
        _set(self.ctl, PARK, 0)
        _serve(self.ctl, 0, 0)
        self.threads = [threading.Thread(target=self._loop, args=(w,), name=f"fuel-spin-{w}", daemon=True)
                        for w in range(workers)]
        for t in self.threads:
            t.start()

    def _loop(self, w: int) -> None:
        if self.cores:
            os.sched_setaffinity(0, {self.cores[w]})
        while True:
            self.events[w].wait()
            self.events[w].clear()
            if self.closed:
                return
            _set(self.ctl, AWAKE + w, 1)
            _serve(self.ctl, w, self.limit)

    def run(self, fn: int, argv: int, parts: int) -> None:
        if not self._hold():
            _run_here(fn, argv, parts)
            return
        try:
            self._wake(_post(self.ctl, fn, argv, parts, self.workers))
            _join(self.ctl)
        finally:
            self.lock.release()

    def _hold(self) -> bool:
        """Take the pool for this thread's jobs (release `lock` after them), moving the thread off the
        workers' cores; False, holding nothing, when another thread has it or it is closed: the jobs then
        run in the calling thread."""
        if not self.lock.acquire(blocking=False):
            return False
        if self.closed:
            self.lock.release()
            return False
        if self.current_cpu is not None and self.current_cpu() in self.cores:
            self._step_aside()
        return True

    def _wake(self, sleeping: int) -> None:
        """Wake the workers in the mask `_post` returned."""
        for w in range(self.workers):
            if sleeping >> w & 1:
                self.events[w].set()

    def park(self) -> None:
        _set(self.ctl, PARK, 1)

    def close(self) -> None:
        """End the workers (a pool replaced for a new thread count): parked, then woken to return. A job
        posted after this runs in the posting thread."""
        with self.lock:
            self.closed = True
            self.park()
            for e in self.events:
                e.set()

    def _step_aside(self) -> None:
        """Move the posting thread off a worker's core (it would share it with that worker, spinning in its
        join while the worker waits for the core), keeping its own affinity: Linux migrates a thread when
        its core leaves the mask and does not move it back when the mask is restored."""
        mask = os.sched_getaffinity(0)
        if mask - set(self.cores):
            os.sched_setaffinity(0, mask - set(self.cores))
            os.sched_setaffinity(0, mask)


_POOL: SpinPool | None = None
_POOL_PID = 0
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> SpinPool:
    global _POOL, _POOL_PID
    pid = os.getpid()
    with _POOL_LOCK:
        if _POOL is None or pid != _POOL_PID or _POOL.workers != workers:
            if _POOL is not None and pid == _POOL_PID:
                _POOL.close()
            _POOL, _POOL_PID = SpinPool(workers), pid
        return _POOL


def parts_for(seconds: float, most: int, per_thread: int = PARTS_PER_THREAD) -> int:
    """How many parts to cut a job of this estimated one-core time into: 1 (run here) for small work, with
    one thread or inside `threads.serial()`; else up to `per_thread` a thread."""
    if seconds < SPIN_MIN_SECONDS:  # first: the common decode-sized call asks nothing else
        return 1
    n = threads.get_num_threads()
    if n <= 1 or threads.serial_now():
        return 1
    return max(1, min(most, per_thread * n))


def run(fn: Task, argv: np.ndarray, parts: int) -> None:
    """Run task `fn` (from `@task`) over `parts` parts with argv (its record, alive until this returns)."""
    run_address(fn.address, address_of(argv), parts)


def run_address(address: int, args: int, parts: int) -> None:
    """`run` of a task and an argv given by their addresses (`fuel.runtime.jobs`)."""
    if parts <= 1:
        _run_here(address, args, 1)
        return
    _pool(threads.get_num_threads() - 1).run(address, args, parts)


def wake() -> None:
    """Wake the pool's sleeping workers now, so that the next job finds them spinning: one posted to
    sleeping workers runs without them until they are up (docs/performance/runtime.md, "pool"). For a caller
    about to time a call after an idle gap, as a decode loop's workers spin from step to step."""
    pool = _POOL
    if pool is not None and os.getpid() == _POOL_PID and not pool.closed:
        _set(pool.ctl, PARK, 0)  # a parked worker would go straight back to sleep
        pool._wake(sum(1 << w for w in range(pool.workers) if pool.ctl[AWAKE + w] == 0))


def run_steps(steps: np.ndarray, seconds: np.ndarray, patches: np.ndarray, env: np.ndarray, start: int,
              stop: int) -> None:
    """Run prepared jobs start..stop-1 of a native program (`fuel.runtime.replay`) on the pool, as `run`
    runs one: one compiled call for the lot, back in Python only to wake sleeping workers for a job
    posted, before joining it."""
    n = threads.get_num_threads()
    if n <= 1 or threads.serial_now():
        _run_steps(_NO_CTL, 0, 1, steps, seconds, patches, env, start, stop)
        return
    pool = _pool(n - 1)
    if not pool._hold():
        _run_steps(_NO_CTL, 0, 1, steps, seconds, patches, env, start, stop)
        return
    try:
        k = start
        while k < stop:
            k, sleeping = _run_steps(pool.ctl, pool.workers, n, steps, seconds, patches, env, k, stop)
            if sleeping:  # job k is posted: wake them, then take its parts alongside them
                try:
                    pool._wake(sleeping)
                finally:
                    _join(pool.ctl)
                k += 1
    finally:
        pool.lock.release()


_NO_CTL = np.zeros(AWAKE + 1, np.int64)
