"""A capture's layout (`fuel.runtime.jit`): the steps folded at capture, and the arena of buffers the
replayed steps write."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fuel.dispatch import executor
from fuel.dispatch.plan import Step
from fuel.graph.node import Op
from fuel.graph.prims import MAY_ALIAS

# Primitives whose result may be their input's memory: the views, a reshape NumPy does as one, and a
# contiguize of what already is contiguous (NumPy hands the input back).
_SAME_MEMORY = (MAY_ALIAS | {Op.CONTIGUIZE}) - {Op.VIEW}


def fold(steps: Sequence[Step], template: list[Any], outputs: Sequence[int], constant: set[int]) -> list[Step]:
    """Run once, at capture, the primitive steps whose results are the same at every call; keep their
    results in `template` and return the steps left to replay. Two kinds are:

    - a step reading only constants (`constant`: slots of frozen captured arrays, `fuel.graph.node.frozen`,
      of the constants the passes made, and of what is folded from them), unless a destructive op writes
      its result (directly or through a view), which each call must compute afresh. A writable captured
      array is not a constant: the caller may update it in place between calls, and each call reads it.
    - a view of fixed values (any value in `template`: a captured array, or an arena buffer, which keeps
      its memory across calls) when it really is a view: it sees later writes to that memory. A reshape
      NumPy had to copy is not.

    Destructive steps, steps with DynScalars and outputs are never folded (each call hands out fresh ones).
    """
    fixed = {s for s, v in enumerate(template) if v is not None}
    constant = set(constant)
    written = _written(steps)
    out_slots = set(outputs)
    left = []
    with np.errstate(all="ignore"):
        for step in steps:
            if (step.prim is None or step.destructive is not None or step.dyn_fields or step.output in out_slots
                    or not all(s in fixed for s in step.inputs)):
                left.append(step)
                continue
            const = step.output not in written and all(s in constant for s in step.inputs)
            view = step.spec.op in MAY_ALIAS
            if not (const or view):
                left.append(step)
                continue
            srcs = [template[s] for s in step.inputs]
            res = executor.checked(step, step.prim(srcs, step.spec, None))
            if not const and not (res.size and np.may_share_memory(res, srcs[0])):
                left.append(step)  # a copy: it would not follow later writes
                continue
            if const:
                res.flags.writeable = False  # a constant like those it was computed from
                constant.add(step.output)
            template[step.output] = res
            fixed.add(step.output)
    return left


def _written(steps: Sequence[Step]) -> set[int]:
    """The slots whose memory a destructive step writes: its destroyed input, and what that is a view of."""
    made = {st.output: st for st in steps}
    written: set[int] = set()
    for st in steps:
        s = None if st.destructive is None else st.inputs[st.destructive]
        while s is not None and s not in written:
            written.add(s)
            src = made.get(s)
            if src is not None and src.prim is not None and src.spec.op in _SAME_MEMORY:
                s = src.inputs[0]
            elif src is not None and src.destructive is not None:
                s = src.inputs[src.destructive]
            else:
                s = None
    return written


def arena(steps: list[Step], outputs: Sequence[int],
           reuse_outputs: bool) -> tuple[dict[int, np.ndarray], int, set[int]]:
    """Raw buffers per step index (of `steps`) that owns one, the arena's total bytes and the step indices
    whose buffers hold outputs and are allocated per call.

    A step owns a buffer unless it is a view or destroys an input (those alias their input's buffer);
    argument and constant slots own none. A buffer whose last reader has run is handed to the next step
    of the same size. Buffers the outputs live in are left out (allocated per call), unless
    `reuse_outputs`.
    """
    base: dict[int, int] = {}  # slot -> the step index whose buffer holds its memory
    owner: set[int] = set()
    for k, step in enumerate(steps):
        if step.slots is not None:
            continue  # a multi-output step's buffers are allocated per call (its views alias them)
        alias = 0 if step.prim is not None and step.spec.op in MAY_ALIAS else step.destructive
        if alias is None:
            base[step.output] = k
            owner.add(k)
        elif step.inputs[alias] in base:
            base[step.output] = base[step.inputs[alias]]
    fresh = set() if reuse_outputs else {base[s] for s in outputs if s in base}
    releases: dict[int, list[int]] = {}
    last_read: dict[int, int] = {}
    for k, step in enumerate(steps):
        for s in step.inputs:
            if s in base:
                last_read[base[s]] = k
    for s in outputs:
        if s in base:
            last_read[base[s]] = len(steps)
    for b, k in last_read.items():
        releases.setdefault(k, []).append(b)
    free: dict[int, list[np.ndarray]] = {}
    buffers: dict[int, np.ndarray] = {}
    total = 0
    for k, step in enumerate(steps):
        if k in owner and k not in fresh:
            nbytes = int(np.prod(step.spec.shape)) * step.spec.dtype.np.itemsize
            pool = free.get(nbytes)
            if pool:
                buffers[k] = pool.pop()
            else:
                buffers[k] = np.empty(max(nbytes, 1), np.uint8)[:nbytes]
                total += nbytes
        for b in releases.get(k, ()):  # after this step's own buffer: a step never writes what it reads
            if b in buffers:
                free.setdefault(buffers[b].nbytes, []).append(buffers[b])
    return buffers, total, fresh


def shared_outputs(steps: Sequence[Step], outputs: Sequence[int]) -> tuple[bool, ...]:
    """Which outputs (their slots; -1: an argument or captured value returned as it is) a call must copy
    out so that it hands out arrays of its own: those whose memory is an argument's or a held value's
    (captured arrays, constants, values folded at capture: the slots no step of `steps` makes), and one
    whose memory an earlier output has.

    An output's memory is that of the step that made it, or, through views and destructive ops, that of
    the input they alias (a multi-output step's projections each have their own).
    """
    made = {st.output: st for st in steps}
    made.update({slot: st for st in steps for _, slot, _ in st.siblings})
    seen: set[int] = set()
    copy = []
    for s in outputs:
        if s < 0:
            copy.append(True)
            continue
        while (st := made.get(s)) is not None:
            if st.prim is not None and st.spec.op in _SAME_MEMORY:
                s = st.inputs[0]
            elif st.destructive is not None:
                s = st.inputs[st.destructive]
            else:
                break
        copy.append(s not in made or s in seen)
        seen.add(s)
    return tuple(copy)
