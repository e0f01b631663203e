"""fuel's thread policy: one thread count for Numba and the BLAS, and small work run serially.

Two thread pools that spin while idle starve each other on a small machine: after a BLAS call the
OpenBLAS workers spin for about 2^28 cycles, and GNU OpenMP's workers (Numba's `omp` layer) spin
about 300k iterations after each parallel region. Measured on a 2-core machine, a one-row Numba
parallel kernel right after a `[1, 576] @ [576, 1536]` GEMV took 8.3 ms; the same row run serially
in the calling thread took 0.06 ms, and with passive OpenMP waiting the parallel call took 0.1 ms.
The policy, in order of what it saves:

1. Work whose estimated time (the impl's own cost at one core's speed) is below
   `PARALLEL_MIN_SECONDS` (2 ms) runs on one Numba thread, and below `WORKERS_MIN_SECONDS` (150 µs)
   `split_work` starts no worker threads either: the executor decides once per plan step
   (`use_serial`), and changes Numba's count only where a serial step follows a parallel one or the
   reverse. No pool wakes for a decode-sized row, so nothing is left spinning against the BLAS, and
   the bytes are those of the parallel path.
2. Numba's layer is chosen on purpose: OpenMP first (it is thread-safe, unlike `workqueue`, so two
   Python threads may realise at once), and it is started with `OMP_WAIT_POLICY=PASSIVE` (unless the
   user set it) so its idle workers sleep instead of spinning against OpenBLAS. The variable is set
   only while the pool starts and restored afterwards, so other libraries see the user's environment.
   A bounded spin (`GOMP_SPINCOUNT=30000`) made back-to-back regions cheap (2 µs) but a one-row
   parallel kernel after a GEMV took 1.8 ms: the spinning worker fought OpenBLAS's.
3. `set_num_threads(n)` sets Numba's count and the BLAS's (OpenBLAS found in the process by its
   exported symbols) together.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Iterator

from fuel.errors import ParamError

# One core moves about this much and computes about this fast on the measured machines (a serial
# NumPy copy moved 12-16 GB/s; a serial sgemm ran 60-200 GFLOP/s). The estimate only has to be right
# within a factor of a few. Two thresholds:
# - Numba's pool (OpenMP regions): an empty two-thread prange took 62 µs with passive waiting, but a
#   region right after a multi-threaded BLAS call, whose workers still spin, took milliseconds (its
#   second thread waits for a core). Measured on a 2-core VM with this at 150 µs and at 2 ms: Gemma-3's
#   128-token prefill 170-196 -> 296-320 tokens/s (its attention's row passes: 238 -> 18 ms), MiniLM
#   64 sentences 298-348 -> 193-196 ms. So a kernel's own pool starts only for work past 2 ms.
# - `split_work`'s Python worker threads (one-thread BLAS and GIL-free kernels per part, no OpenMP
#   region): they start for work past 150 µs.
SERIAL_BYTES_PER_SECOND = 12e9
SERIAL_FLOPS_PER_SECOND = 30e9
PARALLEL_MIN_SECONDS = 2e-3
WORKERS_MIN_SECONDS = 150e-6


def _seconds(flops: int, bytes_moved: int) -> float:
    return bytes_moved / SERIAL_BYTES_PER_SECOND + flops / SERIAL_FLOPS_PER_SECOND


def runs_serially(flops: int, bytes_moved: int) -> bool:
    """Whether work of this cost runs on one Numba thread (below the pool's threshold)."""
    return _seconds(flops, bytes_moved) < PARALLEL_MIN_SECONDS


def runs_inline(flops: int, bytes_moved: int) -> bool:
    """Whether work of this cost runs entirely in the calling thread (no `split_work` workers either)."""
    return _seconds(flops, bytes_moved) < WORKERS_MIN_SECONDS


def thread_use(flops: int, bytes_moved: int) -> tuple[bool, bool]:
    """(runs_serially, runs_inline) of work of this cost, estimated once: `use_serial`'s arguments."""
    seconds = _seconds(flops, bytes_moved)
    return seconds < PARALLEL_MIN_SECONDS, seconds < WORKERS_MIN_SECONDS


class _Mode(threading.local):
    serial = False  # Numba's count is one in this thread now
    inline = False  # split_work runs its parts here, one after another
    forced = False  # inside `serial()`: every kernel runs serially
    nested = False  # inside a part of `split_work`: no other pool is started from here
    threads = 0  # the count last applied to Numba in this thread (Numba keeps it per thread)


MODE = _Mode()
# Called before split_work starts its threads: the spinning pool's workers (`fuel.runtime.pool`) go to
# sleep, so they do not hold a core those threads wait for.
PARK_HOOKS: list[Callable[[], None]] = []


def _park() -> None:
    for hook in PARK_HOOKS:
        hook()


def use_serial(flag: bool, inline: bool | None = None) -> None:
    """Run the next kernels of this Python thread on one Numba thread (flag) or on fuel's thread count;
    `inline` (default: flag) also keeps `split_work` from starting worker threads."""
    flag = flag or MODE.forced
    MODE.inline = flag if inline is None else inline or MODE.forced
    if flag is not MODE.serial:
        n = 1 if flag else _THREADS
        assert n is not None and _SET_NUMBA_THREADS is not None, "start_pool() first"
        _SET_NUMBA_THREADS(n)
        MODE.serial, MODE.threads = flag, n


@contextlib.contextmanager
def serial() -> Iterator[None]:
    """Run every kernel called inside the block serially in this thread."""
    start_pool()
    apply()
    saved = MODE.forced
    MODE.forced = True
    use_serial(True)
    try:
        yield
    finally:
        MODE.forced = saved
        use_serial(saved)


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
_STATE_LOCK = threading.Lock()
_THREADS: int | None = None
_POOL_STARTED = False
_SET_NUMBA_THREADS: Callable[[int], None] | None = None


def _blas() -> _Blas:
    global _BLAS
    if _BLAS is None:
        _BLAS = _Blas()
    return _BLAS


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """BLAS calls inside the block run on one thread, the calling one; the count is restored after. For a
    kernel whose bytes must not depend on how OpenBLAS would split a product over its threads."""
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


def start_pool() -> None:
    """Start Numba's thread pool under fuel's choices (idempotent; the executor calls it first)."""
    global _POOL_STARTED, _SET_NUMBA_THREADS
    if _POOL_STARTED:
        return
    with _STATE_LOCK:
        if _POOL_STARTED:
            return
        import numba
        from numba.np.ufunc import parallel

        if "NUMBA_THREADING_LAYER" not in os.environ and "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
            numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]  # type: ignore[attr-defined]
        passive = "OMP_WAIT_POLICY" not in os.environ
        if passive:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        try:
            parallel._launch_threads()
        finally:
            if passive:
                del os.environ["OMP_WAIT_POLICY"]
        # Numba's checked setter costs ~1.5 µs; its unchecked core ~0.5 µs, and the executor calls it
        # with counts it has already validated.
        _SET_NUMBA_THREADS = getattr(parallel, "_set_num_threads", numba.set_num_threads)
        _POOL_STARTED = True
    if _THREADS is None:
        set_num_threads(available_cores())


