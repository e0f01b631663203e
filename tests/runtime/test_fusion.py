"""Elementwise chains in native replay (`fuel.runtime.fusion`, `fuel.cpu.prims.chain`): a run of
elementwise steps runs as one job whose bytes are those of the steps run one by one, natively (a job a
step) or in Python, and of `realize` on the same graph: over random op chains and layouts (transposed,
broadcast rows, columns and scalars, captured state read before and after its assign), across calls, at
any thread count; and the rules that keep a fused group equal to its steps (a value read after the group
is written, a read at another element of a buffer the group writes cuts the group)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.nn.llama import Llama, LlamaConfig
from fuel.nn.state import get_parameters
from fuel.optim import SGD, AdamW
from fuel.runtime import pool, replay
from fuel.runtime.jit import Jit

UNARY = ("neg", "abs", "sqrt", "sqr", "recip", "rsqrt")
BINARY = ("add", "sub", "mul", "div")
SCALAR = ("adds", "muls")
MAX_OPS = 7  # leaves are at most 1.5 in magnitude: 7 ops (squares at worst) stay finite, so no NaN meets another


@contextlib.contextmanager
def chains(on: bool) -> Iterator[None]:
    """Captures prepared inside run their elementwise runs as chains (on) or a job a step (off)."""
    saved = replay.CHAINS
    replay.CHAINS = on
    try:
        yield
    finally:
        replay.CHAINS = saved


def _apply(kind: str, a: fl.Tensor, b: fl.Tensor | None, c: float) -> fl.Tensor:
    """One op of a random chain, kept finite: sqrt of |a|, and a divisor, reciprocal or rsqrt of |.| + 1."""
    if kind in BINARY:
        assert b is not None
        return {"add": a + b, "sub": a - b, "mul": a * b, "div": a / (b.abs() + 1.0)}[kind]
    if kind in SCALAR:
        return a + c if kind == "adds" else a * c
    return {"neg": -a, "abs": a.abs(), "sqrt": a.abs().sqrt(), "sqr": a.square(), "recip": (a.abs() + 1.0).recip(),
            "rsqrt": (a.abs() + 1.0).rsqrt()}[kind]


@st.composite
def _chains(draw: Any) -> dict[str, Any]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 12), min_size=ndim, max_size=ndim)))
    ops = []
    for k in range(draw(st.integers(2, MAX_OPS))):
        kind = draw(st.sampled_from(UNARY + BINARY + SCALAR))
        ops.append((kind, draw(st.integers(0, 4 + k)), draw(st.integers(0, 4 + k)),
                    draw(st.sampled_from([-1.5, -0.5, 0.25, 1.0, 2.0]))))
    n = 5 + len(ops)  # leaves 0-4, then one value per op
    return {"shape": shape, "ops": ops, "dtype": draw(st.sampled_from([np.float32, np.float64])),
            "assign": draw(st.integers(5, n - 1)),
            "outs": draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3)),
            "after": draw(st.booleans()), "seed": draw(st.integers(0, 2**16))}


class Chain:
    """A drawn chain as a capturable function: leaves x (an argument), y (an argument of the reversed shape,
    transposed back, so a transposed read for 2-D shapes), a captured row vector, a captured 0-d scalar and
    a captured state of the shape, which the chain reads first and assigns one of its values to (later
    values may read it back through the assign). Each mode gets its own copy of the captured arrays."""

    def __init__(self, c: dict[str, Any]) -> None:
        self.c, self.shape, dt = c, c["shape"], c["dtype"]
        rng = np.random.default_rng(c["seed"])
        self.row = rng.uniform(-1.5, 1.5, self.shape[-1:]).astype(dt)
        self.scalar = np.array(rng.uniform(-1.5, 1.5), dt)
        self.state0 = rng.uniform(-1.5, 1.5, self.shape).astype(dt)
        self.calls = [(rng.uniform(-1.5, 1.5, self.shape).astype(dt),
                       rng.uniform(-1.5, 1.5, self.shape[::-1]).astype(dt)) for _ in range(3)]

    def fn(self, state: np.ndarray, effects: bool) -> Callable[..., Any]:
        def f(x: fl.Tensor, y: fl.Tensor) -> tuple[fl.Tensor, ...]:
            s = fl.tensor(state)
            vals = [x, y.permute(*range(y.ndim)[::-1]), fl.tensor(self.row).broadcast_to(self.shape),
                    fl.tensor(self.scalar).broadcast_to(self.shape), s]
            wrote = None
            for k, (kind, i, j, c) in enumerate(self.c["ops"]):
                vals.append(_apply(kind, vals[i], vals[j], c))
                if 5 + k == self.c["assign"]:
                    wrote = fl.assign(s, vals[-1])
                    if self.c["after"]:
                        vals[4] = wrote  # later ops read the state as assigned
            outs = tuple(vals[i] * 1.0 if i < 5 else vals[i] for i in self.c["outs"])
            return (*outs, wrote) if effects and wrote is not None else outs
        return f

    def run(self, mode: str, on: bool = True) -> list[list[bytes]]:
        state = self.state0.copy()
        if mode == "realize":
            f = self.fn(state, True)
            got = []
            for x, y in self.calls:
                np.copyto(state, self.state0)
                res = fl.realize(*f(fl.tensor(x), fl.tensor(y)))
                got.append([r.numpy().tobytes() for r in res[:len(self.c["outs"])]] + [state.tobytes()])
            return got
        jf = fl.jit(self.fn(state, False))
        got = []
        for _ in range(2):  # the first pass captures and prepares native replay, the second replays
            got = []
            for x, y in self.calls:
                np.copyto(state, self.state0)
                with chains(on):
                    got.append([r.numpy().tobytes() for r in jf(x, y)] + [state.tobytes()])
        cap = jf.capture_for(*self.calls[0])
        assert cap is not None
        self.chain_jobs = 0 if cap.native is None else cap.native.chain_jobs
        return got


@settings(max_examples=80, deadline=None)
@given(c=_chains())
def test_fused_chains_give_the_bytes_of_their_steps(c: dict[str, Any]) -> None:
    chain = Chain(c)
    want = chain.run("realize")
    assert chain.run("replay", on=False) == want
    assert chain.chain_jobs == 0
    assert chain.run("replay") == want
    assert chain.chain_jobs >= 1  # two ops or more of one shape: at least one chain


def _three_ways(fn: Callable[..., Any], args: Sequence[tuple[np.ndarray, ...]],
                arrays: tuple[np.ndarray, ...] = ()) -> tuple[list[list[bytes]], Any]:
    """fn's outputs (and the arrays it writes, reset before each call) per call: realized, replayed a job a
    step, replayed with chains, all byte for byte the same; returns them and the chained capture's native
    replay."""
    start = [a.copy() for a in arrays]
    runs = []
    for mode in ("realize", "unfused", "fused"):
        f = fn if mode == "realize" else fl.jit(fn)
        got = []
        for xs in list(args) * (1 if mode == "realize" else 2):
            for a, s in zip(arrays, start, strict=True):
                np.copyto(a, s)  # each call from the same state
            with chains(mode == "fused"):
                res = fn(*map(fl.tensor, xs)) if mode == "realize" else f(*xs)
            res = res if isinstance(res, tuple) else (res,)
            if mode == "realize":
                res = fl.realize(*res)
            got.append([r.numpy().tobytes() for r in res] + [a.tobytes() for a in arrays])
        runs.append(got if mode == "realize" else got[len(args):])
    assert runs[0] == runs[1] == runs[2]
    assert isinstance(f, Jit)
    cap = f.capture_for(*args[0])
    assert cap is not None
    return runs[2], cap.native


def test_a_value_read_after_the_group_is_written() -> None:
    """y, made in the chain of x * 3 - 1 and its square, is read by a reduction after it, and z through a
    reshape that is an output: both are written."""
    rng = np.random.default_rng(1)
    xs = [(rng.standard_normal((6, 10)).astype(np.float32),) for _ in range(2)]

    def fn(x: fl.Tensor) -> tuple[fl.Tensor, fl.Tensor]:
        w = x * 3.0 - 1.0
        y = w * w
        z = y + x
        return y.sum(1), z.reshape(60)

    _, native = _three_ways(fn, xs)
    assert native.chain_jobs >= 1 and native.chained >= 3


def test_an_output_seen_through_a_view_is_written() -> None:
    rng = np.random.default_rng(2)
    xs = [(rng.standard_normal((3, 8)).astype(np.float32),) for _ in range(3)]
    _, native = _three_ways(lambda x: ((x * 2.0 + 1.0).reshape(24), (x - 1.0).sqrt()), xs)
    assert native.chain_jobs >= 1


def test_a_transposed_read_of_a_value_the_group_writes_cuts_the_group() -> None:
    """v.T reads v's buffer at other elements than v's own: one job would meet elements of v it has not yet
    written, so v and what reads it transposed run as two jobs."""
    rng = np.random.default_rng(3)
    xs = [(rng.standard_normal((40, 40)).astype(np.float32),) for _ in range(2)]

    def fn(x: fl.Tensor) -> fl.Tensor:
        v = x * 2.0 + 0.5
        return v.T * 3.0 - v

    _, native = _three_ways(fn, xs)
    assert native.chain_jobs == 2 and native.chained == 4


@pytest.mark.parametrize("read", ["transposed", "column"])
def test_an_assigned_array_read_back_at_other_elements_cuts_the_group(read: str) -> None:
    """A captured state assigned in the chain and read back transposed, or one column broadcast along the
    rows, at the same shape: the read runs after the whole assign."""
    rng = np.random.default_rng(4)
    state = rng.standard_normal((16, 16)).astype(np.float32)
    xs = [(rng.standard_normal((16, 16)).astype(np.float32),) for _ in range(2)]

    def fn(x: fl.Tensor) -> fl.Tensor:
        s = fl.tensor(state)
        t = fl.assign(s, s * 0.5 + x)
        back = t.T if read == "transposed" else t[:, :1].broadcast_to(16, 16)
        return back * 2.0 + x

    _, native = _three_ways(fn, xs, (state,))
    assert native.chain_jobs == 2


def test_a_step_without_a_job_splits_the_run() -> None:
    """exp runs in Python (NumPy's): the chains before and after it are two jobs, in order."""
    rng = np.random.default_rng(5)
    xs = [(rng.standard_normal((5, 7)).astype(np.float32),) for _ in range(2)]
    _, native = _three_ways(lambda x: ((x * 0.5 + 1.0).exp() - x) * 2.0, xs)
    assert native.chain_jobs == 2 and len([i for i in native.items if len(i) != 2]) == 1


@pytest.mark.parametrize("transposed", [False, True])
def test_bytes_do_not_depend_on_the_part_count(transposed: bool) -> None:
    """A chain big enough to be cut into parts on two threads gives the one-thread bytes."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((300, 260)).astype(np.float32)
    y = rng.standard_normal((260, 300) if transposed else (300, 260)).astype(np.float32)

    def fn(a: fl.Tensor, b: fl.Tensor) -> fl.Tensor:
        b = b.T if transposed else b
        return ((a - b) * 0.1 + a).sqrt() / (b.abs() + 1e-3)

    saved = fl.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            fl.set_num_threads(n)
            got, native = _three_ways(fn, [(x, y)])
            outs.append(got)
        assert outs[0] == outs[1]
        job = native.program.jobs[0]
        assert native.chain_jobs == 1 and pool.parts_for(job.seconds, job.most) > 1
    finally:
        fl.set_num_threads(saved)


def _llama_run(fused: bool, python: bool, make_opt: Callable[[list[fl.Tensor]], Any],
               monkeypatch: pytest.MonkeyPatch) -> tuple[list[bytes], Any]:
    with monkeypatch.context() as m:
        m.setattr(replay, "CHAINS", fused)
        if python:
            m.setattr(replay, "prepare", lambda *a, **k: None)
        model = Llama(LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, hidden_dim=48,
                                  max_seq_len=16))
        params = get_parameters(model)
        step = make_opt(params).compile(model.loss)
        rng = np.random.default_rng(7)
        losses = []
        for _ in range(4):
            ids = rng.integers(0, 64, (2, 17))
            losses.append(step(ids[:, :-1].copy(), ids[:, 1:].copy()))
        cap = step.apply.capture_for(ids[:, :-1].copy(), ids[:, 1:].copy())
        return [np.float64(v).tobytes() for v in losses] + [p.numpy().tobytes() for p in params], cap.native


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_training_step_with_chains_is_the_same_bytes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small Llama's captured step (forward, backward, update, four steps): the same losses and parameters,
    byte for byte, with chains, a job a step and all in Python; with chains, each parameter's update (its
    weight gradient transposed, its assigns) runs with no Python step in it."""
    def make(ps: list[fl.Tensor]) -> Any:
        if name == "adamw":
            return AdamW(ps, lr=1e-2, weight_decay=0.1, max_grad_norm=1.0)
        return SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)

    fused, native = _llama_run(True, False, make, monkeypatch)
    assert fused == _llama_run(False, False, make, monkeypatch)[0] == _llama_run(False, True, make, monkeypatch)[0]
    python = [i[2] for i in native.items if len(i) != 2]
    ops = {getattr(p, "op", None) for p in python}
    elementwise = {"ADD", "SUB", "MUL", "DIV", "ADD_SCALAR", "MUL_SCALAR", "SQRT", "CACHE_WRITE"}
    assert not {o.name for o in ops if o is not None} & elementwise
    assert native.chain_jobs > 0


def test_a_fresh_output_whose_chain_does_not_form_is_handed_out_as_a_copy() -> None:
    """y reversed in 3-D has no [rows, cols] split: its step runs in Python, into the buffer the capture staged
    for it as a chain member; each call still hands out an array of its own."""
    rng = np.random.default_rng(8)
    calls = [(rng.standard_normal((3, 4, 5)).astype(np.float32), rng.standard_normal(4).astype(np.float32))
             for _ in range(4)]
    f = fl.jit(lambda y, x: (y.permute(2, 1, 0) * 2.0, x + 1.0))
    outs, kept = [], []
    for y, x in calls:
        out = f(y, x)[0].numpy()
        outs.append(out)
        kept.append(out.copy())
        assert out.tobytes() == (y.transpose(2, 1, 0) * np.float32(2)).tobytes()
    assert [o.tobytes() for o in outs] == [k.tobytes() for k in kept]
