"""Native replay: a captured plan's steps run as one compiled loop over their prepared jobs.

A replayed decode step is hundreds of kernels of 1-100 µs, and Python around each one (the replay loop,
the kernel's entry, its argument checks) costs microseconds a step. A kernel's work is a job of the pool
(`fuel.runtime.jobs`): a task reading its arguments from a record, and a replayed step reads and writes the
same arrays every call. So a capture prepares each such step's job once and runs a whole stretch of them
with one call into jitted code (`pool.run_steps`), which stores the call's DynScalar values into the
records, picks each job's part count and posts it.

What makes a step native:
- its kernel has a job builder (`jobs.kernel` or `jobs.replays` for a fused op's kernel, `prim_job` for a
  primitive), and the builder accepts these arrays and params (it returns None otherwise: another dtype, a
  layout it does not read, a size its task does not cover);
- every array it reads or writes is the same at every call: a captured value, an arena buffer, a fold or
  view of them, or an argument, copied into a buffer of the capture's own first ("staged"). A Python
  step's result that does not come back in its arena buffer is copied there. A small fresh output (a
  `jit` without `reuse_outputs`) is written into a buffer of the capture's own and copied out at the end
  of the call, where its step has a job; a larger one, or what a step allocates outside the arena,
  keeps the steps that touch it in Python.
A replayed job is the one the eager kernel runs (same task, same record), so the bytes are the same.
Runs of consecutive elementwise steps of one shape run as one chain job instead (`fuel.runtime.fusion`,
`CHAINS`), which applies the steps' own operations in their order to each element, so the bytes are the
same again; a step whose only job is a chain's (SQRT, a transposed operand) joins one too.

DynScalars: a job names the argv words that take a DynScalar's value (`Job.dyn`) with the range the
value must lie in; a call whose values fall outside any range runs in Python, whose kernels raise the
precise error. A job's time estimate may scale with one argv word (`Job.unit`: FlashAttn's live keys),
so the part count follows the value as `pool.parts_for` would.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuel.dispatch.plan import Step
from fuel.graph.node import DynScalar, Op, OpSpec
from fuel.graph.prims import MAY_ALIAS
from fuel.runtime import pool
from fuel.runtime.fusion import Entry, chain_form, native_chains
from fuel.runtime.jobs import Job, Jobs, builder_of

PrimBuilder = Callable[[list[np.ndarray], OpSpec, np.ndarray, Any], Jobs | None]
_PRIMS: dict[Op, PrimBuilder] = {}
PRIM_MODULE = "fuel.cpu.prims.prim_tasks"  # registers the primitives' builders when imported
CHAINS = True  # runs of elementwise steps run as one job each (`fuel.runtime.fusion`); False: a job a step


def prim_job(*ops: Op) -> Callable[[PrimBuilder], PrimBuilder]:
    """Register `builder(inputs, spec, out, arg) -> Job | None` for these primitives (arg as built)."""

    def register(builder: PrimBuilder) -> PrimBuilder:
        for op in ops:
            _PRIMS[op] = builder
        return builder

    return register


def jobs_of(step: Step, xs: list[np.ndarray], out: np.ndarray) -> Jobs | None:
    """The step's job (or jobs, in order) over these arrays, or None where it has none."""
    if step.prim is not None:
        importlib.import_module(PRIM_MODULE)
        prim = _PRIMS.get(step.spec.op)
        return None if prim is None else prim(xs, step.spec, out, step.params)
    if step.impl is None or step.joint is not None or step.slots is not None or step.destructive is not None:
        return None
    fused = builder_of(step.impl.kernel)
    return None if fused is None else fused(xs, out, step.params)


def dyn_name(v: Any) -> str | None:
    """The name of a DynScalar parameter, None for a plain value."""
    return v.name if isinstance(v, DynScalar) else None


