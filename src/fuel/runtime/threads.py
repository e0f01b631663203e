"""fuel's threads: one thread count for the spinning pool and the BLAS, and the BLAS policy.

`set_num_threads(n)` (`fl.set_num_threads`) sets how many threads fuel's work uses: a job of the spinning
pool (`fuel.runtime.pool`) runs on up to n threads (the caller and n - 1 workers; `jobs.run` picks its part
count from its cost), and NumPy's OpenBLAS, found in the process by its exported symbols, is set to n
threads too. The default is the cores the process may use. One count for both: two pools that spin while
idle starve each other on a small machine (docs/performance/runtime.md, "threads").

The BLAS policy, the same for every kernel:
- a BLAS call made from Python, outside any task (a NumPy matmul between two jobs), runs on the BLAS's own
  threads at fuel's thread count;
- BLAS called from inside a task (`fuel.cpu.simd.sgemm`) runs one-threaded: whoever posts such a job holds
  `one_blas_thread()` around it, so each call runs in the thread that makes it and its bytes are those of
  the same call made through NumPy on one thread, whatever the part count.

`serial()` runs every job posted inside the block as one part, in the calling thread (the other Python
threads are not affected).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Iterator

from fuel.errors import ParamError

# One core's speed for the cost model of `jobs` and the kernels' estimates: it only has to be right within
# a factor of a few (docs/performance/runtime.md, "threads").
SERIAL_BYTES_PER_SECOND = 12e9
SERIAL_FLOPS_PER_SECOND = 30e9
MAX_THREADS = 64  # the pool's workers each have a bit of one int64 word (`pool._post`'s mask)


class _Mode(threading.local):
    serial = False  # inside `serial()` in this Python thread: every job runs as one part


_MODE = _Mode()


def serial_now() -> bool:
    """Whether this Python thread is inside `serial()`."""
    return _MODE.serial


@contextlib.contextmanager
def serial() -> Iterator[None]:
    """Run every job posted inside the block as one part, in this thread."""
    saved = _MODE.serial
    _MODE.serial = True
    try:
        yield
    finally:
        _MODE.serial = saved


# ---- the BLAS: OpenBLAS in this process, by its exported symbols ------------------------------
_BLAS_SET_NAMES = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                   "openblas_set_num_threads64_", "openblas_set_num_threads")
_BLAS_GET_NAMES = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
                   "openblas_get_num_threads64_", "openblas_get_num_threads")
# The CBLAS routines with 64-bit integers (the ILP64 build NumPy's wheels carry) jitted code may call
BLAS_ROUTINES = ("sgemm", "dgemm", "sgemv", "dgemv")


class _Blas:
    """The thread-count functions of the OpenBLAS NumPy loaded, or nothing where none is found, and the
    addresses of its ILP64 `cblas_<routine>` of `BLAS_ROUTINES` (those it has)."""

    def __init__(self) -> None:
        self.set: Callable[[int], None] | None = None
        self.get: Callable[[], int] | None = None
        self.routines: dict[str, int] = {}
        import numpy as np  # loads NumPy's BLAS

        np.dot(np.ones(2), np.ones(2))
        # NumPy's own OpenBLAS first: SciPy (which sentence-transformers brings) loads a second one
        numpy_dir = os.path.dirname(os.path.dirname(np.__file__))
        ours = [p for p in _loaded_libraries() if os.path.basename(os.path.dirname(p)) == "numpy.libs"
                or p.startswith(os.path.join(numpy_dir, "numpy") + os.sep)]
        for path in ours + [p for p in _loaded_libraries() if p not in ours]:
            if "openblas" not in os.path.basename(path).lower():
                continue
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            setter = next((getattr(lib, n) for n in _BLAS_SET_NAMES if hasattr(lib, n)), None)
            getter = next((getattr(lib, n) for n in _BLAS_GET_NAMES if hasattr(lib, n)), None)
            if setter is not None and getter is not None:
                setter.argtypes, setter.restype = [ctypes.c_int], None
                getter.argtypes, getter.restype = [], ctypes.c_int
                self.set, self.get = setter, getter
                for routine in BLAS_ROUTINES:
                    names = (f"scipy_cblas_{routine}64_", f"cblas_{routine}64_")
                    fn = next((getattr(lib, n) for n in names if hasattr(lib, n)), None)
                    self.routines[routine] = 0 if fn is None else ctypes.cast(fn, ctypes.c_void_p).value or 0
                return


def _loaded_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(maxsplit=5)[5].strip() for line in f if line.count(" ") >= 5 and ".so" in line}
    except (OSError, IndexError):
        return []
    return sorted(p for p in paths if p.startswith("/"))


_BLAS: _Blas | None = None


def _blas() -> _Blas:
    global _BLAS
    if _BLAS is None:
        _BLAS = _Blas()
    return _BLAS


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """BLAS calls inside the block run on one thread, the calling one; the count is restored after. Held
    around a job whose tasks call BLAS (the BLAS policy above), and around a NumPy call whose bytes must not
    depend on how OpenBLAS would split a product over its threads."""
    blas = _blas()
    prev = blas.get() if blas.get is not None and blas.set is not None else 1
    if prev != 1 and blas.set is not None:
        blas.set(1)
    try:
        yield
    finally:
        if prev != 1 and blas.set is not None:
            blas.set(prev)


def blas_address(routine: str) -> int:
    """The address of the controlled OpenBLAS's ILP64 `cblas_<routine>` (one of `BLAS_ROUTINES`), or 0
    where there is none."""
    return _blas().routines.get(routine, 0)


def blas_sgemm_address() -> int:
    """`blas_address("sgemm")`."""
    return blas_address("sgemm")


def blas_num_threads() -> int | None:
    """The BLAS's thread count, or None where fuel found no OpenBLAS to control."""
    get = _blas().get
    return None if get is None else int(get())


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_THREADS_LOCK = threading.Lock()
_THREADS: int | None = None


def set_num_threads(n: int) -> None:
    """Use `n` threads for fuel's jobs and for the BLAS (default: the cores available)."""
    global _THREADS
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ParamError(f"set_num_threads: expected a positive integer, got {n!r}")
    if n > MAX_THREADS:
        raise ParamError(f"set_num_threads: {n} threads asked, but fuel's pool runs at most {MAX_THREADS}")
    with _THREADS_LOCK:
        setter = _blas().set
        if setter is not None:
            setter(n)
        _THREADS = n


def get_num_threads() -> int:
    """The thread count fuel uses for its jobs and the BLAS."""
    if _THREADS is None:
        set_num_threads(min(available_cores(), MAX_THREADS))
    assert _THREADS is not None
    return _THREADS
