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
from fuel.graph.registry import FusedOps


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
    for kind, as_kind in _INTEGERS.items():
        _attend_with(kind, as_kind)


def _attend_with(kind: str, as_kind: Callable[[int], Any]) -> None:
    rng, step = np.random.default_rng(5), _decode_attention()
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


def test_a_traced_replay_hands_out_arrays_for_0d_results() -> None:
    """Under fl.trace() every call of a capture runs its steps in Python; a NumPy scalar a primitive returns for a
    0-d result (a division of two 0-d values) is made an array there too, as the first call does."""
    x = np.arange(4, dtype=np.float32)
    f = fl.jit(lambda t: (t * 2).sum() / fl.tensor(np.float32(2.0)))
    for _ in range(3):
        with fl.trace():
            y = f(x)
        got = y.numpy()
        assert isinstance(got, np.ndarray) and got.shape == () and float(got) == float((x * 2).sum() / 2)
