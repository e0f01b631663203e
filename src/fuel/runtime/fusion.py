"""Elementwise chains in native replay: consecutive elementwise steps of one shape run as one job.

An optimizer update (and many a forward and backward stretch) is a run of elementwise primitives, each of
which, as its own job, reads and writes whole tensors: AdamW's is 14 passes over every parameter plus the
assign copies. `native_chains` finds such runs among a capture's prepared steps and gives each group one
job (`fuel.cpu.prims.chain`) that walks the elements in tiles, applies the group's ops in order to each
tile and writes only the values read outside the group: its kept values, the capture's outputs and the
assigns' targets. Each element sees the same operations in the same order as the separate steps, so the
bytes are the same.

The rules that make one pass over the elements equal to the steps one after another:
- A step joins only with the steps right before and after it in the replay order (a group never spans a
  step outside it, so a destructive op keeps its place relative to every other reader of what it
  destroys), and only steps of one shape and dtype, each of an op and layout the chain computes (`form`).
- A value read after the group (by memory: its buffer, a view of it, or its slot, by any later step) or
  handed out is written to its buffer. What a later step reads is found by memory: the last step before it
  that wrote the whole buffer of what it reads (arena buffers are written whole) made the value it reads.
- Elements are independent only where no operand read from memory overlaps a buffer the group writes with
  another element mapping (a broadcast, transposed or shifted read of it), and no two writes overlap with
  different mappings: element e of one would meet element e' != e of the other across tiles. Such a pair
  cuts the group between its two steps (a step at odds with itself runs alone, as its own job or in Python);
  so does a step whose arrays share no `[rows, cols]` split with those of the steps before it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuel.dispatch.plan import Step
from fuel.runtime.jobs import Job, Jobs

CHAIN_MODULE = "fuel.cpu.prims.chain"  # the chain task and its forms, imported on first use


@dataclass
class Entry:
    """A replayed step as prepared: the arrays it reads (None where unknown until the call), the array it
    writes (None for none of the capture's), its own jobs, and its chain form (None: it joins no chain)."""

    step: Step
    xs: list[np.ndarray | None]
    out: np.ndarray | None
    jobs: Jobs | None
    form: Any = None


def chain_form(step: Step, xs: list[np.ndarray | None], out: np.ndarray | None) -> Any:
    """The step's `chain.Form`, or None where it cannot join a chain."""
    if step.prim is None or step.dyn_fields or out is None or any(x is None for x in xs):
        return None
    return importlib.import_module(CHAIN_MODULE).form(step.spec, step.params, xs, out)


def _root(a: np.ndarray) -> int:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return id(a)


def _mapping(a: np.ndarray, shape: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    return a.ctypes.data, np.broadcast_to(a, shape).strides


def content_readers(entries: Sequence[Entry], handed: Sequence[np.ndarray]) -> dict[int, list[tuple[int, int, bool]]]:
    """Per entry of a chain-form step, who reads the value it makes: (reader entry, input, by its slot);
    `handed`, the arrays of the capture's outputs, are read after the last entry (reader len(entries))."""
    made = {e.step.output: j for j, e in enumerate(entries) if e.form is not None}
    last: dict[int, int] = {}  # buffer root -> the entry that last wrote all of it
    readers: dict[int, list[tuple[int, int, bool]]] = {j: [] for j in made.values()}
    final = ((-1,) * len(handed), list(handed))
    for k, e in enumerate([*entries, None]):
        for i, (s, x) in enumerate(zip(*((e.step.inputs, e.xs) if e is not None else final), strict=True)):
            j = made.get(s)
            if j is not None:
                readers[j].append((k, i, True))
            if x is not None:
                w = last.get(_root(x))
                if w is not None and w != j and w in readers and np.may_share_memory(x, entries[w].out):
                    readers[w].append((k, i, False))
        if e is not None and e.out is not None and e.step.destructive is None:
            last[_root(e.out)] = k
    return readers


def _evaluate(entries: Sequence[Entry], group: list[int], readers: dict[int, list[tuple[int, int, bool]]],
              outputs: Set[int]) -> tuple[dict[int, bool], list[tuple[int, int]]]:
    """(which members' values the group writes, the (earlier, later) member pairs that cannot share it:
    a read and a write, or two writes, of overlapping memory at other elements, and the first member whose
    arrays share no [rows, cols] split with those before it, `chain.plane`, paired with the one before it,
    or with itself where its own arrays share none)."""
    chain = importlib.import_module(CHAIN_MODULE)
    members = set(group)
    made = {entries[j].step.output for j in group}
    store = {j: entries[j].step.destructive is not None or entries[j].step.output in outputs
             or any(k not in members or not by_slot for k, _, by_slot in readers[j]) for j in group}
    shape = entries[group[0]].step.spec.shape
    loads = [(k, x) for k in group for i, x in _memory_operands(entries[k], made)]
    writes = [(j, entries[j].form.dest) for j in group if store[j]]
    clashes = []
    for n, (j, w) in enumerate(writes):
        for k, x in loads + writes[:n]:
            if np.may_share_memory(x, w) and _mapping(x, shape) != _mapping(w, shape):
                clashes.append((min(j, k), max(j, k)))
    common = frozenset(range(len(shape) + 1))
    for n, j in enumerate(group):
        own = frozenset(range(len(shape) + 1))
        for k, x in loads + writes:
            if k == j:
                own &= chain.splits(x, shape)
        if not own & common:
            clashes.append((j if not own or n == 0 else group[n - 1], j))
            break
        common &= own
    return store, clashes


def _memory_operands(e: Entry, made: Set[int]) -> list[tuple[int, np.ndarray]]:
    """(input, array) of each operand the member reads from memory: those no earlier member makes."""
    found = []
    for o in e.form.operands:
        if isinstance(o, int) and e.step.inputs[o] not in made:
            x = e.xs[o]
            assert x is not None  # a chain form's inputs are known
            found.append((o, x))
    return found


def _groups(entries: Sequence[Entry], run: list[int], readers: dict[int, list[tuple[int, int, bool]]],
            outputs: Set[int]) -> list[tuple[list[int], dict[int, bool]]]:
    """`run` cut into groups without clashes, each with its stores, in order."""
    done = []
    todo = [run]
    while todo:
        group = todo.pop()
        store, clashes = _evaluate(entries, group, readers, outputs)
        if not clashes:
            done.append((group, store))
            continue
        a, b = min(clashes, key=lambda c: c[1])
        cut = group.index(b)
        left, right = group[:cut], group[cut + 1:] if a == b else group[cut:]
        todo += [g for g in (left, right) if g]
        if a == b and entries[b].jobs is not None:
            done.append(([b], {}))  # alone: its own job
    return sorted(done, key=lambda g: g[0][0])


def _program(entries: Sequence[Entry], group: list[int], store: dict[int, bool]) -> list[Any]:
    chain = importlib.import_module(CHAIN_MODULE)
    program: list[Any] = []
    value: dict[int, int] = {}  # slot -> the instruction defining its value
    loaded: dict[int, tuple[int, np.ndarray]] = {}  # slot read from memory -> (its value, the array)
    for j in group:
        e = entries[j]
        args = []
        for o in e.form.operands:
            if isinstance(o, np.ndarray):
                program.append(chain.Instr(chain.LOAD, array=o))
                args.append(len(program) - 1)
                continue
            s = e.step.inputs[o]
            if s in value:
                args.append(value[s])
                continue
            if s not in loaded:
                program.append(chain.Instr(chain.LOAD, array=e.xs[o]))
                loaded[s] = (len(program) - 1, e.xs[o])
            args.append(loaded[s][0])
        if e.form.code == chain.COPY:
            v = args[0]
        else:
            program.append(chain.Instr(e.form.code, *args))
            v = len(program) - 1
        value[e.step.output] = v
        if store[j]:
            program.append(chain.Instr(chain.STORE, v, array=e.form.dest))
            loaded = {s: lx for s, lx in loaded.items() if not np.may_share_memory(lx[1], e.form.dest)}
    return program


def native_chains(entries: Sequence[Entry], outputs: Set[int], handed: Sequence[np.ndarray]) -> dict[int, Jobs | None]:
    """The jobs that replace the entries' own: a group's chain job at its first member and None (nothing to
    post) at the others. An entry not in the answer keeps its own jobs (or stays in Python). `outputs`: the
    capture's output slots, `handed` the arrays known for them (read once the call's steps have run)."""
    readers = content_readers(entries, handed)
    chain = importlib.import_module(CHAIN_MODULE)
    found: dict[int, Jobs | None] = {}
    k = 0
    while k < len(entries):
        if entries[k].form is None:
            k += 1
            continue
        spec = entries[k].step.spec
        run = [k]
        while (k + len(run) < len(entries) and entries[k + len(run)].form is not None
               and entries[k + len(run)].step.spec.shape == spec.shape
               and entries[k + len(run)].step.spec.dtype == spec.dtype):
            run.append(k + len(run))
        k += len(run)
        for group, store in _groups(entries, run, readers, outputs):
            if len(group) == 1 and entries[group[0]].jobs is not None:
                continue  # alone: its own job
            job: Job | None = chain.chain_job(spec.shape, _program(entries, group, store))
            if job is not None:
                found.update({j: None for j in group})
                found[group[0]] = job
    return found