def set_num_threads(n: int) -> None:
    """Use `n` threads for Numba kernels and for the BLAS (default: the cores available)."""
    global _THREADS
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ParamError(f"set_num_threads: expected a positive integer, got {n!r}")
    start_pool()
    import numba

    limit = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
    if n > limit:
        raise ParamError(f"set_num_threads: {n} threads asked, but Numba's pool has {limit} "
                         f"(set NUMBA_NUM_THREADS before starting Python to allow more)")
    numba.set_num_threads(1 if MODE.serial else n)
    MODE.threads = 1 if MODE.serial else n
    setter = _blas().set
    if setter is not None:
        setter(n)
    _THREADS = n


def apply() -> None:
    """Bring this Python thread's Numba count to fuel's (Numba keeps the count per thread)."""
    if _THREADS is None:
        start_pool()
    n = _THREADS
    assert n is not None
    if MODE.threads != n and not MODE.serial:
        import numba

        numba.set_num_threads(n)
        MODE.threads = n


def get_num_threads() -> int:
    """The thread count fuel uses for Numba and the BLAS."""
    start_pool()
    assert _THREADS is not None
    return _THREADS


def threading_layer() -> str:
    """The Numba threading layer in use (`omp`, `tbb` or `workqueue`)."""
    start_pool()
    import numba

    return str(numba.threading_layer())


_WORKERS: concurrent.futures.ThreadPoolExecutor | None = None


def _workers() -> concurrent.futures.ThreadPoolExecutor:
    global _WORKERS
    if _WORKERS is None:
        with _STATE_LOCK:
            if _WORKERS is None:
                _WORKERS = concurrent.futures.ThreadPoolExecutor(max_workers=available_cores(),
                                                                 thread_name_prefix="fuel")
    return _WORKERS


def split_work(fn: Callable[[range], None], total: int, strided: bool = False) -> None:
    """Run `fn(part)` over the task indices [0, total) cut into fuel's thread count of parts, concurrently:
    contiguous ranges, or with `strided` every n-th task (which balances tasks of growing cost).

    For kernels whose parts are independent and whose heavy work releases the GIL (NumPy's BLAS calls,
    `nogil` Numba kernels), e.g. attention over (batch, kv head) groups: many small products, each
    run serially, use the cores better than each product split over threads by the BLAS. Part 0 runs
    in the calling thread, the others in fuel's worker threads; every part runs with one Numba thread
    and a one-thread BLAS, so a part's bytes do not depend on how many parts there are. Inside a serial
    step, or with one thread, `fn(range(total))` runs here.
    """
    n = min(_THREADS or 1, total)
    if n <= 1 or MODE.inline:
        with one_blas_thread():  # as in a part; a BLAS worker woken here would spin on after it
            fn(range(total))
        return
    parts = [range(k, total, n) if strided else range(k * total // n, (k + 1) * total // n) for k in range(n)]

    def part(tasks: range) -> None:
        use_serial(True)
        MODE.nested = True
        try:
            fn(tasks)
        finally:
            MODE.nested = False

    _park()
    setter = _blas().set
    if setter is not None:
        setter(1)
    try:
        futures = [_workers().submit(part, tasks) for tasks in parts[1:]]
        try:
            part(parts[0])
        finally:
            use_serial(False)
            errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                raise e
    finally:
        if setter is not None:
            setter(_THREADS or 1)
