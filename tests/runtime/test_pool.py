"""The spinning pool: every part of every job runs exactly once, on more than one thread, whoever is
awake; a busy pool, a serial block and small work fall back to the calling thread; the decode kernels
that post to it give the same bytes whatever the part count."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest
from numba import carray

import fuel as fl
from fuel.cpu.prims import gemv as gemv_module
from fuel.cpu.quant import gguf_decode
from fuel.quant import QuantType
from fuel.runtime import jobs, pool, threads
from fuel.runtime.atomics import cycles, fetch_add, load_acquire, pointer, store
from fuel.runtime.jobs import ADDRESS, INT, record_at
from fuel.testing.pool import awake_when
from fuel.testing.reference.qmatmul import random_weight

COUNT_ARGS = jobs.record(counts=ADDRESS, size=INT)
RENDEZVOUS_ARGS = jobs.record(flags=ADDRESS, cycles=INT)


@pool.task()
def _count_parts(part: int, parts: int, argv: int) -> None:
    """counts[part] += 1."""
    v = record_at(argv, COUNT_ARGS)
    counts = carray(pointer(v.counts, np.int64), (v.size,))
    fetch_add(counts, part, 1)


@pool.task()
def _rendezvous(part: int, parts: int, argv: int) -> None:
    """Two parts that each wait (up to `cycles`) for the other to arrive: both arrive only if two
    threads run them at once. flags[part] is set on arrival, flags[2 + part] if the other was seen."""
    v = record_at(argv, RENDEZVOUS_ARGS)
    flags = carray(pointer(v.flags, np.int64), (4,))
    store(flags, part, 1)
    start = cycles()
    while cycles() - start < v.cycles:
        if load_acquire(flags, 1 - part) == 1:
            store(flags, 2 + part, 1)
            return


@pytest.fixture
def two_threads() -> Any:
    before = fl.get_num_threads()
    fl.set_num_threads(2)
    try:
        yield
    finally:
        fl.set_num_threads(before)


def _counts_after(parts: int) -> np.ndarray:
    counts = np.zeros(max(parts, 1), np.int64)
    argv = jobs.argv_of(COUNT_ARGS)
    argv[0] = (counts.ctypes.data, counts.size)
    pool.run(_count_parts, argv, parts)
    return counts


@pytest.mark.parametrize("parts", [1, 2, 3, 8, 64, 1000])
def test_every_part_runs_exactly_once(two_threads: None, parts: int) -> None:
    for _ in range(200):
        assert (_counts_after(parts) == 1).all()


def test_parts_run_once_when_the_workers_sleep_and_wake(two_threads: None) -> None:
    for pause in (0.0, 2 * pool.SPIN_SECONDS, 0.01):
        time.sleep(pause)
        assert (_counts_after(16) == 1).all()


def test_two_threads_run_parts_at_once(two_threads: None) -> None:
    flags = np.zeros(4, np.int64)
    argv = jobs.argv_of(RENDEZVOUS_ARGS)
    argv[0] = (flags.ctypes.data, int(2.0 * pool._cycles_per_second()))  # two seconds: far past a wake-up
    pool.run(_rendezvous, argv, 2)
    assert flags.tolist() == [1, 1, 1, 1]


def test_a_busy_pool_runs_a_second_threads_job_in_that_thread(two_threads: None) -> None:
    errors: list[str] = []

    def post_many() -> None:
        for _ in range(300):
            counts = _counts_after(8)
            if not (counts == 1).all():
                errors.append(str(counts))

    workers = [threading.Thread(target=post_many) for _ in range(3)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert errors == []


def test_small_work_serial_blocks_and_one_thread_use_one_part(two_threads: None) -> None:
    assert pool.parts_for(1e-3, 1000) == pool.PARTS_PER_THREAD * 2
    assert pool.parts_for(1e-3, 3) == 3
    assert pool.parts_for(pool.SPIN_MIN_SECONDS / 2, 1000) == 1
    with threads.serial():
        assert pool.parts_for(1e-3, 1000) == 1
    fl.set_num_threads(1)
    assert pool.parts_for(1e-3, 1000) == 1


def _parked_pool() -> pool.SpinPool:
    """The two-thread pool after a job, its worker parked and asleep."""
    _counts_after(8)
    workers = pool._pool(1)
    workers.park()
    assert awake_when(workers, 0) == 0
    return workers


def test_parked_workers_go_to_sleep(two_threads: None) -> None:
    _parked_pool()
    assert (_counts_after(8) == 1).all()  # and a later job still runs every part


def test_wake_brings_sleeping_workers_up(two_threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pool.wake()` wakes sleeping workers (for a caller about to time a job after an idle gap), parked
    ones too; they spin and take parts as usual."""
    workers = _parked_pool()
    monkeypatch.setattr(workers, "limit", 1000 * workers.limit)  # spinning long enough to be seen on a busy host
    pool.wake()
    try:
        assert awake_when(workers, 1) == 1
        assert (_counts_after(8) == 1).all()
    finally:
        workers.park()


