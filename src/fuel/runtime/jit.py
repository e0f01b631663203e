"""Capture and replay: `f = fl.jit(fn)` traces `fn` once per input signature and replays its plan.

The contract:
- `fn` takes Tensors (one per positional argument) and returns a Tensor or a tuple/list of Tensors,
  built with the lazy API. It must not realise anything itself: its graph is traced once. Realising a
  value that depends on an argument or on a writable captured array raises RealizeInTrace
  (`fuel.graph.traced`); one computed from constants alone may be realised.
- `f(*args, **env)`: `args` are arrays or realised Tensors; their shapes and dtypes are the signature
  (a new signature traces again); keyword arguments bind DynScalars (`f(x, k_len=17)`) to integers
  (any `numbers.Integral` or 0-d integer array; a float or a bool is a ParamError).
- The first call of a signature traces `fn`, plans the graph (CSE, fusion, lowering, scheduling) and
  lays out an arena: every intermediate gets a buffer, and buffers whose values are dead are shared
  by later steps of the same size. Later calls bind the new arrays and DynScalar values and run the
  steps: no graph is built, nothing is keyed, no intermediate is allocated.
- Outputs are fresh arrays each call, so a result already handed out is never overwritten; with
  `reuse_outputs=True` they live in the arena too, and the next call overwrites them. Either way an
  output never shares memory with an argument, a captured array or another output: one that would (an
  argument or captured array returned as is or viewed, a destructive op's result, a tensor returned
  twice) is copied out (`arena.shared_outputs`). A small output
  whose step runs natively is written into a buffer of the capture's own and copied out
  (`replay.OUT_STAGE_MAX_BYTES`).
- Each signature keeps its capture (and arena) for the life of `f`; `fl.jit(fn, max_arena_bytes=n)`
  drops the least recently used ones once the bytes they hold (arenas, and the native replay's staged
  buffers) pass n, for callers that see many shapes.
- Leaves `fn` captures from outside (weights) are held by the capture and read on every call, so an
  array updated in place between calls is seen. Work on them is done once, at capture, only where it
  cannot change: arithmetic reading constants alone (read-only arrays with no writable base,
  `fl.tensor(arr, const=True)`, Python numbers; `fuel.graph.node.frozen`), and views of captured
  arrays, which see their updates (`arena.fold`). A destructive op writes into its input as in
  `realize`, be it an argument or a captured array. Every destructive op `fn` builds runs at every call,
  in graph order, even when no output reads it: an optimizer's in-place parameter updates are the step's
  effects, and `fn` returns only the loss.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuel.dispatch import executor
from fuel.dispatch.impls import default_kernel_registry
from fuel.dispatch.plan import Plan, Step
from fuel.dtype import from_numpy
from fuel.errors import ParamError
from fuel.graph.node import Node, Op, dyn_value, is_constant, topo_order
from fuel.graph.registry import default_registry
from fuel.graph.traced import effects as traced_effects
from fuel.graph.traced import tracing
from fuel.runtime import replay
from fuel.runtime.arena import arena, fold, shared_outputs

_QUIET = contextlib.nullcontext()
_NOTHING: dict[int, np.ndarray] = {}
_NONE_COPIED: frozenset[int] = frozenset()

Signature = tuple[tuple[tuple[int, ...], np.dtype[Any]], ...]


@dataclass(frozen=True)
class _Run:
    """One step as the replay loop reads it."""

    step: Step
    out: np.ndarray | None  # the arena buffer it writes, or None (a view, or a fresh output)
    check: tuple[int, ...]  # inputs that may arrive non-contiguous (arguments and views)


class Capture:
    """One traced signature: its plan, arena and the leaves it holds."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[np.ndarray], fuse: bool, reuse_outputs: bool) -> None:
        placeholders = [Node(Op.CONST, (), a.shape, from_numpy(a.dtype), None, a) for a in args]
        from fuel.graph.tensor import Tensor

        with tracing(placeholders):  # fn may not realise what depends on them (`fuel.graph.traced`)
            result = fn(*(Tensor(p) for p in placeholders))
            effects = traced_effects()
        self.single = isinstance(result, Tensor)
        outs = [result] if self.single else list(result) if isinstance(result, (tuple, list)) else None
        if outs is None or not all(isinstance(t, Tensor) for t in outs):
            raise ParamError(f"jit: fn must return a Tensor or a tuple/list of Tensors, got {type(result).__name__}")
        nodes = [t.node for t in outs]
        roots = [n for n in nodes if n.value is None]
        reached = {id(n) for n in topo_order(roots)}
        roots += [n for n in effects if id(n) not in reached]  # writes no output reads still run
        order = topo_order(roots)
        leaves = [n for n in order if n.value is not None]
        position = {id(p): i for i, p in enumerate(placeholders)}
        plan = executor.build_plan(roots, leaves, fuse, default_registry(), default_kernel_registry())
        self._layout(plan, leaves, position, nodes, roots, reuse_outputs)
        self.n_steps = len(self.runs)  # the steps each call replays
        self.dyn = tuple(sorted({getattr(r.step.params, f).name for r in self.runs for f in r.step.dyn_fields}))
        self._checked = False
        self._lock = threading.Lock()  # one capture's arena serves one call at a time
        self.native: replay.Native | None = None  # prepared after the first call (`fuel.runtime.replay`)

    def _layout(self, plan: Plan, leaves: list[Node], position: dict[int, int], nodes: list[Node],
                roots: list[Node], reuse_outputs: bool) -> None:
        template: list[Any] = [None] * plan.n_slots
        self.arg_slots: list[tuple[int, int]] = []  # (slot, argument index)
        constant = set(plan.baked)  # slots whose values cannot change between calls
        for leaf, s in zip(leaves, plan.leaf_slots, strict=True):
            if s < 0:
                continue
            if id(leaf) in position:
                self.arg_slots.append((s, position[id(leaf)]))
            else:
                template[s] = leaf.value  # a captured weight or constant, read by every call
                if is_constant(leaf):
                    constant.add(s)
        for s, v in plan.baked.items():
            template[s] = v
        # Fold what reads constants only and the views of captured arrays, then lay out the arena, then fold
        # the views of arena buffers (their memory is fixed too, so a reshape of one is the same view every call).
        steps = fold(plan.steps, template, plan.outputs, constant)
        buffers, self.arena_bytes, fresh = arena(steps, plan.outputs, reuse_outputs)
        self.fresh = {steps[k].output for k in fresh}  # output slots each call allocates
        owned_slots = {steps[k].output for k in buffers}
        for k, raw in buffers.items():
            template[steps[k].output] = raw.view(steps[k].spec.dtype.np).reshape(steps[k].spec.shape)
        replayed = fold(steps, template, plan.outputs, set())
        self.n_folded = len(plan.steps) - len(replayed)
        self.runs: list[_Run] = [
            _Run(step, template[step.output] if step.output in owned_slots else None,
                 tuple(i for i, s in enumerate(step.inputs) if s not in owned_slots))
            for step in replayed]
        self.template = template
        # The steady-state loop's view of each step (no tracing, outputs already checked once): a primitive
        # without DynScalars as (kernel, inputs, spec, out, output slot), anything else as its _Run.
        self.fast: list[tuple[Any, ...]] = [
            (r.step.prim, r.step.inputs, r.step.spec, r.out, r.step.output) if r.step.prim is not None
            and not r.step.dyn_fields else (None, r.step.inputs, r, r.out, r.step.output) for r in self.runs]
        # NumPy's primitives may warn on inf/NaN (silenced, as the executor does); fused kernels never do,
        # and np.errstate costs a tenth of a one-op replay (docs/performance/runtime.md, "jit").
        self._numpy_steps = any(r.step.prim is not None for r in self.runs)
        # Each output is a slot of the plan, an argument fn returned as it is, or a captured value.
        self.output_slots = tuple(plan.outputs)
        self.outputs: list[tuple[int, int, np.ndarray | None]] = [
            (plan.outputs[roots.index(n)], -1, None) if n.value is None
            else (-1, position[id(n)], None) if id(n) in position else (-1, -1, n.value) for n in nodes]
        self.copy_out = shared_outputs(steps, [s for s, _, _ in self.outputs])
        self._copies = any(self.copy_out)

    @property
    def held_bytes(self) -> int:
        """The arena's bytes and those of the native replay's own buffers, once prepared."""
        return self.arena_bytes + (self.native.own_bytes if self.native is not None else 0)

    def run(self, args: Sequence[np.ndarray], env: dict[str, int]) -> list[np.ndarray]:
        if len(env) != len(self.dyn) or any(n not in env for n in self.dyn):
            self._check_names(env)
        slots = list(self.template)
        for s, i in self.arg_slots:
            slots[s] = args[i]
        tracers = executor.tracing()
        first = not self._checked
        with np.errstate(all="ignore") if self._numpy_steps else _QUIET:
            if not tracers and not first:
                copied = self._replay(slots, env)
                return self._outputs(slots, args, copied)
            for r in self.runs:
                start = time.perf_counter() if tracers else 0.0
                step = r.step
                xs = [slots[i] for i in step.inputs]
                if step.prim is not None:
                    res = step.prim(xs, executor.prim_spec(step, env) if step.dyn_fields else step.spec, r.out)
                    if first or tracers:  # a traced replay runs here too: NumPy's 0-d results become arrays
                        res = executor.checked(step, res)
                    copies = 0
                else:
                    res, copies = executor.run_fused(step, xs, r.out, env, r.check, slots)
                slots[step.output] = res
                if tracers:
                    executor.record(step, start, copies)
        if first:
            self.native = replay.prepare([r.step for r in self.runs], self.fast, self.template, args, self.arg_slots,
                                         self.fresh, self.output_slots)
        self._checked = True
        return self._outputs(slots, args)

    def _replay(self, slots: list[Any], env: dict[str, int]) -> frozenset[int]:
        """The steady-state loop: `run`'s without tracing or output checks, its lookups done at capture.
        Returns the output slots whose arrays are the capture's own, to be copied out."""
        run_fused, prim_spec = executor.run_fused, executor.prim_spec
        nat, items, watch, copied = self.native, self.fast, _NOTHING, _NONE_COPIED
        if nat is not None and nat.program.bind(env):
            nat.enter(slots)
            items, watch, copied = nat.items, nat.watch, nat.copied
        for item in items:
            if len(item) == 2:  # a stretch of native steps
                nat.program.run(*item)  # type: ignore[union-attr]
                continue
            prim, inputs, spec, out, o = item
            xs = [slots[i] for i in inputs]
            if prim is not None:
                slots[o] = prim(xs, spec, out)
            elif spec.step.prim is not None:
                slots[o] = spec.step.prim(xs, prim_spec(spec.step, env), out)
            else:
                slots[o] = run_fused(spec.step, xs, out, env, spec.check, slots)[0]
            if o in watch and slots[o] is not watch[o]:  # native steps read it there
                np.copyto(watch[o], slots[o])
                slots[o] = watch[o]
        return copied

    def _outputs(self, slots: list[Any], args: Sequence[np.ndarray],
                 copied: frozenset[int] = _NONE_COPIED) -> list[np.ndarray]:
        outs: list[np.ndarray] = [slots[s] if s >= 0 else args[i] if i >= 0 else c  # type: ignore[misc]
                                  for s, i, c in self.outputs]
        if copied or self._copies:  # native steps wrote them into the capture's own buffers, or they alias
            outs = [o.copy() if own or s in copied else o
                    for o, own, (s, _, _) in zip(outs, self.copy_out, self.outputs, strict=True)]
        return outs

    def _check_names(self, env: dict[str, int]) -> None:
        """A clear error for an unbound DynScalar, or for a keyword the graph has no DynScalar for (a typo
        would otherwise be ignored silently)."""
        uses = ", ".join(self.dyn) or "none"
        for n in self.dyn:
            if n not in env:
                raise ParamError(f"jit: dynamic scalar {n!r} is unbound; call f(..., {n}=…) (the graph uses: {uses})")
        extra = sorted(set(env) - set(self.dyn))
        raise ParamError(f"jit: got {extra[0]}={env[extra[0]]!r}, but the traced graph has no DynScalar "
                         f"{extra[0]!r} (it uses: {uses})")


