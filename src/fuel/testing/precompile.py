"""Filling Numba's on-disk cache ahead of first use (`fuel compile`).

Every kernel compiles on its first call, one function at a time per process. Here every registered impl
runs once on its verification cases, so later processes load the compiled code from the cache instead.
A unit is an impl's run of consecutive cases of one group (`Case.group`: cases that call the same kernels,
by default all of an impl's; QMatMul's quant types are groups of their own): two processes running cases
of one group at once would both compile its kernels. The units are handed to `jobs` worker processes as
they free up, the largest first. An impl's first case also realises its gradients, for the backward
kernels that only gradient graphs call, and QMatMul's cases run again as every other kind of host decodes
them (`gguf_decode.HOST_WAYS`: the tests force each host's kernels on any host). A unit that raises is
reported, never hidden: the kernel it names would fail its tests too. The cases' inputs are writable: a
kernel taking read-only arrays (memory-mapped GGUF weights) is another Numba specialisation, compiled on
first use.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from fuel.errors import ParamError


@dataclass(frozen=True)
class Unit:
    """Cases [start, stop) of the impl at `index` in the kernel registry's order."""

    index: int
    name: str
    start: int
    stop: int


def _impl_cases(index: int) -> tuple[str, list[Any], Callable[[Any], object]]:
    """The impl at `index`: its name, its verification cases (the same in every process) and a runner."""
    from fuel.dispatch.impls import default_kernel_registry
    from fuel.graph.registry import default_registry
    from fuel.testing.contract import output_for
    from fuel.testing.reference import cases

    impl = list(default_kernel_registry())[index]
    entry = default_registry().entry(impl.op_id)
    found = cases(entry.name, impl.dtypes, np.random.default_rng(index))

    ways = _other_hosts(entry.name)

    def run(case: Any) -> None:
        output_for(entry, impl, case.inputs, case.params)
        for way in ways:
            with way():
                output_for(entry, impl, case.inputs, case.params)
        if entry.vjp is not None and case is found[0]:
            _gradients(entry, case)

    return impl.name, list(found), run


def _other_hosts(entry_name: str) -> list[Callable[[], AbstractContextManager[None]]]:
    """The kernel choices of other hosts that an entry's tests force on this one, each a context (QMatMul's
    decode kernels, `gguf_decode.HOST_WAYS`): its cases run again under each, in the same unit."""
    if entry_name != "QMatMul":
        return []
    from fuel.cpu.quant.gguf_decode import HOST_WAYS, host_way

    return [partial(host_way, name) for name in HOST_WAYS]


def _gradients(entry: Any, case: Any) -> None:
    """Realise the gradient of the sum of the op's outputs for each float input: some backward kernels
    (the scans', cross-entropy's) are called only from gradient graphs."""
    import fuel as fl
    from fuel.dtype import from_numpy
    from fuel.graph.prims import views
    from fuel.graph.registry import fused_node

    if not all(a.size for a in case.inputs):
        return
    leaves = [fl.tensor(a) for a in case.inputs]
    node = fused_node(entry.id, [t.node for t in leaves], case.params)
    outs = [fl.Tensor(v) for v in views(node)] if entry.output_views else [fl.Tensor(node)]
    loss = outs[0].sum()
    for o in outs[1:]:
        loss = loss + o.sum()
    for k, a in enumerate(case.inputs):
        if from_numpy(a.dtype).is_float:
            try:
                fl.realize(*fl.grad(loss, [leaves[k]]))
            except fl.NotDifferentiable:  # no gradient for this input (e.g. ALiBi slopes)
                continue


def units() -> list[Unit]:
    """Every impl's cases as units, one a run of consecutive cases of one group, the largest first."""
    from fuel.dispatch.impls import default_kernel_registry

    found = []
    for index in range(len(list(default_kernel_registry()))):
        name, cases, _ = _impl_cases(index)
        starts = [i for i, c in enumerate(cases) if i == 0 or c.group != cases[i - 1].group]
        found += [Unit(index, name, s, e) for s, e in zip(starts, [*starts[1:], len(cases)], strict=True)]
    return sorted(found, key=lambda u: u.start - u.stop)


def run_unit(unit: Unit) -> str:
    """Run one unit's cases (compiling what they call); its error as a line, or "" when it ran."""
    _, cases, run = _impl_cases(unit.index)
    try:
        for case in cases[unit.start:unit.stop]:
            run(case)
    except Exception as e:  # reported by the caller with the impl's name
        return f"{unit.name}, cases {unit.start}-{unit.stop - 1}: {type(e).__name__}: {e}"
    return ""


def precompile(jobs: int, progress: bool = True) -> list[str]:
    """Compile every registered kernel into Numba's cache with `jobs` processes; the failures, one line each."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ParamError(f"compile: jobs must be an int >= 1, got {jobs!r}")
    todo = units()
    failures: list[str] = []
    start = time.perf_counter()
    tty = sys.stderr.isatty()  # a line rewritten in place on a terminal, a line per tenth of the units elsewhere
    context = multiprocessing.get_context("spawn")  # no fork of a process whose thread pools are running
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        pending: set[Future[str]] = {pool.submit(run_unit, u) for u in todo}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            failures += [line for f in done if (line := f.result())]
            finished = len(todo) - len(pending)
            if progress and (tty or finished * 10 // len(todo) != (finished - len(done)) * 10 // len(todo)):
                line = f"compile: {finished}/{len(todo)} units, {time.perf_counter() - start:.0f} s"
                print("\r" + line if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
    if progress and tty:
        print(file=sys.stderr)
    return failures