def test_workers_are_pinned_each_to_a_core_the_poster_keeps_free(two_threads: None) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert pool.worker_cores(1) == allowed[1:2]
    assert pool.worker_cores(len(allowed)) == []  # more threads than cores: nothing pinned
    _counts_after(8)
    workers = pool._pool(1)
    assert len(allowed) >= 2, "the pinning is only exercised with two cores or more"
    for core, t in zip(workers.cores, workers.threads, strict=True):
        assert os.sched_getaffinity(t.native_id) == {core}
    # A poster that sits on a worker's core is moved off it for the job, its affinity unchanged.
    os.sched_setaffinity(0, {workers.cores[0]})
    os.sched_setaffinity(0, set(allowed))
    assert (_counts_after(8) == 1).all()
    assert os.sched_getaffinity(0) == set(allowed)
    assert pool._cpu_reader()() not in workers.cores  # type: ignore[misc]


def test_pinning_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUEL_SPIN_PIN", "0")
    assert pool.worker_cores(1) == []


@pytest.fixture
def forced_parts(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run a kernel with a given part count, whatever its size."""
    def run(parts: int, fn: Any) -> Any:
        monkeypatch.setattr(pool, "parts_for", lambda seconds, most: min(parts, most))
        return fn()
    return run


@pytest.mark.parametrize("qt", [QuantType.Q4_1, QuantType.Q8_0, QuantType.Q6K], ids=lambda q: q.ggml_name)
def test_qmatmul_decode_bytes_do_not_depend_on_the_part_count(two_threads: None, forced_parts: Any,
                                                              qt: QuantType) -> None:
    rng = np.random.default_rng(3)
    n, k = 333, 512
    raw = random_weight(rng, qt, n, k)
    a = rng.standard_normal((1, k)).astype(np.float32)

    def once() -> bytes:
        out = np.zeros((1, n), np.float32)
        gguf_decode.gemv(qt, a, raw, out)
        return out.tobytes()

    assert len({forced_parts(parts, once) for parts in (1, 2, 7, 8, 256)}) == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 576, 192), (3, 5, 17), (4, 1, 3), (1, 100, 1)])
def test_gemv_bytes_do_not_depend_on_the_part_count(two_threads: None, forced_parts: Any, dtype: Any, m: int,
                                                    k: int, n: int) -> None:
    rng = np.random.default_rng(4)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)

    def once() -> bytes:
        out = np.empty((m, n), dtype)
        gemv_module.gemv(a, b, out)
        return out.tobytes()

    results = {forced_parts(parts, once) for parts in (1, 2, 3, 8)}
    assert len(results) == 1
    got = np.frombuffer(results.pop(), dtype).reshape(m, n)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    assert (np.abs(got - ref) <= 8 * np.finfo(dtype).eps * k * scale + 1e-300).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("b", "hq", "hkv", "sq", "kl", "d"), [(1, 9, 3, 1, 37, 32), (2, 8, 2, 3, 50, 64),
                                                               (1, 4, 1, 1, 1, 80), (1, 6, 2, 2, 45, 20)])
def test_flash_attn_decode_bytes_do_not_depend_on_the_part_count(two_threads: None, forced_parts: Any, dtype: Any,
                                                                 b: int, hq: int, hkv: int, sq: int,
                                                                 kl: int, d: int) -> None:
    """Head sizes of whole 64-column register blocks (64), 16-lane vectors only (32), both (80) and
    neither (20, the plain loops), against a float64 reference."""
    rng = np.random.default_rng(5)
    cap = 64
    q = rng.standard_normal((b, hq, sq, d)).astype(dtype)
    k, v = (rng.standard_normal((b, hkv, cap, d)).astype(dtype) for _ in range(2))

    def once() -> bytes:
        (out,) = fl.realize(fl.ops.flash_attn(fl.tensor(q), fl.tensor(k), fl.tensor(v), causal=True, k_len=kl))
        return np.asarray(out).tobytes()

    results = {forced_parts(parts, once) for parts in (1, 2, 3, 7, 64)}
    assert len(results) == 1
    got = np.frombuffer(results.pop(), dtype).reshape(b, hq, sq, d)
    # float64 reference: GQA, the causal mask aligned bottom-right at kl - sq
    kr, vr = (np.repeat(x[:, :, :kl].astype(np.float64), hq // hkv, axis=1) for x in (k, v))
    s = q.astype(np.float64) @ kr.transpose(0, 1, 3, 2) / np.sqrt(d)
    s[..., np.arange(kl)[None, :] > np.arange(sq)[:, None] + kl - sq] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref, size = p @ vr, p @ np.abs(vr)
    assert (np.abs(got - ref) <= 64 * np.finfo(dtype).eps * size).all()


def test_a_replaced_pool_ends_its_workers(two_threads: None) -> None:
    """A pool of another worker count (another thread count) replaces the current one, which ends its
    workers instead of leaving them asleep for the life of the process."""
    def alive() -> int:
        return sum(t.name.startswith("fuel-spin-") and t.is_alive() for t in threading.enumerate())

    _counts_after(8)
    old = pool._pool(1)
    replaced = [old]
    for workers in (2, 1, 2, 1):
        replaced.append(pool._pool(workers))
        assert (_counts_after(16) == 1).all()
    deadline = time.monotonic() + 2.0
    ended = [t for p in replaced[:-1] for t in p.threads]
    while any(t.is_alive() for t in ended) and time.monotonic() < deadline:
        time.sleep(1e-3)
    assert not any(t.is_alive() for t in ended)
    assert alive() == 1  # the current pool's one worker
    counts = np.zeros(4, np.int64)
    argv = jobs.argv_of(COUNT_ARGS)
    argv[0] = (counts.ctypes.data, counts.size)
    old.run(_count_parts.address, argv.ctypes.data, 4)
    assert (counts == 1).all()  # a closed pool runs a job in the posting thread
