"""The executor: layouts, plan cache, CSE, freeing, scheduling, dynamic scalars, trace."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import fuel as fl
from fuel.dispatch import executor
from fuel.graph.node import DynScalar, Node, Op
from fuel.graph.passes.order import schedule
from fuel.graph.prims import make
from fuel.runtime.buffers import POOL, BufferPool


def _softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_non_contiguous_and_broadcast_inputs_are_contiguized_unless_the_kernel_reads_them(
        rng: np.random.Generator) -> None:
    x = rng.standard_normal((16, 8)).astype(np.float32)
    # softmax reads evenly spaced rows in place (tests/dispatch/test_strided_input.py), not a transposed one
    for view, copies in ((x.T, 1), (x[::2], 0), (np.broadcast_to(x[:1], (5, 8)), 0)):
        with fl.trace() as t:
            y = fl.ops.softmax_last_dim(fl.tensor(view)).numpy()
        np.testing.assert_allclose(y, _softmax64(view.astype(np.float64)), rtol=1e-5, atol=1e-7)
        assert [r.copies for r in t.records if r.impl.startswith("SoftmaxLastDim")] == [copies]
    y = fl.ops.softmax_last_dim(fl.tensor(x).transpose()).numpy()
    np.testing.assert_allclose(y, _softmax64(x.T.astype(np.float64)), rtol=1e-5, atol=1e-7)


def test_plan_cache_is_keyed_by_structure_not_values(rng: np.random.Generator) -> None:
    executor.clear_plan_cache()
    with fl.trace() as t:
        for _ in range(3):
            x = fl.tensor(rng.standard_normal((4, 6)).astype(np.float32))
            y = (x * 2.0).softmax(-1)
            np.testing.assert_allclose(y.numpy(), _softmax64(2.0 * x.numpy().astype(np.float64)), rtol=1e-5)
        fl.realize((fl.tensor(np.ones((4, 7), np.float32)) * 2.0).softmax(-1))
        fl.realize((fl.tensor(np.ones((4, 6), np.float32)) * 3.0).softmax(-1))
    assert (t.plans_built, t.plans_reused) == (3, 2)
    assert executor.plan_cache_size() == 3


def test_cse_runs_a_repeated_subexpression_once(rng: np.random.Generator) -> None:
    x = fl.tensor(rng.standard_normal((3, 4)).astype(np.float32))
    a = (x.exp() * 2.0).softmax(-1)
    b = (x.exp() * 2.0).softmax(-1)
    with fl.trace() as t:
        fl.realize(a + b)
    ops = [r.node.split("(")[1].split(" ")[0] for r in t.records]
    assert ops.count("EXP") == 1 and ops.count("FUSED") == 1


def test_intermediate_buffers_are_freed_after_their_last_reader(rng: np.random.Generator) -> None:
    x = fl.tensor(rng.standard_normal((512, 1024)).astype(np.float32))  # 2 MiB: pooled
    POOL.clear()
    y = x
    for _ in range(4):
        y = fl.ops.softmax_last_dim(y)
    fl.realize(y)
    # four 2 MiB outputs in a chain: each is dropped after its reader, so two buffers suffice
    assert POOL.held_bytes == 2 * 512 * 1024 * 4
    assert y.node.inputs[0].value is None


def test_pool_never_hands_out_a_buffer_that_is_still_viewed() -> None:
    pool = BufferPool()
    a = pool.empty((1 << 18,), np.dtype(np.float32))
    view = a[10:20]
    del a
    b = pool.empty((1 << 18,), np.dtype(np.float32))
    assert not np.shares_memory(b, view)


def test_realize_returns_the_same_tensors_and_skips_realised_ones(rng: np.random.Generator) -> None:
    x = fl.tensor(rng.standard_normal(5).astype(np.float32))
    y, z = x * 2.0, x + 1.0
    assert fl.realize(y, z) == (y, z)
    assert y.node.value is not None and z.node.value is not None
    with fl.trace() as t:
        fl.realize(y)
    assert t.records == []


@dataclass(frozen=True)
class _Params:
    k_len: DynScalar
    scale: float


def test_dynamic_scalars_resolve_at_run_time() -> None:
    p = _Params(fl.dyn("k_len"), 0.5)
    assert executor._resolve(p, {"k_len": 17}) == _Params(17, 0.5)  # type: ignore[arg-type]
    with pytest.raises(fl.ParamError, match="'k_len' is unbound"):
        executor._resolve(p, None)


def test_destructive_node_is_scheduled_after_every_other_reader() -> None:
    x = Node(Op.CONST, (), (4,), fl.f32, None, np.zeros(4, np.float32))
    view = make(Op.RESHAPE, (x,), (2, 2))
    destroy = make(Op.EXP, (x,))           # stands for an in-place op on x
    late_reader = make(Op.NEG, (view,))    # reads x through an alias
    other = make(Op.ADD_SCALAR, (x,), 1.0)
    root = make(Op.CONCAT, (destroy, make(Op.RESHAPE, (late_reader,), (4,)), other), 0)
    order = schedule([root], lambda n: 0 if n is destroy else None)
    pos = {n: i for i, n in enumerate(order)}
    assert pos[destroy] > pos[late_reader] and pos[destroy] > pos[other]
    assert pos[root] == len(order) - 1


def test_trace_reports_impl_time_and_copies(rng: np.random.Generator) -> None:
    x = fl.tensor(rng.standard_normal((3, 4)).astype(np.float32).T)
    with fl.trace() as t:
        fl.realize(fl.ops.softmax_last_dim(x))
    (rec,) = t.records
    assert rec.impl == "SoftmaxLastDim[cpu:f32,f32]" and rec.copies == 1 and rec.seconds >= 0
    assert "SoftmaxLastDim" in str(t)


def test_fused_node_without_kernel_is_lowered(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    from fuel.dispatch.impls import FusedKernelRegistry

    empty = FusedKernelRegistry()
    monkeypatch.setattr(executor, "default_kernel_registry", lambda: empty)
    executor.clear_plan_cache()
    x = rng.standard_normal((3, 5)).astype(np.float32)
    with fl.trace() as t:
        y = fl.ops.softmax_last_dim(fl.tensor(x)).numpy()
    executor.clear_plan_cache()
    assert all(r.impl.startswith("prim:") for r in t.records)
    np.testing.assert_allclose(y, _softmax64(x.astype(np.float64)), rtol=1e-5, atol=1e-7)


def _rms_with_dynamic_eps(x: np.ndarray) -> fl.Tensor:
    """An RMS norm node whose eps is a DynScalar (no builder takes one yet: the params are set directly)."""
    from fuel.graph.registry import FusedOps
    from fuel.graph.registry.rms_norm_last_dim import RmsNormLastDimParams

    params = object.__new__(RmsNormLastDimParams)
    object.__setattr__(params, "eps", fl.dyn("eps"))
    leaf = fl.tensor(x).node
    return fl.Tensor(Node(Op.FUSED, (leaf,), leaf.shape, leaf.dtype, (FusedOps.RMS_NORM_LAST_DIM, params)))


def test_unbound_dyn_in_realize_env_is_reported() -> None:
    x = np.arange(8, dtype=np.float64).reshape(2, 4) / 8
    with pytest.raises(fl.ParamError, match="'eps' is unbound"):
        fl.realize(_rms_with_dynamic_eps(x))
    with pytest.raises(fl.ParamError, match="'eps' is unbound"):
        fl.realize(_rms_with_dynamic_eps(x), env={"k_len": 3})
    executor.clear_plan_cache()
    with fl.trace() as t:
        for eps in (1, 4):
            (y,) = fl.realize(_rms_with_dynamic_eps(x), env={"eps": eps})
            want = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
            np.testing.assert_allclose(y.numpy(), want, rtol=1e-12)
    assert (t.plans_built, t.plans_reused) == (1, 1)


# ---- plan-cache hygiene -----------------------------------------------------------------------------


def test_a_cached_plan_pins_no_leaf_array(rng: np.random.Generator) -> None:
    import gc
    import weakref

    executor.clear_plan_cache()
    big = rng.standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    ref = weakref.ref(big)
    y = fl.ops.softmax_last_dim(fl.tensor(big) * 2.0)
    fl.realize(y)
    del big, y
    gc.collect()
    assert executor.plan_cache_size() == 1
    assert ref() is None


def test_realising_under_other_bindings_recomputes() -> None:
    x = np.arange(8, dtype=np.float64).reshape(2, 4) / 8
    y = _rms_with_dynamic_eps(x)
    z = y * 2.0
    for eps in (1, 4, 1):
        want = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        np.testing.assert_allclose(y.numpy(env={"eps": eps}), want, rtol=1e-12)
        np.testing.assert_allclose(z.numpy(env={"eps": eps}), 2 * want, rtol=1e-12)
    # without bindings, the last computed value stands; an unrelated binding does not recompute
    with fl.trace() as t:
        y.numpy()
        z.numpy(env={"k_len": 3})
    assert t.records == []


def test_a_plan_built_before_a_kernel_is_registered_is_not_reused(
        rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    from fuel.dispatch.impls import FusedKernelRegistry, default_kernel_registry

    kernels = FusedKernelRegistry()
    monkeypatch.setattr(executor, "default_kernel_registry", lambda: kernels)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    with fl.trace() as t:
        fl.ops.softmax_last_dim(fl.tensor(x)).numpy()
    assert all(r.impl.startswith("prim:") for r in t.records)
    for impl in default_kernel_registry():
        kernels.register(impl)
    with fl.trace() as t:
        y = fl.ops.softmax_last_dim(fl.tensor(x)).numpy()
    assert [r.impl for r in t.records] == ["SoftmaxLastDim[cpu:f32,f32]"]
    np.testing.assert_allclose(y, _softmax64(x.astype(np.float64)), rtol=1e-5, atol=1e-7)


def test_plan_cache_and_pool_serve_two_threads(rng: np.random.Generator) -> None:
    import threading

    xs = [rng.standard_normal((256 + 64 * (i % 3), 1024)).astype(np.float32) for i in range(6)]  # pooled sizes
    want = [_softmax64(2.0 * x.astype(np.float64)) for x in xs]
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for rep in range(8):
                i = (offset + rep) % len(xs)
                y = fl.ops.softmax_last_dim(fl.tensor(xs[i]) * 2.0).numpy()
                np.testing.assert_allclose(y, want[i], rtol=1e-5, atol=1e-7)
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    executor.clear_plan_cache()
    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]


def _parts_posted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The part count of every job `jobs.run` posts from now on."""
    from fuel.runtime import pool

    seen: list[int] = []
    run_address = pool.run_address
    monkeypatch.setattr(pool, "run_address", lambda task, args, parts: (seen.append(parts),
                                                                        run_address(task, args, parts))[1])
    return seen


