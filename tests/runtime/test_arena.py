"""A capture's layout (`fuel.runtime.arena`): outputs never share memory with what the caller or the
capture holds, and captured arrays are read on every call, arithmetic on them folded at capture only
where they are constants. NumPy on the same arrays is the oracle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import fuel as fl

# ---- outputs never alias what the caller or the capture holds -------------------------------------------


_ARG_OUTPUTS: dict[str, tuple[Callable[..., Any], Callable[[np.ndarray], np.ndarray]]] = {
    "as is": (lambda x: x, lambda a: a),
    "transposed": (lambda x: x.T, lambda a: a.T),
    "sliced": (lambda x: x[1:, ::2], lambda a: a[1:, ::2]),
    "reshaped": (lambda x: x.reshape(12), lambda a: a.reshape(12)),
    "made contiguous": (lambda x: x.contiguous(), lambda a: a),
    "broadcast": (lambda x: x[None].broadcast_to(2, 3, 4), lambda a: np.broadcast_to(a, (2, 3, 4))),
    "unsqueezed": (lambda x: x.unsqueeze(0), lambda a: a[None]),
}


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("name", list(_ARG_OUTPUTS))
def test_an_argument_returned_or_viewed_is_handed_out_as_a_fresh_array(name: str, reuse: bool) -> None:
    """fl.jit(lambda x: x)(a) is not `a`: an output never shares memory with an argument (a later write to
    the argument must not change a result already handed out), reuse_outputs or not."""
    fn, ref = _ARG_OUTPUTS[name]
    f = fl.jit(fn, reuse_outputs=reuse)
    for call in range(3):  # capture, checked replay, steady state
        a = np.arange(12, dtype=np.float32).reshape(3, 4) * (call + 1)
        out = f(a).numpy()
        want = ref(a).copy()
        assert not np.shares_memory(out, a), (name, call)
        a[:] = -1.0
        np.testing.assert_array_equal(out, want)


def test_a_destructive_ops_result_on_an_argument_is_handed_out_as_a_copy() -> None:
    """cache_write writes the caller's cache in place; the cache it returns is the call's own copy."""
    f = fl.jit(lambda rows, cache: fl.cache_write(cache, rows, fl.dyn("pos")))
    cache = np.zeros((4, 3), np.float32)
    handed: list[tuple[np.ndarray, np.ndarray]] = []
    for pos in range(4):
        out = f(np.full((1, 3), pos + 1.0, np.float32), cache, pos=pos).numpy()
        want = np.zeros((4, 3), np.float32)
        want[:pos + 1] = np.arange(1.0, pos + 2)[:, None]
        np.testing.assert_array_equal(cache, want)  # written in place
        assert not np.shares_memory(out, cache)
        handed.append((out, want))
    for out, want in handed:  # later writes to the cache left each result alone
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("view", ["as is", "transposed", "a row"])
def test_a_captured_array_returned_is_read_on_every_call_and_handed_out_as_a_copy(view: str) -> None:
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    tw = fl.tensor(w)
    picks: dict[str, Callable[[Any], Any]] = {"as is": lambda t: t, "transposed": lambda t: t.T,
                                              "a row": lambda t: t[1]}
    f = fl.jit(lambda x: (picks[view](tw), x + 1.0))
    for call in range(3):
        w[:] = np.arange(6).reshape(2, 3) * (call + 2)  # updated in place between calls
        got, _ = f(np.zeros(2, np.float32))
        out, want = got.numpy(), picks[view](w).copy()
        np.testing.assert_array_equal(out, want)
        assert not np.shares_memory(out, w)


@pytest.mark.parametrize("reuse", [False, True])
def test_a_tensor_returned_twice_gives_two_arrays(reuse: bool) -> None:
    def fn(x: fl.Tensor) -> tuple[fl.Tensor, ...]:
        y = x * 2.0
        return y, y, y.T, x, x

    f = fl.jit(fn, reuse_outputs=reuse)
    for call in range(3):
        a = np.arange(6, dtype=np.float32).reshape(2, 3) + call
        outs = [t.numpy() for t in f(a)]
        for i, o in enumerate(outs):
            for p in outs[:i]:
                assert not np.shares_memory(o, p), (call, i)
        for o, want in zip(outs, (a * 2, a * 2, (a * 2).T, a, a), strict=True):
            np.testing.assert_array_equal(o, want)


# ---- captured arrays: read on every call, folded only where constant --------------------------------------

_ON_WEIGHTS: dict[str, tuple[Callable[[Any, Any], Any], Callable[[np.ndarray, np.ndarray], np.ndarray]]] = {
    "scaled": (lambda x, w: x + w * 2.0, lambda x, w: x + w * 2.0),
    "cast": (lambda x, w: x + w.cast(fl.f64), lambda x, w: x + w.astype(np.float64)),
    "exp": (lambda x, w: x * w.exp(), lambda x, w: x * np.exp(w)),
    "product": (lambda x, w: x @ (w.reshape(3, 2).T * 0.5), lambda x, w: x @ (w.reshape(3, 2).T * 0.5)),
    "sum": (lambda x, w: x + w.sum(), lambda x, w: x + w.sum()),
    "copying reshape": (lambda x, w: x + w.reshape(2, 3).T.reshape(6)[:3],
                        lambda x, w: x + w.reshape(2, 3).T.reshape(6)[:3]),
    "fused": (lambda x, w: x + fl.ops.softmax_last_dim(w)[:3], lambda x, w: x + (np.exp(w) / np.exp(w).sum())[:3]),
}


def _read_only_view(w: np.ndarray) -> np.ndarray:
    v = w.view()
    v.flags.writeable = False  # read-only, but its base is writable: it still changes
    return v


@pytest.mark.parametrize("held", ["writable", "read-only view of a writable array"])
@pytest.mark.parametrize("name", list(_ON_WEIGHTS))
def test_arithmetic_on_a_captured_array_sees_in_place_updates(name: str, held: str) -> None:
    """A captured array that can change is read on every call: arithmetic on it is not folded at capture
    (a training loop updating weights in place under a jitted forward would keep the old ones)."""
    fn, ref = _ON_WEIGHTS[name]
    six = {"sum", "fused", "product", "copying reshape"}
    w = np.linspace(-1.0, 1.0, 6, dtype=np.float32) if name in six else np.ones(3, np.float32)
    tw = fl.tensor(w if held == "writable" else _read_only_view(w))
    x_shape = (3, 2) if name == "product" else (3,)
    f = fl.jit(lambda x: fn(x, tw))
    for call in range(4):  # capture, checked replay, steady state (native where it can)
        x = np.full(x_shape, 0.25 * call, np.float32)
        got = f(x).numpy()
        np.testing.assert_allclose(got, ref(x, w), rtol=1e-6, atol=1e-6, err_msg=f"call {call}")
        w *= 2.0  # updated in place


def test_the_briefs_example_gives_the_eager_answer() -> None:
    w = np.ones(3, np.float32)
    tw = fl.tensor(w)
    f = fl.jit(lambda x: x + tw * 2)
    np.testing.assert_array_equal(f(np.zeros(3, np.float32)).numpy(), [2, 2, 2])
    w[:] = 5
    np.testing.assert_array_equal(f(np.zeros(3, np.float32)).numpy(), [10, 10, 10])
    np.testing.assert_array_equal((fl.tensor(np.zeros(3, np.float32)) + tw * 2).numpy(), [10, 10, 10])


def _frozen_copy(w: np.ndarray) -> np.ndarray:
    r = w.copy()
    r.flags.writeable = False
    return r


@pytest.mark.parametrize("make", ["const=True", "read-only array"])
def test_arithmetic_on_constants_is_folded_at_capture(make: str) -> None:
    """`fl.tensor(arr, const=True)` (a read-only snapshot) and a read-only array with no writable base are
    constants: `c * 2.0 + 1.0` and `c.exp()` run once, at capture; only the step reading x replays."""
    w = np.linspace(-1.0, 1.0, 3).astype(np.float32)
    tc = fl.tensor(w, const=True) if make == "const=True" else fl.tensor(_frozen_copy(w))
    want_c = w * 2.0 + 1.0
    f = fl.jit(lambda x: x * (tc * 2.0 + 1.0).exp())
    w[:] = 9.0  # the snapshot (or the read-only copy) does not see it
    for call in range(3):
        x = np.full(3, call + 1.0, np.float32)
        np.testing.assert_allclose(f(x).numpy(), x * np.exp(want_c), rtol=1e-6)
    capture = f.capture_for(x)
    assert capture is not None and capture.n_steps == 1 and capture.n_folded >= 3, capture.n_folded


def test_constants_fold_beside_a_destructive_op_but_what_it_writes_is_recomputed() -> None:
    """With a cache_write in the graph, constant arithmetic still folds; a constant-derived value the write
    destroys does not (each call starts from the constant again, as eager does)."""
    tc = fl.tensor(np.arange(8, dtype=np.float32).reshape(4, 2), const=True)

    def fn(rows: fl.Tensor) -> tuple[fl.Tensor, fl.Tensor]:
        written = fl.cache_write(tc * 1.0, rows, fl.dyn("pos"))
        return written + 0.0, rows + (tc * 3.0).sum()

    f = fl.jit(fn)
    for pos in range(4):
        rows = np.full((1, 2), -1.0 - pos, np.float32)
        written, total = (t.numpy() for t in f(rows, pos=pos))
        want = np.arange(8, dtype=np.float32).reshape(4, 2)
        want[pos] = rows[0]
        np.testing.assert_array_equal(written, want)
        np.testing.assert_array_equal(total, rows + 3.0 * 28.0)
    capture = f.capture_for(rows)
    assert capture is not None and capture.n_folded >= 2  # tc * 3.0 and its sum; not tc * 1.0