class Jit:
    """A function traced once per input signature and replayed; see the module docstring."""

    def __init__(self, fn: Callable[..., Any], *, reuse_outputs: bool = False, fuse: bool = True,
                 max_arena_bytes: int | None = None) -> None:
        if not callable(fn):
            raise ParamError(f"jit: expects a callable, got {type(fn).__name__}")
        if max_arena_bytes is not None and (isinstance(max_arena_bytes, bool) or not isinstance(max_arena_bytes, int)
                                            or max_arena_bytes < 0):
            raise ParamError(f"jit: max_arena_bytes must be a non-negative integer or None, got {max_arena_bytes!r}")
        self.fn = fn
        self.reuse_outputs = reuse_outputs
        self.fuse = fuse
        self.max_arena_bytes = max_arena_bytes
        self._captures: OrderedDict[Signature, Capture] = OrderedDict()
        self._lock = threading.Lock()
        self.__wrapped__ = fn
        self.__doc__ = fn.__doc__

    def __call__(self, *args: Any, **env: Any) -> Any:
        arrays = [a if type(a) is np.ndarray and a.dtype.kind != "b" else _array(a) for a in args]
        for name, v in env.items():
            if type(v) is not int:
                env[name] = dyn_value("jit", name, v)
        sig: Signature = tuple((a.shape, a.dtype) for a in arrays)
        capture = self._captures.get(sig)
        if capture is None:
            with self._lock:
                capture = self._captures.get(sig)
                if capture is None:
                    capture = Capture(self.fn, arrays, self.fuse, self.reuse_outputs)
                    self._captures[sig] = capture
                    self._evict()
        elif self.max_arena_bytes is not None:
            with self._lock:
                if sig in self._captures:
                    self._captures.move_to_end(sig)  # most recently used last
        with capture._lock:  # one capture's arena serves one call at a time
            values = capture.run(arrays, env)
        outs = [_leaf(v) for v in values]
        return outs[0] if capture.single else tuple(outs)

    def _evict(self) -> None:
        """Drop the least recently used captures while the bytes they hold pass `max_arena_bytes` (the newest
        always stays): each signature's arena holds all its intermediates for as long as it is kept, and
        its native replay the buffers it stages arguments and outputs in (`Capture.held_bytes`)."""
        if self.max_arena_bytes is None:
            return
        total = sum(c.held_bytes for c in self._captures.values())
        while total > self.max_arena_bytes and len(self._captures) > 1:
            _, dropped = self._captures.popitem(last=False)
            total -= dropped.held_bytes

    def capture_for(self, *args: Any) -> Capture | None:
        """The capture that serves these arguments' signature, once traced (for inspection)."""
        return self._captures.get(tuple((a.shape, a.dtype) for a in map(_array, args)))

    @property
    def captures(self) -> int:
        return len(self._captures)


