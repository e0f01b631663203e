"""The thread policy: one count for Numba and the BLAS; serial and parallel paths give the same bytes."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from threadpoolctl import threadpool_info

import fuel as fl
from fuel.dispatch.impls import default_kernel_registry
from fuel.graph.registry import default_registry
from fuel.runtime import threads
from fuel.testing.contract import output_bytes, output_for
from fuel.testing.reference import cases


def _blas_threads() -> list[int]:
    """NumPy's BLAS's thread count (the one fuel governs; SciPy, which sentence-transformers brings, may load
    a second OpenBLAS that NumPy never calls)."""
    return [int(i["num_threads"]) for i in threadpool_info()
            if i["user_api"] == "blas" and "numpy" in i["filepath"].replace("\\", "/").split("/")[-2]]


def test_set_num_threads_governs_numba_and_the_blas() -> None:
    before = fl.get_num_threads()
    try:
        fl.set_num_threads(1)
        assert fl.get_num_threads() == 1 and numba.get_num_threads() == 1
        assert _blas_threads() and set(_blas_threads()) == {1}
        fl.set_num_threads(2)
        assert numba.get_num_threads() == 2 and set(_blas_threads()) == {2}
    finally:
        fl.set_num_threads(before)


def test_default_is_the_cores_available() -> None:
    assert fl.get_num_threads() == min(threads.available_cores(), numba.config.NUMBA_NUM_THREADS)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_bad_thread_counts_are_clear_errors(bad: object) -> None:
    with pytest.raises(fl.ParamError, match="set_num_threads: expected a positive integer"):
        fl.set_num_threads(bad)  # type: ignore[arg-type]


def test_too_many_threads_names_the_pool_size() -> None:
    with pytest.raises(fl.ParamError, match="Numba's pool has"):
        fl.set_num_threads(numba.config.NUMBA_NUM_THREADS + 1)


def test_the_threading_layer_is_chosen_on_purpose() -> None:
    assert threads.threading_layer() == "omp"


def test_serial_thresholds_come_from_cost() -> None:
    def cost(rows: int) -> dict[str, int]:
        return {"flops": 3 * rows * 576, "bytes_moved": 2 * rows * 576 * 4}

    assert threads.runs_serially(**cost(1)) and threads.runs_inline(**cost(1))
    assert threads.runs_serially(**cost(4096)) and not threads.runs_inline(**cost(4096))
    assert not threads.runs_serially(**cost(16384)) and not threads.runs_inline(**cost(16384))


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


def test_serial_mode_is_per_python_thread() -> None:
    import threading

    seen: list[int] = []
    with threads.serial():
        t = threading.Thread(target=lambda: seen.append(numba.get_num_threads()))
        t.start()
        t.join()
        assert numba.get_num_threads() == 1
    assert seen == [fl.get_num_threads()] and numba.get_num_threads() == fl.get_num_threads()


@pytest.mark.parametrize("total", [1, 3])
def test_split_work_runs_every_part_on_one_blas_thread(total: int) -> None:
    """Also when it runs its parts in the calling thread (one task, or inside a serial step): a BLAS worker
    woken there would spin on after the call, holding a core the next steps' threads need."""
    before = fl.get_num_threads()
    seen: list[int | None] = []
    try:
        fl.set_num_threads(2)
        threads.split_work(lambda tasks: seen.append(threads.blas_num_threads()), total)
        assert threads.blas_num_threads() == 2  # restored
    finally:
        fl.set_num_threads(before)
    assert seen and set(seen) == {1}
