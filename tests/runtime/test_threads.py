"""The thread policy: one count for the spinning pool and the BLAS; `serial()` runs every job as one part in
its own Python thread, with the bytes of any other part count."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_info

import fuel as fl
from fuel.dispatch.impls import default_kernel_registry
from fuel.graph.registry import default_registry
from fuel.runtime import pool, threads
from fuel.testing.contract import output_bytes, output_for
from fuel.testing.reference import cases


def _blas_threads() -> list[int]:
    """NumPy's BLAS's thread count (the one fuel governs; SciPy, which sentence-transformers brings, may load
    a second OpenBLAS that NumPy never calls)."""
    return [int(i["num_threads"]) for i in threadpool_info()
            if i["user_api"] == "blas" and "numpy" in i["filepath"].replace("\\", "/").split("/")[-2]]


def test_set_num_threads_governs_the_pool_and_the_blas() -> None:
    before = fl.get_num_threads()
    try:
        fl.set_num_threads(1)
        assert fl.get_num_threads() == 1 and pool.parts_for(1.0, 64) == 1
        assert _blas_threads() and set(_blas_threads()) == {1}
        fl.set_num_threads(2)
        assert pool.parts_for(1.0, 64) == 2 * pool.PARTS_PER_THREAD and set(_blas_threads()) == {2}
    finally:
        fl.set_num_threads(before)


def test_default_is_the_cores_available() -> None:
    assert fl.get_num_threads() == min(threads.available_cores(), threads.MAX_THREADS)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_bad_thread_counts_are_clear_errors(bad: object) -> None:
    with pytest.raises(fl.ParamError, match="set_num_threads: expected a positive integer"):
        fl.set_num_threads(bad)  # type: ignore[arg-type]


def test_too_many_threads_names_the_pools_limit() -> None:
    with pytest.raises(fl.ParamError, match=f"set_num_threads: {threads.MAX_THREADS + 1} threads asked, but "
                                            f"fuel's pool runs at most {threads.MAX_THREADS}"):
        fl.set_num_threads(threads.MAX_THREADS + 1)


def test_serial_and_parallel_paths_give_identical_bytes_for_every_impl() -> None:
    """Every impl, every dtype, on its verification cases (many rows: the parallel path really splits)."""
    registry = default_registry()
    checked = 0
    for impl in default_kernel_registry():
        entry = registry.entry(impl.op_id)
        for case in cases(entry.name, impl.dtypes, np.random.default_rng(7)):
            parallel = output_for(entry, impl, case.inputs, case.params)
            with threads.serial():
                serial = output_for(entry, impl, case.inputs, case.params)
            assert output_bytes(parallel) == output_bytes(serial), f"{impl.name}: {case.label}"
            checked += 1
    assert checked > 100


def test_serial_is_per_python_thread_and_nests() -> None:
    before = fl.get_num_threads()
    seen: list[int] = []
    try:
        fl.set_num_threads(2)
        with threads.serial():
            t = threading.Thread(target=lambda: seen.append(pool.parts_for(1.0, 64)))
            t.start()
            t.join()
            with threads.serial():
                assert pool.parts_for(1.0, 64) == 1
            assert pool.parts_for(1.0, 64) == 1 and threads.serial_now()
        assert not threads.serial_now() and pool.parts_for(1.0, 64) == 2 * pool.PARTS_PER_THREAD
    finally:
        fl.set_num_threads(before)
    assert seen == [2 * pool.PARTS_PER_THREAD]


def test_one_blas_thread_is_restored_after_the_block() -> None:
    before = fl.get_num_threads()
    try:
        fl.set_num_threads(2)
        with threads.one_blas_thread():
            assert threads.blas_num_threads() == 1
        assert threads.blas_num_threads() == 2
    finally:
        fl.set_num_threads(before)