def _leaf(v: np.ndarray) -> Any:
    return _tensor_class()(Node(Op.CONST, (), v.shape, from_numpy(v.dtype), None, v))


@functools.cache
def _tensor_class() -> Any:
    from fuel.graph.tensor import Tensor  # the graph package imports this module: bound on first use

    return Tensor


def _array(a: Any) -> np.ndarray:
    from fuel.graph.tensor import Tensor

    if isinstance(a, Tensor):
        if a.node.value is None:
            a.realize()
        value = a.node.value
        assert value is not None
        return value
    arr = np.asarray(a)
    if arr.dtype == np.bool_:
        arr = arr.astype(np.uint8)
    from_numpy(arr.dtype)  # a clear DTypeError for a dtype fuel has no type for
    return arr


def jit(fn: Callable[..., Any] | None = None, *, reuse_outputs: bool = False,
        fuse: bool = True, max_arena_bytes: int | None = None) -> Any:
    """`f = fl.jit(fn)` (or `@fl.jit`, `@fl.jit(reuse_outputs=True)`): capture once, replay after.
    `max_arena_bytes` bounds the arenas kept across signatures (least recently used dropped first)."""
    if fn is None:
        return lambda f: Jit(f, reuse_outputs=reuse_outputs, fuse=fuse, max_arena_bytes=max_arena_bytes)
    return Jit(fn, reuse_outputs=reuse_outputs, fuse=fuse, max_arena_bytes=max_arena_bytes)