@dataclass
class Program:
    """A capture's native steps: `steps` int64 [n, 6] (task address, argv address, most parts, unit
    index, first and end patch), `seconds` [n], `patches` int64 [p, 3] (argv address, index, env slot),
    `env` the call's DynScalar values by slot, with each slot's admissible range."""

    steps: np.ndarray
    seconds: np.ndarray
    patches: np.ndarray
    env: np.ndarray
    names: tuple[str, ...]
    low: tuple[int, ...]
    high: tuple[int, ...]
    jobs: list[Job]  # kept alive: the argvs the steps point at
    checks: tuple[tuple[int, Callable[[], None]], ...] = ()  # (job index, its `Job.check`), in order

    def bind(self, env: dict[str, int]) -> bool:
        """Store the call's DynScalar values; False where one is missing or out of its range."""
        for i, name in enumerate(self.names):
            v = env.get(name)
            if v is None or not self.low[i] <= v <= self.high[i]:
                return False
            self.env[i] = v
        return True

    def run(self, start: int, stop: int) -> None:
        pool.run_steps(self.steps, self.seconds, self.patches, self.env, start, stop)
        for k, check in self.checks:  # a job's data error is raised once its stretch has run
            if start <= k < stop:
                check()


def program(jobs: Sequence[Job]) -> Program:
    """The jobs, in order, as one program."""
    names: list[str] = []
    low: list[int] = []
    high: list[int] = []
    patches: list[tuple[int, int, int]] = []
    steps = np.zeros((len(jobs), 6), np.int64)
    for k, f in enumerate(jobs):
        addr = int(f.argv.ctypes.data)
        steps[k, :4] = f.task, addr, f.most, f.unit
        steps[k, 4] = len(patches)
        for index, name, lo, hi in f.dyn:
            if name not in names:
                names.append(name)
                low.append(lo)
                high.append(hi)
            slot = names.index(name)
            low[slot], high[slot] = max(low[slot], lo), min(high[slot], hi)
            patches.append((addr, index, slot))
        steps[k, 5] = len(patches)
    return Program(steps, np.array([f.seconds for f in jobs], np.float64),
                   np.array(patches, np.int64).reshape(-1, 3), np.zeros(max(len(names), 1), np.int64),
                   tuple(names), tuple(low), tuple(high), list(jobs),
                   tuple((k, f.check) for k, f in enumerate(jobs) if f.check is not None))


STAGE_MAX_BYTES = 4 << 20  # arguments up to this size are copied into the capture's own buffers
# Fresh outputs up to this size are written by native steps into the capture's own buffers and copied out:
# below it a copy costs less than a step left in Python (docs/performance/runtime.md, "replay").
OUT_STAGE_MAX_BYTES = 256 << 10


@dataclass
class Native:
    """A capture's native replay: `items` is its replay list with each stretch of native steps replaced by
    (start, stop) of `program`; `stage` the (slot, buffer) each argument is copied into first, `fixed` the
    (slot, array) of every native step's output and of each view taken once, which later steps read."""

    program: Program
    items: list[tuple[Any, ...]]
    stage: list[tuple[int, np.ndarray]]
    fixed: list[tuple[int, np.ndarray]]
    watch: dict[int, np.ndarray]  # a Python step's output slot -> the array native steps read it from
    step_count: int  # the replayed steps that run as native jobs (a step may post two: `program` has its jobs)
    copied: frozenset[int]  # output slots whose arrays are the capture's own: the call hands out copies
    # The bytes it allocated beside the capture's arena (staged arguments and outputs, the scratch its jobs
    # keep), counted against `fl.jit`'s `max_arena_bytes` with the arena.
    own_bytes: int = 0
    chained: int = 0  # the steps run inside elementwise chains (`fuel.runtime.fusion`)
    chain_jobs: int = 0  # the chain jobs that run them

    def enter(self, slots: list[Any]) -> None:
        for s, buf in self.stage:
            np.copyto(buf, slots[s])
            slots[s] = buf
        for s, a in self.fixed:
            slots[s] = a


