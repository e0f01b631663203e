"""A job: one kernel's work, as every caller posts it to the pool.

The execution contract of a kernel (ARCHITECTURE.md, "How to add a fused op"):
- its work is a task `fn(part, parts, argv)` (`fuel.runtime.pool.task`) that does rows
  `[part·rows/parts, (part+1)·rows/parts)` of it, the same bytes for any split;
- its arguments are a typed record (`record(...)`): named 8-byte fields, array addresses and sizes as
  int64 and real parameters as float64. The task reads them with `args = record_at(argv, RECORD)`;
- a job builder returns the `Job` (task, filled record, one core's time estimate, the most parts it can be
  cut into). The eager kernel runs it (`run`) and native replay posts the very same job, so both compute
  the same machine code on the same rows. `kernel(builder)` makes the first from the second.
- `run` (the runtime, never the kernel) chooses the part count from the estimate and the thread count:
  one part runs in the calling thread, more are claimed by the pool's workers.
A replayed `fl.jit` step calls its kernel with the same array objects every time, so a decode kernel may
remember its job for them (`JobCache`): then the call is a dictionary lookup and a post.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from numba import carray, njit

from fuel.errors import DTypeError, ParamError
from fuel.runtime import pool
from fuel.runtime.atomics import pointer

ADDRESS = np.int64  # a record field holding an array's address (`a.ctypes.data`)
INT = np.int64
REAL = np.float64


_KINDS = (np.dtype(ADDRESS), np.dtype(REAL))  # what a task reads a word as: int64 or float64


def record(**fields: type) -> np.dtype[Any]:
    """A kernel's argument record: each field 8 bytes (`ADDRESS`, `INT` or `REAL`), in the order given. A
    task reads each word as int64 or float64, so any other kind is a DTypeError, and a record of no field
    a ParamError."""
    if not fields:
        raise ParamError("jobs.record: expected at least one field (name=ADDRESS, INT or REAL), got none")
    for name, kind in fields.items():
        try:
            dt = np.dtype(kind)
        except TypeError:
            dt = None
        if dt is None or dt not in _KINDS:
            raise DTypeError(f"jobs.record: field {name!r} must be ADDRESS, INT (int64) or REAL (float64), got "
                             f"{kind!r}")
    return np.dtype(list(fields.items()))


def word(rec: np.dtype[Any], name: str) -> int:
    """The 8-byte word a field occupies in an argv of this record (what replay patches at each call)."""
    found = rec.fields.get(name) if rec.fields is not None else None
    if found is None:
        known = ", ".join(rec.names or ())
        raise ParamError(f"jobs.word: the record has no field {name!r}; its fields are {known or 'none'}")
    return int(found[1]) // 8


def argv_of(rec: np.dtype[Any]) -> np.ndarray:
    """A zeroed argv holding one record; index it as `argv[0]` in jitted code to fill it."""
    return np.zeros(1, rec)


@njit(inline="always", cache=True)
def record_at(argv: int, rec: Any) -> Any:
    """The record at address argv (a task's third argument), fields read by name."""
    return carray(pointer(argv, rec), (1,))[0]


Dyn = tuple[tuple[int, str, int, int], ...]  # (argv word, DynScalar name, lowest, highest value) per entry


class Job(NamedTuple):
    """A prepared job: the task's address, its argv (kept alive here) and argv's address, one core's time
    estimate (per unit of argv word `unit` when unit >= 0) and the most parts it can be cut into. `dyn`
    names the argv words replay sets from a DynScalar at each call, with the range the value must lie in;
    `keep` holds scratch the argv points at that only the job owns. argv holds only the addresses of the
    arrays the task reads and writes: whoever runs the job keeps those arrays alive until it has run.
    `check`, when set, is called by whoever ran the job (`run`, native replay) once it has finished: it
    raises the error the task found in its data (an index out of range) and wrote into scratch of its own,
    where the task wrote nothing."""

    task: int
    argv: np.ndarray
    args: int
    seconds: float
    most: int
    unit: int = -1
    dyn: Dyn = ()
    keep: tuple[np.ndarray, ...] = ()
    check: Callable[[], None] | None = None


def job(task: pool.Task, argv: np.ndarray, seconds: float, most: int, unit: int = -1, dyn: Dyn = (),
        keep: tuple[np.ndarray, ...] = (), check: Callable[[], None] | None = None) -> Job:
    return Job(task.address, argv, pool.address_of(argv), seconds, most, unit, dyn, keep, check)


Jobs = Job | tuple[Job, ...]  # a step's jobs, run in order (none for an empty output)
JobBuilder = Callable[[list[np.ndarray], np.ndarray, Any], Jobs | None]


def _seconds(j: Job) -> float:
    return j.seconds if j.unit < 0 else j.seconds * float(j.argv.view(np.int64)[j.unit])


def run(jobs: Jobs) -> None:
    """Post each job (parts for the thread count of now), wait for it, then run its check."""
    for j in (jobs,) if isinstance(jobs, Job) else jobs:
        pool.run_address(j.task, j.args, pool.parts_for(_seconds(j), j.most))
        if j.check is not None:
            j.check()


_BUILDERS: dict[Any, JobBuilder] = {}


def kernel(build: JobBuilder) -> Callable[[list[np.ndarray], np.ndarray, Any], None]:
    """The impl kernel `kernel(inputs, out, params)` that runs the jobs `build` returns for them, with
    `build` registered for native replay (`builder_of`). In replay, params arrive as built (DynScalar fields
    unresolved), and a builder returns None where it does not serve the call; eagerly it must serve every
    call the impl is registered for."""

    def run_kernel(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
        jobs = build(inputs, out, params)
        if jobs is None:
            raise RuntimeError(f"{build.__qualname__} prepared no job for a call its impl is registered for")
        run(jobs)

    run_kernel.__name__ = run_kernel.__qualname__ = build.__name__.removesuffix("_job") + "_kernel"
    run_kernel.__module__ = build.__module__
    run_kernel.__doc__ = build.__doc__
    run_kernel.__wrapped__ = build  # type: ignore[attr-defined]  # its source is the builder's (inventory)
    _BUILDERS[run_kernel] = build
    return run_kernel


def replays(*kernels: Any) -> Callable[[JobBuilder], JobBuilder]:
    """Register `builder(inputs, out, params) -> Jobs | None` as what native replay posts for steps these
    kernels run, for a kernel whose eager path is not itself a job (it returns None where it does not
    serve the call)."""

    def register(builder: JobBuilder) -> JobBuilder:
        for k in kernels:
            _BUILDERS[k] = builder
        return builder

    return register


def builder_of(kernel: Any) -> JobBuilder | None:
    """The job builder replay posts for this impl kernel, or None."""
    return _BUILDERS.get(kernel)


class JobCache:
    """Jobs by the identity of the arrays of a call (and its params object). An entry holds weak references
    to its arrays and is dropped when any of them dies, so a remembered address never outlives its memory;
    it is used only when the same objects come back with the same shapes and the same params object."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, ...], tuple[Any, ...]] = {}

    def find(self, arrays: tuple[np.ndarray, ...], params: Any) -> Job | None:
        entry = self._entries.get(tuple([id(x) for x in arrays]))
        if entry is None:
            return None
        refs, shapes, known, found = entry
        for ref, x, shape in zip(refs, arrays, shapes, strict=True):
            if ref() is not x or x.shape != shape:
                return None
        return found if known is params else None

    def remember(self, arrays: tuple[np.ndarray, ...], params: Any, found: Job) -> None:
        key = tuple([id(x) for x in arrays])

        def drop(_: Any) -> None:
            self._entries.pop(key, None)

        self._entries[key] = (tuple(weakref.ref(x, drop) for x in arrays), tuple(x.shape for x in arrays),
                              params, found)

    def __len__(self) -> int:
        return len(self._entries)
