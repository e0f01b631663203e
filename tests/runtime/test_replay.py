"""Native replay (`fuel.runtime.replay`): a capture's task-backed steps posted from jitted code give the
bytes the Python replay gives, call after call, with new arguments and DynScalar values, at any thread
count; a decode-shaped block also against torch in float64. Steps it cannot serve stay in Python."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.cpu.prims.gemv import GEMV_MAX_ROWS
from fuel.cpu.quant import gguf_decode
from fuel.cpu.quant import nf4_matmul as nf4_kernels
from fuel.dtype import DType
from fuel.errors import IndexOutOfRange
from fuel.graph.registry.qmatmul import QMatMulParams
from fuel.quant import QuantType, nf4_quantize
from fuel.runtime import pool, replay
from fuel.testing.oracle import assert_close_contraction
from fuel.testing.pool import awake_when
from fuel.testing.reference.nf4_matmul import dequant64
from fuel.testing.reference.qmatmul import as_words, qmatmul64, qmatmul_scale, random_weight

H, D, CAP = 2, 16, 24
HIDDEN = H * D
EPS = 1e-5


@pytest.fixture
def python_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Captures made inside keep every step in Python."""
    monkeypatch.setattr(replay, "prepare", lambda *a, **k: None)
    yield


def _q8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Q8_0 blocks of w as u32 words, their dequantisation in float64)."""
    q = gguf.quants.quantize(w.astype(np.float32), GGMLQuantizationType.Q8_0)
    return (np.frombuffer(q.tobytes(), np.uint32).copy(),
            gguf.quants.dequantize(q, GGMLQuantizationType.Q8_0).astype(np.float64))


class Block:
    """A decode step of a toy attention layer: norm with weight, Q8_0 projection, rope, in-graph K/V cache
    writes at DynScalar `pos`, attention over `k_len` keys, SiLU gate, residual, scalar ops."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.norm_w = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        self.words, self.w64 = _q8(rng.standard_normal((3 * HIDDEN, HIDDEN)) * 0.3)
        ang = np.arange(CAP)[:, None] * 0.1 * np.arange(1, D + 1)[None, :]
        self.cos, self.sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        self.k_cache = np.zeros((1, H, CAP, D), np.float32)
        self.v_cache = np.zeros((1, H, CAP, D), np.float32)

    def graph(self, x: fl.Tensor, cos: fl.Tensor, sin: fl.Tensor) -> fl.Tensor:
        h = fl.ops.rms_norm_last_dim(x, EPS) * fl.tensor(self.norm_w)
        qkv = fl.ops.qmatmul(h, fl.tensor(self.words), "q8_0", HIDDEN, 3 * HIDDEN)
        q, k, v = (qkv[:, i * HIDDEN:(i + 1) * HIDDEN].reshape(1, 1, H, D).permute(0, 2, 1, 3) for i in range(3))
        q, k = fl.ops.rope(q, cos, sin), fl.ops.rope(k, cos, sin)
        kc = fl.cache_write(fl.tensor(self.k_cache), k, fl.dyn("pos"))
        vc = fl.cache_write(fl.tensor(self.v_cache), v, fl.dyn("pos"))
        a = fl.ops.flash_attn(q, kc, vc, softmax_scale=D ** -0.5, causal=True, k_len=fl.dyn("k_len"))
        y = a.permute(0, 2, 1, 3).reshape(1, HIDDEN)
        g = (y * 0.5).silu() * (y - x) + x
        return (g / 3.0 + 1.0) * 2.0

    def torch_step(self, x: np.ndarray, pos: int) -> np.ndarray:
        """The same step in float64, on torch's own caches."""
        t = torch.from_numpy(x.astype(np.float64))
        h = torch.nn.functional.rms_norm(t, (HIDDEN,), torch.from_numpy(self.norm_w.astype(np.float64)), EPS)
        qkv = h @ torch.from_numpy(self.w64).T
        q, k, v = (qkv[:, i * HIDDEN:(i + 1) * HIDDEN].reshape(1, 1, H, D).permute(0, 2, 1, 3) for i in range(3))
        c, s = (torch.from_numpy(a[pos:pos + 1].astype(np.float64)) for a in (self.cos, self.sin))

        def rope(z: torch.Tensor) -> torch.Tensor:
            return z * c + torch.cat([-z[..., D // 2:], z[..., :D // 2]], -1) * s

        self.tk[:, :, pos], self.tv[:, :, pos] = rope(k)[:, :, 0], v[:, :, 0]
        a = torch.nn.functional.scaled_dot_product_attention(rope(q), self.tk[:, :, :pos + 1],
                                                             self.tv[:, :, :pos + 1])
        y = a.permute(0, 2, 1, 3).reshape(1, HIDDEN)
        g = torch.nn.functional.silu(y * 0.5) * (y - t) + t
        return ((g / 3.0 + 1.0) * 2.0).numpy()

    def run(self, f: Callable[..., Any], xs: list[np.ndarray], start: int = 0,
            oracle: bool = False) -> list[np.ndarray]:
        self.tk = torch.zeros((1, H, CAP, D), dtype=torch.float64)
        self.tv = torch.zeros((1, H, CAP, D), dtype=torch.float64)
        outs = []
        for i, x in enumerate(xs):
            pos = start + i
            out = f(x, self.cos[pos:pos + 1], self.sin[pos:pos + 1], pos=pos, k_len=pos + 1).numpy()
            if oracle:
                ref = self.torch_step(x, pos)
                assert np.all(np.abs(out - ref) <= 1e-4 * np.abs(ref).max(axis=-1, keepdims=True)), (pos, out, ref)
            outs.append(out)
        return outs


def _steps(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    return [rng.standard_normal((1, HIDDEN)).astype(np.float32) for _ in range(n)]


def _python_bytes(rng_seed: int, xs: list[np.ndarray], monkeypatch: pytest.MonkeyPatch) -> list[np.ndarray]:
    with monkeypatch.context() as m:
        m.setattr(replay, "prepare", lambda *a, **k: None)
        block = Block(np.random.default_rng(rng_seed))
        f = fl.jit(block.graph)
        outs = block.run(f, xs)
        assert f.capture_for(xs[0], block.cos[:1], block.sin[:1]).native is None  # type: ignore[union-attr]
    return outs


def test_a_decode_block_runs_natively_with_the_python_replays_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    xs = _steps(np.random.default_rng(1), 8)
    want = _python_bytes(0, xs, monkeypatch)
    block = Block(np.random.default_rng(0))
    f = fl.jit(block.graph)
    got = block.run(f, xs, oracle=True)
    for g, w in zip(got, want, strict=True):
        assert g.tobytes() == w.tobytes()
    cap = f.capture_for(xs[0], block.cos[:1], block.sin[:1])
    assert cap is not None and cap.native is not None
    python_steps = [item for item in cap.native.items if len(item) != 2]
    # every step is native, the last writing the fresh output into a buffer of the capture's, copied out
    assert cap.native.step_count == cap.n_steps and not python_steps and cap.native.copied
    assert set(cap.native.program.names) == {"pos", "k_len"}


@pytest.mark.parametrize("threads", [1, 2])
def test_native_bytes_do_not_depend_on_the_thread_count(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    xs = _steps(np.random.default_rng(2), 5)
    want = _python_bytes(0, xs, monkeypatch)
    saved = fl.get_num_threads()
    fl.set_num_threads(threads)
    try:
        block = Block(np.random.default_rng(0))
        got = block.run(fl.jit(block.graph), xs)
    finally:
        fl.set_num_threads(saved)
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]


def test_a_dynamic_scalar_out_of_range_is_the_python_paths_error() -> None:
    block = Block(np.random.default_rng(0))
    f = fl.jit(block.graph)
    xs = _steps(np.random.default_rng(3), 3)
    block.run(f, xs)
    assert f.capture_for(xs[0], block.cos[:1], block.sin[:1]).native is not None  # type: ignore[union-attr]
    with pytest.raises(IndexOutOfRange, match="cache_write"):
        f(xs[0], block.cos[:1], block.sin[:1], pos=CAP, k_len=CAP)
    with pytest.raises(IndexOutOfRange, match="k_len"):
        f(xs[0], block.cos[:1], block.sin[:1], pos=0, k_len=CAP + 1)
    # and the capture goes on natively afterwards
    block.run(f, xs, start=3)


def test_arguments_are_read_afresh_each_call_even_non_contiguous() -> None:
    rng = np.random.default_rng(4)
    w = rng.standard_normal(HIDDEN).astype(np.float32)
    f = fl.jit(lambda x: (fl.ops.rms_norm_last_dim(x, EPS) * fl.tensor(w)) * 2.0 + x, reuse_outputs=False)
    for i in range(5):
        big = rng.standard_normal((3, 2 * HIDDEN)).astype(np.float32)
        x = big[:, ::2] if i % 2 else np.ascontiguousarray(big[:, :HIDDEN])
        got = f(x).numpy()
        (want,) = fl.realize(f.__wrapped__(fl.tensor(np.ascontiguousarray(x))))
        assert got.tobytes() == want.numpy().tobytes()
    cap = f.capture_for(x)
    assert cap is not None and cap.native is not None and len(cap.native.program.jobs) >= 2


def test_a_cache_passed_as_argument_is_written_in_place() -> None:
    rng = np.random.default_rng(5)
    f = fl.jit(lambda cache, rows: fl.cache_write(cache, rows * 2.0, fl.dyn("pos")) * 1.0)
    cache = np.zeros((1, 2, 6, 4), np.float32)
    want = cache.copy()
    for pos in range(6):
        rows = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
        out = f(cache, rows, pos=pos).numpy()
        want[:, :, pos] = rows[:, :, 0] * 2
        assert np.array_equal(cache, want) and np.array_equal(out, want)


def test_reused_outputs_come_from_native_steps() -> None:
    rng = np.random.default_rng(6)
    f = fl.jit(lambda a, b: (a * b + 1.0).silu(), reuse_outputs=True)
    for _ in range(4):
        a, b = rng.standard_normal((2, 3, 5)).astype(np.float32), rng.standard_normal((3, 5)).astype(np.float32)
        got = f(a, b).numpy().copy()
        want = fl.realize(f.__wrapped__(fl.tensor(a), fl.tensor(b)))[0].numpy()
        assert got.tobytes() == want.tobytes()
    cap = f.capture_for(a, b)
    assert cap is not None and cap.native is not None and cap.native.step_count == cap.n_steps - 1
    assert not [item for item in cap.native.items if len(item) != 2]  # b broadcast once, from its staged copy



def test_small_fresh_outputs_are_written_natively_and_handed_out_as_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `reuse_outputs`, a native step writes a small output (or what a view of it returns) into a
    buffer of the capture's own, and each call hands out a copy: results already handed out keep their
    values, share no memory with each other or the capture, and are the Python replay's bytes."""
    rng = np.random.default_rng(12)
    xs = [rng.standard_normal((3, 8)).astype(np.float32) for _ in range(4)]

    def fn(x: fl.Tensor) -> tuple[fl.Tensor, fl.Tensor]:
        return (x * 2.0 + 1.0).reshape(24), (x - 1.0).silu()

    with monkeypatch.context() as m:
        m.setattr(replay, "prepare", lambda *a, **kw: None)
        python = fl.jit(fn)
        want = [[t.numpy().copy() for t in python(x)] for x in xs]
    f = fl.jit(fn)
    got = [[t.numpy() for t in f(x)] for x in xs]
    kept = [[g.copy() for g in pair] for pair in got]
    cap = f.capture_for(xs[0])
    assert cap is not None and cap.native is not None
    assert len(cap.native.copied) == 2 and not [item for item in cap.native.items if len(item) != 2]
    owned = [a for _, a in cap.native.fixed]
    flat = [g for pair in got for g in pair]
    for i, g in enumerate(flat):
        assert not any(np.shares_memory(g, a) for a in owned)
        assert not any(np.shares_memory(g, h) for h in flat[i + 1:])
    assert [[g.tobytes() for g in pair] for pair in got] == [[w.tobytes() for w in pair] for pair in want]
    assert [[g.tobytes() for g in pair] for pair in got] == [[k.tobytes() for k in pair] for pair in kept]


def test_a_fresh_output_over_the_staging_size_stays_in_python() -> None:
    """An output larger than `OUT_STAGE_MAX_BYTES` is allocated by its step each call, in Python: a copy
    of it would cost more than the Python step."""
    rows = replay.OUT_STAGE_MAX_BYTES // (4 * 64) + 1
    x = np.random.default_rng(13).standard_normal((rows, 64)).astype(np.float32)
    f = fl.jit(lambda t: (t * 2.0) + 1.0)
    first, second = f(x).numpy(), f(x).numpy()
    cap = f.capture_for(x)
    assert cap is not None and cap.native is not None and not cap.native.copied
    assert len(cap.native.program.jobs) == 1 and len([item for item in cap.native.items if len(item) != 2]) == 1
    assert not np.shares_memory(first, second)
    assert second.tobytes() == ((x * np.float32(2)) + np.float32(1)).tobytes()

_SHAPES = st.lists(st.integers(1, 5), min_size=1, max_size=4)


@st.composite
def _broadcast_pair(draw: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An output shape and a shape of b that broadcasts to it (dims dropped from the front, some set to 1)."""
    shape = tuple(draw(_SHAPES))
    keep = draw(st.integers(0, len(shape)))
    b = [d if draw(st.booleans()) else 1 for d in shape[len(shape) - keep:]]
    return shape, tuple(b)


@settings(max_examples=40, deadline=None)
@given(pair=_broadcast_pair(), op=st.sampled_from(["add", "sub", "mul", "div", "add_scalar", "mul_scalar"]),
       seed=st.integers(0, 2**16))
def test_binary_steps_match_numpy_on_every_broadcast_layout(pair: tuple[tuple[int, ...], tuple[int, ...]], op: str,
                                                           seed: int) -> None:
    shape, bshape = pair
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape).astype(np.float32)
    b = (rng.standard_normal(bshape).astype(np.float32) + 2.5).astype(np.float32)
    ops: dict[str, Callable[[Any, Any], Any]] = {
        "add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y, "div": lambda x, y: x / y,
        "add_scalar": lambda x, y: x + 0.3, "mul_scalar": lambda x, y: x * -1.7}
    fn = ops[op]
    f = fl.jit(lambda x, y: fn(x, y), reuse_outputs=True)
    for _ in range(3):  # the third call replays natively
        got = f(a, b).numpy()
    want = fn(a, b)
    assert got.dtype == np.float32 and got.tobytes() == np.asarray(want, np.float32).tobytes()
    cap = f.capture_for(a, b)
    assert cap is not None
    # b along each axis: whole (its size) or broadcast (1); a suffix of whole axes after broadcast ones
    # (a row vector), or the reverse (a column), is a layout the tasks read, so the step ran natively
    n, bb = len(shape), (1,) * (len(shape) - len(bshape)) + bshape
    whole = [bb[d] == shape[d] for d in range(n)]
    one = [bb[d] == 1 for d in range(n)]
    served = any((all(one[:t]) and all(whole[t:])) or (all(whole[:t]) and all(one[t:])) for t in range(n + 1))
    assert (cap.native is not None) == served or (op.endswith("scalar") and cap.native is not None)


def _native_against_python(fn: Callable[[fl.Tensor], fl.Tensor], xs: list[np.ndarray],
                           monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[np.ndarray]]:
    """fn jitted over the calls xs natively, checked byte for byte against a jit of it whose captures keep
    every step in Python: (the native jit, its outputs)."""
    with monkeypatch.context() as m:
        m.setattr(replay, "prepare", lambda *a, **kw: None)
        python = fl.jit(fn)
        want = [python(x).numpy() for x in xs]
    f = fl.jit(fn)
    got = [f(x).numpy() for x in xs]
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]
    return f, got


# The table ways this host has (AVX-512: Q4_0, Q4_1, Q4_K; AVX2: Q4_0).
_ONE_ROW_WAYS = [(qt, way) for qt, way in [
    (QuantType.Q4_0, "portable"), (QuantType.Q4_0, "tables"), (QuantType.Q4_1, "tables"), (QuantType.Q4K, "tables"),
    (QuantType.Q4K, "words"), (QuantType.Q6K, "portable"), (QuantType.Q6K, "words"), (QuantType.Q8_0, "portable")]
    if way != "tables" or qt in gguf_decode.TABLE_KERNELS]


@pytest.mark.parametrize(("qt", "way"), _ONE_ROW_WAYS, ids=lambda v: getattr(v, "ggml_name", v))
def test_one_row_qmatmul_runs_natively_every_way(qt: QuantType, way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each one-row decoder (portable, table, words) as a native job, a table kernel's after the job that
    permutes the activations into its scratch: the Python replay's bytes, and gguf-py's values in float64."""
    monkeypatch.setattr(gguf_decode, "USE_TABLES", way == "tables")
    monkeypatch.setattr(gguf_decode, "USE_WORDS", way == "words")
    k, n = 2 * qt.block_elements, 40
    params = QMatMulParams(quant_type=qt, k=k, n=n)
    words = as_words(random_weight(np.random.default_rng(7), qt, n, k))
    rng = np.random.default_rng(8)
    xs = [rng.standard_normal((1, k)).astype(np.float32) for _ in range(4)]

    def fn(x: fl.Tensor) -> fl.Tensor:
        return fl.ops.qmatmul(x, fl.tensor(words), qt, k, n)

    f, got = _native_against_python(fn, xs, monkeypatch)
    cap = f.capture_for(xs[0])
    assert cap is not None and cap.native is not None
    assert len(cap.native.program.jobs) == (2 if way == "tables" else 1)  # the output copied out of its buffer
    assert cap.native.step_count == 1  # one step however many jobs it posts
    for x, g in zip(xs, got, strict=True):
        ref = qmatmul64([x.astype(np.float64), words], params)
        assert_close_contraction(g, ref, qmatmul_scale([x.astype(np.float64), words], params), DType.F32)


@pytest.mark.parametrize(("bs", "shape"), [(32, (1, 128)), (64, (1, 1, 256)), (128, (1, 384)), (24, (1, 96))],
                         ids=str)
def test_one_row_nf4_matmul_runs_natively(bs: int, shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """Nf4Matmul's one-row table decode as two native jobs, the activations permuted into the form's own
    scratch and then the table task (32 or 64 codes a lookup by block size): the Python replay's bytes, and
    float64 dequantise-then-matmul's values. A block size no 16-byte step fits stays in Python."""
    rng = np.random.default_rng(11)
    n, k = 40, shape[-1]
    packed, absmax = nf4_quantize(rng.standard_normal((n, k)).astype(np.float32), bs)
    xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(4)]

    def fn(x: fl.Tensor) -> fl.Tensor:
        return fl.ops.nf4_matmul(x, fl.tensor(packed), fl.tensor(absmax), bs)

    f, got = _native_against_python(fn, xs, monkeypatch)
    cap = f.capture_for(xs[0])
    assert cap is not None
    served = nf4_kernels.USE_TABLE and bs % 32 == 0
    assert (cap.native is not None and len(cap.native.program.jobs) == 2) == served
    deq = dequant64(packed, absmax, bs)
    for x, g in zip(xs, got, strict=True):
        x64 = x.astype(np.float64)
        assert_close_contraction(g, x64 @ deq.T, np.abs(x64) @ np.abs(deq).T, DType.F32)


@pytest.mark.parametrize("rows", [1, 3, 16, 17])
def test_few_row_f32_products_run_natively(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A product of up to GEMV_MAX_ROWS rows with an f32 weight (the MATMUL kernel's gemv) as one native job:
    the Python replay's bytes, and torch's float64 product; more rows go to the BLAS, in Python."""
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((96, 80)).astype(np.float32)
    xs = [rng.standard_normal((rows, 96)).astype(np.float32) for _ in range(3)]

    def fn(x: fl.Tensor) -> fl.Tensor:
        return x @ fl.tensor(w)

    f, got = _native_against_python(fn, xs, monkeypatch)
    cap = f.capture_for(xs[0])
    assert cap is not None
    assert (cap.native is not None and len(cap.native.program.jobs) == 1) == (rows <= GEMV_MAX_ROWS)
    for x, g in zip(xs, got, strict=True):
        ref = (torch.from_numpy(x.astype(np.float64)) @ torch.from_numpy(w.astype(np.float64))).numpy()
        assert_close_contraction(g, ref, np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)), DType.F32)


def test_a_stretch_wakes_sleeping_workers_and_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs large enough to post find the pool's workers asleep: the stretch returns to Python with the
    job posted and no part of it taken, Python wakes them, joins it and resumes at the next step; the
    bytes are NumPy's."""
    saved = fl.get_num_threads()
    fl.set_num_threads(2)  # a worker to wake, whatever the host
    rng = np.random.default_rng(9)
    x = rng.standard_normal((64, 1024)).astype(np.float32)
    f = fl.jit(lambda t: ((t + 1.0) * 2.0 - t) / 3.0 * 1.0)
    f(x)
    workers = pool._pool(1)
    woken: list[int] = []
    taken: list[int] = []  # the parts of the posted job claimed when Python wakes the workers

    def wake(w: int, e: threading.Event) -> None:
        woken.append(w)
        taken.append(int(workers.ctl[pool.CLAIM]) & pool.UNCLAIMABLE)
        threading.Event.set(e)

    for w, event in enumerate(workers.events):
        monkeypatch.setattr(event, "set", lambda w=w, e=event: wake(w, e))
    try:
        for _ in range(3):
            workers.park()
            assert all(awake_when(workers, 0, worker=w) == 0 for w in range(workers.workers))  # the workers sleep
            got = f(x).numpy()
            want = ((x + np.float32(1)) * np.float32(2) - x) / np.float32(3) * np.float32(1)
            assert got.tobytes() == want.tobytes()
    finally:
        fl.set_num_threads(saved)
    cap = f.capture_for(x)
    assert cap is not None and cap.native is not None and cap.native.step_count == 5  # 256 KiB out: staged
    assert woken and not any(taken)  # a stretch found them asleep and Python woke them before joining