def test_small_work_runs_in_the_calling_thread_and_large_work_in_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime picks each job's part count from its one-core estimate (`pool.parts_for`): one part for a
    decode-sized row, several for many rows, the same bytes as one part."""
    seen = _parts_posted(monkeypatch)
    before = fl.get_num_threads()
    try:
        fl.set_num_threads(2)
        outs = []
        for rows in (1, 16384):
            x = np.random.default_rng(rows).standard_normal((rows, 576)).astype(np.float32)
            outs.append(fl.ops.rms_norm_last_dim(fl.tensor(x), 1e-6).numpy())
            with fl.serial():
                assert fl.ops.rms_norm_last_dim(fl.tensor(x), 1e-6).numpy().tobytes() == outs[-1].tobytes()
    finally:
        fl.set_num_threads(before)
    assert seen[0] == 1 and seen[1] == 1 and seen[2] > 1 and seen[3] == 1


def test_a_step_with_a_dyn_k_len_is_sized_with_the_bound_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode attention over a big cache: one part while few rows are live, several once many are, the same
    bytes as one part either way."""
    rng = np.random.default_rng(0)
    cap = 8192
    q = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, 8, cap, 64)).astype(np.float32) for _ in range(2))

    def attend(n: int) -> np.ndarray:
        y = fl.ops.flash_attn(fl.tensor(q), fl.tensor(k), fl.tensor(v), k_len=fl.dyn("n"))
        return fl.realize(y, env={"n": n})[0].numpy()

    seen = _parts_posted(monkeypatch)
    before = fl.get_num_threads()
    try:
        fl.set_num_threads(2)
        few = attend(4)
        assert seen == [1]
        seen.clear()
        many = attend(cap)
        assert seen and seen[0] > 1
        with fl.serial():
            assert attend(cap).tobytes() == many.tobytes()
            assert attend(4).tobytes() == few.tobytes()
    finally:
        fl.set_num_threads(before)


