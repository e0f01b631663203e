"""The optimizer base and the captured training step.

An optimizer owns, besides its parameters' state arrays, small 0-d arrays holding the scalars torch
computes in Python floats at each step (the learning rate, bias corrections, step sizes). `update(grads)`
builds the lazy in-place writes of parameters and state reading those arrays; `advance()` counts the step
and rewrites them. So the graph `update` builds is the same at every step, and one `fl.jit` capture of
forward + backward + update serves the whole run (`TrainStep`): captured arrays are re-read at every replay.

Scalars are stored in the dtype the update computes in (a parameter's, or f32 for master weights), so
they round once from Python's float64 as torch rounds its Python-float scalars to the tensor's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from typing import Any

import numpy as np

from fuel.dtype import DType, from_numpy
from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.autograd import grad
from fuel.graph.functions import assign
from fuel.graph.tensor import Tensor, tensor, zeros
from fuel.optim.clip import clip_grad_norm
from fuel.optim.schedule import Schedule, as_schedule


class Optimizer:
    """The base of SGD and AdamW: parameters, the schedule, clipping, master weights, the per-step scalars
    and checkpoints. A subclass names its state (`state_names`), computes its scalars (`scalars(step, lr)`)
    and builds one parameter's update (`_param_update`)."""

    state_names: tuple[str, ...] = ()

    def __init__(self, params: Sequence[Tensor], lr: float | Schedule, *, max_grad_norm: float | None = None,
                 master_weights: bool | None = None) -> None:
        op = type(self).__name__
        self.params = _check_params(op, params)
        self.schedule = as_schedule(op, lr)
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, Real)
                                          or not math.isfinite(float(max_grad_norm)) or max_grad_norm <= 0):
            raise ParamError(f"{op}: max_grad_norm must be a finite number > 0 or None, got {max_grad_norm!r}")
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        if master_weights not in (None, True, False):
            raise ParamError(f"{op}: master_weights must be True, False or None, got {master_weights!r}")
        half = any(p.dtype.is_half for p in self.params)
        if master_weights and not half:
            raise DTypeError(f"{op}: master_weights=True needs bf16 or f16 parameters, got "
                             f"{sorted({p.dtype.value for p in self.params})}")
        use_master = half if master_weights is None else bool(master_weights)
        # The f32 master copy of each half parameter (None where the parameter is updated in place itself).
        self.masters: list[np.ndarray | None] = [
            _value(p).astype(np.float32) if use_master and p.dtype.is_half else None for p in self.params]
        self._targets = [p if m is None else tensor(m) for p, m in zip(self.params, self.masters, strict=True)]
        self.compute_dtypes: list[DType] = [t.dtype for t in self._targets]
        self.state: list[dict[str, np.ndarray]] = [
            {name: np.zeros(t.shape, t.dtype.np) for name in self.state_names} for t in self._targets]
        self._state_leaves = [{k: tensor(a) for k, a in s.items()} for s in self.state]
        self._scalars: dict[tuple[str, DType], np.ndarray] = {}
        self._scalar_leaves: dict[tuple[str, DType], Tensor] = {}
        self.step_count = 0

    # ---- the per-step scalars ----------------------------------------------------------------
    def scalars(self, step: int, lr: float) -> dict[str, float]:
        """The Python-float scalars of update number `step` (from 1) at learning rate `lr`."""
        raise NotImplementedError

    def scalar(self, name: str, dtype: DType) -> Tensor:
        """The 0-d leaf holding scalar `name` in `dtype`, rewritten by every `advance()`."""
        key = (name, dtype)
        if key not in self._scalar_leaves:
            arr = np.zeros((), dtype.np)
            arr[()] = self._values(max(self.step_count, 1))[name]
            self._scalars[key] = arr
            self._scalar_leaves[key] = tensor(arr)
        return self._scalar_leaves[key]

    def _values(self, step: int) -> dict[str, float]:
        lr = self.schedule(step)
        if isinstance(lr, bool) or not isinstance(lr, Real) or not math.isfinite(float(lr)) or lr < 0:
            raise ParamError(f"{type(self).__name__}: the schedule gave lr={lr!r} at step {step}; "
                             f"expected a finite number >= 0")
        return self.scalars(step, float(lr))

    @property
    def lr(self) -> float:
        """The learning rate of the latest update (of the first, before any)."""
        return float(self.schedule(max(self.step_count, 1)))

    def advance(self) -> None:
        """Count one more update and write its scalars (call before each replay of a step from `update`).
        A schedule value that is not a finite lr >= 0 is a ParamError, and the count stays."""
        self._write_scalars(self.step_count + 1)
        self.step_count += 1

    def _write_scalars(self, step: int) -> None:
        values = self._values(max(step, 1))
        for (name, _), arr in self._scalars.items():
            arr[()] = values[name]

    # ---- the update --------------------------------------------------------------------------
    def update(self, grads: Sequence[Tensor | None]) -> list[Tensor]:
        """The lazy in-place writes of one update from `grads` (one per parameter, None to skip it): the
        clipping, if set, then the state and parameter writes. Realise them (or build them inside fl.jit,
        where they are effects) after `advance()`."""
        return self.build(grads)[0]

    def build(self, grads: Sequence[Tensor | None]) -> tuple[list[Tensor], Tensor | None]:
        """`update`'s writes, and the total gradient norm before clipping (None without clipping)."""
        gs = self._check_grads(grads)
        gs = [None if g is None else g.cast(dt) for g, dt in zip(gs, self.compute_dtypes, strict=True)]
        norm = None
        if self.max_grad_norm is not None:
            gs, norm = clip_grad_norm(gs, self.max_grad_norm)
        writes: list[Tensor] = []
        for i, g in enumerate(gs):
            if g is None:
                continue
            target = self._targets[i]
            new, state = self._param_update(i, target, g, self._state_leaves[i])
            writes += [assign(self._state_leaves[i][k], v) for k, v in state.items()]
            writes.append(assign(target, new))
            if self.masters[i] is not None:
                writes.append(assign(self.params[i], new.cast(self.params[i].dtype)))
        return writes, norm

    def _param_update(self, i: int, p: Tensor, g: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Parameter i's new value and its state's new values, lazily, from its gradient `g`."""
        raise NotImplementedError

    def _check_grads(self, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        op = type(self).__name__
        if isinstance(grads, Tensor) or not isinstance(grads, Sequence):
            raise ParamError(f"{op}.update: grads must be a sequence of Tensors (one per parameter), got "
                             f"{type(grads).__name__}")
        if len(grads) != len(self.params):
            raise ParamError(f"{op}.update: grads has {len(grads)} entries, expected one per parameter "
                             f"({len(self.params)})")
        for i, (g, p) in enumerate(zip(grads, self.params, strict=True)):
            if g is None:
                continue
            if not isinstance(g, Tensor):
                raise ParamError(f"{op}.update: grads[{i}] must be a Tensor or None, got {type(g).__name__}")
            if g.shape != p.shape:
                raise ShapeError(f"{op}.update: grads[{i}] is {list(g.shape)}, its parameter is {list(p.shape)}")
            if not g.dtype.is_float:
                raise DTypeError(f"{op}.update: grads[{i}] must be a float tensor, got {g.dtype.value}")
        return list(grads)

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the step count (`"step"`), each parameter's state (`"state.{i}.{name}"`) and master
        weights (`"master.{i}"`). The schedule is not saved: it is recomputed from the step count."""
        out = {k: a.copy() for k, a in self._live_state().items()}
        out["step"] = np.array(self.step_count, np.int64)
        return out

    def _live_state(self) -> dict[str, np.ndarray]:
        """`state_dict()`'s arrays themselves (no step count): what `load_state_dict` writes into."""
        out: dict[str, np.ndarray] = {}
        for i, s in enumerate(self.state):
            for k, a in s.items():
                out[f"state.{i}.{k}"] = a
            master = self.masters[i]
            if master is not None:
                out[f"master.{i}"] = master
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy a `state_dict()` into this optimizer's arrays (in place, so captured steps see it) and
        rewrite the scalars for its step count. Keys, shapes and dtypes must match exactly."""
        op = f"{type(self).__name__}.load_state_dict"
        mine = {"step": np.array(self.step_count, np.int64), **self._live_state()}
        missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
        if missing:
            raise ParamError(f"{op}: missing key {missing[0]!r}")
        if extra:
            raise ParamError(f"{op}: unknown key {extra[0]!r}")
        arrays = {k: np.asarray(v.numpy() if isinstance(v, Tensor) else v) for k, v in state.items()}
        for k, want in mine.items():
            got = arrays[k]
            if got.shape != want.shape:
                raise ShapeError(f"{op}: {k!r} is {list(got.shape)}, expected {list(want.shape)}")
            if got.dtype != want.dtype:
                raise DTypeError(f"{op}: {k!r} is {from_numpy(got.dtype).value}, expected "
                                 f"{from_numpy(want.dtype).value}")
        step = int(arrays["step"])
        if step < 0:
            raise ParamError(f"{op}: 'step' must be >= 0, got {step}")
        for k, a in mine.items():
            if k != "step":
                np.copyto(a, arrays[k])
        self.step_count = step
        self._write_scalars(step)

    # ---- the captured step -------------------------------------------------------------------
    def compile(self, loss_fn: Callable[..., Tensor], accumulate: int = 1) -> TrainStep:
        """`step = opt.compile(loss_fn)`; `step(*batch) -> float` runs one captured forward + backward +
        update (see `TrainStep`)."""
        return TrainStep(self, loss_fn, accumulate)


def _value(p: Tensor) -> np.ndarray:
    assert p.node.value is not None
    return p.node.value


def _check_params(op: str, params: Sequence[Tensor]) -> list[Tensor]:
    """Realised float leaves over distinct writable C-contiguous arrays, so updates can be written in place."""
    if isinstance(params, Tensor) or not isinstance(params, Sequence):
        raise ParamError(f"{op}: params must be a sequence of Tensors, got {type(params).__name__}")
    if not params:
        raise ParamError(f"{op}: params is empty")
    seen: dict[int, int] = {}
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise ParamError(f"{op}: params[{i}] must be a Tensor, got {type(p).__name__}")
        v = p.node.value
        if v is None:
            raise ParamError(f"{op}: params[{i}] must be a realised leaf (a parameter), got a lazy "
                             f"{p.node.op.name} result")
        if not p.dtype.is_float:
            raise DTypeError(f"{op}: params[{i}] must be a float tensor, got {p.dtype.value}")
        if not v.flags.writeable or not v.flags.c_contiguous:
            raise ParamError(f"{op}: params[{i}] must be over a writable C-contiguous array")
        if id(v) in seen:
            raise ParamError(f"{op}: params[{i}] is params[{seen[id(v)]}] again")
        seen[id(v)] = i
    return list(params)


class TrainStep:
    """One training step as one `fl.jit(reuse_outputs=True)` replay: `step(*batch) -> float` (the loss).

    `loss_fn(*batch)` builds the scalar loss from the batch's tensors and the parameters it captures. The
    replay computes the loss, its gradients w.r.t. the optimizer's parameters and the update, whose writes
    of parameters and state are the capture's effects; `advance()` runs before it. After the first call a
    step builds no graph and allocates no intermediate: the arena is laid out once.

    With `accumulate=n`, n calls make one update: each adds the gradient of `loss / n` (its micro-batch
    loss over n, as torch users write `(loss / n).backward()`) into a persistent buffer, and the nth updates
    from the buffers' sum and zeroes them. The first n - 1 calls replay a second capture without the update.
    `last_grad_norm` is the total gradient norm before clipping of the latest update (with clipping)."""

    def __init__(self, opt: Optimizer, loss_fn: Callable[..., Tensor], accumulate: int = 1) -> None:
        if not callable(loss_fn):
            raise ParamError(f"compile: loss_fn must be callable, got {type(loss_fn).__name__}")
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ParamError(f"compile: accumulate must be an integer >= 1, got {accumulate!r}")
        from fuel.runtime.jit import jit

        self.opt, self.loss_fn, self.accumulate = opt, loss_fn, accumulate
        self.buffers = [np.zeros(t.shape, dt.np) for t, dt in zip(opt.params, opt.compute_dtypes, strict=True)] \
            if accumulate > 1 else []
        self._buffer_leaves = [tensor(b) for b in self.buffers]
        self.micro = 0  # micro-batches accumulated toward the next update
        self.last_grad_norm: float | None = None
        self.apply = jit(self._apply, reuse_outputs=True)
        self.add = jit(self._add, reuse_outputs=True) if accumulate > 1 else None

    def _grads(self, batch: tuple[Tensor, ...]) -> tuple[Tensor, list[Tensor]]:
        loss = self.loss_fn(*batch)
        if not isinstance(loss, Tensor) or loss.shape != () or not loss.dtype.is_float:
            what = f"a {list(loss.shape)} {loss.dtype.value} tensor" if isinstance(loss, Tensor) \
                else type(loss).__name__
            raise ShapeError(f"compile: loss_fn must return a scalar float Tensor, got {what}")
        scaled = loss if self.accumulate == 1 else loss / float(self.accumulate)
        gs = grad(scaled, self.opt.params)
        gs = [g.cast(dt) for g, dt in zip(gs, self.opt.compute_dtypes, strict=True)]
        return loss, gs

    def _add(self, *batch: Tensor) -> Tensor:
        loss, gs = self._grads(batch)
        for b, g in zip(self._buffer_leaves, gs, strict=True):
            assign(b, b + g)
        return loss

    def _apply(self, *batch: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        loss, gs = self._grads(batch)
        if self.accumulate > 1:
            gs = [b + g for b, g in zip(self._buffer_leaves, gs, strict=True)]
        _, norm = self.opt.build(gs)  # its writes are the capture's effects
        for b in self._buffer_leaves:
            assign(b, zeros(b.shape, b.dtype))
        return loss if norm is None else (loss, norm)

    def __call__(self, *batch: Any) -> float:
        if self.micro + 1 < self.accumulate:
            assert self.add is not None
            loss = float(self.add(*batch).numpy())
            self.micro += 1  # counted once its gradient is in the buffers
            return loss
        self.opt.advance()
        try:
            out = self.apply(*batch)
        except BaseException:
            self.opt.step_count -= 1  # the update did not happen: its scalars are the previous step's again
            self.opt._write_scalars(self.opt.step_count)
            raise
        self.micro = 0
        if isinstance(out, tuple):
            self.last_grad_norm = float(out[1].numpy())
            return float(out[0].numpy())
        return float(out.numpy())