def prepare(steps: Sequence[Step], fast: Sequence[tuple[Any, ...]], template: list[Any], args: Sequence[Any],
            arg_slots: Sequence[tuple[int, int]], fresh: Set[int] = frozenset(),
            outputs: Sequence[int] = ()) -> Native | None:
    """The native replay of a capture's replayed `steps` (`fast`: their entries in the replay loop, whose
    4th field is the arena buffer a step writes), given its `template` and the arguments of a call; None
    where no step has a job. `fresh`: the output slots each call allocates, `outputs` all output slots.

    The arrays a step may be given a job over: the template's (captured values, arena buffers, folds of
    them), staged arguments, the buffers native steps write, a Python step's arena buffer or the input it
    destroys (its result is copied there, should it ever come back elsewhere: `Native.watch`), and views
    of all these, taken here once, as the capture folds those of its own values. A fresh output's step
    with a job writes a buffer of its own here (`OUT_STAGE_MAX_BYTES`), which outputs are copied from."""
    destroyed = {st.inputs[st.destructive] for st in steps if st.destructive is not None}
    stage = {s: np.empty(args[i].shape, args[i].dtype) for s, i in arg_slots
             if s not in destroyed and isinstance(args[i], np.ndarray) and args[i].nbytes <= STAGE_MAX_BYTES}
    own: dict[int, np.ndarray] = {s: v for s, v in enumerate(template) if isinstance(v, np.ndarray)}
    own.update(stage)
    own_bytes = sum(b.nbytes for b in stage.values())
    entries: list[tuple[Entry, tuple[Any, ...]]] = []
    fixed: list[tuple[int, np.ndarray]] = []
    for step, entry in zip(steps, fast, strict=True):
        found = [own.get(s) for s in step.inputs]
        xs = [x for x in found if x is not None]
        known = len(xs) == len(found)
        out: np.ndarray | None = entry[3]
        if step.destructive is not None:
            out = xs[step.destructive] if known else None
        jobs = None
        if known and step.prim is not None and step.spec.op in MAY_ALIAS and not step.dyn_fields:
            view = step.prim(xs, step.spec, None)  # of arrays fixed from call to call: fixed too
            if view.size and np.may_share_memory(view, xs[0]):
                own[step.output] = view
                fixed.append((step.output, view))
                continue
        if known and out is None and step.output in fresh:
            out, jobs = stage_output(step, xs)
            own_bytes += out.nbytes if out is not None else 0
        elif known and out is not None:
            jobs = jobs_of(step, xs, out)
        if out is not None:
            own[step.output] = out
        entries.append((Entry(step, found, out, jobs, chain_form(step, found, out) if CHAINS else None), entry))
    # Runs of elementwise steps as one job each (`fuel.runtime.fusion`): step k's jobs, None for a member
    # that its group's first step runs.
    chains = native_chains([e for e, _ in entries], frozenset(outputs),
                           [own[s] for s in outputs if s in own]) if CHAINS else {}
    posted: list[Job] = []
    items: list[tuple[Any, ...]] = []
    watch: dict[int, np.ndarray] = {}
    start = step_count = 0
    for k, (e, entry) in enumerate(entries):
        if k not in chains and e.jobs is None:
            if len(posted) > start:
                items.append((start, len(posted)))
                start = len(posted)
            items.append(entry)
            if e.out is not None:
                watch[e.step.output] = e.out
            continue
        jobs = chains.get(k, e.jobs)
        if jobs is not None:
            posted.extend((jobs,) if isinstance(jobs, Job) else jobs)  # a Job is a tuple too
        assert e.out is not None  # a job writes it
        fixed.append((e.step.output, e.out))
        step_count += 1
    if not posted:
        return None
    if len(posted) > start:
        items.append((start, len(posted)))
    # outputs in the capture's own buffers: a native step's, or a Python step's whose chain did not form
    staged = [a for s, a in [*fixed, *watch.items()] if s in fresh]
    copied = frozenset(s for s in outputs if isinstance(own.get(s), np.ndarray)
                       and any(np.may_share_memory(own[s], a) for a in staged))
    own_bytes += sum(k.nbytes for f in posted for k in f.keep)
    return Native(program(posted), items, list(stage.items()), fixed, watch, step_count, copied, own_bytes,
                  len(chains), sum(j is not None for j in chains.values()))


def stage_output(step: Step, xs: list[np.ndarray]) -> tuple[np.ndarray | None, Jobs | None]:
    """(a buffer for a fresh output's step, its job writing it: None where it can join a chain), or (None,
    None) where the output is over `OUT_STAGE_MAX_BYTES` or the step has no job. The copy out is a memcpy;
    the Python step it spares costs the replay's loop, the kernel's entry and its checks
    (docs/performance/runtime.md, "replay"). A fresh output's step is never a view, a destructive step nor
    a multi-output one: those own no buffer (`jit._arena`)."""
    nbytes = math.prod(step.spec.shape) * step.spec.dtype.np.itemsize
    if nbytes > OUT_STAGE_MAX_BYTES:
        return None, None
    out = np.empty(step.spec.shape, step.spec.dtype.np)
    jobs = jobs_of(step, xs, out)
    if jobs is None and not (CHAINS and chain_form(step, list(xs), out) is not None):
        return None, None
    return out, jobs