def _softmax_plan() -> tuple[executor.Plan, list[np.ndarray]]:
    """A plan of one f32 SoftmaxLastDim step whose kernel only records that it ran."""
    from dataclasses import replace

    from fuel.dispatch.impls import default_kernel_registry
    from fuel.graph.registry import default_registry

    x = fl.tensor(np.ones((4, 8), np.float32))
    y = fl.ops.softmax_last_dim(x)
    plan = executor.build_plan([y.node], [x.node], True, default_registry(), default_kernel_registry())
    (step,) = plan.steps
    assert step.impl is not None and step.impl.name == "SoftmaxLastDim[cpu:f32,f32]"
    ran: list[np.ndarray] = []

    def spy(xs: list[np.ndarray], out: np.ndarray, params: object) -> None:
        ran.append(out)

    plan.steps[0] = replace(step, impl=replace(step.impl, kernel=spy))
    return plan, ran


@pytest.mark.parametrize(("dtype", "name"), [("float64", "f64"), ("float16", "f16"), ("uint8", "u8"), ("int64", "i64"),
                                           ("int32", "int32")])
def test_a_fused_kernel_never_runs_on_inputs_of_a_dtype_it_is_not_registered_for(dtype: str, name: str) -> None:
    plan, ran = _softmax_plan()
    x = np.ones((4, 8), np.dtype(dtype))
    with pytest.raises(fl.KernelError, match=rf"SoftmaxLastDim\[cpu:f32,f32\]: is registered for inputs \(f32\), "
                                            rf"got \({name}\)"):
        executor.run(plan, [x], None)
    assert ran == [] and (x == 1).all()
    executor.run(plan, [np.ones((4, 8), np.float32)], None)  # its own dtype runs
    assert len(ran) == 1


def test_a_fused_kernel_never_writes_an_output_of_a_dtype_it_is_not_registered_for() -> None:
    plan, ran = _softmax_plan()
    x = np.ones((4, 8), np.float32)
    out = np.full((4, 8), 3, np.float64)
    with pytest.raises(fl.KernelError, match=r"SoftmaxLastDim\[cpu:f32,f32\]: is registered for a \(f32\) output, "
                                            r"got \(f64\)"):
        executor.run_fused(plan.steps[0], [x], out, None)
    assert ran == [] and (out == 3).all()
