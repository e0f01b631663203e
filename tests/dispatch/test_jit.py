"""fl.jit: capture once per signature, replay with new values, never overwrite handed-out outputs."""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import fuel as fl
from fuel.graph.node import Node, Op
from fuel.graph.registry import (
    FusedOps,
)


def _mlp(w1: np.ndarray, w2: np.ndarray):  # type: ignore[no-untyped-def]
    t1, t2 = fl.tensor(w1), fl.tensor(w2)

    def fn(x: fl.Tensor) -> tuple[fl.Tensor, fl.Tensor]:
        h = fl.ops.rms_norm_last_dim(x, 1e-5)
        y = (h @ t1).silu() @ t2
        return fl.ops.softmax_last_dim(y), y.sum()

    return fn


def _torch_mlp(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    tx = torch.from_numpy(x.astype(np.float64))
    h = torch.nn.functional.rms_norm(tx, (x.shape[-1],), None, 1e-5)
    y = torch.nn.functional.silu(h @ torch.from_numpy(w1.astype(np.float64))) @ torch.from_numpy(w2.astype(np.float64))
    return torch.softmax(y, -1).numpy(), y.sum().numpy()


def test_replay_with_new_values_matches_eager_and_torch(rng: np.random.Generator) -> None:
    w1 = rng.standard_normal((32, 48)).astype(np.float32) * 0.2
    w2 = rng.standard_normal((48, 16)).astype(np.float32) * 0.2
    fn = _mlp(w1, w2)
    f = fl.jit(fn)
    for _ in range(4):
        x = rng.standard_normal((3, 32)).astype(np.float32)
        p, s = f(x)
        ep, es = fl.realize(*fn(fl.tensor(x)))
        assert np.array_equal(p.numpy(), ep.numpy()) and np.array_equal(s.numpy(), es.numpy())
        tp, ts = _torch_mlp(x, w1, w2)
        np.testing.assert_allclose(p.numpy(), tp, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(s.numpy(), ts, rtol=1e-4, atol=1e-3)
    assert f.captures == 1


def test_a_new_signature_traces_again(rng: np.random.Generator) -> None:
    f = fl.jit(lambda x: (x * 2.0).softmax(-1))
    a = f(rng.standard_normal((2, 5)).astype(np.float32))
    b = f(rng.standard_normal((3, 5)).astype(np.float32))
    c = f(rng.standard_normal((3, 5)))  # f64: another signature
    assert (a.shape, b.shape, c.dtype, f.captures) == ((2, 5), (3, 5), fl.f64, 3)


def test_outputs_handed_out_are_never_overwritten(rng: np.random.Generator) -> None:
    f = fl.jit(lambda x: fl.ops.rms_norm_last_dim(x, 1e-6) * 3.0)
    x1, x2 = rng.standard_normal((2, 2, 64)).astype(np.float32)
    first = f(x1).numpy()
    kept = first.copy()
    second = f(x2).numpy()
    assert np.array_equal(first, kept) and not np.shares_memory(first, second)


def test_reuse_outputs_overwrites_on_request(rng: np.random.Generator) -> None:
    f = fl.jit(lambda x: fl.ops.rms_norm_last_dim(x, 1e-6) * 3.0, reuse_outputs=True)
    x1, x2 = rng.standard_normal((2, 2, 64)).astype(np.float32)
    first = f(x1).numpy()
    second = f(x2).numpy()
    assert np.shares_memory(first, second)
    np.testing.assert_array_equal(first, fl.realize(fl.ops.rms_norm_last_dim(fl.tensor(x2), 1e-6) * 3.0)[0].numpy())


def _dyn_eps_rms(x: fl.Tensor) -> fl.Tensor:
    """An RMS norm whose eps is the DynScalar "eps" (no builder takes one yet: params set directly)."""
    from fuel.graph.registry.rms_norm_last_dim import RmsNormLastDimParams

    params = object.__new__(RmsNormLastDimParams)
    object.__setattr__(params, "eps", fl.dyn("eps"))
    return fl.Tensor(Node(Op.FUSED, (x.node,), x.shape, x.dtype, (FusedOps.RMS_NORM_LAST_DIM, params)))


def test_replay_binds_new_dynamic_scalars(rng: np.random.Generator) -> None:
    f = fl.jit(lambda x: _dyn_eps_rms(x) + 1.0)
    x = rng.standard_normal((4, 8))
    for eps in (1, 4, 1, 9):
        want = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) + 1.0
        np.testing.assert_allclose(f(x, eps=eps).numpy(), want, rtol=1e-12)
    assert f.captures == 1
    with pytest.raises(fl.ParamError, match="'eps' is unbound"):
        f(x)
    with pytest.raises(fl.ParamError, match="must be an integer"):
        f(x, eps=1.5)
    with pytest.raises(fl.ParamError, match=r"got esp=2, but the traced graph has no DynScalar 'esp' \(it uses: eps\)"):
        f(x, eps=1, esp=2)


def test_a_gradient_step_under_jit_matches_torch(rng: np.random.Generator) -> None:
    """A training step: loss and weight gradient of a small softmax model, replayed with new weights."""

    def step(x: fl.Tensor, w: fl.Tensor) -> tuple[fl.Tensor, fl.Tensor]:
        p = fl.ops.softmax_last_dim(fl.ops.rms_norm_last_dim(x, 1e-6) @ w)
        loss = (p * p).sum()
        (gw,) = fl.grad(loss, [w])
        return loss, gw

    f = fl.jit(step)
    x = rng.standard_normal((6, 16))
    w = rng.standard_normal((16, 10)) * 0.3
    for _ in range(3):
        loss, gw = f(x, w)
        tw = torch.from_numpy(w.copy()).requires_grad_()
        tx = torch.from_numpy(x)
        tp = torch.softmax(torch.nn.functional.rms_norm(tx, (16,), None, 1e-6) @ tw, -1)
        tl = (tp * tp).sum()
        tl.backward()
        np.testing.assert_allclose(loss.item(), tl.item(), rtol=1e-12)
        np.testing.assert_allclose(gw.numpy(), tw.grad.numpy(), rtol=1e-10, atol=1e-14)  # type: ignore[union-attr]
        w = w - 0.5 * gw.numpy()
    assert f.captures == 1


def test_arguments_and_captured_values_returned_as_they_are(rng: np.random.Generator) -> None:
    const = fl.tensor(np.arange(3, dtype=np.float32))
    f = fl.jit(lambda x, y: (x, const, x + y))
    a, b = rng.standard_normal((2, 3)).astype(np.float32)
    for scale in (1.0, 2.0):
        x_out, c_out, s = f(a * scale, b)
        np.testing.assert_array_equal(x_out.numpy(), a * scale)
        np.testing.assert_array_equal(c_out.numpy(), np.arange(3))
        np.testing.assert_array_equal(s.numpy(), a * scale + b)


def test_intermediates_share_arena_buffers(rng: np.random.Generator) -> None:
    def chain(x: fl.Tensor) -> fl.Tensor:
        for _ in range(6):
            x = fl.ops.softmax_last_dim(x * 2.0)
        return x

    x = rng.standard_normal((64, 256)).astype(np.float32)
    f = fl.jit(chain)
    y = f(x).numpy()
    capture = f.capture_for(x)
    assert capture is not None
    # 11 intermediates of 64 KiB each; a chain needs two live at a time
    assert capture.arena_bytes == 2 * x.nbytes
    np.testing.assert_array_equal(y, fl.realize(chain(fl.tensor(x)))[0].numpy())


def test_non_contiguous_arguments_are_copied_for_contiguous_kernels(rng: np.random.Generator) -> None:
    f = fl.jit(lambda x: fl.ops.softmax_last_dim(x))
    x = rng.standard_normal((8, 6)).astype(np.float32)
    f(np.ascontiguousarray(x.T))
    with fl.trace() as t:
        y = f(x.T).numpy()
    assert [r.copies for r in t.records] == [1]
    np.testing.assert_array_equal(y, fl.ops.softmax_last_dim(fl.tensor(np.ascontiguousarray(x.T))).numpy())


def test_bad_functions_and_arguments_are_clear_errors() -> None:
    with pytest.raises(fl.ParamError, match="expects a callable"):
        fl.jit(3)  # type: ignore[arg-type]
    with pytest.raises(fl.ParamError, match="must return a Tensor"):
        fl.jit(lambda x: 3)(np.ones(2, np.float32))
    with pytest.raises(fl.DTypeError):
        fl.jit(lambda x: x)(np.ones(2, np.complex64))


def test_decorator_form_with_options(rng: np.random.Generator) -> None:
    @fl.jit(reuse_outputs=True)
    def double(x: fl.Tensor) -> fl.Tensor:
        return x * 2.0

    np.testing.assert_array_equal(double(np.ones(3, np.float32)).numpy(), [2, 2, 2])


# ---- destructive ops under replay -----------------------------------------------------------------


def _affine(x: fl.Tensor) -> fl.Tensor:
    return fl.ops.inplace_affine(x, 2.0, 1.0)  # x <- 2·x + 1 in x's buffer


def test_destructive_op_runs_after_every_reader_of_its_input_under_replay() -> None:
    def fn(state: fl.Tensor, x: fl.Tensor) -> tuple[fl.Tensor, fl.Tensor]:
        before = state * x           # reads the old state
        return _affine(state), before

    f = fl.jit(fn)
    state = np.ones(4, np.float32)
    for step in range(3):
        old = state.copy()
        new, before = f(state, np.full(4, 10.0, np.float32))
        np.testing.assert_array_equal(before.numpy(), old * 10.0)
        np.testing.assert_array_equal(state, old * 2 + 1)  # the caller's buffer was written in place
        np.testing.assert_array_equal(new.numpy(), state)
        assert not np.shares_memory(new.numpy(), state), step  # the result handed out is the call's own


def test_destructive_op_on_an_intermediate_reuses_its_arena_buffer() -> None:
    f = fl.jit(lambda x: _affine(x * 3.0) + 0.0)
    for v in (1.0, 2.0):
        np.testing.assert_array_equal(f(np.full(5, v, np.float32)).numpy(), np.full(5, 6 * v + 1))


def test_primitives_of_captured_weights_are_folded_at_capture(rng: np.random.Generator) -> None:
    w = fl.tensor(rng.standard_normal((6, 4)).astype(np.float32))
    g = fl.tensor(rng.standard_normal(4).astype(np.float32))

    def fn(x: fl.Tensor) -> fl.Tensor:
        return (x @ w.T.T * 2.0) * g  # the transposes and g's broadcast read only captured values

    f = fl.jit(fn)
    for _ in range(2):
        x = rng.standard_normal((3, 6)).astype(np.float32)
        np.testing.assert_array_equal(f(x).numpy(), fl.realize(fn(fl.tensor(x)))[0].numpy())
    capture = f.capture_for(x)
    assert capture is not None and capture.n_folded >= 3


def test_captured_arrays_a_step_destroys_are_not_folded() -> None:
    state = np.ones(4, np.float32)
    held = fl.tensor(state)
    f = fl.jit(lambda x: (_affine(held), held * 2.0 + x))
    for _ in range(3):
        before = state.copy()
        _, doubled = f(np.zeros(4, np.float32))
        np.testing.assert_array_equal(doubled.numpy(), before * 2.0)  # read before this call's write
        np.testing.assert_array_equal(state, before * 2 + 1)


def test_views_of_arena_buffers_are_folded_and_copying_reshapes_are_not(rng: np.random.Generator) -> None:
    def fn(x: fl.Tensor) -> tuple[fl.Tensor, fl.Tensor]:
        y = (x * 2.0).reshape(4, 3).T          # views of an arena buffer: the same every call
        flat = y.reshape(12)                    # y is transposed: NumPy copies, so this runs every call
        return y * 1.0, flat + 0.0

    f = fl.jit(fn)
    for _ in range(3):
        x = rng.standard_normal(12).astype(np.float32)
        got = [t.numpy() for t in f(x)]
        want = [t.numpy() for t in fl.realize(*fn(fl.tensor(x)))]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    capture = f.capture_for(x)
    assert capture is not None and capture.n_folded == 2  # the reshape and the transpose


def test_a_copying_reshape_of_a_destroyed_capture_is_not_folded() -> None:
    state = np.arange(6, dtype=np.float32).reshape(2, 3)
    held = fl.tensor(state)
    f = fl.jit(lambda x: (held.T.reshape(6) + x, _affine(held)))
    for _ in range(3):
        before = state.copy()
        flat, _ = f(np.zeros(6, np.float32))
        np.testing.assert_array_equal(flat.numpy(), before.T.reshape(6))


def test_max_arena_bytes_drops_the_least_recently_used_capture() -> None:
    def fn(x: fl.Tensor) -> fl.Tensor:
        return (x * 2.0).exp() * 3.0 + 1.0

    a, b, c = (np.ones((n,), np.float32) for n in (1000, 2000, 3000))
    probe = fl.jit(fn)
    sizes = []
    for x in (a, b, c):
        probe(x)
        cap = probe.capture_for(x)
        assert cap is not None
        sizes.append(cap.arena_bytes)
    assert min(sizes) > 0
    step = fl.jit(fn, max_arena_bytes=sizes[1] + sizes[2])  # room for the two largest, not all three
    step(a)
    step(b)
    step(a)  # a is now the most recently used
    step(c)  # over budget: b (least recently used) goes, then a if still over
    assert step.capture_for(b) is None and step.capture_for(c) is not None
    assert step.captures < 3
    np.testing.assert_allclose(step(b).numpy(), 3.0 * np.exp(2.0) + 1.0, rtol=1e-6)  # traced again when needed
    with pytest.raises(fl.ParamError, match="max_arena_bytes"):
        fl.jit(fn, max_arena_bytes=-1)


def test_max_arena_bytes_counts_the_native_replays_staged_buffers() -> None:
    """An argument the native replay copies into a buffer of the capture's own is memory the capture
    holds: two signatures whose arenas fit the budget but whose staged arguments do not are not both kept."""

    def fn(x: fl.Tensor) -> fl.Tensor:
        return (x * 2.0).exp() * 3.0

    a, b = np.ones((60000,), np.float32), np.ones((70000,), np.float32)
    step = fl.jit(fn)
    held = []
    for x in (a, b):
        step(x)
        cap = step.capture_for(x)
        assert cap is not None and cap.native is not None and cap.native.stage  # x staged
        assert cap.held_bytes == cap.arena_bytes + cap.native.own_bytes >= cap.arena_bytes + x.nbytes
        held.append(cap.held_bytes)
    arenas = sum(c.arena_bytes for c in (step.capture_for(a), step.capture_for(b)) if c is not None)
    budget = fl.jit(fn, max_arena_bytes=max(arenas, *held))  # both arenas fit; arenas and staged buffers do not
    budget(a)
    budget(b)
    assert budget.capture_for(a) is None and budget.capture_for(b) is not None


@pytest.mark.parametrize("dtype", ["f32", "f64", "bf16"])
def test_prims_writing_into_the_arena_give_the_eager_bytes(dtype: str) -> None:
    """SiLU and index_select write straight into their arena buffers under replay; the bytes are the
    eager (fresh-array) path's, and index_select still rejects an out-of-range index."""
    np_dtype = fl.DType(dtype).np
    rng = np.random.default_rng(9)
    x = np.concatenate([rng.standard_normal(61) * 30, [-100.0, 100.0, np.inf, -np.inf, np.nan]]).astype(np_dtype)
    table = rng.standard_normal((7, 5)).astype(np_dtype)
    idx = np.array([6, 0, 3, 3], np.int64)

    def fn(a: fl.Tensor, t: fl.Tensor, i: fl.Tensor) -> tuple[fl.Tensor, fl.Tensor]:
        return (a * 1.0).silu() * 1.0, (t * 1.0).index_select(0, i) * 1.0

    eager = [np.asarray(v) for v in fl.realize(*fn(fl.tensor(x), fl.tensor(table), fl.tensor(idx)))]
    jitted = fl.jit(fn)
    for _ in range(3):  # capture, the checked first replay, then the steady-state loop
        got = [np.asarray(v) for v in jitted(x, table, idx)]
        assert [g.tobytes() for g in got] == [e.tobytes() for e in eager]
    with pytest.raises(fl.FuelError, match="index_select: index 7 is out of range"):
        jitted(x, table, np.array([1, 7], np.int64))


# ---- DynScalar bindings ------------------------------------------------------------------------------


class _Integral:
    """An integer type neither Python nor NumPy knows, registered as a `numbers.Integral`."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __int__(self) -> int:
        return self.v

    def __index__(self) -> int:
        return self.v


numbers.Integral.register(_Integral)

_INTEGERS: dict[str, Callable[[int], Any]] = {
    "int": int, "np.int64": np.int64, "np.int32": np.int32, "np.uint16": np.uint16, "0-d i64": np.array,
    "0-d u8": lambda v: np.array(v, np.uint8), "0-d u64": lambda v: np.array(v, np.uint64), "Integral": _Integral}

H, D, CAP = 2, 8, 6


def _decode_attention() -> Any:
    return fl.jit(lambda q, k, v, kc, vc: fl.ops.flash_attn(
        q, fl.cache_write(kc, k, fl.dyn("pos")), fl.cache_write(vc, v, fl.dyn("pos")), causal=True,
        k_len=fl.dyn("k_len")))


def test_dynamic_scalars_bind_any_integer() -> None:
    """pos and k_len given as any integral number (Python's, NumPy's, a 0-d integer array, a registered
    numbers.Integral) bind as that integer, on the capturing call, the checked replay and the steady state;
    torch's attention over its own caches is the oracle."""
    for kind in _INTEGERS:
        _attend_with(kind)


def _attend_with(kind: str) -> None:
    as_kind = _INTEGERS[kind]
    rng = np.random.default_rng(5)
    step = _decode_attention()
    kc, vc = np.zeros((1, H, CAP, D), np.float32), np.zeros((1, H, CAP, D), np.float32)
    tk, tv = torch.zeros((1, H, CAP, D), dtype=torch.float64), torch.zeros((1, H, CAP, D), dtype=torch.float64)
    for pos in range(4):
        q, k, v = (rng.standard_normal((1, H, 1, D)).astype(np.float32) for _ in range(3))
        out = step(q, k, v, kc, vc, pos=as_kind(pos), k_len=as_kind(pos + 1)).numpy()
        tk[:, :, pos], tv[:, :, pos] = torch.from_numpy(k[:, :, 0]), torch.from_numpy(v[:, :, 0])
        want = torch.nn.functional.scaled_dot_product_attention(
            torch.from_numpy(q.astype(np.float64)), tk[:, :, :pos + 1], tv[:, :, :pos + 1]).numpy()
        assert np.all(np.abs(out - want) <= 1e-5 * np.abs(want).max(axis=-1, keepdims=True)), (kind, pos)
    assert step.captures == 1


@pytest.mark.parametrize("bad", [2.0, np.float64(2.0), np.float32(2.0), True, np.True_, np.array(2.0), np.array(True),
                                 np.array([2]), "2", None], ids=repr)
def test_a_non_integer_dynamic_scalar_is_a_param_error_naming_it(bad: object) -> None:
    """Never truncated (2.0 is not bound as 2) nor read as 0/1 (a bool): a ParamError naming the DynScalar."""
    step = _decode_attention()
    q = np.ones((1, H, 1, D), np.float32)
    cache = np.zeros((1, H, CAP, D), np.float32)
    step(q, q, q, cache, cache.copy(), pos=1, k_len=2)
    want = re.escape(f"jit: dynamic scalar 'k_len' must be an integer (a Python or NumPy integer, or a 0-d integer "
                     f"array), got {bad!r} ({type(bad).__name__})")
    with pytest.raises(fl.ParamError, match=want):
        step(q, q, q, cache, cache.copy(), pos=2, k_len=bad)


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


def test_tensor_const_takes_a_read_only_snapshot_without_touching_the_callers_array() -> None:
    w = np.arange(4, dtype=np.float32)
    tc = fl.tensor(w, const=True)
    assert w.flags.writeable and not np.shares_memory(tc.numpy(), w)  # the caller's array is left as it was
    w[:] = -1.0
    np.testing.assert_array_equal(tc.numpy(), np.arange(4))
    frozen = _frozen_copy(np.arange(4, dtype=np.float32))
    assert np.shares_memory(fl.tensor(frozen, const=True).numpy(), frozen)  # already constant: no copy
    with pytest.raises(fl.ParamError, match="const=True takes an array, got a Tensor"):
        fl.tensor(tc, const=True)


# ---- fn must not realise what can change -----------------------------------------------------------------

_REALISES: dict[str, Callable[[Any], Any]] = {
    ".numpy()": lambda t: t.numpy(),
    ".item()": lambda t: t.item(),
    "float()": float,
    "int()": lambda t: int(t.cast(fl.i64)),
    "bool()": lambda t: bool(t > 0),
    "operator.index()": lambda t: range(10)[t.cast(fl.i64)],
    "np.asarray()": np.asarray,
    "fl.realize()": fl.realize,
    ".realize()": lambda t: t.realize(),
}


@pytest.mark.parametrize("on", ["the argument", "a value computed from it"])
@pytest.mark.parametrize("how", list(_REALISES))
def test_realising_what_depends_on_an_argument_inside_fn_is_an_error(how: str, on: str) -> None:
    """The value would be baked into the capture: a RealizeInTrace naming the call and the argument."""
    realise = _REALISES[how]

    def fn(x: fl.Tensor) -> fl.Tensor:
        v = x if on == "the argument" else (x * 2.0).sum()
        realise(v)
        return x + 1.0

    with pytest.raises(fl.RealizeInTrace, match=re.escape(f"jit: fn must not realise inside fl.jit, but it called "
                                                          f"{how} of a ") + r".* depends on argument 0 \(\[\] f32\)"):
        fl.jit(fn)(np.float32(1.5))
    np.testing.assert_array_equal(fl.tensor(np.ones(2, np.float32)).numpy(), [1, 1])  # realising works again after


def test_python_branching_on_a_value_inside_fn_is_an_error() -> None:
    def fn(x: fl.Tensor, y: fl.Tensor) -> fl.Tensor:
        return x * 2.0 if (y.sum() > 0) else x  # bool() of a value of argument 1

    with pytest.raises(fl.RealizeInTrace, match=r"bool\(\) of a \[\] u8 tensor .* argument 1 \(\[3\] f32\)"):
        fl.jit(fn)(np.ones(3, np.float32), np.ones(3, np.float32))


def test_a_jitted_call_inside_fn_is_an_error() -> None:
    inner = fl.jit(lambda x: x * 2.0)
    with pytest.raises(fl.RealizeInTrace, match="depends on argument 0"):
        fl.jit(lambda x: inner(x * 1.0) + 1.0)(np.ones(3, np.float32))


def test_realising_constants_inside_fn_is_allowed_and_a_writable_capture_is_not() -> None:
    """A constant's value is the same at every call (what the capture would fold anyway): fn may read it,
    e.g. to pick a branch. A writable captured array may change between calls: reading it is an error."""
    tc = fl.tensor(np.array([1.0, 2.0, 3.0], np.float32), const=True)

    def fn(x: fl.Tensor) -> fl.Tensor:
        scale = float(tc.sum()) + float(fl.full((), 0.5) * 2.0)  # 6 + 1
        return x * scale if bool(tc[0] > 0) else x

    f = fl.jit(fn)
    for v in (1.0, 2.0):
        np.testing.assert_array_equal(f(np.full(2, v, np.float32)).numpy(), [7.0 * v] * 2)
    w = np.array([1.0, 2.0], np.float32)
    tw = fl.tensor(w)
    for how, realise in _REALISES.items():
        with pytest.raises(fl.RealizeInTrace, match=re.escape(f"called {how} of a ") + r".*reads a writable "
                           r"captured array \(\[2\] f32\) that may change between calls.*const=True"):
            fl.jit(lambda x, r=realise: x + r(tw.sum()))(np.ones(2, np.float32))  # type: ignore[misc]
